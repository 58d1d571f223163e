"""GEMM ``C = A @ B (+ bias) (+ residual)``: check, plan, run; the one call ``numasched.matmul``.

    >>> c = numasched.matmul(a, b)                          # schedule chosen by a model
    >>> y = numasched.matmul(x, w.T, bias=b, residual=h)    # a linear layer with its residual add
    >>> c = numasched.matmul(a, b, mapping="row_major", persistent=True)
    >>> numasched.matmul(a, b, out=c)                       # writes into c, returns c
    >>> plan = numasched.plan_matmul(a, b)                  # once per signature
    >>> c = plan.run(a, b)                                  # every call

The plan holds what depends only on the operands' signatures (shapes, strides, dtypes, device,
16-byte alignment) and the process state: the schedule (numasched.gemm_schedule picks the kernel,
tile shape and split-K from a model of the GPU: no tuning at run time, unless the options ask for
Triton's autotuner), the policy, the read path (TMA descriptors on Hopper or masked pointers),
the grid, the split-K workspace. ``run`` launches the compiled kernel directly.

Two kernels: ``tiled`` (kernels/gemm.py: TMA + wgmma tiles, for large M) and ``splitk``
(kernels/gemm_splitk.py: small M, each tile's K range split over several programs and merged
in the same launch, deterministically). Both apply the epilogue (bias, residual, output dtype);
on Hopper the warp-specialised kernel (numasched.gemm_ws) adds the bias and the residual too.

The one call is the torch custom ops ``numasched::matmul`` (functional, with a backward) and
``numasched::matmul_out`` (writes ``out``), each with a fake implementation, under
``torch.compile`` and autograd; plain eager calls skip the op dispatcher. Where no Triton kernel
can run (CPU tensors without ``TRITON_INTERPRET=1``) it falls back to torch with a one-time
warning. Under the interpreter, bf16 runs in fp32 (the interpreter's bf16 dot is wrong).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Optional, Union

import torch

from . import caps
from . import gemm_schedule as _sched
from . import mappings as M
from . import observe as _observe
from . import options as _options
from . import topology as _topology
from ._launch import HostDesc, TensorDescriptor  # TensorDescriptor: None on a Triton without them
from ._plan import _REG, PLANS, Plan, fast_signature, grow_only, signature, upcast_like
from ._route import mapping_token, plain_eager, warn_once
from ._validate import INT32_MAX, check_no_overlap, check_same, check_tensor

__all__ = ["matmul", "plan_matmul", "check_matmul", "GemmPlan", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------- checks
def check_matmul(a, b, out=None, *, bias=None, residual=None, out_dtype=None, mapping="auto",
                 persistent=None) -> tuple:
    """Check a matmul's arguments without reading data (works on fake and meta tensors);
    returns (M, N, K, output dtype). TypeError for a wrong type, ValueError for a wrong value or
    shape; errors name the argument."""
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, dtypes=SUPPORTED_DTYPES)
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)} "
                             f"(batched inputs are not supported: loop or reshape to 2-D)")
    check_same("a", a, "b", b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} and b is {tuple(b.shape)} "
                         f"(a.shape[1] must equal b.shape[0])")
    for name, size in (("M (a.shape[0])", a.shape[0]), ("K (a.shape[1])", a.shape[1]), ("N (b.shape[1])", b.shape[1])):
        if size > INT32_MAX:
            raise ValueError(f"{name} = {size} overflows int32; split the call")
    Mdim, N = a.shape[0], b.shape[1]
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
        if out_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"out_dtype {out_dtype} is not supported (float16, bfloat16, float32)")
    dtype = out_dtype or a.dtype  # as torch.matmul: out must have it (pass out_dtype for another)
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(dtype,), device=a.device)
        want = (Mdim, N)
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {want} for a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=SUPPORTED_DTYPES, device=a.device)
        if bias.shape[0] != N:
            raise ValueError(f"bias has {bias.shape[0]} entries, expected N = {N}")
        if N > 1 and bias.stride(0) != 1:   # the kernels read it as N consecutive elements
            raise ValueError(f"bias must be contiguous (stride 1), got stride {bias.stride(0)}; pass "
                             f"bias.contiguous()")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=SUPPORTED_DTYPES, device=a.device)
        if tuple(residual.shape) != (Mdim, N):
            raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {(Mdim, N)}")
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent must be True, False or None, got {persistent!r}")
    mapping_token(mapping, "gemm")
    return Mdim, N, a.shape[1], dtype


# ----------------------------------------------------------------------------------- layouts
def tma_view(t: torch.Tensor):
    """How TMA can read a 2-D tensor: ``(transposed, shape, strides)`` of a row-major descriptor
    over its storage -- (rows, cols) if the last dimension has unit stride, (cols, rows) with
    ``transposed`` if the first one has -- or None (unaligned base or leading stride).
    A dimension of size 1 has no meaningful stride; a padded one stands in for it."""
    es = t.element_size()
    try:
        if t.data_ptr() % 16:
            return None
    except RuntimeError:  # fake tensors: plan for aligned memory (run() checks the real one)
        pass
    r, c = t.shape
    s0, s1 = t.stride()
    align = 16 // es

    def lead_ok(lead):
        return lead > 0 and (lead * es) % 16 == 0

    if s1 == 1 or c == 1:
        lead = s0 if r > 1 else -(-c // align) * align
        if lead_ok(lead):
            return False, [r, c], [lead, 1]
    if s0 == 1 or r == 1:
        lead = s1 if c > 1 else -(-r // align) * align
        if lead_ok(lead):
            return True, [c, r], [lead, 1]
    return None


def input_precision(dtype: torch.dtype) -> Optional[str]:
    """fp32 inputs: "ieee" unless torch allows TF32 (``torch.set_float32_matmul_precision``
    "high"/"medium"), to match torch.matmul. 16-bit inputs: the default (tensor cores)."""
    if dtype != torch.float32:
        return None
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def persistent_programs(num_tiles: int, num_sms: int, num_domains: int) -> int:
    """Persistent grid size: at most one program per SM, a multiple of the domain count when it
    can be (so tile t and program t mod P share domain t mod X under round-robin dispatch)."""
    p = max(1, min(num_sms, num_tiles))
    if num_domains > 1 and p >= num_domains:
        p -= p % num_domains
    return p


def choose_persistent(num_tiles: int, num_sms: int) -> bool:
    """Heuristic where no autotuner decides (interpreter): persistent once there are several
    waves of tiles, where launching a program per tile costs the most."""
    return num_tiles >= 2 * num_sms


# ----------------------------------------------------------------------------------- split-K buffers
# Partial sums and tile counters of the split-K kernel, per (device, stream): launches on a stream
# run in order, so consecutive calls never share a buffer at once. The counters are zeroed once
# and reset by the kernel; while a CUDA graph is captured the partials are allocated fresh (the
# graph's pool owns them), as flash_decode does.
_WS: dict = {}
_CTRS: dict = {}


def _splitk_buffers(device: torch.device, ws_numel: int, tiles: int, stream: int, capturing: bool):
    # grow-only (numasched._plan.grow_only): plans cache these addresses in their launch arguments
    # and captured graphs hold them; a replaced buffer must never be freed
    key = (device.type, device.index, stream)
    ctr = grow_only(_CTRS, key, tiles, torch.int32, device, zero=True, minimum=4096)
    if capturing:
        return torch.empty(ws_numel, dtype=torch.float32, device=device), ctr
    return grow_only(_WS, key, ws_numel, torch.float32, device), ctr


# A's rows realigned (options.gemm_align_a): per (device, stream, dtype), grow-only like the
# split-K buffers (launch arguments cached by pointer hold their address), fresh while capturing
_APAD: dict = {}


def _aligned_rows(a: torch.Tensor, kp: int, capturing: bool) -> torch.Tensor:
    """An (M, K) view of a buffer whose rows are ``kp`` elements (whole 128-byte lines), for
    this stream; not yet filled."""
    m, k = a.shape
    dev = a.device
    if capturing:
        buf = torch.empty(m * kp, dtype=a.dtype, device=dev)
    else:
        buf = grow_only(_APAD, (dev.type, dev.index, caps.stream_handle(dev), a.dtype), m * kp, a.dtype, dev)
    return buf[:m * kp].view(m, kp)[:, :k]


def _row_copy_launch(a: torch.Tensor, kp: int, interp: bool, options: _options.Options, pad: bool = False):
    """The launch that copies A (K-contiguous rows) into rows of ``kp`` elements
    (kernels/copy_rows.py); ``pad``: zeros in each row's columns K..kp too (its grid covers kp)."""
    from ._launch import Launch
    from .kernels import copy_rows as CR
    from .kernels.gemm_splitk import vector_width

    m, k = a.shape
    width = kp if pad else k
    bk = CR.block_k(width)
    vec = vector_width(a.element_size(), k, a.stride(0), kp)
    const = dict(BLOCK_K=bk, VEC=vec, PAD=1) if pad else dict(BLOCK_K=bk, VEC=vec)
    return Launch(CR.copy_rows_kernel, (m, -(-width // bk)), const, config=dict(num_warps=4),
                  device=a.device, interpret=interp, options=options)


def _align_a_wanted(a: torch.Tensor, b: torch.Tensor, M: int, N: int, K: int, options: _options.Options,
                    interp: bool) -> int:
    """The row length (elements) A is copied to before the kernel (options.gemm_align_a), or 0."""
    es = a.element_size()
    # A's own rows already whole lines (e.g. a K-slice of a wider, aligned buffer): nothing to do
    if options.gemm_align_a is False or a.stride(1) != 1 or (a.stride(0) * es) % 128 == 0:
        return 0
    if (K * es) % 16:
        # K not a multiple of 16 bytes: only where W's rows are 16-byte strided (prepare_weight's
        # weight, read through TMA over the logical K); then A's copy is what gives TMA at all,
        # at any M (without it both operands go through element-wise loads), a GPU only
        if tma_view(a) is not None or tma_view(b) is None or b.stride(0) != 1 or (interp and not options.gemm_align_a):
            return 0
    elif M < 2 or (options.gemm_align_a is None
                   and (interp or not _sched.align_a_pays(M, K, es, lead=a.stride(0)))):
        return 0
    return -(-K * es // 128) * 128 // es


# K padded to whole 128-byte lines (options.gemm_pad_k): A's and W's zero-padded rows per
# (device, stream, dtype, operand), grow-only like _APAD, fresh while capturing
_KPAD: dict = {}


def _padded_rows(t: torch.Tensor, rows: int, kp: int, which: str, capturing: bool) -> torch.Tensor:
    """A (rows, kp) row-major buffer for this stream (``which``: "a" or "w"); the copy fills all
    of it, its padding included, so what it held before does not matter."""
    dev = t.device
    if capturing:
        buf = torch.empty(rows * kp, dtype=t.dtype, device=dev)
    else:
        buf = grow_only(_KPAD, (dev.type, dev.index, caps.stream_handle(dev), t.dtype, which), rows * kp, t.dtype,
                        dev)
    return buf[:rows * kp].view(rows, kp)


def _pad_k_wanted(a: torch.Tensor, b: torch.Tensor, M: int, N: int, K: int, options: _options.Options,
                  interp: bool) -> int:
    """K rounded up to whole 128-byte lines where A and W are copied into zero-padded rows of
    that length before the kernel (options.gemm_pad_k), or 0."""
    es = a.element_size()
    # K a multiple of 16 bytes: rows TMA can read (A's lines are gemm_align_a's); only A
    # K-contiguous and B the W.T view of a row-major (N, K) W (F.linear's layout): the copy
    # kernel pads rows, and a (K, N) B would need zero rows instead
    if options.gemm_pad_k is False or (K * es) % 16 == 0 or a.stride(1) != 1 or b.stride(0) != 1:
        return 0
    # both rows already 16-byte strided (K-slices of wider buffers): TMA reads them as they are;
    # W's alone (prepare_weight's): A is copied into whole-line rows (_align_a_wanted), W is not
    if tma_view(b) is not None and (options.gemm_pad_k is None or tma_view(a) is not None):
        return 0
    if options.gemm_pad_k is None:
        tma = TensorDescriptor is not None and caps.tma_supported(a.device)
        if interp or not _sched.pad_k_pays(M, N, K, es, _sched.Machine.of(a.device), tma=tma,
                                           tail=options.gemm_tail_split):
            return 0
    return _sched.padded_k(K, es)


# ----------------------------------------------------------------------------------- the plan
class GemmPlan(Plan):
    """A planned matmul: made by :func:`plan_matmul`, run with :meth:`run`.

    Attributes: M, N, K (the caller's); k_padded (options.gemm_pad_k: the K the kernel runs
    over, A and W copied into zero-padded rows of it first; 0: not padded); out_dtype; schedule
    (a numasched.gemm_schedule.Schedule, or None for the autotuned or hand-configured tiled
    kernel); kernel ("tiled", "splitk" or "streamk"); policy, topology;
    path ("tma" or "pointer"); a_trans, b_trans (operands read through a descriptor of their
    transposed storage); c_tma; int64; persistent; split_k; mode ("kernel", "interpreter", "torch",
    "empty", "zero"); grid and config (None until the autotuner chose); workspace_bytes; tensors."""

    op = "matmul"

    def __init__(self, a, b, out=None, *, bias=None, residual=None, out_dtype=None, mapping="auto",
                 persistent=None, path="auto", config=None, schedule=None, split_k=None, int64=None,
                 num_programs=None, options: Optional[_options.Options] = None):
        Mdim, N, K, dtype = check_matmul(a, b, out, bias=bias, residual=residual, out_dtype=out_dtype,
                                         mapping=mapping, persistent=persistent)
        options = options if options is not None else _options.current()
        self._opts = options
        self.M, self.N, self.K = Mdim, N, K
        self.out_dtype = dtype
        self.tensors = dict(a=signature(a), b=signature(b), out=signature(out), bias=signature(bias),
                            residual=signature(residual))
        self.device = dev = a.device
        self.topology = _topology.current()
        self.workspace_bytes = 0
        self.policy = self.grid = self.config = self.schedule = None
        self.kernel = "tiled"
        self.split_k = 1
        self.tail_whole_tiles = 0   # split-K tail schedules: the tiles that run whole
        self.path, self.a_trans, self.b_trans, self.c_tma, self.int64 = "pointer", False, False, False, False
        self.persistent = persistent
        self._out_shape = (Mdim, N)
        self._launch = None
        self._epi = (bias is not None, residual is not None)
        self._a_rows = self._copy_bytes = 0   # options.gemm_align_a (below); the copies' buffers
        self.k_padded = 0   # options.gemm_pad_k (below)
        self._kernel_k = K   # the K the kernel runs over (k_padded where padded)
        self.a_pointer = ""   # split-K on TMA: A through pointers ("b_tma", "b_tma_last": options.gemm_splitk_operands)
        if Mdim == 0 or N == 0:
            self.mode = "empty"
        elif K == 0:
            self.mode = "zero"
        else:
            self.mode = caps.launch_mode(dev)
        if self.mode in ("empty", "zero", "torch"):
            self._freeze()
            return
        interp = self.mode == "interpreter"
        # K not a multiple of 16 bytes (options.gemm_pad_k): run() copies A and W into rows of
        # whole 128-byte lines, zeros past K in both, and the kernel is planned for those buffers
        # over the padded K (stand-ins of their layout: run() fills this stream's buffers)
        self.k_padded = _pad_k_wanted(a, b, Mdim, N, K, options, interp)
        hint = None if interp else straddling_weight_hint(b)
        if hint is not None:
            warn_once(hint, PerformanceWarning, key="prepare_weight")
        if self.k_padded:
            kp = self.k_padded
            self._pad_copies = (_row_copy_launch(a, kp, interp, options, pad=True),
                                _row_copy_launch(b.T, kp, interp, options, pad=True))
            a = torch.empty_strided((Mdim, kp), (kp, 1), dtype=a.dtype, device=dev)
            b = torch.empty_strided((kp, N), (1, kp), dtype=b.dtype, device=dev)
            self._copy_bytes = (Mdim + N) * kp * a.element_size()   # counted in workspace_bytes
            K = self._kernel_k = kp
        # rows of A that are not whole 128-byte lines (options.gemm_align_a): run() copies A into
        # a buffer of aligned rows first, and the kernel is planned for that buffer's layout
        # (not where K is padded: those rows are whole lines already)
        self._a_rows = 0 if self.k_padded else _align_a_wanted(a, b, Mdim, N, K, options, interp)
        if self._a_rows:   # (a stand-in of that layout: run() fills this stream's buffer)
            self._a_copy = _row_copy_launch(a, self._a_rows, interp, options)
            a = torch.empty_strided((Mdim, K), (self._a_rows, 1), dtype=a.dtype, device=dev)
            self._copy_bytes = Mdim * self._a_rows * a.element_size()   # counted in workspace_bytes
        self._upcast = interp and a.dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong
        # a stand-in for the output: its layout is what the plan is made for
        c = out if out is not None else torch.empty((Mdim, N), dtype=dtype, device="meta")
        self._c_stride = c.stride()
        self.int64 = bool(caps.needs_int64(a, b, c)) if int64 is None else bool(int64)
        X = self.topology.num_domains
        self.policy = M.resolve(mapping, "gemm", self.topology, M.GemmGrid(max(1, -(-Mdim // 128)),
                                                                           max(1, -(-N // 128))))
        self._mapping_arg = self.policy.constexpr(X)
        self._precision = "ieee" if self._upcast else input_precision(a.dtype)
        self._res_stride = residual.stride() if residual is not None else (0, 0)

        a_view, b_view = tma_view(a), tma_view(b)
        tma_ok = (not interp) and TensorDescriptor is not None and caps.tma_supported(dev) \
            and a_view is not None and b_view is not None
        explicit_tiled = (config is not None or path != "auto" or persistent is not None or num_programs is not None)
        # why the warp-specialised kernel cannot take this product (None: it can), asked once
        ws_why = functools.cache(lambda: self._ws_why(a, b, out, bias, residual, dtype, mapping))
        if schedule is None and split_k is None and not explicit_tiled:
            if interp:
                schedule = None  # the interpreter: the small split-K config below
            elif options.gemm_schedule == "model":
                ws_ok = options.gemm_ws and ws_why() is None
                choose = functools.partial(_sched.choose, Mdim, N, K, a.dtype, dev, splitk_only=not tma_ok or self.int64,
                                           splitk_tma=options.gemm_splitk_tma and tma_ok and not self.int64,
                                           aligned=a_view is not None and b_view is not None,
                                           tail=options.gemm_tail_split, ws=ws_ok,
                                           ws_swap=ws_ok and options.gemm_ws_swap and b.stride(0) == 1)
                schedule = choose(table=options.gemm_table)
                if schedule is not None and schedule.kind == "ws" and not ws_ok:   # a table's WS entry it cannot take
                    schedule = choose(table=None)
        if schedule is not None and schedule.kind == "ws":
            if (schedule.block_m not in (64, 128, 256) or schedule.block_k != 64 or schedule.split_k < 1
                    or (schedule.block_m != 128 and schedule.split_k > 1)):
                why = "its tiles are 128 rows (or 64, unsplit, or 256) by block_n columns with K steps of 64"
            elif schedule.swap and (b.stride(0) != 1 or not 80 <= schedule.block_n <= 256):
                why = ("its swapped form takes b as the transpose of a row-major (N, K) weight (F.linear's) and "
                       "tiles 80 to 256 wide along M")
            elif schedule.split_k > 1 and schedule.block_n not in _sched.WS_SPLIT_NS:
                why = f"its split-K form takes tiles of {' / '.join(map(str, _sched.WS_SPLIT_NS))} columns"
            elif schedule.tail and (schedule.split_k < 2 or schedule.block_n not in _sched.WS_TAIL_NS
                                    or not _sched.ws_tail_fits(Mdim, N, schedule.block_n, caps.num_sms(dev))):
                why = ("its tail form (data-parallel rounds, then the last round's tiles split in K) takes tiles "
                       "of 128 x 128 or 128 x 256 that leave a last round part-empty, split in 2 or more parts")
            elif split_k is not None or explicit_tiled:
                why = "it takes no split_k, config, path, persistent or num_programs (the schedule says it all)"
            else:
                why = ws_why()
            if why is not None:
                raise ValueError(f"schedule {schedule.describe()!r}: the warp-specialised GEMM cannot run this: {why}")
            self._plan_ws(a, b, out, schedule, bias, residual)
            self.workspace_bytes += self._copy_bytes
            self._freeze()
            return
        if schedule is not None and schedule.kind == "streamk":
            # TMA on Hopper (path "auto" or "tma"), or in the interpreter when asked (path="tma")
            can_tma = (not self.int64 and a_view is not None and b_view is not None and TensorDescriptor is not None
                       and (interp or caps.tma_supported(dev)))
            if path == "tma" and not can_tma:
                raise ValueError("path='tma' needs a Hopper (sm_90+) GPU or the interpreter, 16-byte aligned a and b "
                                 "with one unit-stride dimension, and 32-bit offsets")
            if path not in ("auto", "tma", "pointer"):
                raise ValueError(f"path must be 'auto', 'tma' or 'pointer', got {path!r}")
            streamk_tma = can_tma and (path == "tma" or (path == "auto" and not interp))
            self._plan_streamk(a, b, c, schedule, interp, (a_view, b_view) if streamk_tma else None, num_programs)
        elif split_k is not None or (schedule is not None and schedule.kind == "splitk") or \
                (interp and not explicit_tiled):
            # TMA-fed split-K (options.gemm_splitk_tma): Hopper, or the interpreter (which reads
            # descriptors too), both operands describable, 32-bit offsets; which operands go
            # through descriptors: options.gemm_splitk_operands (auto: gemm_schedule.splitk_operands,
            # the interpreter both)
            bm = schedule.block_m if schedule is not None else 16
            bn = schedule.block_n if schedule is not None else 64
            operands = options.gemm_splitk_operands
            if operands == "auto":   # (an odd K: pointer loads masked at K go one element at a time)
                operands = ("tma" if interp or (K * a.element_size()) % 16
                            else _sched.splitk_operands(bm, bn, Mdim))
            splitk_tma = (options.gemm_splitk_tma and operands != "pointer" and not self.int64 and a_view is not None
                          and b_view is not None and TensorDescriptor is not None
                          and (interp or caps.tma_supported(dev)))
            self._plan_splitk(a, b, c, schedule, split_k, interp, (a_view, b_view) if splitk_tma else None,
                              prefetch=options.pdl and options.pdl_prefetch and not interp and caps.pdl_supported(dev),
                              num_programs=num_programs,
                              a_pointer=(operands if splitk_tma and operands in ("b_tma", "b_tma_last")
                                         and not a_view[0] and a.stride(1) == 1 else ""))
        else:
            self._plan_tiled(a, b, c, a_view, b_view, schedule, path, config, persistent, num_programs, options,
                             interp)
        self._blocks = None
        self._args: dict = {}
        self._sync_config()
        self.workspace_bytes += self._copy_bytes
        self._freeze()

    # ---------------------------------------------------------------- the kernels
    def _ws_why(self, a, b, out, bias, residual, dtype, mapping) -> Optional[str]:
        """Why the warp-specialised kernel (numasched.gemm_ws) cannot compute this product, or None."""
        if dtype != a.dtype:
            return "it has no output dtype epilogue (out is in a's dtype)"
        from .gemm_ws import residual_by_tma

        if residual is not None and not residual_by_tma(residual, a.dtype):
            # (its pointer path waits for the residual after each tile's K loop: the Triton kernels are faster)
            return "it takes a residual in a's dtype, row-major with 16-byte aligned rows"
        if not (isinstance(mapping, str) and mapping == "auto"):
            return "it walks its tiles in its own grouped order (mapping='auto' only)"
        if self.int64:
            return "its sizes overflow 32-bit offsets"
        from .gemm_ws import supported

        return supported(a, b, out)

    def _plan_ws(self, a, b, out, schedule, bias=None, residual=None) -> None:
        from .gemm_ws import WsGemmPlan, WsTailPlan, split_config, wide_config

        self.kernel, self.schedule, self.path = "ws", schedule, "tma"
        self.persistent = True
        if schedule.tail:   # whole rounds data-parallel, then the last round's tiles split in K
            self._ws = WsTailPlan(a, b, out, block_n=schedule.block_n, split=schedule.split_k,
                                  max_stages=max(3, schedule.num_stages), bias=bias, residual=residual)
            self.split_k = self._ws.split
        elif schedule.split_k > 1:   # split-K in K lockstep, the banded merge (one unit per SM)
            self._ws = WsGemmPlan(a, b, out, config=split_config(schedule.block_n, schedule.split_k), bias=bias,
                                  residual=residual)
            self.split_k = self._ws.split
        else:
            # (the schedule's stages at most: a name timed with fewer stages runs as it was timed)
            cfg = wide_config(schedule.block_n, block_m=schedule.block_m, max_stages=max(3, schedule.num_stages),
                              swap=schedule.swap)
            # swap: the kernel computes (W @ a.T) with W = b.T, and stores it transposed into out
            # (bias and residual as out has them: the kernel adds them along its own rows / columns)
            self._ws = (WsGemmPlan(b.T, a.T, out, config=cfg, bias=bias, residual=residual) if schedule.swap
                        else WsGemmPlan(a, b, out, config=cfg, bias=bias, residual=residual))
        self.grid = (self._ws.num_programs,)
        self.workspace_bytes = self._ws.workspace_bytes   # the split forms' fp32 partials and tickets
        cfg = self._ws.config
        self.config = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.tile_n, BLOCK_K=cfg.block_k, num_warps=4,
                           num_stages=cfg.stages)

    def _plan_splitk(self, a, b, c, schedule, split_k, interp, tma_views=None, prefetch: bool = False,
                     num_programs=None, a_pointer: str = "") -> None:
        from ._launch import Launch
        from .kernels import gemm_splitk as KS

        Mdim, N, K = self.M, self.N, self._kernel_k
        if schedule is not None and schedule.kind == "splitk":
            cfg = {k: v for k, v in schedule.config().items()}
            S = int(split_k or schedule.split_k)
        else:
            cfg = dict(KS.INTERPRETER_CONFIG) if interp else KS.config(16 if Mdim <= 16 else 64, 64, 64, 4, 3)
            tiles = -(-Mdim // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
            # interpreter: split while there are few tiles, so CPU tests exercise the merge
            S = int(split_k) if split_k is not None else max(1, min(4, K // (2 * cfg["BLOCK_K"]), 8 // tiles))
        if S < 1:
            raise ValueError(f"split_k must be >= 1, got {S}")
        if interp:
            cfg.update(num_warps=4, num_stages=1)
        self.kernel, self.split_k, self.schedule = "splitk", S, schedule
        self.persistent = False
        bk = cfg["BLOCK_K"]
        self._kps = -(-(-(-K // S)) // bk) * bk  # K per split: a multiple of BLOCK_K
        NM, NN = -(-Mdim // cfg["BLOCK_M"]), -(-N // cfg["BLOCK_N"])
        self._tiles = NM * NN
        self._ws_numel = S * NM * cfg["BLOCK_M"] * NN * cfg["BLOCK_N"] if S > 1 else 0
        self.workspace_bytes = 4 * self._ws_numel
        use_tma = self._take_tma_views(tma_views)
        const = dict(MAPPING=self._mapping_arg, SPLIT_K=S, HAS_BIAS=self._epi[0], HAS_RES=self._epi[1],
                     INPUT_PRECISION=self._precision, USE_TMA=use_tma, A_TRANS=self.a_trans, B_TRANS=self.b_trans)
        # tail (Schedule.tail): the whole waves' tiles whole, the rest in S parts; the waves are
        # the SMs times the programs one holds, or ``num_programs`` slots when given
        whole, grid = 0, self._tiles * S
        if schedule is not None and schedule.tail and S > 1:
            elt = torch.empty((), dtype=a.dtype).element_size()
            slots = None if num_programs is None else max(1, int(num_programs))
            whole, grid = _sched.tail_split(schedule, self._tiles, elt, _sched.Machine.of(self.device), slots)
            const["TAIL"] = True
        self.tail_whole_tiles = whole
        if not use_tma:   # pointer loads: K's vector width where Triton would not see it (K_VEC)
            elt = a.element_size()
            const.update(KS.k_vector(Mdim, N, K, self._kps, a.stride(), b.stride(), elt))
        # A (K-contiguous) through pointers, B through its descriptor: in every tile ("b_tma"), or
        # in the last tile row where it is partial ("b_tma_last")
        if use_tma and (a_pointer == "b_tma" or (a_pointer == "b_tma_last" and Mdim % cfg["BLOCK_M"])):
            self.a_pointer = a_pointer
            const.update(KS.a_pointer_constants(a_pointer, a, K, self._kps))
        if prefetch and not use_tma:   # options.pdl_prefetch: B into L2 before the PDL wait
            const["PREFETCH_B"] = KS.prefetch_programs(b, K, self._kps, cfg["BLOCK_N"], grid,
                                                       caps.l2_bytes(self.device), tail=bool(whole))
        self._sizes = (Mdim, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                       *self._res_stride, self._kps, whole)
        self._launch = Launch(KS.gemm_splitk_kernel, (grid,), const, config=cfg, device=self.device,
                              interpret=interp, options=self._opts)

    def _take_tma_views(self, tma_views) -> bool:
        """The split-K and stream-K kernels read A and B through these TMA views (or pointers: None)."""
        if tma_views is None:
            return False
        self.path = "tma"
        self.a_trans, self.b_trans = bool(tma_views[0][0]), bool(tma_views[1][0])
        self._views = (tma_views[0], tma_views[1], None)
        return True

    def _plan_streamk(self, a, b, c, schedule, interp, tma_views, num_programs) -> None:
        from ._launch import Launch
        from .kernels import gemm_streamk as KSK

        Mdim, N, K = self.M, self.N, self._kernel_k
        if self.int64:
            raise ValueError("the stream-K kernel uses 32-bit offsets: these operands span more than 2^31 elements "
                             "(use the default schedule, which takes the tiled kernel with 64-bit offsets)")
        cfg = schedule.config()
        if interp:
            cfg.update(num_warps=4, num_stages=1)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        tiles = -(-Mdim // bm) * -(-N // bn)
        iters = -(-K // bk)
        P = int(num_programs) if num_programs is not None else caps.num_sms(self.device)
        P = max(1, min(P, tiles * iters))
        X = self.topology.num_domains
        if num_programs is None and X > 1 and P >= X:
            P -= P % X   # whole domains: program p runs on domain p mod X (round-robin dispatch)
        dp, W = KSK.split_work(tiles, iters, P)
        self.kernel, self.split_k, self.schedule, self.persistent = "streamk", 1, schedule, True
        self._tiles = max(1, tiles - dp)  # counters: one per stream-K tile
        self._ws_numel = KSK.workspace_numel(P, bm, bn) if W else 0
        self.workspace_bytes = 4 * self._ws_numel
        use_tma = self._take_tma_views(tma_views)
        const = dict(MAPPING=self._mapping_arg, FIX_N=min(bn, 128), HAS_BIAS=self._epi[0], HAS_RES=self._epi[1],
                     INPUT_PRECISION=self._precision, USE_TMA=use_tma, A_TRANS=self.a_trans, B_TRANS=self.b_trans,
                     K_ALIGNED=self._opts.gemm_streamk_k_aligned)
        self._sizes = (Mdim, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                       *self._res_stride, dp, iters, W)
        self._launch = Launch(KSK.gemm_streamk_kernel, (P,), const, config=cfg, device=self.device, interpret=interp,
                              options=self._opts)

    def _plan_tiled(self, a, b, c, a_view, b_view, schedule, path, config, persistent, num_programs, options,
                    interp) -> None:
        from ._launch import Launch, config_kwargs
        from .kernels import gemm as K_

        Mdim, N, K = self.M, self.N, self._kernel_k
        dev = self.device
        out_given = self.tensors["out"] is not None
        c_view = tma_view(c) if out_given else (False, [Mdim, N], [N, 1])
        if c_view is not None and not out_given and (N * c.element_size()) % 16:
            c_view = None
        tma_dev = TensorDescriptor is not None and (interp or caps.tma_supported(dev))
        if path == "auto":
            # The interpreter takes the pointer path unless asked (both are tested there).
            path = "tma" if (not interp and tma_dev and a_view is not None and b_view is not None) else "pointer"
        if path == "tma":
            if not tma_dev:
                raise ValueError("path='tma' needs a Hopper (sm_90+) GPU or the interpreter")
            if a_view is None or b_view is None:
                raise ValueError("path='tma' needs 16-byte aligned a and b with one unit-stride dimension")
        elif path != "pointer":
            raise ValueError(f"path must be 'auto', 'tma' or 'pointer', got {path!r}")
        use_tma = path == "tma"
        self.path = path
        # The store goes through TMA only for a row-major C (any other C takes masked pointer stores).
        self.c_tma = use_tma and c_view is not None and not c_view[0]
        self.a_trans = bool(a_view[0]) if use_tma else False
        self.b_trans = bool(b_view[0]) if use_tma else False
        self._views = (a_view, b_view, c_view)
        fp32 = a.dtype == torch.float32 or self._upcast
        nsm = caps.num_sms(dev)
        X = self.topology.num_domains
        self._sizes = (Mdim, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                       *self._res_stride)
        const = dict(MAPPING=self._mapping_arg, USE_TMA=use_tma, A_TRANS=self.a_trans, B_TRANS=self.b_trans,
                     C_TMA=self.c_tma, INPUT_PRECISION=self._precision, INT64=self.int64, HAS_BIAS=self._epi[0],
                     HAS_RES=self._epi[1])

        def grid_of(kw):  # plain integer arithmetic: triton.cdiv is a slower call on the host
            tiles = -(-Mdim // kw["BLOCK_M"]) * -(-N // kw["BLOCK_N"])
            if kw["PERSISTENT"]:
                return (num_programs or persistent_programs(tiles, nsm, X),)
            return (tiles,)

        flatten = options.gemm_flatten
        if schedule is not None and config is None:
            config = schedule.config()
            config["FLATTEN"] = bool(config["PERSISTENT"]) and flatten
            config["EPILOGUE_SUBTILE"] = bool(config["EPILOGUE_SUBTILE"]) and use_tma
            if any(self._epi) and config["BLOCK_M"] * config["BLOCK_N"] >= 128 * 256 and config["num_stages"] > 3:
                # the bias / residual epilogue stages its tile through shared memory too: 128 x 256
                # with 4 stages needs 262 KB on sm_90 (over the 227 KB limit; found by the GPU
                # test of a linear layer with its residual), 3 stages 213 KB
                config["num_stages"] = 3
            self.schedule = schedule
        if config is None and interp:
            tiles16 = -(-Mdim // 16) * -(-N // 16)
            config = K_.cpu_config(choose_persistent(tiles16, nsm) if persistent is None else bool(persistent))
        if config is None and (not options.autotune or options.gemm_schedule != "autotune"):
            # no autotuning: the first config of the family, compiled once
            config = K_.gpu_configs(path, bool(persistent), fp32, flatten)[0]
        if config is not None:
            meta = config_kwargs(config)
            meta.pop("pre_hook", None)
            if persistent is not None:
                meta["PERSISTENT"] = bool(persistent)
                meta["FLATTEN"] = bool(persistent) and flatten
            meta["num_stages"] = caps.cap_stages("gemm", meta.get("num_stages", 3))
            self._launch = Launch(K_.gemm_kernel, grid_of, const, config=meta, device=dev, interpret=interp,
                                  options=self._opts)
            self.persistent = bool(meta["PERSISTENT"])
        else:
            self._launch = Launch(K_.gemm_kernel, grid_of, const, device=dev,
                                  tuner=K_.tuned_kernel(path, persistent, fp32, flatten),
                                  fixed=K_.gpu_configs(path, bool(persistent), fp32, flatten)[0], options=self._opts)

    def _sync_config(self) -> None:
        cfg = self._launch.config
        if cfg is not None:
            object.__setattr__(self, "config", dict(cfg))
            object.__setattr__(self, "persistent", bool(cfg.get("PERSISTENT", self.persistent)))
            if self._launch.grid is not None:
                object.__setattr__(self, "grid", self._launch.grid[:1])

    # ---------------------------------------------------------------- run
    def run(self, a, b, out=None, *, bias=None, residual=None) -> torch.Tensor:
        """C = A @ B (+ bias) (+ residual) into ``out`` (a new tensor when None) for operands with
        the plan's signatures. A plan made without ``out`` takes any ``out`` laid out as it would
        allocate one (a contiguous (M, N) tensor of the output dtype)."""
        if out is not None and self.tensors["out"] is None:
            self.check_signatures(a=a, b=b, bias=bias, residual=residual)
            check_tensor("out", out, ndim=2, dtypes=(self.out_dtype,), device=self.device)
            if tuple(out.shape) != (self.M, self.N) or (self.mode in ("kernel", "interpreter")
                                                        and out.stride() != self._c_stride):
                raise ValueError(f"out must be a contiguous ({self.M}, {self.N}) tensor for this plan (it was made "
                                 f"without out), got shape {tuple(out.shape)} with strides {out.stride()}; make a "
                                 f"plan with out= for other layouts")
            if out.data_ptr() % 16:
                raise ValueError("out's data pointer is not 16-byte aligned (the plan's kernel is specialised "
                                 "for aligned outputs); make a plan with out= for it")
            check_no_overlap(out, a=a, b=b)
        else:
            self.check_signatures(a=a, b=b, out=out, bias=bias, residual=residual)
        return self._run(a, b, out, bias, residual)

    def _descriptors(self, a, b, c):
        blocks = self._blocks
        if blocks is not None:  # compiled: light descriptors (the layout was checked when planned)
            av, bv, cv = self._views
            return (HostDesc(a, av[1], av[2], blocks[0]), HostDesc(b, bv[1], bv[2], blocks[1]),
                    HostDesc(c, cv[1], cv[2], blocks[2]) if self.c_tma else None)
        kw = self._launch.kwargs
        bm, bn, bk = kw.get("BLOCK_M", 16), kw.get("BLOCK_N", 16), kw.get("BLOCK_K", 16)
        av, bv, cv = self._views
        a_desc = TensorDescriptor(a, av[1], av[2], [bk, bm] if self.a_trans else [bm, bk])
        b_desc = TensorDescriptor(b, bv[1], bv[2], [bn, bk] if self.b_trans else [bk, bn])
        c_desc = None
        if self.c_tma:
            c_desc = TensorDescriptor(c, cv[1], cv[2], [bm, bn // 2] if kw.get("EPILOGUE_SUBTILE") else [bm, bn])
        if self._launch.compiled is not None:
            object.__setattr__(self, "_blocks", (a_desc.block_shape, b_desc.block_shape,
                                                 None if c_desc is None else c_desc.block_shape))
        return a_desc, b_desc, c_desc

    def _args_for(self, a, b, out, bias, residual, ptrs: bool):
        """The launch's arguments (pointers as integers with ``ptrs``: the direct path)."""
        def p(t):
            return None if t is None else (t.data_ptr() if ptrs else t)

        if self.kernel in ("splitk", "streamk"):
            dev = self.device
            if self._ws_numel:
                ws, ctr = _splitk_buffers(dev, self._ws_numel, self._tiles, caps.stream_handle(dev), caps.capturing(dev))
            else:
                ws = ctr = out
            a_ptr = p(out)   # (a stand-in where the kernel reads A through no pointer)
            if self.path == "tma":
                a_arg, b_arg, _ = self._descriptors(a, b, out)
                if self.a_pointer == "b_tma":
                    a_arg = p(a)
                elif self.a_pointer:
                    a_ptr = p(a)
            else:
                a_arg, b_arg = p(a), p(b)
            if self.kernel == "streamk":
                return (a_arg, b_arg, p(out), p(bias) if bias is not None else p(out),
                        p(residual) if residual is not None else p(out), p(ws), p(ctr), *self._sizes)
            return (a_arg, b_arg, p(out), p(bias) if bias is not None else p(out),
                    p(residual) if residual is not None else p(out), p(ws), p(ctr), *self._sizes, a_ptr)
        if self.path == "tma":
            a_arg, b_arg, c_desc = self._descriptors(a, b, out)
        else:
            a_arg, b_arg, c_desc = p(a), p(b), None
        return (a_arg, b_arg, p(out), c_desc, p(bias) if bias is not None else p(out),
                p(residual) if residual is not None else p(out), *self._sizes)

    def _run(self, a, b, out=None, bias=None, residual=None) -> torch.Tensor:
        mode = self.mode
        if out is None:
            out = a.new_empty(self._out_shape, dtype=self.out_dtype)
        if self.k_padded:   # options.gemm_pad_k: A and W into zero-padded whole-line rows first
            kp, capturing = self.k_padded, caps.capturing(self.device)
            w = b.T
            a_dst = _padded_rows(a, self.M, kp, "a", capturing)
            w_dst = _padded_rows(w, self.N, kp, "w", capturing)
            copy_a, copy_w = self._pad_copies
            with caps.launch_device(a):
                copy_a(a, a_dst, self.K, a.stride(0), kp)
                copy_w(w, w_dst, self.K, w.stride(0), kp)
            a, b = a_dst, w_dst.T
        elif self._a_rows:   # options.gemm_align_a: A into whole 128-byte rows first
            dst = _aligned_rows(a, self._a_rows, caps.capturing(self.device))
            with caps.launch_device(a):
                self._a_copy(a, dst, self.K, a.stride(0), self._a_rows)
            a = dst
        if self.kernel == "ws":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "matmul", self.grid, (out,), self)
            with caps.launch_device(a):
                if self._ws.swap:   # the weight as the kernel's A, out written as (W @ a.T).T
                    return self._ws.run(b.T, a.T, out, bias=bias, residual=residual)
                return self._ws.run(a, b, out, bias=bias, residual=residual)
        launch = self._launch
        if launch is not None and launch.raw is not None and not _observe.OBSERVERS:
            # compiled, direct path: the whole argument list depends only on the pointers
            key = (a.data_ptr(), b.data_ptr(), out.data_ptr(), None if bias is None else bias.data_ptr(),
                   None if residual is None else residual.data_ptr(), caps.stream_handle(self.device))
            full = self._args.get(key)
            if full is None:
                full = self._full_args(key, a, b, out, bias, residual)
            with caps.launch_device(a):
                launch.call_full(full)
            return out
        if mode == "empty":
            return out
        if mode == "zero":
            out.zero_()
            if bias is not None:
                out += bias.to(out.dtype)
            if residual is not None:
                out += residual.to(out.dtype)
            return out
        if mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out,), self, self._fallback_reason())
            ref = torch.matmul(a.float(), b.float())
            if bias is not None:
                ref += bias.float()
            if residual is not None:
                ref += residual.float()
            return out.copy_(ref)
        res = out
        if self._upcast:
            a, b = upcast_like(a), upcast_like(b)
            out = torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device=self.device)
        if _observe.OBSERVERS:
            # an output that is also the residual (an in-place add) is an input too: not offered
            # to observers as a write-only output (they may poison those)
            writes = (res,) if residual is None or residual.data_ptr() != res.data_ptr() else ()
            _observe.notify(self.op, self.kernel if self.kernel in ("splitk", "streamk") else "matmul",
                            launch.grid[:1] if launch.grid else (), writes, self)
        with caps.launch_device(a):
            launch(*self._args_for(a, b, out, bias, residual, False))
        if self.config is None:
            self._sync_config()
        if out is not res:
            res.copy_(out)
        return res

    def _full_args(self, key, a, b, out, bias, residual) -> tuple:
        """The compiled kernel's complete argument list for these tensors, pointers as integers
        (so the launcher neither calls data_ptr() nor queries the driver per pointer, and the
        cache holds no tensor), descriptors expanded; cached by the pointers (and stream)."""
        full = self._launch.full_args(self._args_for(a, b, out, bias, residual, True))
        if any(isinstance(x, torch.Tensor) for x in full):  # a descriptor expanded to its tensor: no cache
            return full
        if self.kernel in ("splitk", "streamk") and self._ws_numel and caps.capturing(self.device):
            return full  # a capture's workspace is its own: not for later calls
        if len(self._args) >= 64:
            self._args.pop(next(iter(self._args)))
        self._args[key] = full
        return full

    def _fallback_reason(self) -> str:
        return (f"no Triton kernel can run on {self.device} (CPU tensors need TRITON_INTERPRET=1); "
                f"using torch.matmul")


def plan_matmul(a, b, out=None, *, bias=None, residual=None, out_dtype=None, mapping="auto",
                persistent: Optional[bool] = None, path: str = "auto", config=None, schedule=None,
                split_k: Optional[int] = None, options: Optional[_options.Options] = None,
                num_programs: Optional[int] = None, int64: Optional[bool] = None) -> GemmPlan:
    """Plan ``a @ b (+ bias) (+ residual)`` (into ``out``'s layout when given) for operands like
    these (real, meta or fake tensors: only their signatures are read).

    By default the schedule (kernel, tiles, split-K) comes from the model of
    numasched.gemm_schedule (``options.gemm_schedule="autotune"``: Triton's autotuner instead).
    These force the tiled kernel: ``path`` ("tma" or "pointer"), ``config`` (a ``triton.Config``
    or dict), ``persistent``, ``num_programs``. ``schedule``: a Schedule to use as is;
    ``split_k``: force the split-K kernel with this many splits. ``int64`` forces 64-bit offsets.
    """
    if options is not None and not isinstance(options, _options.Options):
        raise TypeError(f"options must be a numasched.options.Options, got {type(options).__name__}")
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None, got {split_k!r}")
    if schedule is not None and not isinstance(schedule, _sched.Schedule):
        raise TypeError(f"schedule must be a numasched.gemm_schedule.Schedule or None, got {type(schedule).__name__}")
    if config is not None and not isinstance(config, Mapping) and not hasattr(config, "all_kwargs"):
        raise TypeError(f"config must be a triton.Config, a dict of kernel meta-parameters or None, got "
                        f"{type(config).__name__}")
    return GemmPlan(a, b, out, bias=bias, residual=residual, out_dtype=out_dtype,
                    mapping="auto" if mapping is None else mapping, persistent=persistent, path=path, config=config,
                    schedule=schedule, split_k=split_k, options=options, num_programs=num_programs, int64=int64)


def _key(a, b, out, mapping, persistent, bias=None, residual=None, out_dtype=None) -> tuple:
    """The plan-cache key of a call (a flat tuple, see numasched._plan; built on every call)."""
    return ("matmul", a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15, b.shape, b.stride(), b.dtype,
            b.device, b.data_ptr() & 15, fast_signature(out), fast_signature(bias), fast_signature(residual),
            out_dtype, mapping, persistent, type(persistent), torch.get_float32_matmul_precision() if a.dtype is torch.float32 else None,
            a.device.type != "cuda" and caps.interpreting(), _topology.current(), _REG._VERSION[0], _options._CURRENT)


def _planned(a, b, out, mapping, persistent, bias=None, residual=None, out_dtype=None) -> GemmPlan:
    key, plan = PLANS.find(_key, a, b, out, mapping, persistent, bias, residual, out_dtype)
    if plan is None:
        plan = plan_matmul(a, b, out, bias=bias, residual=residual, out_dtype=out_dtype, mapping=mapping,
                           persistent=persistent)
        if plan.mode == "torch":
            warn_once(f"numasched.matmul: {plan._fallback_reason()}")
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _run(a, b, out, mapping, persistent, bias=None, residual=None, out_dtype=None):
    """Checked eager implementation shared by both custom ops and unplanned eager calls."""
    check_matmul(a, b, out, bias=bias, residual=residual, out_dtype=out_dtype, mapping=mapping, persistent=persistent)
    check_no_overlap(out, a=a, b=b)
    # bias and residual may alias out (residual=out is an in-place add): each element is read by
    # the program that then writes it, before it writes
    return _planned(a, b, out, mapping, persistent, bias, residual, out_dtype)._run(a, b, out, bias, residual)


# ----------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("numasched::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, mapping: str, persistent: Optional[bool],
               bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return _run(a, b, None, mapping, persistent, bias, residual, out_dtype)


@_matmul_op.register_fake
def _matmul_fake(a, b, mapping, persistent, bias=None, residual=None, out_dtype=None):
    _, _, _, dtype = check_matmul(a, b, bias=bias, residual=residual, out_dtype=out_dtype, mapping=mapping,
                                  persistent=persistent)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


def _setup_context(ctx, inputs, output):
    a, b, mapping, persistent, bias, residual, out_dtype = (tuple(inputs) + (None,) * 7)[:7]
    ctx.save_for_backward(a, b)
    ctx.mapping, ctx.persistent = mapping, persistent
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.res_dtype = None if residual is None else residual.dtype


def _backward(ctx, grad):
    # dA = dC @ B^T and dB = A^T @ dC: transposed views, which the kernel reads without copies;
    # d bias = sum over rows of dC; d residual = dC.
    a, b = ctx.saved_tensors
    ga = gb = gbias = gres = None
    g = grad.to(a.dtype)
    if ctx.needs_input_grad[0]:
        ga = torch.ops.numasched.matmul(g, b.T, ctx.mapping, ctx.persistent)
    if ctx.needs_input_grad[1]:
        gb = torch.ops.numasched.matmul(a.T, g, ctx.mapping, ctx.persistent)
    needs = tuple(ctx.needs_input_grad) + (False,) * 7
    if needs[4] and ctx.bias_dtype is not None:
        gbias = grad.float().sum(0).to(ctx.bias_dtype)
    if needs[5] and ctx.res_dtype is not None:
        gres = grad.to(ctx.res_dtype)
    return (ga, gb, None, None, gbias, gres, None)[:len(ctx.needs_input_grad)]


_matmul_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("numasched::matmul_out", mutates_args=("out",))
def _matmul_out_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, mapping: str,
                   persistent: Optional[bool], bias: Optional[torch.Tensor] = None,
                   residual: Optional[torch.Tensor] = None) -> None:
    _run(a, b, out, mapping, persistent, bias, residual)


@_matmul_out_op.register_fake
def _matmul_out_fake(a, b, out, mapping, persistent, bias=None, residual=None):
    check_matmul(a, b, out, bias=bias, residual=residual, mapping=mapping, persistent=persistent)


# ----------------------------------------------------------------------------------- one call
def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
           mapping: Union[str, "M.Policy"] = "auto", persistent: Optional[bool] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b (+ bias) (+ residual)`` for 2-D fp16/bf16/fp32 matrices with fp32 accumulation.

    Args:
        a: (M, K) matrix; any strides (a transposed view is read without a copy).
        b: (K, N) matrix of the same dtype and device; any strides (``w.T`` of a (N, K) weight, as
            ``F.linear`` has it, is read without a copy).
        bias: optional (N,) vector added to every row (any float dtype; added in fp32).
        residual: optional (M, N) matrix added to the product (any float dtype; in fp32).
        out_dtype: the output's dtype (default: out's, else a's).
        mapping: "auto" (or None: the topology's choice, or the default set with
            ``numasched.set_default_mapping("gemm", ...)``), a GEMM policy name from
            ``numasched.mappings.available("gemm")`` or a ``Policy`` (registered or not).
        persistent: True / False force the tiled kernel, persistent or one program per tile;
            None lets the schedule chooser decide (numasched.gemm_schedule).
        out: optional (M, N) output (any strides, not overlapping a or b).

    fp32 inputs use IEEE fp32 products unless ``torch.set_float32_matmul_precision`` allows TF32.
    """
    if mapping is None:
        mapping = "auto"
    if out is None and bias is None and residual is None and out_dtype is None and plain_eager(a, b):
        # the plan cache first: a repeated call costs a key, a lookup and the launch
        key, plan = PLANS.find(_key, a, b, None, mapping, persistent)
        if plan is not None:
            return plan._run(a, b)
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("out", out), ("bias", bias), ("residual", residual)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if out is not None and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (a, b, out, bias, residual)):
        # as torch.matmul: the out= form records no autograd graph, so a gradient would be silently lost
        raise RuntimeError("matmul(..., out=...) does not support automatic differentiation, but an argument "
                           "requires grad; drop out= or run under torch.no_grad()")
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent must be True, False or None, got {persistent!r}")
    token = mapping_token(mapping, "gemm")
    if plain_eager(a, b, out, bias, residual):
        return _run(a, b, out, mapping, persistent, bias, residual, out_dtype)
    if out is None:
        return torch.ops.numasched.matmul(a, b, token, persistent, bias, residual, out_dtype)
    if out_dtype is not None and out_dtype != out.dtype:
        raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
    torch.ops.numasched.matmul_out(a, b, out, token, persistent, bias, residual)
    return out


# ----------------------------------------------------------------------------------- weights
class PerformanceWarning(UserWarning):
    """A call that runs correctly but slower than it could (e.g. a weight whose rows straddle
    cache lines: see prepare_weight)."""


# weights smaller than this are not worth a hint: their rows' line offsets cost microseconds
HINT_MIN_WEIGHT_BYTES = 8 << 20


def straddling_weight_hint(b: torch.Tensor) -> Optional[str]:
    """The one-time hint :func:`matmul` gives for ``b = w.T`` of a weight (N, K) whose rows do not
    start on 128-byte lines (K * element size not a multiple of 128, from HINT_MIN_WEIGHT_BYTES),
    or None."""
    if b.dim() != 2 or b.stride(0) != 1 or b.shape[1] < 2:
        return None
    es = b.element_size()
    lead = b.stride(1)
    if (lead * es) % 128 == 0 or b.shape[0] * b.shape[1] * es < HINT_MIN_WEIGHT_BYTES:
        return None
    return (f"numasched.matmul: the weight's rows ({b.shape[0]} elements, {lead * es} bytes apart) do not start on "
            "128-byte lines, which made large GEMMs up to 1.5x slower (an odd K up to 3x: a copy of the weight per call); "
            "numasched.prepare_weight(w) once, as the model is loaded, moves them onto whole lines (warned once)")


def prepare_weight(w: torch.Tensor, *, line_bytes: int = 128) -> torch.Tensor:
    """``w`` (N, K), ``F.linear``'s weight layout, with each row starting on a whole cache line:
    the same values in a view of a zero-padded (N, Kp) buffer, Kp * element size a multiple of
    ``line_bytes``. Made once per weight (as a model is loaded), it is read as ``w.T`` by
    :func:`matmul` like any weight and saves what rows that straddle lines cost at every call:

    - K * element size a multiple of 16 bytes but not of 128 (e.g. bf16 K = 8 mod 16): each TMA
      box row spans two lines (prepared, 40 such shapes ran 1.10x faster on an H200 and an H100,
      up to 1.48x; bench/results/gemm-s44/);
    - K * element size not a multiple of 16 (an odd K in bf16): no TMA at all; with a prepared
      weight only the activation is copied into whole-line rows per call (options.gemm_align_a),
      not the weight too (options.gemm_pad_k).

    ``w`` itself is returned where its rows already start on lines (or it has one row); an
    ``nn.Parameter`` comes back as one (same ``requires_grad``). The padding is never read as
    data: the view's K is the weight's."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D (N, K) weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {w.dtype}")
    if not isinstance(line_bytes, int) or isinstance(line_bytes, bool) or line_bytes < 16 or line_bytes % 16:
        raise ValueError(f"line_bytes must be a positive multiple of 16, got {line_bytes!r}")
    n, k = w.shape
    es = w.element_size()
    if n <= 1 or k == 0 or (w.stride(1) == 1 and (w.stride(0) * es) % line_bytes == 0
                            and w.data_ptr() % line_bytes == 0):
        return w
    kp = -(-k * es // line_bytes) * line_bytes // es
    with torch.no_grad():
        # a line more than the rows, the view started at the first whole line
        flat = torch.zeros(n * kp + line_bytes // es, dtype=w.dtype, device=w.device)
        off = (-flat.data_ptr() % line_bytes) // es
        buf = flat[off:off + n * kp].view(n, kp)
        buf[:, :k].copy_(w)
    out = buf[:, :k]
    if isinstance(w, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=w.requires_grad)
    return out.requires_grad_(True) if w.requires_grad else out
