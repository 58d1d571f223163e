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

from numasched import caps
from numasched._validate import check_int32_indexing, check_positive_int

from . import _ws, cost
from ._common import Call, _aligned, _bulk_ok, _cdiv, _check_operands, _desc, _on_gpu, _Op, _output, _tma_default, _tma_ok
from ._common import _auto_nccl_ok, _matmul, register, run

IMPLS = ("auto", "oneshot", "twoshot", "bulk", "overlap", "fused")
# impl="overlap": the rows are cut into this many chunks; chunk i's all-reduce (NCCL, on a side
# stream: it uses few SMs) runs while chunk i+1's GEMM runs. Measured on two H200s it is slower
# than GEMM-then-all-reduce at every M (1024: 155 us against 79 for cuBLAS + NCCL; 4096: 275
# against 246; bench/results/collectives-2xh200-2026-11-23.csv): NCCL beside cuBLAS on a second
# stream does not overlap here. So "auto" never picks it; it stays for measurement.
OVERLAP_CHUNKS = 4
# each extra chunk costs a GEMM launch, an event pair and a smaller, less efficient GEMM
OVERLAP_CHUNK_US = 4.0
GEMMS = ("auto", "numasched", "torch")

__all__ = ["MatmulAllReducePlan", "plan_matmul_all_reduce", "matmul_all_reduce_plan", "matmul_all_reduce"]


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
        if self.all_reduce == "fused":
            return "fused"
        if self.chunks > 1:
            return "overlap"
        return "bulk" if (self.gemm, self.all_reduce) == ("torch", "nccl") else self.all_reduce

    def describe(self) -> str:
        how = f", {self.chunks} overlapped row chunks" if self.chunks > 1 else ""
        return (f"matmul_all_reduce {self.M}x{self.N}x{self.K_local} {str(self.dtype).replace('torch.', '')} over "
                f"{self.world} ranks: GEMM {self.gemm}, all-reduce {self.all_reduce}{how} "
                f"(model {self.est_us:.1f} us)")


def plan_matmul_all_reduce(a, b_local, *, world: int, impl: str = "auto", gemm: str = "auto",
                           bulk_ok: bool = True, fused_ok: bool = False, num_sms: int = 132,
                           ws: bool = False, nccl_ok: bool = True) -> MatmulAllReducePlan:
    """The plan for ``a`` (M, K_local) @ ``b_local`` (K_local, N) summed over ``world`` ranks
    (shapes only: meta tensors work). ``bulk_ok``: NCCL is available (a real context);
    ``nccl_ok``: "auto" may take NCCL's all-reduce (False on a ``bounded_only`` context);
    ``fused_ok``: "auto" may weigh the one-kernel fused path (its TMA-fed big tiles run here:
    a Hopper GPU, 16-bit operands); ``num_sms``: the GPU's SMs (wave quantisation of that kernel);
    ``ws``: its tile pairs run on the warp-specialised kernel (distributed._ws.ws_wanted)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    _check_operands(None, "a", a, "b_local", b_local, "K_local")
    check_positive_int("world", world, allow_none=False)
    M, Kl = a.shape
    N = b_local.shape[1]
    nbytes = M * N * a.element_size()
    g_s = cost.gemm_s(M, N, Kl, a.dtype)
    if impl in ("bulk", "overlap") and not bulk_ok:
        raise ValueError(f"impl={impl!r} needs a real context (numasched.distributed.init): a simulated rank has no "
                         f"process group")
    if impl == "bulk":
        engine = "torch" if gemm == "auto" else gemm
        est = cost.two_kernel_gemm_s(M, N, Kl, a.dtype, world, engine) + cost.all_reduce_s("nccl", nbytes, world)
        return MatmulAllReducePlan(M, N, Kl, a.dtype, world, engine, "nccl", est * 1e6)
    fused_s = cost.fused_matmul_all_reduce_s(M, N, Kl, a.dtype, world, num_sms, ws=ws, device=a.device)
    if impl == "fused":
        return MatmulAllReducePlan(M, N, Kl, a.dtype, world, "fused", "fused", fused_s * 1e6)
    if impl == "overlap":
        overlap = _overlap_s(g_s, cost.all_reduce_s("nccl", nbytes, world), OVERLAP_CHUNKS)
        return MatmulAllReducePlan(M, N, Kl, a.dtype, world, "torch" if gemm == "auto" else gemm, "nccl",
                                   overlap * 1e6, OVERLAP_CHUNKS)
    engine = cost.gemm_engine(M, a.device) if gemm == "auto" else gemm
    if impl == "auto":
        allowed = ("oneshot", "twoshot", "nccl") if bulk_ok and nccl_ok and world > 1 else ("oneshot", "twoshot")
        ar = cost.choose_all_reduce(nbytes, world, allowed=allowed)
    else:
        ar = impl
    # on the fused kernel's scale (cost.fused_matmul_all_reduce_s)
    est = cost.two_kernel_gemm_s(M, N, Kl, a.dtype, world, engine) + cost.all_reduce_s(ar, nbytes, world)
    if (impl == "auto" and gemm == "auto" and fused_ok and world > 1 and a.element_size() == 2
            and M >= cost.FUSED_AR_MIN_ROWS and fused_s < est):
        return MatmulAllReducePlan(M, N, Kl, a.dtype, world, "fused", "fused", fused_s * 1e6)
    return MatmulAllReducePlan(M, N, Kl, a.dtype, world, engine, ar, est * 1e6)


def _overlap_s(gemm_s: float, ar_s: float, k: int) -> float:
    """k chunks pipelined: the longer of the two streams plus one chunk of the shorter, plus a
    cost per extra chunk."""
    return max(gemm_s, ar_s) + min(gemm_s, ar_s) / k + (k - 1) * OVERLAP_CHUNK_US * 1e-6


def plan_key(a, b_local, impl: str = "auto", gemm: str = "auto") -> tuple:
    """Key of the plan a ``matmul_all_reduce`` call keeps in ``ctx.plans`` (what it chose is
    ``ctx.plans[plan_key(a, b_local)]`` after the call)."""
    return ("matmul_all_reduce", tuple(a.shape), tuple(b_local.shape), a.dtype, impl, gemm)


def matmul_all_reduce(a, b_local, *, ctx, impl: str = "auto", gemm: str = "auto", out=None, check: bool = True,
                      residual=None, norm_weight=None, eps: float = 1e-6):
    """``sum over ranks of a @ b_local``, returned on every rank (M, N).

    a: (M, K_local) this rank's slice of the activations' columns; b_local: (K_local, N) its rows
    of the weight (``w_local.T`` of a (N, K_local) ``F.linear`` weight works without a copy).
    impl: "auto" (default: the cost model picks the GEMM engine and the all-reduce, see
    :mod:`numasched.distributed.cost`), "oneshot" / "twoshot" (numasched all-reduce after the
    GEMM), "fused" (one kernel: each output tile pushed to the peers from registers as it is
    computed and summed a tile later, so the exchange overlaps the GEMM; narrow tiles at small M,
    TMA-fed 128 x 256 tiles from 256 rows; "auto" weighs it from 256 rows on Hopper GPUs: on two
    H200s it measured 1.05-1.34x the best other path at M >= 1024 with a small K_local, and slower
    where wave quantisation or a long K makes its GEMM the bottleneck),
    "overlap" (row chunks: each chunk's NCCL all-reduce on a side stream beside the next
    chunk's GEMM; measured slower on two H200s, never picked by "auto"), or "bulk" (torch.matmul then NCCL: the bulk-synchronous baseline). gemm: "auto",
    "numasched" or "torch". The GEMM writes into ``out`` (default a new tensor) and the
    all-reduce sums it in place; results are identical on every rank.

    residual, norm_weight: the transformer layer's epilogue, fused into the all-reduce
    (:func:`numasched.distributed.all_reduce_add_rmsnorm`): returns ``(residual + sum, rmsnorm(
    residual + sum) * norm_weight)`` with ``residual`` updated in place; the GEMM's output then
    lands in a scratch tensor (``out`` is the normalised output). One-shot: decode-sized M.
    residual alone: returns ``residual`` with the sum added in place (the bits of ``residual +
    sum``). Where the plan is fused the add is in the kernel's epilogue: the owner of a tile adds
    its residual and sends the result, so ``residual`` must hold the same values on every rank
    (the replicated residual stream of tensor parallelism); the sum never goes to memory alone
    (a prefill's residual add then reads one tensor fewer). Otherwise the sum, then an add.

    An ``out`` (or ``residual``) in the symmetric heap (``ctx.alloc``) at the same offset on both
    of two ranks lets the fused kernel's tile pairs store each sum straight into the peer's
    tensor (no receive slot, no copy). The offset is part of the plan's header and key: ranks
    that disagree are refused when a rank first makes that plan; where both ranks already hold
    the plans they ask for, they wait for each other in different plans and time out naming the
    rank, as any mismatched collective call does.
    """
    if not hasattr(ctx, "_ensure_usable") or not hasattr(ctx, "plans"):
        raise TypeError(f"matmul_all_reduce: ctx must be a context from numasched.distributed.init() (or a rank of a "
                        f"SimWorld), got {type(ctx).__name__}")
    plan = matmul_all_reduce_plan(ctx, a, b_local, impl=impl, gemm=gemm)
    if norm_weight is not None:
        if residual is None:
            raise ValueError("norm_weight needs residual (the fused add + RMSNorm)")
        c = torch.empty((plan.M, plan.N), dtype=a.dtype, device=a.device)
        _matmul(plan.gemm if plan.gemm in ("torch", "numasched") else cost.gemm_engine(plan.M, a.device), a, b_local, c)
        return run(ctx, "all_reduce_add_rmsnorm", c, residual, norm_weight, eps, out=out, check=check)
    if residual is not None:
        if out is not None:
            raise ValueError("pass out or residual, not both: without norm_weight the sum is added into residual "
                             "in place")
        _check_residual(residual, a, (plan.M, plan.N))
        if plan.all_reduce == "fused":   # the add in the kernel's epilogue
            return run(ctx, "matmul_all_reduce", a, b_local, residual=residual, check=check)
        return residual.add_(matmul_all_reduce(a, b_local, ctx=ctx, impl=impl, gemm=gemm, check=check))
    if plan.all_reduce == "fused":
        return run(ctx, "matmul_all_reduce", a, b_local, out=out, check=check)
    c = _output(out, (plan.M, plan.N), a, "fused")
    if not c.is_contiguous():
        raise ValueError("out must be contiguous (the all-reduce sums it in place)")
    if plan.chunks > 1:
        return _overlapped(ctx, plan, a, b_local, c)
    _matmul(plan.gemm, a, b_local, c)
    if plan.world == 1:
        return c
    return run(ctx, "all_reduce", c, impl=plan.all_reduce, out=c, check=check)


def matmul_all_reduce_plan(ctx, a, b_local, *, impl: str = "auto", gemm: str = "auto") -> MatmulAllReducePlan:
    """The plan a ``matmul_all_reduce(a, b_local, ctx=ctx, impl=impl, gemm=gemm)`` call runs
    (made and kept in ``ctx.plans`` on first use, as the call would): e.g. whether it is fused."""
    key = plan_key(a, b_local, impl, gemm)
    plan = ctx.plans.get(key)
    if plan is None:
        _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
        fused_ok = (_bulk_ok(ctx) and a.is_cuda and _tma_default(True) and _fused_tma_layout(a, b_local)
                    and _fused_fits(ctx, a, b_local))
        plan = ctx.plans[key] = plan_matmul_all_reduce(a, b_local, world=ctx.world, impl=impl, gemm=gemm,
                                                       bulk_ok=_bulk_ok(ctx), fused_ok=fused_ok,
                                                       nccl_ok=_auto_nccl_ok(ctx),
                                                       num_sms=getattr(ctx, "num_sms", 132),
                                                       ws=fused_ok and _ws.ws_wanted(ctx))
    else:   # cheap re-checks of what the key does not cover
        if a.device != ctx.device or b_local.device != ctx.device or b_local.dtype != a.dtype:
            _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
    return plan


def _check_residual(residual, a, shape) -> None:
    from numasched._validate import check_tensor

    check_tensor("residual", residual, ndim=2, dtypes=(a.dtype,), device=a.device)
    if tuple(residual.shape) != tuple(shape):
        raise ValueError(f"residual must have shape {tuple(shape)} (M, N), got {tuple(residual.shape)}")
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous (the fused kernel reads and writes it at the sum's offsets)")


def _fused_tma_layout(a, b) -> bool:
    """The fused kernel's TMA path takes operands laid out like these (b row-major, or the w.T
    view of a weight). Layout only, not the pointers: every rank must make the same choice, and
    a rank whose pointer turns out unaligned still runs the fused kernel (through pointer loads)."""
    b_store = b.T if (b.stride(1) != 1 and b.stride(0) == 1) else b
    return all(t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in (a, b_store))


def _fused_fits(ctx, a, b) -> bool:
    """Whether the fused kernel's buffers for this signature fit in what is left of the symmetric
    heap (counting what ``recycle`` could give back; without it a new signature's buffers stay):
    "auto" does not pick it where it would exhaust the heap that the all-reduce alone fits in.
    The same on every rank (the heap is used in the same order everywhere)."""
    return ctx.heap_room(fused_heap_sizes(ctx, a, b))


def fused_heap_sizes(ctx, a, b_local) -> list:
    """The heap allocations (bytes, as ``alloc_bytes`` rounds them) of the fused kernel's buffers
    for a call like ``(a, b_local)`` (one plan)."""
    from ._common import _numel, alloc_bytes

    return [alloc_bytes(_numel(shape) * torch.empty((), dtype=dt).element_size())
            for _, shape, dt in MatmulAllReduceFused.buffers(MatmulAllReduceFused.describe(a, b_local,
                                                                                         world=ctx.world))]


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
        _matmul(plan.gemm, a[lo:lo + rows], b, chunk)
        done = torch.cuda.Event()
        done.record(main)
        side.wait_event(done)
        with torch.cuda.stream(side):
            dist.all_reduce(chunk, group=ctx.group)
    main.wait_stream(side)
    c.record_stream(side)
    return c


# ----------------------------------------------------------------------------- impl="fused"
# rows from which the fused kernel takes the big TMA-fed tiles of the other fused GEMMs
FUSED_BIG_TILE_ROWS = 256
# ... and their config; ``per_sm``: programs per SM (the grid is at most SMs x per_sm programs).
# Timed against 128 x 128 tiles, 4 warps, 3 stages, 2 per SM (one program's epilogue and
# exchange beside the other's K loop) and 128 x 128 with 8 warps (scripts/mar_sweep.py, two
# H100s, bench/results/tp2-s18/mar-sweep-tp2-h100.log): both slower at every shape (4096 x 4096
# x 2048: 191.6 against 209.8 and 224.7 us).
# FLAT (PAIRS with TMA): the persistent tile loop and the K loop fused into one pipelined loop, so
# the next tile's operand loads are in flight during a tile's epilogue (kernels/dist_gemm_ar.py,
# _pairs_flat); options.fused_flat overrides.
# TMA_PUSH (FLAT): the pushes as asynchronous TMA stores into the peer's receive slots. Off: the
# same bits, but slower on two H200s (bench/results/tp2-s26e/mar-sweep-tp2-h200.log: 205.2 against
# 172.8 us at 4096 x 4096 x 2048, 426.9 against 378.3 at x 7168, 713.0 against 547.7 at 16384 rows;
# the TP 2 prefill 55.83 against 54.74 ms); options.fused_tma_push overrides.
# WS (two ranks, Hopper, Gluon): the tile pairs on the warp-specialised kernel instead
# (kernels/dist_gemm_ar_ws.py: TMA copies paced over the next K loop). The same bits as the
# Triton kernel (tests/dist_worker.py) and faster on two H100s (bench/results/tp2-s27f/: 147.0
# against 175.1 us at 4096 x 4096 x 2048, 365.8 against 407.6 at x 7168, 533.9 against 576.5 at
# 16384 rows; the TP 2 prefill 55.20 / 54.55 against 56.26 / 55.76 ms, tp2-s27f/, tp2-s27g/). On
# by default there (WS None: numasched.distributed._ws.ws_wanted) since its launch is thin as the
# Triton kernel's (numasched._launch.Launch: was Gluon's Python path, about 0.5 ms a call eager).
# Its sums are exactly the Triton kernel's on two H100s: out outside the heap (scripts/mar_sweep.py,
# out poisoned, three shapes, tp2-s27f/) and DIRECT (the sums stored into the peer's out in the
# heap: the TP prefill's residual stream; tests/dist_worker.py with a spy that the WS kernel ran,
# tp2-s29b/). The TP 2 prefill: 1.111-1.118x torch on two H100s against the Triton kernel's
# 1.075-1.088x (tp2-s28c/, tp2-s28f/, tp2-s28g/).
# options.fused_ws (NUMASCHED_FUSED_WS=0|1) overrides, eager and captured, DIRECT included.
FUSED_BIG_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, per_sm=1, FLAT=True,
                      TMA_PUSH=False, WS=None)


def _fused_cfg(M: int, dtype, gpu: bool) -> dict:
    from ._common import _tma_default

    tma = _tma_default(gpu)
    if not gpu:   # the interpreter: its dot needs >= 16
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, USE_TMA=tma)
    elt = torch.empty((), dtype=dtype).element_size()
    if M >= FUSED_BIG_TILE_ROWS and elt == 2:
        from numasched import options

        o = options.current()   # a measurement's overrides (None: the config's)
        stages = {} if o.fused_ar_stages is None else dict(num_stages=o.fused_ar_stages)
        return dict(FUSED_BIG_TILE, USE_TMA=tma, **stages,
                    **({} if o.fused_flat is None else dict(FLAT=o.fused_flat)),
                    **({} if o.fused_tma_push is None else dict(TMA_PUSH=o.fused_tma_push)),
                    **({} if o.fused_ws is None else dict(WS=o.fused_ws)))
    bm = min(64, max(16, 1 << max(0, M - 1).bit_length()))
    # decode-sized M streams the weight: narrow column tiles give every SM a strip of it
    return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128 if elt == 2 else 64, num_warps=4, num_stages=4, USE_TMA=False)


def _ws_width(cfg: dict, M: int, N: int, K: int, elt: int, world: int, device) -> dict:
    """``cfg`` with the warp-specialised kernel's tile width (cost.fused_ar_ws_width) where two
    ranks of this GPU take that kernel for this call: ``cfg`` has its 128 x 256 tiles, one program
    an SM and pairs not turned off, and the operands pass _ws.ws_ok's shape checks (M a multiple
    of 64, rows of 16 bytes; a caller's non-contiguous ``out`` would still send the narrowed tiles
    to the Triton kernel). The narrowed config is marked WS_NARROW: only it takes the WS kernel at
    128 columns (a caller's own 128 x 128 config stays on the Triton kernel)."""
    if (world == 2 and (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (128, 256, 64)
            and cfg.get("per_sm", 1) == 1 and cfg.get("PAIRS") is not False and cfg.get("WS") is not False
            and M % 64 == 0 and (N * elt) % 16 == 0 and (K * elt) % 16 == 0 and _ws.ws_wanted_on(device, world)):
        width = cost.fused_ar_ws_width(M, N, caps.num_sms(device))
        if width != cfg["BLOCK_N"]:
            return dict(cfg, BLOCK_N=width, WS_NARROW=True)
    return cfg


def _pairs(ctx, c) -> bool:
    """Whether the fused kernel runs in tile pairs (PAIRS) for config ``c`` on ``ctx``: two ranks
    and ``cost.fused_pairs`` (the config's PAIRS overrides)."""
    pairs = c.get("PAIRS")
    slots = ctx.num_sms * c.get("per_sm", 1)
    return ctx.world == 2 and (cost.fused_pairs(c["tiles"], slots) if pairs is None else bool(pairs))


@register
class MatmulAllReduceFused(_Op):
    """``impl="fused"``: the GEMM + all-reduce kernel (kernels/dist_gemm_ar.py) as a collective
    op (buffers per call signature, header check, SimWorld phases)."""

    name = "matmul_all_reduce"
    sim_phases = ("push", "consume", "gather")

    @staticmethod
    def describe(a, b_local, *, world, cfg=None, impl="fused", residual: bool = False, out_offset=None) -> Call:
        M, Kl = a.shape
        N = b_local.shape[1]
        # heap sizing (required_heap_bytes): "auto" may pick the fused kernel from 256 rows (its
        # receive slots hold every rank's output tiles, as the one-shot all-reduce's do, plus flags)
        if impl == "auto" and M >= cost.FUSED_AR_MIN_ROWS and a.element_size() == 2:
            impl = "fused"
        if impl != "fused":   # heap sizing (required_heap_bytes) of the other impls: the all-reduce's
            from .all_reduce import AllReduce

            out = torch.empty((M, N), dtype=a.dtype, device="meta")
            ar = "auto" if impl in ("auto", "overlap") else {"bulk": "nccl"}.get(impl, impl)
            return AllReduce.describe(out, world=world, impl=ar)
        cfg = cfg or _ws_width(_fused_cfg(M, a.dtype, _on_gpu(a)), M, N, Kl, a.element_size(), world, a.device)
        tiles = _cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"])
        # residual: every rank must add one (the owner of a tile adds it for all); out_offset: a
        # contiguous out in the symmetric heap, where the peers may store the sums (PAIRS), must
        # be at the same offset on every rank: both in the header (checked when a plan is made)
        # and in the key (a new offset makes a new plan, so it is checked too)
        header = dict(op="matmul_all_reduce", a_shape=tuple(a.shape), b_local_shape=tuple(b_local.shape),
                      dtype=str(a.dtype), impl="fused", world=world, config=tuple(sorted(cfg.items())),
                      residual=bool(residual), out_heap_offset=out_offset)
        key = ("matmul_all_reduce", M, Kl, N, a.dtype, tuple(sorted(cfg.items())), out_offset, bool(residual))
        return Call("matmul_all_reduce", key, header, dict(a=a, b_local=b_local),
                    dict(cfg, M=M, N=N, Kl=Kl, tiles=tiles, world=world, impl="fused", residual=bool(residual),
                         out_offset=out_offset))

    @staticmethod
    def buffers(call) -> list:
        if call.op == "all_reduce":   # describe() of another impl: its all-reduce's buffers
            from .all_reduce import AllReduce

            return AllReduce.buffers(call)
        c, W = call.cfg, call.cfg["world"]
        # flags: (W, 2 x tiles): the WS kernel's are per half tile (the Triton kernel's per tile, in the first half)
        return [("flags", (W, 2 * c["tiles"]), torch.int64), ("recv", (2, W, c["M"], c["N"]), call.tensors["a"].dtype)]

    @classmethod
    def prepare(cls, ctx, a, b_local, *, out=None, residual=None, communicate=True):
        _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
        check_int32_indexing("a", a)
        check_int32_indexing("b_local", b_local)
        if residual is not None:   # the kernel adds the sum into it in place
            if out is not None:
                raise ValueError("pass out or residual, not both: with residual the sum is added into it in place")
            _check_residual(residual, a, (a.shape[0], b_local.shape[1]))
            out = residual
        call = cls.describe(a, b_local, world=ctx.world, residual=residual is not None)
        # tile pairs and a contiguous out in the symmetric heap: the peer stores its sums there
        # (DIRECT), so the offset joins the header and key; elsewhere it changes nothing (no plan
        # of its own per offset, no refusal of ranks whose offsets differ)
        if out is not None and out.is_contiguous() and _pairs(ctx, call.cfg):
            off = ctx.heap_offset(out)
            if off is not None:
                call = cls.describe(a, b_local, world=ctx.world, residual=residual is not None, out_offset=off)
        call.tensors["out"] = _output(out, (call.cfg["M"], call.cfg["N"]), a, "fused")
        # False: timing only (phase "nocomm"); "nowait": timing only, the pushes without the waits
        call.extra["communicate"] = "nowait" if communicate == "nowait" else bool(communicate)
        return call

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        c, t, bf = call.cfg, call.tensors, plan.bufs
        a, b, out = t["a"], t["b_local"], t["out"]
        slots = ctx.num_sms * c.get("per_sm", 1)
        programs = max(1, min(slots, c["tiles"]))
        # Two ranks and one tile per program: the unlagged kernel (LAG=False) does the same
        # exchange with less memory traffic (no own partial stored and read back), and the lag
        # has nothing to hide there (a program's only tile is summed right after its push either
        # way). Two H100s, 1024 x 4096 x 2048: 59.0 against 62.4 us. With several tiles per
        # program the lag hides the peer's push and the unlagged form lost (4096 x 4096 x 2048:
        # 218.8 against 195.8; bench/results/tp2-s22/mar-sweep-tp2-h100.log). The config's LAG
        # overrides (scripts/mar_sweep.py); other world sizes always lag.
        lag = c.get("LAG")
        lag = (c["tiles"] > programs if lag is None else bool(lag)) or ctx.world != 2
        # Two ranks and several tiles per program: PAIRS (the kernel's _pairs: each tile pair's
        # all-reduce in two halves, the peer's tile first, so no program waits for a tile just
        # computed) where pairs add no round of tiles (cost.fused_pairs). Two H100s, against the
        # lagged one-shot: 4096 x 4096 x 2048 177 against 192 us, x 7168 394 against 421, 16384 x
        # 4096 x 2048 568 against 672 (bench/results/tp2-s23-b/mar-sweep-tp2-h100.log). The
        # config's PAIRS overrides (None: this rule).
        pairs = _pairs(ctx, c)
        if pairs:
            programs = max(1, min(slots, _cdiv(c["tiles"], 2)))
        if phase == "gather" and not pairs:   # the simulation's third launch: only PAIRS has one
            return out
        # TMA: A row-major; B row-major (K, N) or the transposed view of a (N, K) weight (w.T)
        b_trans = b.stride(1) != 1 and b.stride(0) == 1
        b_store = b.T if b_trans else b
        use_tma = c["USE_TMA"] and _tma_ok(a, b_store)
        if use_tma:
            bblock = [c["BLOCK_N"], c["BLOCK_K"]] if b_trans else [c["BLOCK_K"], c["BLOCK_N"]]
            descs = (_desc(a, [c["BLOCK_M"], c["BLOCK_K"]]), _desc(b_store, bblock))
        else:
            descs = (None, None)
        args = (a, b, out, bf["recv"], *descs, bf["flags"], ctx.status, bf["epoch"], bf["counters"], ctx.heap_bases,
                ctx.rank, c["M"], c["N"], c["Kl"], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                out.stride(0), out.stride(1), ctx.wait_bound)
        layout = (use_tma, b_trans, _aligned(a), a.stride(), _aligned(b), b.stride(), _aligned(out), out.stride())
        stages = {"push": 1, "consume": 2, "gather": 4}.get(phase, 7)
        last = "gather" if pairs else "consume"
        flat = bool(pairs and use_tma and stages == 7 and c.get("FLAT", False))
        # TMA_PUSH (FLAT, compiled): the pushes as TMA stores through a descriptor of the peer's
        # receive slot, made in the kernel (rows of 16-byte multiples; scratch per launch)
        tma_push = (flat and bool(c.get("TMA_PUSH")) and ctx.device.type != "cpu"
                    and (c["N"] * out.element_size()) % 16 == 0)

        ws = c.get("WS")
        if ws is None:   # the default: on two ranks of Hopper GPUs (see FUSED_BIG_TILE)
            ws = _ws.ws_wanted(ctx)
        if (ws and phase == "full" and pairs and use_tma and ctx.world == 2
                and (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == (128, 256 if not c.get("WS_NARROW") else 128, 64)
                and c.get("per_sm", 1) == 1
                and _ws.ws_ok(ctx, a, b_store, out, c["M"], c["N"], c["Kl"])):
            return _ws.launch(ctx, plan, a=a, b_store=b_store, b_trans=b_trans, out=out, recv=bf["recv"],
                              flags=bf["flags"], epoch=bf["epoch"], counters=bf["counters"], programs=programs,
                              rows=c["M"], N=c["N"], K=c["Kl"], residual=bool(c["residual"]),
                              direct=c.get("out_offset") is not None, rs=False, block_n=c["BLOCK_N"])

        def build():
            from numasched.kernels.dist_gemm_ar import matmul_all_reduce_kernel

            kw = dict(WORLD=ctx.world, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                      EVEN_K=c["Kl"] % c["BLOCK_K"] == 0, USE_TMA=use_tma, B_TRANS=use_tma and b_trans, STAGES=stages,
                      BUMP_EPOCH=phase in ("full", last, "nocomm", "nowait"), WAIT_CLOCK=ctx.wait_clock,
                      LAG=lag, PAIRS=pairs, RESIDUAL=c["residual"], CONTIG=out.is_contiguous(),
                      DIRECT=pairs and c["out_offset"] is not None and not tma_push, FLAT=flat,
                      TMA_PUSH=tma_push)
            if tma_push:
                from numasched._launch import ensure_scratch_allocator

                ensure_scratch_allocator()
            if phase == "nocomm":   # pushes into our own heap, no waits: the time without the exchange
                kw.update(REMOTE=False)
            if phase == "nowait":   # pushes to the peer, no waits: what the waits cost (FLAT pairs only)
                if not (flat and pairs and use_tma):
                    raise ValueError('communicate="nowait" times the FLAT tile pairs only (two ranks, TMA)')
                kw.update(WAITS=False)
            if ctx.device.type != "cpu":
                kw.update(num_warps=c["num_warps"], num_stages=c["num_stages"])
            return matmul_all_reduce_kernel, kw

        _Op._run(ctx, plan, call, phase, programs, args, layout, () if phase == "push" else (out,), build)
        return None if phase == "push" else out
