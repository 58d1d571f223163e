"""Device capabilities and constants: the one place host code and kernels read them.

Nothing here imports the rest of numasched, so every layer (kernels included) may use it.

* constants: ``LOG2E``, ``LN2``, ``INT32_MAX``;
* where kernels run: :func:`interpreting` (Triton's interpreter, read at call time, not at
  import), :func:`kernel_device_ok`, :func:`launch_device`;
* what the GPU has: :func:`num_sms`, :func:`capability`, :func:`tma_supported`, :func:`is_hip`;
* index widths: :func:`span` (largest element offset of a view), :func:`needs_int64`;
* streams: :func:`stream_handle`, :func:`capturing`.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
INT32_MAX = 2**31 - 1

#: SM count the host plans with on the interpreter: a small pretend GPU, so that CPU tests exercise
#: several splits, persistent loops with several trips and partial last waves.
INTERPRETER_SMS = 8


def launch_mode(device) -> str:
    """How an op's kernels run on ``device``: "interpreter" (``TRITON_INTERPRET=1``), "kernel"
    (compiled, CUDA/ROCm) or "torch" (no Triton device: the op's torch fallback)."""
    if interpreting():
        return "interpreter"
    return "kernel" if device.type == "cuda" else "torch"


def interpreting() -> bool:
    """Whether Triton's interpreter runs kernels (``TRITON_INTERPRET=1``), read now.

    Triton decides per ``@triton.jit`` function when the function is defined; numasched decides
    per call, and :func:`numasched._launch.interpreted` turns kernels defined before the variable
    was set into interpreted ones, so setting it after ``import numasched`` works."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_hip() -> bool:
    """A ROCm build of torch (AMD GPUs)."""
    return getattr(torch.version, "hip", None) is not None


# Pipeline stages that fit the LDS of an AMD CDNA3 block (gfx942: 64 KiB). Offline compiles
# (numasched.portability, bench/results/portability-2026-11-22.md) put the 3-stage bf16 GEMM,
# prefill and distributed GEMM tiles and the 5-stage paged decode at 80-99 KiB there; 2 stages
# (3 for decode) fit. Nothing was launched on AMD hardware: this comes from the compiles alone.
AMD_MAX_STAGES = {"gemm": 2, "attention": 2, "decode": 3}


def cap_stages(kind: str, num_stages: int) -> int:
    """``num_stages`` limited to what fits an AMD GPU's LDS (unchanged on NVIDIA)."""
    return min(num_stages, AMD_MAX_STAGES[kind]) if is_hip() else num_stages


def kernel_device_ok(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``'s device: CUDA/ROCm, or CPU under the interpreter."""
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreting()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOTHING = _Nothing()


def launch_device(t: torch.Tensor):
    """Context for launching on ``t``'s GPU: Triton launches on the *current* device, so switch to
    ``t``'s when it is another one (a no-op otherwise: ``torch.cuda.device`` costs microseconds)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NOTHING


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _smem_optin(index: int) -> int:
    p = torch.cuda.get_device_properties(index)
    return int(getattr(p, "shared_memory_per_block_optin", 0) or 48 * 1024)


@functools.lru_cache(maxsize=None)
def _l2_size(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 0)


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 capacity in bytes (0 where torch does not say; the interpreter's CPU: 0)."""
    if device.type != "cuda":
        return 0
    return _l2_size(_index(device))


def shared_memory_per_block(device: torch.device) -> int:
    """Shared memory (AMD: LDS) one block may use on ``device``, bytes (the opt-in maximum;
    the interpreter's CPU: unbounded)."""
    if device.type != "cuda":
        return 1 << 30
    return _smem_optin(_index(device))


def capability(device: torch.device) -> tuple:
    """(major, minor) compute capability of a CUDA device (cached: a query costs microseconds)."""
    return _capability(_index(device))


def num_sms(device: torch.device) -> int:
    """SMs (NVIDIA) or CUs (AMD) of a GPU; :data:`INTERPRETER_SMS` for the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(_index(device))


def nvidia_sm90_plus(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (never AMD or the interpreter's CPU)."""
    if device.type != "cuda" or is_hip():
        return False
    return capability(device)[0] >= 9


def hopper(device: torch.device) -> bool:
    """An NVIDIA sm_90 GPU (H100, H200), what the warp-specialised Gluon kernels are written for
    (ROCm's torch reports gfx9 parts as capability 9.x too: never those)."""
    if device.type != "cuda" or is_hip():
        return False
    return capability(device)[0] == 9


def tma_supported(device: torch.device) -> bool:
    """Hopper-class TMA (tensor descriptors): NVIDIA sm_90+ only; never on AMD or the interpreter."""
    return nvidia_sm90_plus(device)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (``launch_pdl``, ``griddepcontrol``): NVIDIA sm_90+ only."""
    return nvidia_sm90_plus(device)


def span(t: torch.Tensor) -> int:
    """Largest element offset of ``t`` from its first element (0 for an empty tensor)."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether some tensor's largest element offset overflows int32 (kernels then use int64)."""
    return any(span(t) > INT32_MAX for t in tensors if t is not None)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device: torch.device) -> int:
    """The current stream of a device as an integer handle (0 on CPU); no Stream object is built."""
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        return _raw_stream(_index(device))
    return torch.cuda.current_stream(device).cuda_stream  # pragma: no cover - older torch


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the device's current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def capturing_index(index) -> bool:
    """:func:`capturing` for a CUDA device index (None: not a CUDA device)."""
    return index is not None and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------ interpreter
# Triton picks JIT or interpreter per @triton.jit function when it is defined. numasched decides
# per call (interpreting()), so a kernel or device function defined before TRITON_INTERPRET=1 was
# set must still run interpreted: these helpers do that (triton is imported only when used).
_INTERPRETED: dict = {}


def interpreted(fn):
    """``fn`` as the interpreter runs it: a JIT function defined while TRITON_INTERPRET was unset
    is wrapped; an Autotuner is unwrapped to its kernel; anything else is returned as is."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(fn, triton.runtime.Autotuner):
        return interpreted(fn.fn)
    if isinstance(fn, JITFunction):
        w = _INTERPRETED.get(fn.fn)
        if w is None:
            w = _INTERPRETED[fn.fn] = InterpretedFunction(fn.fn)
        return w
    return fn


def _interpreted_call(self, *args, **kwargs):
    return interpreted(self)(*args, **kwargs)


@contextlib.contextmanager
def nested_jit_interpreted():
    """While interpreting: a JIT function called from inside a kernel (a helper, or a policy passed
    as a constexpr) runs interpreted instead of raising "Cannot call @triton.jit'd outside of the
    scope of a kernel"."""
    from triton.runtime.jit import JITFunction

    old = JITFunction.__call__
    if old is _interpreted_call:
        yield
        return
    JITFunction.__call__ = _interpreted_call
    try:
        yield
    finally:
        JITFunction.__call__ = old


def run_interpreted(fn, grid, args, kwargs) -> None:
    """One launch of ``fn`` through Triton's interpreter, whenever the kernel was defined."""
    with nested_jit_interpreted():
        interpreted(fn)[grid](*args, **kwargs)
