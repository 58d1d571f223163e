"""All-reduce fused with the residual add and RMSNorm that follow every row-parallel projection of
a transformer layer (kernel: kernels/dist_allreduce.py, ``all_reduce_add_rmsnorm_kernel``).

    residual, y = all_reduce_add_rmsnorm(x, residual, weight, eps, ctx=ctx)
    # == residual + all_reduce(x), then transformers' RMSNorm of it with ``weight``

One kernel instead of an all-reduce and an elementwise kernel: the rows are summed, added and
normalised where they arrive. One-shot (every rank pushes its rows to every peer), rows whole per
program: meant for decode-sized M (the one-shot all-reduce's regime).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from numasched import options as _options
from numasched._validate import check_no_overlap, check_tensor

from ._common import (DTYPES, Call, _aligned, _cdiv, _check_device, _on_gpu, _Op, check_context, plan_for, register,
                      run)

MAX_PROGRAMS = 1024
MAX_N = 16384   # a row is one register block
LL_MAX_N = 8192
# options.arn_exchange="auto": LL up to this many bytes of rows per rank, rows of up to
# LL_AUTO_MAX_N elements. Two H100s, bf16 (bench/results/tp2-s20*/arn/, three calls): at 4096
# columns LL 0-0.7 us faster at 1-6 rows (8-48 KB), even at 8, 0.2-1.0 slower at 12-16, 9
# slower at 64; at 5120 columns (rows padded to 8192 lanes) slower at every row count (1 row: 9.87
# against 8.51 us, 7.93 against 6.90), so LL stays off there.
LL_AUTO_BYTES = 48 << 10
LL_AUTO_MAX_N = 4096


@register
class AllReduceAddRmsnorm(_Op):
    name = "all_reduce_add_rmsnorm"
    sim_phases = ("push", "consume")

    @staticmethod
    def describe(x, residual=None, weight=None, *, world, num_sms=132, eps=1e-6, pushed: int = 0) -> Call:
        M, N = x.shape
        block_n = max(16, 1 << max(0, N - 1).bit_length())
        programs = max(1, min(num_sms, MAX_PROGRAMS, M))
        rdt = residual.dtype if residual is not None else x.dtype
        wdt = weight.dtype if weight is not None else x.dtype
        header = dict(op="all_reduce_add_rmsnorm", x_shape=tuple(x.shape), dtype=str(x.dtype), residual_dtype=str(rdt),
                      programs=programs, world=world)
        # every dtype the compiled kernel is specialised for is in the key (a plan's thin launch
        # reuses its compiled kernel for every later call of the key)
        iters = _cdiv(M, programs)
        # a row per program (decode): the loads before the wait (options.arn_one_row) and the
        # exchange (options.arn_exchange: LL's tagged 8-byte words, twice the bytes over the link,
        # no fence and no flag, where the rows are small; "auto" picks by their bytes)
        opt = _options.current()
        one_row = iters == 1 and opt.arn_one_row
        # (LL's system-scope stores are NVIDIA PTX: not on ROCm; rows of up to 8192 elements: at
        # 16384 the sm_90 compile spills 788 bytes)
        ll_ok = one_row and torch.version.hip is None and N <= LL_MAX_N
        ll = ll_ok and (opt.arn_exchange == "ll" or opt.arn_exchange == "auto" and N <= LL_AUTO_MAX_N
                        and M * N * x.element_size() <= LL_AUTO_BYTES)
        # pushed (the producer stored the peers' parts and counts them: push_target): the flag
        # form's buffers, a row a program; the key keeps pushed calls' plans (their counts, which
        # only grow) apart from the others', and from pushed calls of another count
        if pushed:
            one_row, ll, iters = True, False, 1
        key = ("all_reduce_add_rmsnorm", M, N, x.dtype, rdt, wdt, programs, one_row, ll) + ((pushed,) if pushed else ())
        return Call("all_reduce_add_rmsnorm", key, dict(header, ll=ll, pushed=pushed), dict(x=x),
                    dict(M=M, N=N, BLOCK_N=block_n, programs=programs, iters=iters, world=world, one_row=one_row,
                         ll=ll, pushed=pushed, num_warps=4 if block_n <= 2048 else 8 if block_n <= 8192 else 16))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        if W == 1:
            return []
        bufs = [("flags", (W, MAX_PROGRAMS), torch.int64), ("recv", (2, W, c["M"], c["N"]), call.tensors["x"].dtype)]
        if c.get("ll"):   # LL words: two 16-bit elements (or one 32-bit) and a tag each
            pack = 2 if call.tensors["x"].element_size() == 2 else 1
            bufs.append(("recv_ll", (2, W, c["M"], _cdiv(c["N"], pack)), torch.int64))
        if c.get("pushed"):   # the producers' adds, one count per source rank (no flags: nothing raises them)
            bufs = [b for b in bufs if b[0] != "flags"] + [("pcount", (W,), torch.int64)]
        return bufs

    @classmethod
    def prepare(cls, ctx, x, residual, weight, eps, *, residual_out=None, out=None, pushed: int = 0):
        if isinstance(pushed, bool) or not isinstance(pushed, int) or pushed < 0:
            raise ValueError(f"pushed must be an int >= 0 (the producer's adds a call; 0: not pushed), got {pushed!r}")
        check_tensor("x", x, ndim=2, dtypes=DTYPES)
        _check_device(ctx, "x", x)
        check_tensor("residual", residual, ndim=2, dtypes=DTYPES, device=x.device)
        check_tensor("weight", weight, ndim=1, dtypes=DTYPES, device=x.device)
        M, N = x.shape
        if tuple(residual.shape) != (M, N):
            raise ValueError(f"residual has shape {tuple(residual.shape)}; it must match x {(M, N)}")
        if weight.shape[0] != N:
            raise ValueError(f"weight has {weight.shape[0]} elements; it must match x's {N} columns")
        if not 1 <= N <= MAX_N:
            raise ValueError(f"x has {N} columns; 1 to {MAX_N} are supported (a row is normalised in one block)")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ValueError(f"eps must be a finite non-negative float, got {eps!r}")
        for name, t in (("x", x), ("residual", residual), ("weight", weight)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        res_out = residual if residual_out is None else residual_out
        y = torch.empty_like(x) if out is None else out
        for name, t in (("residual_out", res_out), ("out", y)):
            check_tensor(name, t, ndim=2, device=x.device)
            if tuple(t.shape) != (M, N) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous ({M}, {N}) tensor")
        if res_out.dtype != residual.dtype:
            raise TypeError(f"residual_out has dtype {res_out.dtype}; it must match residual's {residual.dtype}")
        if y.dtype != x.dtype:
            raise TypeError(f"out has dtype {y.dtype}; it must match x's {x.dtype}")
        # out may be x itself (each row is read before it is written, by the same program), never the
        # residual stream (the normalised rows would replace the new residual)
        check_no_overlap(y, residual=residual, residual_out=res_out)
        check_no_overlap(res_out, "residual_out", x=x, weight=weight)
        call = cls.describe(x, residual, weight, world=ctx.world, num_sms=ctx.num_sms, pushed=pushed)
        if pushed and ctx.world > 1 and M > call.cfg["programs"]:
            raise ValueError(f"pushed: x has {M} rows; a pushed call takes at most {call.cfg['programs']} (a row a "
                             f"program)")
        call.tensors.update(residual=residual, weight=weight, residual_out=res_out, out=y)
        call.extra["eps"] = float(eps)
        return call

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        c, t = call.cfg, call.tensors
        x, res, w, res_out, y = t["x"], t["residual"], t["weight"], t["residual_out"], t["out"]
        if ctx.world == 1:   # no peer: the add and the norm alone (torch)
            if phase == "push":
                return None
            r = (res.float() + x.float()).to(res_out.dtype)
            res_out.copy_(r)
            rf = r.float()
            y.copy_(w * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + call.extra["eps"])).to(y.dtype))
            return res_out, y
        bf = plan.bufs
        pushed = c.get("pushed", 0)
        if pushed:
            if phase == "push":   # the producer pushed
                return None
            if not plan.pending:
                raise RuntimeError(f"all_reduce_add_rmsnorm(pushed={pushed}) on rank {ctx.rank}: nothing was pushed "
                                   f"for this call (push_target, then the producer, then this call)")
            plan.pending = 0
        # each form has one of the flags and the counts; the other argument gets it as a stand-in,
        # never read
        flags = bf.get("flags", bf.get("pcount"))
        pcount = bf.get("pcount", flags)
        args = (x, res, w, res_out, y, bf["recv"], flags, ctx.status, bf["epoch"], bf["counters"],
                ctx.heap_bases, ctx.rank, c["M"], c["N"], c["iters"], call.extra["eps"], ctx.wait_bound,
                bf["recv_ll"] if c.get("ll") else flags, pcount, pushed)
        layout = tuple(_aligned(v) for v in (x, res, w, res_out, y))
        stages = {"full": 3, "push": 1, "consume": 2}[phase]

        def build():
            from numasched.kernels.dist_allreduce import all_reduce_add_rmsnorm_kernel

            kw = dict(WORLD=ctx.world, BLOCK_N=c["BLOCK_N"], STAGES=stages, BUMP_EPOCH=phase in ("full", "consume"),
                      WAIT_CLOCK=ctx.wait_clock, ONE_PROGRAM=c["programs"] == 1,
                      ONE_ROW=c["one_row"], LL=c["ll"], PUSHED=bool(pushed))
            if _on_gpu(x):
                kw["num_warps"] = c["num_warps"]
            return all_reduce_add_rmsnorm_kernel, kw

        _Op._run(ctx, plan, call, phase, c["programs"], args, layout, () if phase == "push" else (res_out, y), build)
        return None if phase == "push" else (res_out, y)


def all_reduce_add_rmsnorm(x, residual, weight, eps: float, *, ctx, residual_out=None, out=None,
                           check: bool = True, pushed: int = 0):
    """``r = residual + all_reduce(x)`` and ``y = weight * rmsnorm(r)`` in one kernel; returns (r, y).

    x, residual: (M, N) contiguous (this rank's partial sums and the residual stream, the same on
    every rank); weight: (N,). ``residual_out`` defaults to ``residual`` itself (updated in
    place, as a transformer's residual stream is); ``out`` to a new tensor. The sum is in fp32 in
    rank order (bit-identical on every rank) and rounded to x's dtype before the add, and the norm
    is transformers' (normalise in fp32, round, scale), so the result equals the unfused
    all_reduce, add and RMSNorm up to the norm's rounding.

    ``pushed`` (> 0): the kernel that wrote x has already pushed it to every peer through
    :func:`push_target`'s buffers, adding ``pushed`` to each peer's count a call (e.g. the
    weight-first GEMM's epilogue: one add a 64-column band). Nothing is sent here; the wait is for
    those counts. Every rank must make its pushed calls in the same order as its producers' pushes.
    """
    return run(ctx, "all_reduce_add_rmsnorm", x, residual, weight, eps, residual_out=residual_out, out=out,
               check=check, pushed=pushed)


@dataclass(frozen=True)
class PushTarget:
    """Where a producer pushes for the next pushed :func:`all_reduce_add_rmsnorm` call of a signature
    (this rank's copies; a peer's are at the same heap offsets): its part goes to
    ``recv[epoch[0] + 1 & 1, rank, :M, :N]`` on every peer, then ``pcount[rank]`` on every peer is
    raised by one add for each of ``signals`` units (release, system scope, after the unit's
    stores): exactly ``signals`` adds a call, what the consumer waits for."""

    recv: torch.Tensor        # heap (2, world, M, N), x's dtype
    pcount: torch.Tensor      # heap (world,) int64
    epoch: torch.Tensor       # (1,) int64: the consumer's last epoch (the next call's is epoch + 1)
    heap_bases: torch.Tensor  # (world,) int64
    rank: int
    world: int
    signals: int              # the adds a call, to each peer


def push_target(x, residual, weight, eps: float, *, ctx, pushed: int) -> PushTarget:
    """The buffers a producer of x pushes into for ``all_reduce_add_rmsnorm(x, residual, weight, eps,
    ctx=ctx, pushed=pushed)`` (its plan is made here on first use, as the call would make it:
    every rank must ask in the same order). Call it before the producer, each time: a recycling
    context may move a plan between calls. Each target must be followed by its producer's push and
    then the pushed call: asking again before that call raises (a push that is not consumed would
    leave the peers' counts a call ahead, and every later call reading stale rows)."""
    check_context(ctx, "push_target", alone=False)
    # a signature asked before skips the argument checks (an eager decode step asks 64 times;
    # the call that follows checks its tensors again): what they depend on is in the signature
    sig = tuple((t.shape, t.dtype, t.device, t.is_contiguous()) if isinstance(t, torch.Tensor) else t
                for t in (x, residual, weight, eps, pushed)) + (_options.current(),)
    known = ctx.__dict__.setdefault("_push_target_keys", {})
    plan = ctx.plans.get(known.get(sig, ()))
    if plan is None:
        if isinstance(pushed, bool) or not isinstance(pushed, int) or pushed < 1:
            raise ValueError(f"pushed must be an int >= 1 (the producer's adds a call), got {pushed!r}")
        if ctx.world < 2:
            raise ValueError("push_target: a world of one rank has no peer to push to")
        call = AllReduceAddRmsnorm.prepare(ctx, x, residual, weight, eps, out=x, pushed=pushed)
        plan = plan_for(ctx, "all_reduce_add_rmsnorm", call)
        known[sig] = call.key
    if plan.pending:
        raise RuntimeError(f"push_target on rank {ctx.rank}: the last target of this signature was not followed by "
                           f"its all_reduce_add_rmsnorm(pushed={pushed}) call (or its producer failed); a second push "
                           f"would put the peers' counts a call ahead: make that call, or create a new context")
    plan.pending = 1
    b = plan.bufs
    return PushTarget(b["recv"], b["pcount"], b["epoch"], ctx.heap_bases, ctx.rank, ctx.world, pushed)
