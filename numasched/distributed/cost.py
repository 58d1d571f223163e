"""Per-call cost model of the collectives: which implementation a call with ``impl="auto"`` runs.

Every estimate is latency + bytes / bandwidth, in seconds, from a :class:`Link` describing the
GPUs' interconnect. The defaults are two H200s over NVLink (NV18), measured here on 2026-11-22/23
(bench/results/collectives-*.csv and distributed-*.csv):

* ``push_bw``: bytes/s one rank stores into a peer's heap with every SM pushing (330-356 GB/s);
* ``flag_us``: a release flag seen by the peer's acquire spin plus the kernel's start and
  epoch bookkeeping (one-shot all-reduce of 8 KB in a CUDA graph, minus its data time);
* ``nccl_us`` / ``nccl_bw``: NCCL all-reduce in a CUDA graph, small-message latency and bus
  bandwidth (9.7 us at 8 KB, 34.5 us at 4 MB on 2 GPUs);
* ``hbm_bw``: local streaming bandwidth (reads of received copies, writes of the result).

The choice is recorded in each call's plan (``cfg["impl"]``), printed by the benchmark, and can
be forced with ``impl=``. The model decides between implementations that are all correct, so a
wrong constant costs time, never a wrong result.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Link", "LINK", "all_reduce_s", "choose_all_reduce", "gemm_engine", "set_link"]


@dataclass(frozen=True)
class Link:
    push_bw: float = 340e9
    flag_us: float = 3.0
    nccl_us: float = 9.5
    nccl_bw: float = 170e9
    hbm_bw: float = 3.8e12
    # two-shot pays a second exchange (another flag round) for moving 2 (W-1)/W n instead of (W-1) n
    two_shot_extra_us: float = 2.0


LINK = Link()


def set_link(**fields) -> Link:
    """Replace model constants (e.g. after measuring another machine); returns the new Link."""
    global LINK
    LINK = replace(LINK, **fields)
    return LINK


def all_reduce_s(impl: str, nbytes: int, world: int, link: Link = None) -> float:
    """Estimated seconds of one all-reduce of ``nbytes`` per rank over ``world`` ranks."""
    L = link or LINK
    if world <= 1:
        return 0.0
    if impl == "oneshot":
        sent = (world - 1) * nbytes
        local = (world + 1) * nbytes          # read x and W-1 copies, write out
        return L.flag_us * 1e-6 + sent / L.push_bw + local / L.hbm_bw
    if impl == "twoshot":
        sent = 2 * (world - 1) * nbytes / world
        local = 3 * nbytes
        return (L.flag_us + L.two_shot_extra_us) * 1e-6 + sent / L.push_bw + local / L.hbm_bw
    if impl == "nccl":
        return L.nccl_us * 1e-6 + 2 * (world - 1) / world * nbytes / L.nccl_bw
    raise ValueError(f"unknown all-reduce implementation {impl!r}")


def choose_all_reduce(nbytes: int, world: int, *, allowed=("oneshot", "twoshot", "nccl"), link: Link = None) -> str:
    """The fastest of ``allowed`` by :func:`all_reduce_s` (ties: the first listed)."""
    return min(allowed, key=lambda impl: all_reduce_s(impl, nbytes, world, link))


# Rows up to which numasched's GEMM matched cuBLAS on the inference grid (bench/results/
# gemm_inference-h200-2026-11-22.csv: per-M geomean 0.97-1.02 at M <= 64, 0.74-0.93 above), so a
# fused op's GEMM runs there on numasched and above it on torch.matmul (cuBLAS) when the caller
# lets the model choose.
NUMASCHED_GEMM_MAX_M = 64


def gemm_engine(m: int) -> str:
    """``"numasched"`` or ``"torch"``: which GEMM a model-chosen collective+GEMM runs for ``m`` rows."""
    return "numasched" if m <= NUMASCHED_GEMM_MAX_M else "torch"


# ----------------------------------------------------------------------------- GEMM + collective
# A fused GEMM+collective kernel starts a persistent grid, keeps per-tile flags and (at small M)
# cuts the rows into one shard per rank, so each rank's shard re-reads the whole weight: its GEMM
# time is modelled as W GEMMs of one shard. Fitted to the two-H200 runs of 2026-11-22 (fused
# 48 us vs bulk 26 us at M = 16, 183 vs 241 us at M = 2048; bench/results/distributed-*.csv).
FUSED_FIXED_US = 20.0


def gemm_s(M: int, N: int, K: int, dtype) -> float:
    """Modelled seconds of an (M, K) x (K, N) GEMM (numasched.gemm_schedule's pick and estimate)."""
    from numasched.gemm_schedule import choose

    return choose(max(M, 1), max(N, 1), max(K, 1), dtype).est_s


def nccl_move_s(nbytes_received: int, link: Link = None) -> float:
    """NCCL all-gather / reduce-scatter in which each rank receives ``nbytes_received``."""
    L = link or LINK
    return L.nccl_us * 1e-6 + nbytes_received / L.nccl_bw


def gemm_collective_s(op: str, impl: str, M: int, N: int, K: int, dtype, world: int, link: Link = None) -> float:
    """Modelled seconds of ``op`` ("all_gather_matmul": M rows in all, K, N per rank;
    "matmul_reduce_scatter": M rows, K per rank, N) run as ``impl`` ("fused" or "bulk")."""
    L = link or LINK
    es = _elt(dtype)
    shard = max(1, M // world)
    if op == "all_gather_matmul":
        moved = (world - 1) * shard * K * es
    elif op == "matmul_reduce_scatter":
        moved = (world - 1) * shard * N * es
    else:
        raise ValueError(f"unknown op {op!r}")
    if impl == "bulk":
        return gemm_s(M, N, K, dtype) + nccl_move_s(moved, L)
    if impl == "fused":
        return max(world * gemm_s(shard, N, K, dtype), moved / L.push_bw) + (FUSED_FIXED_US + L.flag_us) * 1e-6
    raise ValueError(f"unknown implementation {impl!r}")


def choose_gemm_collective(op: str, M: int, N: int, K: int, dtype, world: int, *, bulk_ok: bool = True,
                           link: Link = None) -> str:
    """"fused" or "bulk" for one call, by :func:`gemm_collective_s` ("fused" where bulk is not possible)."""
    if not bulk_ok or world == 1:
        return "fused"
    t = {impl: gemm_collective_s(op, impl, M, N, K, dtype, world, link) for impl in ("fused", "bulk")}
    return min(t, key=t.get)


def _elt(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
