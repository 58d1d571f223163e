"""Tile order of the distributed GEMMs: which shard, then which tile inside it.

A distributed GEMM's output rows come in ``world`` shards of ``TMS`` tile rows each (shard ``s``
holds the rows that rank ``s`` owns: its A rows for all-gather+GEMM, its output slice for
GEMM+reduce-scatter). Ticket ``t`` (the t-th tile this rank starts) maps to

    per  = TMS * TN
    pos  = t div per                       # how many shards this rank has visited before
    src  = (rank + FIRST + pos) mod world  # FIRST = 0: own shard first; FIRST = 1: own shard last
    tm, tn = gemm_tile(t mod per, TMS, TN, MAPPING)   # the inner GEMM policy

i.e. shards in rank order starting from this rank (all-gather: its rows need no communication,
so they run while peer rows are in flight) or from rank + 1 (reduce-scatter: partial tiles for
peers are computed and pushed first; this rank's own slice, which needs every peer's partials,
comes last). Inside a shard any registered GEMM policy orders the tiles (``mapping=``; "auto" is
grouped on one locality domain). A bijection of [0, world*per) onto (src, tm, tn) because the
shard part is a rotation of [0, world) and the inner policy is a bijection of [0, per).
"""
import numpy as np
import triton
import triton.language as tl

from numasched.mappings.jit import gemm_tile

ALL_GATHER_FIRST = 0       # local shard first, then rank+1, rank+2, ...
REDUCE_SCATTER_FIRST = 1   # rank+1 first, ..., own shard last


def shard_order_reference(tickets, rank: int, world: int, first: int, tms: int, tn: int, policy,
                          num_domains: int = 1) -> np.ndarray:
    """NumPy reference: (src, tm, tn) of each ticket, int64 array of shape (len(tickets), 3)."""
    from numasched.mappings import GemmGrid

    t = np.asarray(tickets, dtype=np.int64).reshape(-1)
    per = tms * tn
    if t.size and (t.min() < 0 or t.max() >= world * per):
        raise ValueError(f"tickets must lie in [0, {world * per})")
    src = (rank + first + t // per) % world
    inner = policy.reference(t % per, GemmGrid(tms, tn), num_domains)
    return np.stack([src, inner[:, 0], inner[:, 1]], axis=1)


@triton.jit
def shard_order(t, rank, WORLD: tl.constexpr, FIRST: tl.constexpr, TMS, TN, MAPPING: tl.constexpr):
    """Device twin of :func:`shard_order_reference` (same math, id for id)."""
    per = TMS * TN
    src = (rank + FIRST + t // per) % WORLD
    tm, tn = gemm_tile(t % per, TMS, TN, MAPPING)
    return src, tm, tn


@triton.jit
def _shard_order_map_kernel(out, T, rank, TMS, TN, WORLD: tl.constexpr, FIRST: tl.constexpr,
                            MAPPING: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < T
    src, tm, tn = shard_order(t, rank, WORLD, FIRST, TMS, TN, MAPPING)
    tl.store(out + t * 3 + 0, src, mask=mask)
    tl.store(out + t * 3 + 1, tm, mask=mask)
    tl.store(out + t * 3 + 2, tn, mask=mask)


def shard_order_device_map(rank: int, world: int, first: int, tms: int, tn: int, policy,
                           num_domains: int = 1, device="cpu") -> np.ndarray:
    """(src, tm, tn) of every ticket computed by the Triton device function (tests)."""
    import torch

    T = world * tms * tn
    out = torch.full((T, 3), -7, dtype=torch.int32, device=device)  # poison: -7 is no valid item
    BLOCK = 128
    from numasched.caps import run_interpreted

    grid = (triton.cdiv(T, BLOCK),)
    args = (out, T, rank, tms, tn)
    kw = dict(WORLD=world, FIRST=first, BLOCK=BLOCK, MAPPING=policy.constexpr(num_domains))
    if out.device.type == "cpu":
        run_interpreted(_shard_order_map_kernel, grid, args, kw)
    else:
        _shard_order_map_kernel[grid](*args, **kw)
    return out.cpu().numpy().astype(np.int64)
