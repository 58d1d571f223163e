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


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """Storage offsets (in elements) of every element of a view, in its element order, computed on
    the host from its shape, strides and offset (no device work: safe under CUDA-graph capture,
    for meta and fake tensors)."""
    off = torch.full((1,) * t.dim(), t.storage_offset(), dtype=torch.int64)
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = n
        off = off + (torch.arange(n, dtype=torch.int64) * st).view(shape)
    return off.reshape(-1)


def _strides_nest(t: torch.Tensor) -> bool:
    """Whether ``t``'s dimensions nest (each stride, in increasing order, exceeds the span of the
    smaller ones): then no two of its elements share memory. Host arithmetic only."""
    span = 0
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda x: x[1]):
        if st <= span:
            return False
        span += (n - 1) * st
    return True


_EXACT_OVERLAP_LIMIT = 1 << 22  # elements compared one by one on the host; beyond it a byte-range overlap is refused


def _row_blocks(t: torch.Tensor, es: int):
    """(row bytes, first row, end row, first byte, end byte in a row) of a 2-D view with unit column
    stride whose rows do not wrap, as a block of a row-major matrix of that row stride over its
    storage; else None."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1) or t.stride(0) < t.shape[1]:
        return None
    rs = t.stride(0) * es
    if rs == 0:
        return None
    r0, c0 = divmod(t.data_ptr() - t.untyped_storage().data_ptr(), rs)   # (bytes from the storage's start)
    c1 = c0 + t.shape[1] * es
    if c1 > rs:
        return None
    return rs, r0, r0 + t.shape[0], c0, c1


def _address_known(t: torch.Tensor) -> bool:
    """Real memory to compare (not a meta or fake tensor, whose addresses mean nothing)."""
    if t.device.type == "meta":
        return False
    try:
        return t.untyped_storage().data_ptr() != 0 or t.numel() == 0
    except (RuntimeError, NotImplementedError):   # no storage (fake tensors)
        return False


def check_no_overlap(out: Optional[torch.Tensor], /, name: str = "out", **inputs) -> None:
    """Refuse an output ``out`` (``name`` in the errors) whose elements share memory (an expanded,
    stride-0 dimension, or overlapping dimensions) or that shares memory with one of the named
    ``inputs`` (None entries skipped): a kernel's programs would read what others wrote, or write
    one element twice. Views of one storage are compared element by element (strides count:
    ``out=big[:, 256:]`` beside ``a=big[:, :256]`` is fine). Host work only (shapes, strides,
    addresses), so it may run on every call and during CUDA-graph capture."""
    if out is None or out.numel() == 0:
        return
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        raise ValueError(f"{name} has stride 0 in a dimension of size > 1 (shape {tuple(out.shape)}, strides "
                         f"{out.stride()}): several elements share memory; pass a tensor without expanded dims")
    if not _strides_nest(out) and out.numel() <= _EXACT_OVERLAP_LIMIT:
        if _element_offsets(out).unique().numel() != out.numel():
            raise ValueError(f"{name} has elements that share memory (shape {tuple(out.shape)}, strides "
                             f"{out.stride()}); pass a tensor without overlapping dims")
    if not _address_known(out):
        return
    es = out.element_size()
    o_base = out.untyped_storage().data_ptr()
    o_lo = out.data_ptr()
    o_hi = o_lo + (span(out) + 1) * es
    for what, t in inputs.items():
        if t is None or not t.numel() or not _address_known(t):
            continue
        if t.untyped_storage().data_ptr() != o_base:
            continue
        t_lo = t.data_ptr()
        t_hi = t_lo + (span(t) + 1) * t.element_size()
        if t_hi <= o_lo or o_hi <= t_lo:
            continue  # disjoint byte ranges
        blocks = _row_blocks(out, es), _row_blocks(t, t.element_size())   # (only for a shared byte range)
        if None not in blocks and blocks[0][0] == blocks[1][0]:   # row slices of one row-major matrix
            (rs, r0, r1, c0, c1), (_, q0, q1, d0, d1) = blocks
            if r1 <= q0 or q1 <= r0 or c1 <= d0 or d1 <= c0:
                continue
            raise ValueError(f"{name} shares memory with {what}; pass a separate output tensor")
        if t.element_size() == es and t.numel() + out.numel() <= _EXACT_OVERLAP_LIMIT:
            if not bool(torch.isin(_element_offsets(out), _element_offsets(t)).any()):
                continue  # interleaved but disjoint (e.g. column slices of one matrix)
        raise ValueError(f"{name} shares memory with {what}; pass a separate output tensor")


# the tile / launch keys of the kernels' fixed configs, and their ranges (powers of two where marked)
_CONFIG_RANGES = {"BLOCK_M": (16, 256, True), "BLOCK_N": (16, 256, True), "BLOCK_K": (16, 512, True),
                  "num_warps": (1, 16, True), "num_stages": (1, 12, False), "maxnreg": (24, 255, False)}


def check_config(name: str, config, keys: Iterable[str], flags: Iterable[str] = ()) -> Optional[dict]:
    """A kernel config given by hand (``plan_*(config=...)``): None, or a mapping whose keys are
    among ``keys`` (ints in the ranges of _CONFIG_RANGES) or ``flags`` (bools); returns it as a
    dict. Refused by name before it can reach the compiler (a BLOCK_N of 7 would fail there, or a
    CPU run would ignore it)."""
    if config is None:
        return None
    from collections.abc import Mapping

    if not isinstance(config, Mapping):
        raise TypeError(f"{name} must be a dict of kernel meta-parameters ({', '.join(keys)}) or None, "
                        f"got {type(config).__name__}")
    keys, flags = tuple(keys), tuple(flags)
    for k, v in config.items():
        if k in flags:
            if not isinstance(v, bool):
                raise TypeError(f"{name}[{k!r}] must be a bool, got {v!r}")
            continue
        if k not in keys:
            raise ValueError(f"{name} has an unknown key {k!r}; known: {', '.join(keys + flags)}")
        lo, hi, pow2 = _CONFIG_RANGES.get(k, (1, 1 << 16, False))
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or (pow2 and v & (v - 1)):
            raise ValueError(f"{name}[{k!r}] must be an int{' power of two' if pow2 else ''} in [{lo}, {hi}], "
                             f"got {v!r}")
    return dict(config)
