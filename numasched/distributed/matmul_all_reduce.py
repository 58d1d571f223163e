"""GEMM + all-reduce, the row-parallel layer of tensor parallelism: every rank gets
``sum over ranks of a @ b_local`` (the output projection and the MLP's down projection).

check -> plan -> run like every op: the plan (:class:`MatmulAllReducePlan`, one per call
signature and context, visible as ``plan_matmul_all_reduce(...)``) names the GEMM engine and the
all-reduce the cost model picked; the run is the GEMM writing into the output, then the
all-reduce in place on the same stream (no host synchronisation, graph-capturable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cost
from ._common import _bulk_ok, _check_operands, _output, run

IMPLS = ("auto", "oneshot", "twoshot", "bulk", "overlap")
# impl="overlap": the rows are cut into this many chunks; chunk i's all-reduce (NCCL, on a side
# stream: it uses few SMs) runs while chunk i+1's GEMM runs. Measured on two H200s it is slower
# than GEMM-then-all-reduce at every M (1024: 155 us against 79 for cuBLAS + NCCL; 4096: 275
# against 246; bench/results/collectives-2xh200-2026-11-23.csv): NCCL beside cuBLAS on a second
# stream does not overlap here. So "auto" never picks it; it stays for measurement.
OVERLAP_CHUNKS = 4
# each extra chunk costs a GEMM launch, an event pair and a smaller, less efficient GEMM
OVERLAP_CHUNK_US = 4.0
GEMMS = ("auto", "numasched", "torch")

__all__ = ["MatmulAllReducePlan", "plan_matmul_all_reduce", "matmul_all_reduce"]


@dataclass(frozen=True)
class MatmulAllReducePlan:
    """What one matmul_all_reduce call runs.

    gemm: "numasched" (numasched.matmul, schedule from numasched.gemm_schedule) or "torch" (cuBLAS).
    all_reduce: "oneshot", "twoshot" (numasched's kernels over the symmetric heap) or "nccl".
    chunks: 1, or the row chunks of impl "overlap" (GEMM of chunk i+1 beside the all-reduce of chunk i).
    est_us: the cost model's estimate of the whole call (GEMM + all-reduce), microseconds.
    """

    M: int
    N: int
    K_local: int
    dtype: torch.dtype
    world: int
    gemm: str
    all_reduce: str
    est_us: float
    chunks: int = 1

    @property
    def impl(self) -> str:
        if self.chunks > 1:
            return "overlap"
        return "bulk" if (self.gemm, self.all_reduce) == ("torch", "nccl") else self.all_reduce

    def describe(self) -> str:
        how = f", {self.chunks} overlapped row chunks" if self.chunks > 1 else ""
        return (f"matmul_all_reduce {self.M}x{self.N}x{self.K_local} {str(self.dtype).replace('torch.', '')} over "
                f"{self.world} ranks: GEMM {self.gemm}, all-reduce {self.all_reduce}{how} "
                f"(model {self.est_us:.1f} us)")


def plan_matmul_all_reduce(a, b_local, *, world: int, impl: str = "auto", gemm: str = "auto",
                           bulk_ok: bool = True) -> MatmulAllReducePlan:
    """The plan for ``a`` (M, K_local) @ ``b_local`` (K_local, N) summed over ``world`` ranks
    (shapes only: meta tensors work). ``bulk_ok``: NCCL is available (a real context)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    M, Kl = a.shape
    N = b_local.shape[1]
    nbytes = M * N * a.element_size()
    g_s = cost.gemm_s(M, N, Kl, a.dtype)
    if impl in ("bulk", "overlap") and not bulk_ok:
        raise ValueError(f"impl={impl!r} needs a real context (numasched.distributed.init): a simulated rank has no "
                         f"process group")
    if impl == "bulk":
        engine = "torch" if gemm == "auto" else gemm
        est = g_s + cost.all_reduce_s("nccl", nbytes, world)
        return MatmulAllReducePlan(M, N, Kl, a.dtype, world, engine, "nccl", est * 1e6)
    if impl == "overlap":
        overlap = _overlap_s(g_s, cost.all_reduce_s("nccl", nbytes, world), OVERLAP_CHUNKS)
        return MatmulAllReducePlan(M, N, Kl, a.dtype, world, "torch" if gemm == "auto" else gemm, "nccl",
                                   overlap * 1e6, OVERLAP_CHUNKS)
    engine = cost.gemm_engine(M) if gemm == "auto" else gemm
    if impl == "auto":
        allowed = ("oneshot", "twoshot", "nccl") if bulk_ok and world > 1 else ("oneshot", "twoshot")
        ar = cost.choose_all_reduce(nbytes, world, allowed=allowed)
    else:
        ar = impl
    est = g_s + cost.all_reduce_s(ar, nbytes, world)
    return MatmulAllReducePlan(M, N, Kl, a.dtype, world, engine, ar, est * 1e6)


def _overlap_s(gemm_s: float, ar_s: float, k: int) -> float:
    """k chunks pipelined: the longer of the two streams plus one chunk of the shorter, plus a
    cost per extra chunk."""
    return max(gemm_s, ar_s) + min(gemm_s, ar_s) / k + (k - 1) * OVERLAP_CHUNK_US * 1e-6


def matmul_all_reduce(a, b_local, *, ctx, impl: str = "auto", gemm: str = "auto", out=None, check: bool = True):
    """``sum over ranks of a @ b_local``, returned on every rank (M, N).

    a: (M, K_local) this rank's slice of the activations' columns; b_local: (K_local, N) its rows
    of the weight (``w_local.T`` of a (N, K_local) ``F.linear`` weight works without a copy).
    impl: "auto" (default: the cost model picks the GEMM engine and the all-reduce, see
    :mod:`numasched.distributed.cost`), "oneshot" / "twoshot" (numasched all-reduce after the
    GEMM), "overlap" (row chunks: each chunk's NCCL all-reduce on a side stream beside the next
    chunk's GEMM; measured slower on two H200s, never picked by "auto"), or "bulk" (torch.matmul then NCCL: the bulk-synchronous baseline). gemm: "auto",
    "numasched" or "torch". The GEMM writes into ``out`` (default a new tensor) and the
    all-reduce sums it in place; results are identical on every rank.
    """
    if not hasattr(ctx, "_ensure_usable") or not hasattr(ctx, "plans"):
        raise TypeError(f"matmul_all_reduce: ctx must be a context from numasched.distributed.init() (or a rank of a "
                        f"SimWorld), got {type(ctx).__name__}")
    key = ("matmul_all_reduce", tuple(a.shape), tuple(b_local.shape), a.dtype, impl, gemm)
    plan = ctx.plans.get(key)
    if plan is None:
        _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
        plan = ctx.plans[key] = plan_matmul_all_reduce(a, b_local, world=ctx.world, impl=impl, gemm=gemm,
                                                       bulk_ok=_bulk_ok(ctx))
    else:   # cheap re-checks of what the key does not cover
        if a.device != ctx.device or b_local.device != ctx.device or b_local.dtype != a.dtype:
            _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
    c = _output(out, (plan.M, plan.N), a, "fused")
    if not c.is_contiguous():
        raise ValueError("out must be contiguous (the all-reduce sums it in place)")
    if plan.chunks > 1:
        return _overlapped(ctx, plan, a, b_local, c)
    _gemm(plan, a, b_local, c)
    if plan.world == 1:
        return c
    return run(ctx, "all_reduce", c, impl=plan.all_reduce, out=c, check=check)


def _gemm(plan, a, b, c):
    if plan.gemm == "torch":
        torch.matmul(a, b, out=c)
    else:
        from numasched.gemm import matmul

        matmul(a, b, out=c)


_SIDE: dict = {}


def _overlapped(ctx, plan, a, b, c):
    """Row chunks: GEMM of chunk i on the caller's stream, NCCL all-reduce of chunk i on a side
    stream after it, so chunk i+1's GEMM overlaps chunk i's communication. Graph-capturable (the
    side stream forks from and joins the caller's stream through events)."""
    import torch.distributed as dist

    main = torch.cuda.current_stream()
    side = _SIDE.get(ctx.device)
    if side is None:
        side = _SIDE[ctx.device] = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(main)          # c may still be in use by earlier work on the caller's stream
    rows = -(-plan.M // plan.chunks)
    for lo in range(0, plan.M, rows):
        chunk = c[lo:lo + rows]
        _gemm(plan, a[lo:lo + rows], b, chunk)
        done = torch.cuda.Event()
        done.record(main)
        side.wait_event(done)
        with torch.cuda.stream(side):
            dist.all_reduce(chunk, group=ctx.group)
    main.wait_stream(side)
    c.record_stream(side)
    return c
