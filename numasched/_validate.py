"""Argument checks shared by the public calls: every error names the argument."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

INT32_MAX = 2**31 - 1


def check_tensor(name: str, t, *, ndim: Optional[int] = None, dtypes: Optional[Iterable[torch.dtype]] = None,
                 device: Optional[torch.device] = None, contiguous_last: bool = False) -> torch.Tensor:
    """Check type, rank, dtype, device and (optionally) unit stride of the last dimension."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs must share a device)")
    if contiguous_last and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have unit stride in its last dimension (got strides {t.stride()}); "
                         f"call .contiguous()")
    return t


def check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, *, dtype=True, device=True) -> None:
    if dtype and a.dtype != b.dtype:
        raise TypeError(f"{name_b} has dtype {b.dtype} but {name_a} has {a.dtype}; they must match")
    if device and a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}; they must match")


def check_int32_indexing(name: str, t: torch.Tensor) -> None:
    """Raise if the largest element offset of ``t`` does not fit int32 (Triton indexes with int32 by default)."""
    span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
    if span > INT32_MAX:
        raise ValueError(f"{name} spans {span} elements, which overflows int32 indexing (max {INT32_MAX}); "
                         f"split the call")


def kernel_device_ok(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on t's device: CUDA/ROCm, or CPU under TRITON_INTERPRET=1."""
    import os

    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOTHING = _Nothing()


def launch_device(t: torch.Tensor):
    """Context for launching a kernel on t's GPU: Triton launches on the *current* device, so switch
    to t's when it is another one (a no-op otherwise: torch.cuda.device costs microseconds)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NOTHING
