"""The thin launch: a Triton kernel bound once to its constexprs, grid and options.

Triton's ``kernel[grid](*args, **constexprs)`` binds every argument, builds a specialisation key
and looks the compiled kernel up on each call: tens of microseconds of Python, as much as a
decode step's kernel takes on the GPU. A :class:`Launch` pays that once: its first call goes
through Triton (compiling, or autotuning once when a tuner is given), keeps the compiled kernel,
and every later call hands the arguments straight to the compiled kernel's launcher.

That is sound because a plan (and so its Launch) is made per call signature: shapes, strides,
dtypes, device and 16-byte alignment of every tensor -- everything Triton specialises on.

On Triton's interpreter every call goes through the interpreter. Kernels and device functions
defined before ``TRITON_INTERPRET=1`` was set are JIT functions, which the interpreter cannot call;
:func:`interpreted` and :func:`nested_jit_interpreted` run them anyway.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
from triton import knobs

from . import caps
from .caps import interpreted, nested_jit_interpreted, run_interpreted  # noqa: F401

try:  # host-side TMA descriptors (triton >= 3.3); the interpreter understands them too
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

_RUNTIME = knobs.runtime
_raw_stream = caps._raw_stream

# ------------------------------------------------------------------------------ launch
_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")
# tensor maps a Launch keeps (by descriptor position and base pointer; 128 bytes each): one
# launch serves every layer of a model, so a weight per layer and a heap buffer per layer at
# several positions (the WS collectives: six descriptors) must fit, or eager calls re-encode
# them each time (a first-in-first-out cache of 64 held less than one TP step's)
_DESC_CACHE = 1024


def wants_pdl(fn, device, interpret: bool, opts=None) -> bool:
    """Whether a launch of ``fn`` on ``device`` uses programmatic dependent launch: the kernel
    takes a ``PDL`` constexpr (it waits for its predecessor first: kernels/pdl.py), the device
    is NVIDIA sm_90+ and ``pdl`` is on in ``opts`` (the plan's options; default the current ones)."""
    from . import options

    opts = opts if opts is not None else options.current()
    return (not interpret and "PDL" in getattr(fn, "arg_names", ()) and opts.pdl
            and caps.pdl_supported(device))


def config_kwargs(config) -> dict:
    """A triton.Config (or a dict) as the keyword arguments of a launch."""
    if isinstance(config, triton.Config):
        return dict(config.all_kwargs())
    return dict(config)


def hooked() -> bool:
    """Whether a profiler listens to Triton's launches (then launches go through Triton's path,
    which reports them, not through a cached argument list)."""
    return bool(_RUNTIME.launch_enter_hook.calls or _RUNTIME.launch_exit_hook.calls)


class Launch:
    """One kernel of a plan.

    Args:
        fn: the ``@triton.jit`` kernel.
        grid: programs (an int or a tuple of up to three ints), or a function of the launch's
            keyword arguments (the config's block sizes decide it).
        constexprs: keyword arguments of every launch that are not the kernel config.
        config: the kernel config (block sizes, num_warps, num_stages, ...), when known.
        tuner: a ``triton.autotune`` wrapper of ``fn``: the first call tunes (or finds the tuning
            of its key), later calls run the chosen config thinly. ``fixed`` is used instead
            while a CUDA graph is being captured (tuning launches and synchronises).
        device: the device the kernel runs on (its compiled handle is per device).
        interpret: launch through Triton's interpreter every time.
        options: the plan's :class:`numasched.options.Options` (``pdl``, ``pdl_trigger``); default
            the current ones.
    """

    __slots__ = ("fn", "grid", "kwargs", "tuner", "fixed", "grid_of", "device_index", "interpret", "compiled",
                 "tail", "config", "name", "raw", "coop", "pdl", "desc_pos", "desc_meta", "desc_cache")

    def __init__(self, fn, grid, constexprs: dict, *, device, config: Optional[dict] = None, tuner=None,
                 fixed: Optional[dict] = None, interpret: bool = False, options=None):
        self.fn = fn
        self.tuner = tuner
        self.fixed = fixed
        self.grid_of: Optional[Callable] = grid if callable(grid) else None
        self.kwargs = dict(constexprs)
        if wants_pdl(fn, device, interpret, options):
            from numasched.kernels.pdl import has_late_point, pdl_value

            from . import options as _options

            opts = options if options is not None else _options.current()
            self.kwargs.update(PDL=pdl_value(opts.pdl_trigger, has_late_point(fn)), launch_pdl=True)
        self.config = None
        if config is not None:
            self.config = {k: v for k, v in config_kwargs(config).items() if k != "pre_hook"}
            self.kwargs.update(self.config)
        self.grid = None if callable(grid) else _grid3(grid)
        if self.grid is None and tuner is None:
            self.grid = _grid3(self.grid_of(self.kwargs))
        self.device_index = device.index if device.type == "cuda" else None
        self.interpret = bool(interpret)
        self.compiled = None
        self.tail = None
        self.raw = None
        self.desc_pos = ()
        self.name = getattr(getattr(fn, "fn", fn), "__name__", str(fn))

    @property
    def tuned(self) -> bool:
        """Whether the kernel config is known (no autotuning left to do)."""
        return self.tuner is None

    def __call__(self, *args) -> None:
        raw = self.raw
        if raw is not None and not hooked():
            # the compiled kernel's C launcher itself: no Python wrapper between
            g = self.grid
            k = self.compiled
            if self.desc_pos:
                args = self._expand(args)
                raw(g[0], g[1], g[2], _raw_stream(self.device_index), k.function, self.coop, self.pdl, None, None,
                    k.packed_metadata, None, None, None, *args)
            else:
                raw(g[0], g[1], g[2], _raw_stream(self.device_index), k.function, self.coop, self.pdl, None, None,
                    k.packed_metadata, None, None, None, *args, *self.tail)
            return
        k = self.compiled
        if k is not None:
            g = self.grid
            stream = _raw_stream(self.device_index)
            enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
            if enter.calls or leave.calls:  # a profiler is listening: give it what Triton gives
                full = args + self.tail
                k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata,
                      k.launch_metadata(g, stream, *full), enter, leave, *full)
            else:
                k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None, None, *args, *self.tail)
            return
        self._slow(args)

    def call_full(self, full) -> None:
        """Launch with the complete argument list (constexpr tail and expanded descriptors
        included), as :meth:`full_args` built it; only on the direct path (``raw`` set)."""
        g = self.grid
        k = self.compiled
        self.raw(g[0], g[1], g[2], _raw_stream(self.device_index), k.function, self.coop, self.pdl, None, None,
                 k.packed_metadata, None, None, None, *full)

    def keep_full(self, fulls: dict, key, args, limit: int = 64) -> None:
        """Cache ``args``' complete argument list in ``fulls`` under ``key`` (a caller's pointers
        and strides) for :meth:`call_full`, where it holds no tensor (pointers as ints,
        descriptors expanded); at most ``limit`` lists, the oldest dropped first."""
        full = self.full_args(args)
        if not any(isinstance(x, torch.Tensor) for x in full):
            if len(fulls) >= limit:
                fulls.pop(next(iter(fulls)))
            fulls[key] = full

    def full_args(self, args) -> tuple:
        """``args`` completed for :meth:`call_full` (a caller may cache the result when every
        argument in it is a plain value: pointers as ints, descriptors already expanded)."""
        return tuple(self._expand(args)) if self.desc_pos else tuple(args) + self.tail

    def _expand(self, args) -> list:
        """Kernel arguments with each TMA descriptor expanded as Triton's launcher expects; the
        CUtensorMap of a descriptor is cached by its base pointer (a plan's descriptor at one
        position always has the same shape, strides and block shape)."""
        full = list(args) + list(self.tail)
        cache = self.desc_cache
        out = []
        prev = 0
        for pos, meta in zip(self.desc_pos, self.desc_meta):
            d = full[pos]
            if meta is None:  # no TMA metadata: the expansion holds the tensor itself, not cached
                exp = _make_tensordesc_arg(d, meta)
            else:
                key = (pos, d.base.data_ptr())
                exp = cache.get(key)
                if exp is None:
                    exp = _make_tensordesc_arg(d, meta)
                    if len(cache) >= _DESC_CACHE:
                        cache.pop(next(iter(cache)))
                    cache[key] = exp
            out += full[prev:pos]
            out += exp
            prev = pos + 1
        out += full[prev:]
        return out

    def triton_call(self, *args) -> None:
        """One launch through Triton's own path, the compiled kernel left as it is (arguments
        whose specialisation may differ from the plan's, e.g. a caller's output tensor)."""
        if self.interpret or self.grid is None or not self.tuned:
            self._slow(args)
            return
        self.fn[self.grid](*args, **self.kwargs)

    def _slow(self, args) -> None:
        if self.interpret:
            run_interpreted(self.fn, self.grid or self.grid_of(self._fixed_kwargs()), args, self._interp_kwargs())
            return
        if self.tuner is not None:
            if caps.capturing_index(self.device_index):
                kw = self._fixed_kwargs()
                self.fn[_grid3(self.grid_of(kw))](*args, **kw)
                return
            grid = (lambda meta: _grid3(self.grid_of(meta))) if self.grid_of is not None else self.grid
            self.tuner[grid](*args, **self.kwargs)
            chosen = {k: v for k, v in config_kwargs(self.tuner.best_config).items() if k != "pre_hook"}
            self.kwargs = {**self.kwargs, **chosen}
            self.config = dict(chosen)
            if self.grid_of is not None:
                self.grid = _grid3(self.grid_of(self.kwargs))
            self.tuner = None  # from now on: the plain kernel with the chosen config
            return
        if self.grid is None:
            self.grid = _grid3(self.grid_of(self.kwargs))
        k = self.fn[self.grid](*args, **self.kwargs)
        if getattr(k, "function", None) is not None:
            self._keep(k, len(args))

    def _keep(self, k, nargs: int) -> None:
        """Remember the compiled kernel and the constexpr tail of its argument list."""
        names = self.fn.arg_names[nargs:]
        tail = []
        for name, param in zip(names, self.fn.params[nargs:]):
            if name in self.kwargs:
                tail.append(self.kwargs[name])
            elif param.has_default:
                tail.append(param.default)
            else:  # an argument passed by keyword that is not a constexpr: keep Triton's path
                return
        self.tail = tuple(tail)
        self.compiled = k
        self.raw, self.coop, self.pdl, self.desc_pos, self.desc_meta = _raw_launcher(k)
        self.desc_cache = {}

    def _fixed_kwargs(self) -> dict:
        kw = dict(self.kwargs)
        if self.tuner is not None and self.fixed is not None:
            kw.update(config_kwargs(self.fixed))
        return kw

    def _interp_kwargs(self) -> dict:
        return {k: v for k, v in self._fixed_kwargs().items() if k not in _OPTION_NAMES}


try:  # the pieces of Triton's NVIDIA launcher the direct path uses (checked, not assumed)
    from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT_LEN as _BASE_LEN
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except Exception:  # pragma: no cover - another Triton layout or no NVIDIA backend
    _BASE_LEN = None
    _make_tensordesc_arg = None


def _raw_launcher(k) -> tuple:
    """``(C launch function, cooperative flag, PDL flag, descriptor positions, descriptor metadata)``
    of a compiled NVIDIA kernel, or ``(None, ...)`` when its launcher is not the layout this
    code knows (Triton 3.5-3.6's CudaLauncher) or needs scratch memory per launch: then the
    compiled kernel's own ``run`` is used."""
    none = (None, 0, 0, (), ())
    run = getattr(k, "run", None)
    if type(run).__name__ != "CudaLauncher" or _BASE_LEN != 13 or _make_tensordesc_arg is None:
        return none
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return none
    launch = getattr(run, "launch", None)
    closure = getattr(launch, "__closure__", None)
    if getattr(launch, "__name__", "") == "inner" and closure:  # the tensor-descriptor wrapper
        cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in closure)))
        raw, idx, meta = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
        if raw is None or idx is None or meta is None or len(meta) != len(idx):
            return none
        return raw, run.launch_cooperative_grid, run.launch_pdl, tuple(sorted(idx)), tuple(meta)
    if type(launch).__name__ != "builtin_function_or_method":
        return none
    return launch, run.launch_cooperative_grid, run.launch_pdl, (), ()


class HostDesc:
    """A host-side TMA descriptor as Triton's launcher reads it (base, shape, strides, padding),
    without the checks of ``TensorDescriptor.__init__``: for launches of a compiled kernel whose
    plan already checked the layout. The first launch (compile, tuning) takes a real
    ``TensorDescriptor``."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, base, shape, strides, block_shape):
        self.base, self.shape, self.strides, self.block_shape, self.padding = base, shape, strides, block_shape, "zero"


def _grid3(grid) -> tuple:
    if isinstance(grid, int):
        return (grid, 1, 1)
    g = tuple(int(x) for x in grid)
    return g + (1,) * (3 - len(g))


def _scratch_alloc(size: int, alignment: int, stream):
    # device-side tensor descriptors need a little global memory per program
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton an allocator for kernels that need global scratch per launch (device-side
    tensor descriptors, ``tl.make_tensor_descriptor``), unless one is set already. Such kernels
    launch through the compiled kernel's own ``run``, which allocates it (see _raw_launcher)."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch_alloc)
