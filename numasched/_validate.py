"""Argument checks shared by the public calls: every error names the argument."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .caps import INT32_MAX, span  # noqa: F401  (INT32_MAX re-exported)


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
    n = span(t)
    if n > INT32_MAX:
        raise ValueError(f"{name} spans {n} elements, which overflows int32 indexing (max {INT32_MAX}); "
                         f"split the call")


def check_bool(name: str, value) -> bool:
    """A real bool (torch raises TypeError for an int ``is_causal``; so do we)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: default 1/sqrt(head_dim); else a positive finite number."""
    import math

    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def check_positive_int(name: str, value, *, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
