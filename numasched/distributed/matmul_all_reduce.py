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

IMPLS = ("auto", "oneshot", "twoshot", "bulk")
GEMMS = ("auto", "numasched", "torch")

__all__ = ["MatmulAllReducePlan", "plan_matmul_all_reduce", "matmul_all_reduce"]


@dataclass(frozen=True)
class MatmulAllReducePlan:
    """What one matmul_all_reduce call runs.

    gemm: "numasched" (numasched.matmul, schedule from numasched.gemm_schedule) or "torch" (cuBLAS).
    all_reduce: "oneshot", "twoshot" (numasched's kernels over the symmetric heap) or "nccl".
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

    @property
    def impl(self) -> str:
        return "bulk" if (self.gemm, self.all_reduce) == ("torch", "nccl") else self.all_reduce

    def describe(self) -> str:
        return (f"matmul_all_reduce {self.M}x{self.N}x{self.K_local} {str(self.dtype).replace('torch.', '')} over "
                f"{self.world} ranks: GEMM {self.gemm}, all-reduce {self.all_reduce} (model {self.est_us:.1f} us)")


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
    if impl == "bulk":
        if not bulk_ok:
            raise ValueError("impl='bulk' needs a real context (numasched.distributed.init): a simulated rank has no "
                             "process group")
        ar = "nccl"
        engine = "torch" if gemm == "auto" else gemm
    else:
        engine = cost.gemm_engine(M) if gemm == "auto" else gemm
        if impl == "auto":
            allowed = ("oneshot", "twoshot", "nccl") if bulk_ok and world > 1 else ("oneshot", "twoshot")
            ar = cost.choose_all_reduce(nbytes, world, allowed=allowed)
        else:
            ar = impl
    est = cost.gemm_s(M, N, Kl, a.dtype) + cost.all_reduce_s(ar, nbytes, world)
    return MatmulAllReducePlan(M, N, Kl, a.dtype, world, engine, ar, est * 1e6)


def matmul_all_reduce(a, b_local, *, ctx, impl: str = "auto", gemm: str = "auto", out=None, check: bool = True):
    """``sum over ranks of a @ b_local``, returned on every rank (M, N).

    a: (M, K_local) this rank's slice of the activations' columns; b_local: (K_local, N) its rows
    of the weight (``w_local.T`` of a (N, K_local) ``F.linear`` weight works without a copy).
    impl: "auto" (default: the cost model picks the GEMM engine and the all-reduce, see
    :mod:`numasched.distributed.cost`), "oneshot" / "twoshot" (numasched all-reduce after the
    GEMM), or "bulk" (torch.matmul then NCCL: the bulk-synchronous baseline). gemm: "auto",
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
    if plan.gemm == "torch":
        torch.matmul(a, b_local, out=c)
    else:
        from numasched.gemm import matmul

        matmul(a, b_local, out=c)
    if plan.world == 1:
        return c
    return run(ctx, "all_reduce", c, impl=plan.all_reduce, out=c, check=check)
