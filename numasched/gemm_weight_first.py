"""Host side of the weight-first decode GEMM (kernels/gemm_weight_first.py): check -> plan -> run.

    plan = WeightFirstPlan(x, w, glu=False)     # checks, the config, workspace and counters
    y = plan.run(x, w)                          # y = x @ w.T  (glu: silu(x @ w[:n].T) * (x @ w[n:].T))

For decode-sized rows (M <= 64) of 16-bit x (M, K) and an F.linear weight w (N, K), both
row-major, on an sm_90 GPU. The program's weight boxes are issued before its PDL wait, so a
launch with ``pdl=1`` streams weights while the kernel before it (an all-reduce + norm) still runs:
w must not be written by any kernel that may still be running then (numasched's kernels let their
successor launch before their own wait, so that is any kernel of the chain before). A plan's
workspace and counters serve one stream at a time.
Not in numasched.matmul. Alone it was 0-10 % slower than the split-K pick at 19-21 of the 22
M <= 16 decode shapes on an H200. Behind a latency-bound kernel it gains: 1.6-6.1 us a GEMM after
a 7 us spin (scripts/weight_first_probe.py). NumaschedBackend takes it at TP > 1, where the step
was 0.7-3.6 % shorter (bench/results/README.md, fifty-fifth session).

The config (:func:`config`): 64-row bands of W, BLOCK_K 128, BLOCK_T the smallest of 16 / 32 / 64
holding M, as many ring stages as fit ``smem`` bytes (at most MAX_STAGES), and split-K
(``splits``) so that bands x splits fill the SMs once at most.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from numasched._launch import HostDesc, Launch, hooked
from numasched.gemm_ws import descriptor_maker
from numasched.kernels.gemm_weight_first import BAND   # rows of W a unit computes (no Gluon needed)

__all__ = ["WfConfig", "RowScale", "config", "early_stages", "check", "WeightFirstPlan"]

BLOCK_K = 128
MAX_ROWS = 64        # wgmma's N: x's rows in one box of 16, 32 or 64
MAX_STAGES = 12
SMEM = 220 * 1024    # shared memory a program may take (sm_90: 227 KB a block)
PDL_MODES = (0, 1, 3)


@dataclass(frozen=True)
class WfConfig:
    block_t: int     # x's rows in a box (wgmma's N)
    stages: int      # ring slots
    splits: int      # K parts of a band
    k_per_split: int  # a multiple of BLOCK_K
    bands: int

    @property
    def units(self) -> int:
        return self.bands * self.splits


@dataclass(frozen=True)
class RowScale:
    """RMSNorm's factor for each row of x, from sums of squares: row m of the result is scaled by
    1 / sqrt(sums[:, m].sum() / K + eps) (K: x's columns). ``sums``: fp32 (parts, block_t) with
    block_t the plan's ``cfg.block_t`` (rows past M ignored), e.g. the row-parallel GEMM's
    per-band sums (``numasched.distributed.reduce_target``). For a model whose norm weights are
    folded into the projections (TPDecoder.fold_norms): x is the residual stream itself."""

    sums: torch.Tensor
    eps: float


def config(M: int, N: int, K: int, *, glu: bool = False, sms: int = 132, elt: int = 2, stages: Optional[int] = None,
           splits: Optional[int] = None, smem: int = SMEM) -> WfConfig:
    """The launch's shape for x (M, K) and a weight of N (glu: 2N) rows: see the module doc. An
    explicit ``splits`` may come back lower: K is cut into parts of whole 128-wide steps, and a
    part left empty is dropped (K = 1000 in 5 parts: 4 of 256)."""
    for name, v in (("M", M), ("N", N), ("K", K), ("sms", sms)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if M > MAX_ROWS:
        raise ValueError(f"M={M}: the weight-first GEMM takes at most {MAX_ROWS} rows (decode sizes)")
    block_t = 16 if M <= 16 else 32 if M <= 32 else 64
    stage = ((2 if glu else 1) * BAND + block_t) * BLOCK_K * elt
    fit = max(2, min(MAX_STAGES, (smem - 1024) // stage))
    if stages is None:
        stages = fit
    elif isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= fit:
        raise ValueError(f"stages must be an int in [1, {fit}] (shared memory), got {stages!r}")
    bands = -(-N // BAND)
    iters = -(-K // BLOCK_K)
    if splits is None:
        splits = max(1, min(iters, sms // bands))
    elif isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= iters:
        raise ValueError(f"splits must be an int in [1, {iters}] (K steps of {BLOCK_K}), got {splits!r}")
    kps = -(-iters // splits) * BLOCK_K
    splits = -(-K // kps)   # no empty last part
    return WfConfig(block_t=block_t, stages=stages, splits=splits, k_per_split=kps, bands=bands)


def early_stages(early: Optional[int], stages: int) -> int:
    """The ring stages whose weight boxes go before the PDL wait: at most ``early`` (0: none, the
    A/B of the order), every stage where it is None."""
    if early is None:
        return stages
    if isinstance(early, bool) or not isinstance(early, int) or early < 0:
        raise ValueError(f"early must be None or an int >= 0 (ring stages), got {early!r}")
    return min(early, stages)


def check(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None, glu: bool = False) -> None:
    """Raise naming the argument where the kernel cannot take the operands."""
    from numasched import caps

    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be bf16 or fp16, got {t.dtype}")
        _check_rows(name, t)
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must match x's dtype and device (x {x.dtype} on {x.device}, w {w.dtype} on {w.device})")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has {w.shape[1]} columns; it must match x's K = {x.shape[1]} (F.linear's weight, (N, K))")
    if glu and w.shape[0] % 2:
        raise ValueError(f"glu: w must hold the gate's rows then the up's (2n, K), got {w.shape[0]} rows")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; the weight-first GEMM takes 1 to {MAX_ROWS}")
    if (x.shape[1] * x.element_size()) % 16:
        raise ValueError(f"K={x.shape[1]} must be a multiple of {16 // x.element_size()} (TMA's 16-byte rows)")
    _check_out(x, w.shape[0] // 2 if glu else w.shape[0], out)
    if x.device.type != "cuda" or caps.is_hip() or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise RuntimeError("the weight-first GEMM is for NVIDIA sm_90 GPUs (Gluon wgmma + TMA)")


def _check_rows(name: str, t: torch.Tensor) -> None:
    """TMA reads ``t`` by rows: unit stride along them, 16-byte aligned starts."""
    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        raise ValueError(f"{name} must be row-major with 16-byte aligned rows (TMA)")


def _check_out(x: torch.Tensor, n: int, out: Optional[torch.Tensor]) -> None:
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (x.shape[0], n)
                            or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must be a ({x.shape[0]}, {n}) {x.dtype} tensor on {x.device}")


def _check_push(push, x: torch.Tensor, n: int, glu: bool, bands: int) -> None:
    """A push target (numasched.distributed.PushTarget) for y (M, n) from a launch of ``bands``
    bands: its receive buffer holds y's rows in y's dtype on x's device, its consumer waits for
    one add a band, and its counts, epoch word and heap bases are what the kernel reads."""
    if glu:
        raise ValueError("push: the GLU form does not push (a row-parallel projection's GEMM does)")
    # (by its fields: the distributed layer sits above this one, which never imports it)
    fields = ("recv", "pcount", "epoch", "heap_bases", "rank", "world", "signals")
    if not all(hasattr(push, f) for f in fields) or not isinstance(push.recv, torch.Tensor):
        raise TypeError(f"push must be a numasched.distributed.PushTarget (push_target), got {type(push).__name__}")
    W, recv = push.world, push.recv
    want = (2, W, x.shape[0], n)
    if tuple(recv.shape) != want or recv.dtype != x.dtype or recv.device != x.device or W < 2:
        raise ValueError(f"push: its receive buffer is {tuple(recv.shape)} {recv.dtype} on {recv.device}; y needs "
                         f"{want} {x.dtype} on {x.device} (push_target of y's shape, world >= 2)")
    # the kernel's pushed stores are 16 bytes a thread, and the launch's specialisation (cached
    # per call signature) does not see recv's alignment: a heap buffer always has it
    if not recv.is_contiguous() or recv.data_ptr() % 16:
        raise ValueError(f"push: its receive buffer must be contiguous and 16-byte aligned (a symmetric-heap buffer), "
                         f"got strides {recv.stride()} at an address of {recv.data_ptr() % 16} mod 16")
    if push.signals != bands:
        raise ValueError(f"push: its consumer waits for {push.signals} adds a call; this launch makes one a band, "
                         f"{bands} (push_target(..., pushed=plan.cfg.bands))")
    for name, t, shape in (("pcount", push.pcount, (W,)), ("epoch", push.epoch, (1,)),
                           ("heap_bases", push.heap_bases, (W,))):
        if t.dtype != torch.int64 or tuple(t.shape) != shape or t.device != x.device:
            raise ValueError(f"push.{name} must be an int64 {shape} tensor on {x.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if isinstance(push.rank, bool) or not isinstance(push.rank, int) or not 0 <= push.rank < W:
        raise ValueError(f"push.rank must be an int in [0, {W}), got {push.rank!r}")


def _check_reduce(red, x: torch.Tensor, n: int, glu: bool, bands: int, block_t: int) -> None:
    """A reduce target (numasched.distributed.ReduceTarget) for y (M, n) from a launch of
    ``bands`` bands: its buffers' shapes, dtypes and device, by its fields (the distributed layer
    sits above this one, which never imports it)."""
    if glu:
        raise ValueError("reduce: the GLU form does not reduce (a row-parallel projection's GEMM does)")
    fields = ("recv", "flags", "ss", "epoch", "xcount", "status", "bound", "heap_bases", "rank", "world", "residual")
    if not all(hasattr(red, f) for f in fields) or not isinstance(red.recv, torch.Tensor):
        raise TypeError(f"reduce must be a numasched.distributed.ReduceTarget (reduce_target), got {type(red).__name__}")
    W, M = red.world, x.shape[0]
    for name, t, shape, dt in (("recv", red.recv, (2, W, M, n), x.dtype), ("flags", red.flags, (W, bands), torch.int64),
                               ("ss", red.ss, (bands, block_t), torch.float32), ("epoch", red.epoch, (1,), torch.int64),
                               ("xcount", red.xcount, None, torch.int32), ("status", red.status, None, torch.int32),
                               ("heap_bases", red.heap_bases, (W,), torch.int64),
                               ("residual", red.residual, (M, n), x.dtype)):
        if (not isinstance(t, torch.Tensor) or t.dtype != dt or t.device != x.device or not t.is_contiguous()
                or (shape is not None and tuple(t.shape) != shape) or t.numel() < 1 or t.data_ptr() % 16):
            want = "" if shape is None else f"{shape} "
            raise ValueError(f"reduce.{name} must be a contiguous, 16-byte aligned {want}{dt} tensor on {x.device} "
                             f"(reduce_target(residual, ctx=, bands={bands}, block_t={block_t}))")
    if isinstance(red.rank, bool) or not isinstance(red.rank, int) or not 0 <= red.rank < W:
        raise ValueError(f"reduce.rank must be an int in [0, {W}), got {red.rank!r}")
    # (an int32 argument whatever its value: the compiled kernel's signature does not change)
    if isinstance(red.bound, bool) or not isinstance(red.bound, int) or not 2 <= red.bound < 2**31:
        raise ValueError(f"reduce.bound must be an int in [2, 2**31) (microseconds of a wait), got {red.bound!r}")


def _check_scale(scale, x: torch.Tensor, block_t: int) -> None:
    if not isinstance(scale, RowScale):
        raise TypeError(f"scale must be a RowScale, got {type(scale).__name__}")
    t = scale.sums
    if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != block_t or t.dtype != torch.float32
            or t.device != x.device or not t.is_contiguous() or not 1 <= t.shape[0] <= MAX_SUM_PARTS
            or t.data_ptr() % 16):
        raise ValueError(f"scale.sums must be a contiguous, 16-byte aligned fp32 (parts, {block_t}) tensor on "
                         f"{x.device} with 1 to {MAX_SUM_PARTS} parts, got {getattr(t, 'dtype', type(t).__name__)} "
                         f"{tuple(getattr(t, 'shape', ()))}")
    if isinstance(scale.eps, bool) or not isinstance(scale.eps, (int, float)) or not 0 <= scale.eps < float("inf"):
        raise ValueError(f"scale.eps must be a finite non-negative float, got {scale.eps!r}")


MAX_SUM_PARTS = 256   # RowScale.sums's rows (a hidden size of 16384 in 64-column bands), read 32 at a time


class WeightFirstPlan:
    """A launch of ``y = x @ w.T`` for operands of x's and w's shapes, dtype and device (checked
    once); ``run`` makes the descriptors of the tensors it is given and launches."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, *, glu: bool = False, pdl: int = 0, stages=None,
                 splits=None, early: Optional[int] = None):
        check(x, w, glu=glu)
        if pdl not in PDL_MODES or isinstance(pdl, bool):
            raise ValueError(f"pdl must be one of {PDL_MODES} (none, trigger then wait, wait and trigger late), "
                             f"got {pdl!r}")
        M, K = x.shape
        self.glu, self.pdl = glu, pdl
        self.N = w.shape[0] // 2 if glu else w.shape[0]
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        self.cfg = c = config(M, self.N, K, glu=glu, sms=sms, elt=x.element_size(), stages=stages, splits=splits)
        self.early = early_stages(early, c.stages)
        self.ws = torch.empty(c.units * (2 if glu else 1) * BAND * c.block_t if c.splits > 1 else 1,
                              device=x.device, dtype=torch.float32)
        self.counters = torch.zeros(c.bands, device=x.device, dtype=torch.int32)
        self.key = (tuple(x.shape), tuple(w.shape), x.dtype, glu, x.device)
        self._launches: dict = {}   # specialisation signature -> Launch
        self._fulls: dict = {}      # (pointers, strides) -> the C launcher's whole argument list

    def run(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None, push=None, reduce=None,
            scale: Optional[RowScale] = None) -> torch.Tensor:
        """``push``: a :class:`numasched.distributed.PushTarget` (from ``push_target(..., pushed=
        plan.cfg.bands)``): y's bands also go to the peers for the pushed all-reduce + add + norm
        that must follow (not with glu). ``reduce``: a :class:`numasched.distributed.ReduceTarget`
        (``reduce_target(residual, ctx=, bands=plan.cfg.bands, block_t=plan.cfg.block_t)``): the
        all-reduce and the residual add are finished here (``residual += sum over ranks of y``,
        in place, and its sums of squares a band into ``reduce.ss``); returns the residual, y is
        not written. ``scale``: a :class:`RowScale`, RMSNorm's factor a row applied to the
        result (before the GLU)."""
        if (tuple(x.shape), tuple(w.shape), x.dtype, self.glu, x.device) != self.key:
            raise ValueError(f"x {tuple(x.shape)} / w {tuple(w.shape)} {x.dtype} on {x.device} are not the plan's "
                             f"{self.key[:3]} on {self.key[4]}")
        # the plan checked everything else once; what may differ from call to call is each tensor's
        # layout and the output
        _check_rows("x", x)
        _check_rows("w", w)
        _check_out(x, self.N, out)
        c = self.cfg
        M, K = x.shape
        if push is not None:
            if reduce is not None:
                raise ValueError("push and reduce: one target a call")
            _check_push(push, x, self.N, self.glu, c.bands)
        if reduce is not None:
            _check_reduce(reduce, x, self.N, self.glu, c.bands, c.block_t)
            if out is not None:
                raise ValueError("reduce: the result goes to reduce.residual; out must be None")
        if scale is not None:
            _check_scale(scale, x, c.block_t)
        if reduce is not None:
            y = reduce.residual
        else:
            y = torch.empty((M, self.N), device=x.device, dtype=x.dtype) if out is None else out
        sy0, sy1 = y.stride()
        # the thin launch (numasched._launch): Gluon's Python path on a signature's first call, then
        # the C launcher, with the argument list of these pointers and strides made once. A
        # signature is what Triton specialises the kernel on that may change from call to call:
        # y's strides (1, a multiple of 16) and alignment (the descriptors specialise on nothing);
        # and x's and w's row strides, since a Launch caches each descriptor's tensor map by its
        # base pointer alone
        tgt = push if push is not None else reduce
        world = tgt.world if tgt is not None else 1
        rank = tgt.rank if tgt is not None else 0
        nss = scale.sums.shape[0] if scale is not None else 0
        # (rank, nss: ints Triton specialises when 1 or a multiple of 16, as 0 is)
        sig = (sy0 == 1, sy0 % 16 == 0, sy1 == 1, sy1 % 16 == 0, y.data_ptr() % 16 == 0, x.stride(0), w.stride(0),
               world, rank == 1, rank % 16 == 0, reduce is not None, nss and 1 << (nss - 1).bit_length(), nss == 1,
               nss % 16 == 0)
        run = self._launches.get(sig)
        if run is None:
            run = self._launches[sig] = self._launch(x.device, world, reduce=reduce is not None, nss=sig[-3])
        # the push's or reduce's buffers, then the row scale's (stand-ins where unused: y, the
        # counters, the workspace and rank 0)
        if push is not None:
            pt = (push.recv, push.pcount, push.epoch, push.heap_bases, y, self.ws, self.counters, self.counters)
        elif reduce is not None:
            pt = (reduce.recv, reduce.flags, reduce.epoch, reduce.heap_bases, reduce.residual, reduce.ss,
                  reduce.xcount, reduce.status)
        else:
            pt = (y, self.counters, self.counters, self.counters, y, self.ws, self.counters, self.counters)
        bound = int(reduce.bound) if reduce is not None else 0
        xs = scale.sums if scale is not None else self.ws
        eps = float(scale.eps) if scale is not None else 0.0
        fkey = (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), sy0, sy1,
                tuple(t.data_ptr() for t in pt), rank, bound, xs.data_ptr(), nss, eps)
        if run.raw is not None and not hooked():
            full = self._fulls.get(fkey)
            if full is not None:
                run.call_full(full)
                return y
        desc = descriptor_maker(run)
        w_d = desc(w, w.shape, w.stride(), [BAND, BLOCK_K])
        x_d = desc(x, x.shape, x.stride(), [c.block_t, BLOCK_K])
        thin = run.raw is not None and desc is HostDesc
        args = (w_d, x_d, y.data_ptr() if thin else y, self.ws.data_ptr() if thin else self.ws,
                self.counters.data_ptr() if thin else self.counters, M, self.N, K, sy0, sy1, c.k_per_split,
                *(t.data_ptr() if thin else t for t in pt[:4]), rank, *(t.data_ptr() if thin else t for t in pt[4:]),
                bound, xs.data_ptr() if thin else xs, nss, eps)
        run(*args)
        if thin and not hooked():
            run.keep_full(self._fulls, fkey, args)
        return y

    def _launch(self, device, world: int = 1, reduce: bool = False, nss: int = 0):
        """The kernel's Launch with this plan's constexprs: its own PDL mode (``pdl``), so the
        options' PDL switch, which Launch would apply, is off for it; ``world`` > 1: the pushing
        form for that many ranks (``reduce``: the reducing one, at any world); ``nss``: the row
        scale's parts, padded to a power of two (0: none)."""
        import dataclasses

        from numasched import options as _options
        from numasched.kernels.gemm_weight_first import weight_first_kernel

        c = self.cfg
        return Launch(weight_first_kernel, c.units,
                      dict(SPLITS=c.splits, STAGES=c.stages, GLU=self.glu, PDL=self.pdl, EARLY=self.early,
                           PUSH=world > 1 or reduce, WORLD=world, REDUCE=reduce, NSS=nss, num_warps=4,
                           launch_pdl=self.pdl != 0),
                      device=device, options=dataclasses.replace(_options.current(), pdl=False))
