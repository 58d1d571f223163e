"""GEMM ``C = A @ B``: check, plan, run; the one call ``numasched.matmul``.

    >>> c = numasched.matmul(a, b)                          # policy from topology ("auto")
    >>> c = numasched.matmul(a, b, mapping="row_major", persistent=True)
    >>> numasched.matmul(a, b, out=c)                       # writes into c, returns c
    >>> plan = numasched.plan_matmul(a, b)                  # once per signature
    >>> c = plan.run(a, b)                                  # every call

The plan holds what depends only on the operands' signatures (shapes, strides, dtypes, device,
16-byte alignment) and the process state: the policy, the read path (TMA descriptors on Hopper or
masked pointers), transposed layouts, the kernel config (autotuned on the first GPU run unless
given or turned off), the grid. ``run`` builds the TMA descriptors and launches the compiled
kernel directly.

The one call is the torch custom ops ``numasched::matmul`` (functional, with a backward) and
``numasched::matmul_out`` (writes ``out``), each with a fake implementation, under
``torch.compile`` and autograd; plain eager calls skip the op dispatcher. Where no Triton kernel
can run (CPU tensors without ``TRITON_INTERPRET=1``) it falls back to ``torch.matmul`` with a
one-time warning. Under the interpreter, bf16 runs in fp32 (the interpreter's bf16 dot is wrong).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import caps
from . import mappings as M
from . import observe as _observe
from . import options as _options
from . import topology as _topology
from ._plan import _REG, PLANS, Plan, fast_signature, signature
from ._route import mapping_token, plain_eager, warn_once
from ._launch import HostDesc
from ._validate import INT32_MAX, check_same, check_tensor

__all__ = ["matmul", "plan_matmul", "check_matmul", "GemmPlan", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

try:  # host-side TMA descriptors (triton >= 3.3); the interpreter understands them too
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


# ----------------------------------------------------------------------------------- checks
def check_matmul(a, b, out=None, *, mapping="auto", persistent=None) -> tuple:
    """Check a matmul's arguments without reading data (works on fake and meta tensors);
    returns (M, N, K). TypeError for a wrong type, ValueError for a wrong value or shape."""
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
    if out is not None:
        check_tensor("out", out, ndim=2)
        check_same("a", a, "out", out)
        want = (a.shape[0], b.shape[1])
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {want} for a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent must be True, False or None, got {persistent!r}")
    mapping_token(mapping, "gemm")
    return a.shape[0], b.shape[1], a.shape[1]


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """Storage offsets (in elements) of every element of a 2-D view."""
    i = torch.arange(t.shape[0], device=t.device, dtype=torch.int64)[:, None] * t.stride(0)
    j = torch.arange(t.shape[1], device=t.device, dtype=torch.int64)[None, :] * t.stride(1)
    return (t.storage_offset() + i + j).reshape(-1)


_EXACT_OVERLAP_LIMIT = 1 << 24  # elements; beyond it a byte-range overlap is refused


def check_no_overlap(a, b, out) -> None:
    """Refuse an ``out`` that shares memory with ``a`` or ``b`` (or with itself): the kernel's tiles
    would read what others wrote. Views of one storage are compared element by element (strides
    count: ``out=big[:, 256:]`` beside ``a=big[:, :256]`` is fine)."""
    if out is None or out.numel() == 0:
        return
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        raise ValueError(f"out has stride 0 in a dimension of size > 1 (shape {tuple(out.shape)}, strides "
                         f"{out.stride()}): several elements share memory; pass a tensor without expanded dims")
    if not out.is_contiguous() and not out.T.is_contiguous() and out.numel() <= _EXACT_OVERLAP_LIMIT:
        try:
            offs = _element_offsets(out)
        except (RuntimeError, NotImplementedError):
            offs = None
        if offs is not None and offs.unique().numel() != out.numel():
            raise ValueError(f"out has elements that share memory (shape {tuple(out.shape)}, strides "
                             f"{out.stride()}); pass a tensor without overlapping dims")
    es = out.element_size()
    for name, t in (("a", a), ("b", b)):
        if not t.numel():
            continue
        try:
            same = t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (fake tensors): nothing to compare
            return
        if not same:
            continue
        t_lo = t.data_ptr()
        t_hi = t_lo + (caps.span(t) + 1) * t.element_size()
        o_lo = out.data_ptr()
        o_hi = o_lo + (caps.span(out) + 1) * es
        if t_hi <= o_lo or o_hi <= t_lo:
            continue  # disjoint byte ranges
        if t.element_size() == es and t.numel() + out.numel() <= _EXACT_OVERLAP_LIMIT:
            if not bool(torch.isin(_element_offsets(out), _element_offsets(t)).any()):
                continue  # interleaved but disjoint (e.g. column slices of one matrix)
        raise ValueError(f"out shares memory with {name}; pass a separate output tensor")


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


# ----------------------------------------------------------------------------------- the plan
class GemmPlan(Plan):
    """A planned matmul: made by :func:`plan_matmul`, run with :meth:`run`.

    Attributes: M, N, K; policy, topology; path ("tma" or "pointer"); a_trans, b_trans (operands
    read through a descriptor of their transposed storage); c_tma; int64; persistent (None until
    the autotuner chose); mode ("kernel", "interpreter", "torch", "empty", "zero"); grid and
    config (None until chosen); workspace_bytes (0); tensors."""

    op = "matmul"

    def __init__(self, a, b, out=None, *, mapping="auto", persistent=None, path="auto", config=None,
                 int64=None, num_programs=None, options: Optional[_options.Options] = None):
        Mdim, N, K = check_matmul(a, b, out, mapping=mapping, persistent=persistent)
        options = options if options is not None else _options.current()
        self.M, self.N, self.K = Mdim, N, K
        self.tensors = dict(a=signature(a), b=signature(b), out=signature(out))
        self.device = dev = a.device
        self.topology = _topology.current()
        self.workspace_bytes = 0
        self.policy = None
        self.grid = None
        self.config = None
        self.path, self.a_trans, self.b_trans, self.c_tma, self.int64 = "pointer", False, False, False, False
        self.persistent = persistent
        self._out_dtype = a.dtype
        self._out_shape = (Mdim, N)
        self._launch = None
        if Mdim == 0 or N == 0:
            self.mode = "empty"
        elif K == 0:
            self.mode = "zero"
        elif caps.interpreting():
            self.mode = "interpreter"
        elif dev.type == "cuda":
            self.mode = "kernel"
        else:
            self.mode = "torch"
        if self.mode in ("empty", "zero", "torch"):
            self._freeze()
            return
        from .kernels import gemm as K_

        interp = self.mode == "interpreter"
        self._upcast = interp and a.dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong
        # a stand-in for the output: its layout is what the plan is made for
        c = out if out is not None else torch.empty((Mdim, N), dtype=a.dtype, device="meta")
        a_view, b_view = tma_view(a), tma_view(b)
        c_view = tma_view(c) if out is not None else (False, [Mdim, N], [N, 1])
        if c_view is not None and out is None and (N * a.element_size()) % 16:
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
        self.int64 = bool(caps.needs_int64(a, b, c)) if int64 is None else bool(int64)
        self.a_trans = bool(a_view[0]) if use_tma else False
        self.b_trans = bool(b_view[0]) if use_tma else False
        self._views = (a_view, b_view, c_view)
        fp32 = a.dtype == torch.float32 or self._upcast
        nsm = caps.num_sms(dev)
        X = self.topology.num_domains
        self.policy = M.resolve(mapping, "gemm", self.topology, M.GemmGrid(max(1, -(-Mdim // 128)),
                                                                           max(1, -(-N // 128))))
        self._c_stride = c.stride()
        self._sizes = (Mdim, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
        precision = "ieee" if self._upcast else input_precision(a.dtype)
        const = dict(MAPPING=self.policy.constexpr(X), USE_TMA=use_tma, A_TRANS=self.a_trans,
                     B_TRANS=self.b_trans, C_TMA=self.c_tma, INPUT_PRECISION=precision, INT64=self.int64)

        def grid_of(kw):  # plain integer arithmetic: triton.cdiv is a slower call on the host
            tiles = -(-Mdim // kw["BLOCK_M"]) * -(-N // kw["BLOCK_N"])
            if kw["PERSISTENT"]:
                return (num_programs or persistent_programs(tiles, nsm, X),)
            return (tiles,)

        flatten = options.gemm_flatten
        if config is None and interp:
            tiles16 = -(-Mdim // 16) * -(-N // 16)
            config = K_.cpu_config(choose_persistent(tiles16, nsm) if persistent is None else bool(persistent))
        if config is None and not options.autotune:
            # autotuning off: the first config of the family, compiled once
            config = K_.gpu_configs(path, bool(persistent), fp32, flatten)[0]
        from ._launch import Launch, config_kwargs

        if config is not None:
            meta = config_kwargs(config)
            meta.pop("pre_hook", None)
            if persistent is not None:
                meta["PERSISTENT"] = bool(persistent)
                meta["FLATTEN"] = bool(persistent) and flatten
            self._launch = Launch(K_.gemm_kernel, grid_of, const, config=meta, device=dev, interpret=interp)
            self.persistent = bool(meta["PERSISTENT"])
        else:
            self._launch = Launch(K_.gemm_kernel, grid_of, const, device=dev,
                                  tuner=K_.tuned_kernel(path, persistent, fp32, flatten),
                                  fixed=K_.gpu_configs(path, bool(persistent), fp32, flatten)[0])
        self._blocks = None
        self._args: dict = {}
        self._sync_config()
        self._freeze()

    def _sync_config(self) -> None:
        cfg = self._launch.config
        if cfg is not None:
            object.__setattr__(self, "config", dict(cfg))
            object.__setattr__(self, "persistent", bool(cfg.get("PERSISTENT", self.persistent)))
            if self._launch.grid is not None:
                object.__setattr__(self, "grid", self._launch.grid[:1])

    # ---------------------------------------------------------------- run
    def run(self, a, b, out=None) -> torch.Tensor:
        """C = A @ B into ``out`` (a new tensor when None) for operands with the plan's signatures.
        A plan made without ``out`` takes any ``out`` laid out as it would allocate one (a
        contiguous (M, N) tensor of a's dtype)."""
        if out is not None and self.tensors["out"] is None:
            self.check_signatures(a=a, b=b)
            check_tensor("out", out, ndim=2, dtypes=(self._out_dtype,), device=self.device)
            if tuple(out.shape) != (self.M, self.N) or (self.mode in ("kernel", "interpreter")
                                                        and out.stride() != self._c_stride):
                raise ValueError(f"out must be a contiguous ({self.M}, {self.N}) tensor for this plan (it was made "
                                 f"without out), got shape {tuple(out.shape)} with strides {out.stride()}; make a "
                                 f"plan with out= for other layouts")
            if out.data_ptr() % 16:
                raise ValueError("out's data pointer is not 16-byte aligned (the plan's kernel is specialised "
                                 "for aligned outputs); make a plan with out= for it")
            check_no_overlap(a, b, out)
        else:
            self.check_signatures(a=a, b=b, out=out)
        return self._run(a, b, out)

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

    def _run(self, a, b, out=None) -> torch.Tensor:
        mode = self.mode
        if out is None:
            out = a.new_empty(self._out_shape)
        launch = self._launch
        if launch is not None and launch.raw is not None and not _observe.OBSERVERS:
            # compiled, direct path: the whole argument list depends only on the three pointers
            ptrs = (a.data_ptr(), b.data_ptr(), out.data_ptr())
            full = self._args.get(ptrs)
            if full is None:
                full = self._full_args(a, b, out)
            with caps.launch_device(a):
                launch.call_full(full)
            return out
        if mode == "empty":
            return out
        if mode == "zero":
            return out.zero_()
        if mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out,), self, self._fallback_reason())
            return out.copy_(torch.matmul(a, b))
        res = out
        if self._upcast:
            a, b = a.float(), b.float()
            out = torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device=self.device)
        launch = self._launch
        if _observe.OBSERVERS:
            _observe.notify(self.op, "matmul", launch.grid[:1] if launch.grid else (), (res,), self)
        if self.path == "tma":
            a_arg, b_arg, c_desc = self._descriptors(a, b, out)
        else:
            a_arg, b_arg, c_desc = a, b, None
        with caps.launch_device(a):
            launch(a_arg, b_arg, out, c_desc, *self._sizes)
        if self.config is None:
            self._sync_config()
        if out is not res:
            res.copy_(out)
        return res

    def _full_args(self, a, b, out) -> tuple:
        """The compiled kernel's complete argument list for these operands, pointers as integers
        (so the launcher neither calls data_ptr() nor queries the driver per pointer, and the
        cache holds no tensor), descriptors expanded; cached by the three pointers."""
        if self.path == "tma":
            a_arg, b_arg, c_desc = self._descriptors(a, b, out)
        else:
            a_arg, b_arg, c_desc = a.data_ptr(), b.data_ptr(), None
        full = self._launch.full_args((a_arg, b_arg, out.data_ptr(), c_desc, *self._sizes))
        if any(isinstance(x, torch.Tensor) for x in full):  # a descriptor expanded to its tensor: no cache
            return full
        if len(self._args) >= 64:
            self._args.pop(next(iter(self._args)))
        self._args[(a.data_ptr(), b.data_ptr(), out.data_ptr())] = full
        return full

    def _fallback_reason(self) -> str:
        return (f"no Triton kernel can run on {self.device} (CPU tensors need TRITON_INTERPRET=1); "
                f"using torch.matmul")


def plan_matmul(a, b, out=None, *, mapping="auto", persistent: Optional[bool] = None, path: str = "auto",
                config=None, options: Optional[_options.Options] = None, num_programs: Optional[int] = None,
                int64: Optional[bool] = None) -> GemmPlan:
    """Plan ``a @ b`` (into ``out``'s layout when given) for operands like these (real, meta or fake
    tensors: only their signatures are read).

    ``path``: "auto" (TMA on Hopper+ when the operands allow it, else pointers), "tma" or
    "pointer". ``config``: a fixed ``triton.Config`` or dict (BLOCK_M, BLOCK_N, BLOCK_K,
    PERSISTENT, ..., num_warps, num_stages) instead of autotuning. ``num_programs`` sets the
    persistent grid size; ``int64`` forces 64-bit offsets (tests).
    """
    if options is not None and not isinstance(options, _options.Options):
        raise TypeError(f"options must be a numasched.options.Options, got {type(options).__name__}")
    return GemmPlan(a, b, out, mapping="auto" if mapping is None else mapping, persistent=persistent, path=path,
                    config=config, options=options, num_programs=num_programs, int64=int64)


def _key(a, b, out, mapping, persistent) -> tuple:
    """The plan-cache key of a call (a flat tuple, see numasched._plan; built on every call)."""
    return ("matmul", a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15, b.shape, b.stride(), b.dtype,
            b.device, b.data_ptr() & 15, None if out is None else fast_signature(out), mapping, persistent,
            torch.get_float32_matmul_precision() if a.dtype is torch.float32 else None,
            a.device.type != "cuda" and caps.interpreting(), _topology._CURRENT, _REG._VERSION[0], _options._CURRENT)


def _planned(a, b, out, mapping, persistent) -> GemmPlan:
    try:
        key = _key(a, b, out, mapping, persistent)
    except (AttributeError, RuntimeError, TypeError):
        key = None
    plan = PLANS.get(key) if key is not None else None
    if plan is None:
        plan = plan_matmul(a, b, out, mapping=mapping, persistent=persistent)
        if plan.mode == "torch":
            warn_once(f"numasched.matmul: {plan._fallback_reason()}")
        if key is not None:
            PLANS.put(key, plan)
    return plan


def _run(a, b, out, mapping, persistent):
    """Checked eager implementation shared by both custom ops and unplanned eager calls."""
    check_matmul(a, b, out, mapping=mapping, persistent=persistent)
    check_no_overlap(a, b, out)
    return _planned(a, b, out, mapping, persistent)._run(a, b, out)


# ----------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("numasched::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, mapping: str, persistent: Optional[bool]) -> torch.Tensor:
    return _run(a, b, None, mapping, persistent)


@_matmul_op.register_fake
def _matmul_fake(a, b, mapping, persistent):
    check_matmul(a, b, mapping=mapping, persistent=persistent)
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_context(ctx, inputs, output):
    a, b, mapping, persistent = inputs
    ctx.save_for_backward(a, b)
    ctx.mapping, ctx.persistent = mapping, persistent


def _backward(ctx, grad):
    # dA = dC @ B^T and dB = A^T @ dC: transposed views, which the kernel reads without copies.
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = torch.ops.numasched.matmul(grad, b.T, ctx.mapping, ctx.persistent)
    if ctx.needs_input_grad[1]:
        gb = torch.ops.numasched.matmul(a.T, grad, ctx.mapping, ctx.persistent)
    return ga, gb, None, None


_matmul_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("numasched::matmul_out", mutates_args=("out",))
def _matmul_out_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, mapping: str,
                   persistent: Optional[bool]) -> None:
    _run(a, b, out, mapping, persistent)


@_matmul_out_op.register_fake
def _matmul_out_fake(a, b, out, mapping, persistent):
    check_matmul(a, b, out, mapping=mapping, persistent=persistent)


# ----------------------------------------------------------------------------------- one call
def matmul(a: torch.Tensor, b: torch.Tensor, *, mapping: Union[str, "M.Policy"] = "auto",
           persistent: Optional[bool] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` for 2-D fp16/bf16/fp32 matrices with fp32 accumulation (output in the input dtype).

    Args:
        a: (M, K) matrix; any strides (a transposed view is read without a copy).
        b: (K, N) matrix of the same dtype and device; any strides.
        mapping: "auto" (or None: the topology's choice, or the default set with
            ``numasched.set_default_mapping("gemm", ...)``), a GEMM policy name from
            ``numasched.mappings.available("gemm")`` or a ``Policy`` (registered or not).
        persistent: True runs about one program per SM looping over tiles, False one program per
            tile, None lets the autotuner (GPU) or a tile-count heuristic (interpreter) choose.
        out: optional (M, N) output of a's dtype and device (any strides, not overlapping a or b).

    fp32 inputs use IEEE fp32 products unless ``torch.set_float32_matmul_precision`` allows TF32.
    """
    if mapping is None:
        mapping = "auto"
    if out is None and plain_eager(a, b):
        # the plan cache first: a repeated call costs a key, a lookup and the launch
        try:
            key = _key(a, b, None, mapping, persistent)
        except (AttributeError, RuntimeError, TypeError):
            key = None
        plan = PLANS.get(key) if key is not None else None
        if plan is not None:
            return plan._run(a, b)
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out is not None and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad):
        # as torch.matmul: the out= form records no autograd graph, so a gradient would be silently lost
        raise RuntimeError("matmul(..., out=...) does not support automatic differentiation, but an argument "
                           "requires grad; drop out= or run under torch.no_grad()")
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent must be True, False or None, got {persistent!r}")
    token = mapping_token(mapping, "gemm")
    if plain_eager(a, b, out):
        return _run(a, b, out, mapping, persistent)
    if out is None:
        return torch.ops.numasched.matmul(a, b, token, persistent)
    torch.ops.numasched.matmul_out(a, b, out, token, persistent)
    return out
