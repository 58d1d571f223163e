"""The all-reduce + residual add that a row-parallel GEMM finishes in its own epilogue, band by band
(kernels/gemm_weight_first.py, REDUCE): no kernel runs it; this module holds its buffers.

    target = reduce_target(residual, ctx=ctx, bands=plan.cfg.bands, block_t=plan.cfg.block_t)
    plan.run(x, w, reduce=target)           # residual += sum over ranks of x @ w.T, in place
    ctx.check("...")                         # eager: a wait that gave up raises TimeoutError
    qkv_plan.run(residual, wqkv, scale=RowScale(target.ss, eps))   # RMSNorm's 1 / rms a row

Each band's last program of the GEMM pushes its band of y into every peer's receive slot, sets
the peer's flag of (this rank, band) to the call's epoch, waits (bounded) for every peer's flag of
the same band, sums the parts in rank order (fp32, rounded to y's dtype, as an all-reduce returns
it), adds it to the residual (rounded: the all-reduce + add kernel's bits) and stores the band's
sum of squares of each row into ``ss``. The next projection's weight-first GEMM reads the
residual stream itself and scales each row by RMSNorm's factor from those sums: the norm weight is
folded into that projection (TPDecoder.fold_norms). A decode step then has no kernel between its
row-parallel GEMM and the next projection.

Flags hold the epoch of the last call that arrived, so they are never reset; two receive slots
alternate (a band of call e + 2 is pushed after its rank saw every peer's band of e + 1, which a
peer sends after its call e ended). Every rank must make the same calls of a signature in the same
order. NVIDIA sm_90 (the GEMM is Gluon); two or more ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from numasched import options as _options
from numasched._validate import check_tensor

from ._common import DTYPES, Call, _check_device, _make_plan, _Op, check_context, plan_for, register

MAX_BANDS = 256   # the consumer's row scale reads every band's sums (gemm_weight_first.MAX_SUM_PARTS)


@register
class AllReduceAddBands(_Op):
    name = "all_reduce_add_bands"
    sim_phases = ()
    kernel = False   # no kernel of its own: its buffers serve a GEMM's epilogue (reduce_target)

    @staticmethod
    def describe(residual, *, world, num_sms=132, bands: int = 1, block_t: int = 16) -> Call:
        M, N = residual.shape
        header = dict(op="all_reduce_add_bands", shape=(M, N), dtype=str(residual.dtype), bands=bands,
                      block_t=block_t, world=world)
        key = ("all_reduce_add_bands", M, N, residual.dtype, bands, block_t)
        return Call("all_reduce_add_bands", key, header, dict(residual=residual),
                    dict(M=M, N=N, bands=bands, block_t=block_t, world=world))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        return [("recv", (2, W, c["M"], c["N"]), call.tensors["residual"].dtype), ("flags", (W, c["bands"]), torch.int64)]

    @classmethod
    def plan(cls, ctx, call):
        c = call.cfg
        p = _make_plan(ctx, cls, call, local_bufs=[("ss", (c["bands"], c["block_t"]), torch.float32)])
        p.bufs["ss"].zero_()
        return p

    @classmethod
    def launch(cls, ctx, plan, call, *, phase="full"):
        raise RuntimeError("all_reduce_add_bands has no kernel of its own: the row-parallel GEMM runs it "
                           "(WeightFirstPlan.run(..., reduce=reduce_target(...)))")


@dataclass(frozen=True)
class ReduceTarget:
    """What a reducing GEMM launch reads and writes (this rank's buffers; a peer's are at the same
    heap offsets): its part of call e (the epoch word + 1) goes to ``recv[e & 1, rank]`` on every
    peer, then the peer's ``flags[rank, band]`` is set to e; the sum lands in ``residual`` and
    each band's sums of squares in ``ss`` (bands, block_t), the next projection's
    ``RowScale(ss, eps)``."""

    recv: torch.Tensor        # heap (2, world, M, N), the residual's dtype
    flags: torch.Tensor       # heap (world, bands) int64
    ss: torch.Tensor          # (bands, block_t) fp32
    epoch: torch.Tensor       # (1,) int64: the last call's epoch
    xcount: torch.Tensor      # int32 exit count (left zero)
    status: torch.Tensor      # the context's status word (int32)
    bound: int                # a wait's bound, us of the GPU's global timer
    heap_bases: torch.Tensor  # (world,) int64
    rank: int
    world: int
    residual: torch.Tensor    # (M, N): the stream, updated in place


def reduce_target(residual: torch.Tensor, *, ctx, bands: int, block_t: int) -> ReduceTarget:
    """The buffers for a reducing GEMM launch whose result (``residual``'s shape and dtype) is cut
    into ``bands`` 64-column bands, rows padded to ``block_t`` (the weight-first plan's
    ``cfg.bands`` and ``cfg.block_t``). The plan is made on the first call of a signature (every
    rank must ask in the same order); later calls check only the residual."""
    check_context(ctx, "reduce_target", alone=False)
    sig = (residual.shape, residual.dtype, residual.device, bands, block_t, _options.current())
    known = ctx.__dict__.setdefault("_reduce_target_keys", {})
    plan = ctx.plans.get(known.get(sig, ()))
    if plan is None:
        check_tensor("residual", residual, ndim=2, dtypes=DTYPES)
        _check_device(ctx, "residual", residual)
        if ctx.world < 2:
            raise ValueError("reduce_target: a world of one rank has nothing to reduce")
        for name, v, hi in (("bands", bands, MAX_BANDS), ("block_t", block_t, 64)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ValueError(f"{name} must be an int in [1, {hi}], got {v!r}")
        if residual.shape[0] > block_t:
            raise ValueError(f"residual has {residual.shape[0]} rows; block_t={block_t} must hold them")
        call = AllReduceAddBands.describe(residual, world=ctx.world, num_sms=ctx.num_sms, bands=bands, block_t=block_t)
        plan = plan_for(ctx, "all_reduce_add_bands", call)
        known[sig] = call.key
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous (the GEMM adds into its rows in place)")
    if ctx.recycle:   # this call's recency; a capture pins the plan (never given back)
        ctx.used(known[sig], ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    from ._ws import _bound_us

    b = plan.bufs
    plan.launches += 1
    return ReduceTarget(b["recv"], b["flags"], b["ss"], b["epoch"], b["counters"], ctx.status, _bound_us(ctx),
                        ctx.heap_bases, ctx.rank, ctx.world, residual)
