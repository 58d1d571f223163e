"""Host side of the two-rank fused ops on the warp-specialised Gluon kernel
(kernels/dist_gemm_ar_ws.py): ``matmul_all_reduce``'s tile pairs and ``matmul_reduce_scatter``'s
(``options.fused_ws``). The kernel addresses the peer's ``out``, receive slots and flags at the
same heap offsets as ours, mapped into this GPU's address space by the symmetric heap: the host
makes TMA descriptors of them once per data pointers and keeps them in the plan.
"""
from __future__ import annotations

import torch

from numasched import caps
from numasched.gemm_ws import dist_config

__all__ = ["ws_ok", "ws_wanted", "launch", "peer_address"]


# The tile order (the reduce-scatter's slice, the all-reduce's output): groups of GROUP_M tile
# rows, column by column (the WS GEMM's grouped order), or row by row. Two H100s
# (bench/results/tp2-s41/call3, call4), the reduce-scatter grouped against row by row: Qwen3-32B
# down at 16384 rows 3.12-3.29 ms against 3.69-4.25 (its WS GEMM alone 3.22-3.34), 0.91-1.01x at
# Llama-3-8B down and Qwen3-32B o from 2048 to 16384 rows: always grouped. The all-reduce: 0.80-0.98x
# at Qwen3-32B down (a weight of 131 MB), 0.98-1.01x at Llama-3-8B down 16384 rows, but 1.02-1.11x
# at 4096 x 4096 x {2048, 7168}: grouped only where the weight is more than twice the L2.
GROUP_M = 8


def group_of(ctx, rs: bool, N: int, K: int, elt: int) -> int:
    """The kernel's GROUP (see GROUP_M) for a call of this weight (``options.fused_ws_group``
    overrides it)."""
    if rs or N * K * elt > 2 * caps.l2_bytes(ctx.device):
        return GROUP_M
    return 0


def ws_ok(ctx, a, b_store, out, rows: int, N: int, K: int) -> bool:
    """Whether the kernel can take the call: a Hopper GPU with Gluon, two ranks, 16-bit operands,
    rows (out's) a multiple of 64 (a receive slot's half tiles must not straddle slots), rows of
    16 bytes, a contiguous out."""
    from numasched.kernels.gemm_ws import HAVE_GLUON

    elt = out.element_size()
    return (HAVE_GLUON and ctx.world == 2 and caps.hopper(ctx.device) and rows % 64 == 0
            and out.is_contiguous() and a.dtype in (torch.bfloat16, torch.float16) and a.stride(1) == 1
            and (N * elt) % 16 == 0 and (K * elt) % 16 == 0)


def ws_wanted(ctx) -> bool:
    """Whether the fused ops of ``ctx`` take the warp-specialised kernel where it can run:
    ``options.fused_ws`` when set, else on by default for two ranks of Hopper GPUs with Gluon
    (the tile pairs of ``matmul_all_reduce`` with out outside the heap; ``matmul_reduce_scatter``
    where ``cost.rs_ws_pays``). The per-call checks (``ws_ok``) come on top."""
    return ws_wanted_on(ctx.device, ctx.world)


def ws_wanted_on(device, world: int) -> bool:
    """:func:`ws_wanted` for ``world`` ranks of GPU ``device`` (no context needed: a plan's
    description)."""
    from numasched import options
    from numasched.kernels.gemm_ws import HAVE_GLUON

    o = options.current().fused_ws
    if o is not None:
        return bool(o)
    return HAVE_GLUON and world == 2 and caps.hopper(device)


def peer_address(ctx, t: torch.Tensor):
    """The peer's copy of heap tensor ``t`` (two ranks: the same offset in its heap), as a
    DeviceAddress valid on this GPU."""
    from numasched.gemm_ws import DeviceAddress

    peer = 1 - ctx.rank
    return DeviceAddress(ctx.heap_bases_host[peer] + (t.data_ptr() - ctx.heap_bases_host[ctx.rank]), t.dtype)


def _bound_us(ctx) -> int:
    """A wait's bound in the WS kernel: ``timeout_s`` in us of the GPU's global timer (an int32
    for any timeout below 35 minutes, so the compiled kernel's argument type does not change with
    it: the C launcher reuses one compile)."""
    return min(int(ctx.timeout_s * 1e6), 2**31 - 1)


def launch(ctx, plan, *, a, b_store, b_trans, out, recv, flags, epoch, counters, rows, N, K,
           residual: bool, direct: bool, rs: bool, programs=None, block_n: int = 256):
    """One launch of kernels/dist_gemm_ar_ws.py (see its doc): ``rows`` out's rows (RS: a slice's),
    ``recv`` the (2, 2, rows, N) receive slots, ``flags`` at least (2, 2 x tiles) int64;
    ``programs`` default: one per tile pair (RS: per tile of both slices), at most one per SM;
    ``block_n``: the tiles' width (gemm_ws.DIST_RING_STAGES: 128 for the all-reduce's pairs where
    256-wide pairs would add a round, matmul_all_reduce._ws_width)."""
    from numasched import options
    from numasched._launch import HostDesc, Launch, hooked
    from numasched.gemm_ws import descriptor_maker
    from numasched.kernels.dist_gemm_ar_ws import matmul_all_reduce_ws_kernel

    from . import cost

    cfg = dist_config(block_n)
    tiles = -(-rows // cfg.block_m) * -(-N // cfg.block_n)
    if programs is None:
        programs = max(1, min(ctx.num_sms, 2 * tiles if rs else -(-tiles // 2)))
    if flags.shape[-1] < 2 * tiles:
        raise ValueError(f"flags has {flags.shape[-1]} slots a rank, the kernel needs {2 * tiles}")
    # the thin launch (numasched._launch): Gluon's Python path once per constexpr set, then the
    # compiled kernel's C launcher, the descriptors' tensor maps cached by base pointer
    o = options.current()
    rs_pairs = rs and (cost.rs_ws_pairs(tiles, programs) if o.fused_rs_pairs is None else o.fused_rs_pairs)
    rs_early = rs and o.fused_rs_early
    # B's orientation is in the key: it decides the compiled kernel's B box ((N, K) or (K, N));
    # one plan serves both (its key has no strides), and a kernel compiled for one misreads the
    # other (the reduce-scatter's sums were wrong for the second layout: dist_worker, tp2-s29c)
    group = group_of(ctx, rs, N, K, a.element_size()) if o.fused_ws_group is None else o.fused_ws_group
    key = ("ws", residual, direct, rs, rs_pairs, rs_early, group, programs, cfg.block_n, bool(b_trans))
    run = plan.launchers.get(key)
    if run is None:
        run = Launch(matmul_all_reduce_ws_kernel, programs,
                     dict(STAGES=cfg.stages, RESIDUAL=residual, DIRECT=direct, RS=rs, RS_PAIRS=rs_pairs,
                          RS_EARLY=rs_early, GROUP=group,
                          CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
                          num_warps=4, maxnreg=cfg.maxnreg), device=ctx.device)
        plan.launchers[key] = run
    if run.raw is not None and not hooked():
        # the compiled kernel's C launcher with the whole argument list of these data pointers,
        # made once (descriptors expanded into their tensor maps): an eager call's host work is
        # a key and a lookup (the shapes are the plan's; strides are in the key)
        fkey = (a.data_ptr(), a.stride(), b_store.data_ptr(), b_store.stride(), out.data_ptr(), recv.data_ptr(),
                flags.data_ptr(), epoch.data_ptr(), counters.data_ptr(), _bound_us(ctx))
        fulls = plan.launchers.setdefault(("ws-full",) + key[1:], {})
        full = fulls.get(fkey)
        if full is not None:
            run.call_full(full)
            plan.launches += 1
            return out
    desc = descriptor_maker(run)
    half, chunk = [cfg.block_m // 2, cfg.block_n], [cfg.block_m // 2, 64]
    recv2 = recv.view(-1, N)   # (2 slots x 2 ranks x rows, N)
    bblock = [cfg.block_n, cfg.block_k] if b_trans else [cfg.block_k, cfg.block_n]
    args = (desc(a, a.shape, a.stride(), [cfg.block_m, cfg.block_k]),
            desc(b_store, b_store.shape, b_store.stride(), bblock),
            desc(out, (rows, N), (N, 1), half),
            desc(peer_address(ctx, out) if direct else out, (rows, N), (N, 1), chunk),
            desc(recv2, recv2.shape, recv2.stride(), half),
            desc(peer_address(ctx, recv2), recv2.shape, recv2.stride(), chunk),
            flags, peer_address(ctx, flags), ctx.status, epoch, counters, _bound_us(ctx), ctx.rank, rows, N, K)
    if plan.launches == 0:
        # compile on every rank, then line them up, before any waits (a rank still compiling a
        # Gluon kernel, seconds, must not look dead): as the Triton kernels' first launch
        from ._common import _first_use

        _first_use(ctx, matmul_all_reduce_ws_kernel, (programs,), args, run.kwargs)
    run(*args)
    plan.launches += 1
    if run.raw is not None and desc is HostDesc:
        if len(fulls) >= 256:
            fulls.pop(next(iter(fulls)))
        fulls[fkey] = run.full_args(args)
    return out
