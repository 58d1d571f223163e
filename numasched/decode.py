"""``numasched.flash_decode``: decode attention (one query token per sequence) over a KV cache.

    out = numasched.flash_decode(q, k_cache, v_cache, cache_seqlens=lens)             # contiguous
    out = numasched.flash_decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=bt)  # paged
    out, lse = numasched.flash_decode(..., return_lse=True)

Layouts follow FlashAttention's ``flash_attn_with_kvcache`` and vLLM:

* q: (batch, heads, head_dim); out has q's shape and dtype; lse (batch, heads) fp32, natural log.
* contiguous cache: k_cache, v_cache (batch, max_len, kv_heads, head_dim); any strides with a
  unit-stride last dimension (so ``k.transpose(1, 2)`` of a (B, H, S, D) tensor works as is).
* paged cache: (num_pages, page_size, kv_heads, head_dim) with ``block_table`` int32
  (batch, max_pages): token t of sequence b is slot t % page_size of page
  block_table[b, t // page_size].
* cache_seqlens: int32 (batch,) (or an int), the number of valid tokens per sequence; default
  the whole cache. A sequence of length 0 gives zeros and lse = -inf.

The call is the torch custom op ``numasched::flash_decode`` under torch.compile, for fake or
subclass tensors, inside dispatch modes and when autograd is recording; a plain eager call runs
the same implementation without the op dispatcher. Both work in CUDA graph capture. The first call
with given shapes, strides, dtypes and arguments builds a plan (checks, split count, policy,
kernel constants) that later calls look up, so a decode step costs little host time.
Checks that read tensor data (block-table range, lengths within the cache) run only outside graph
capture and can be turned off with ``numasched.decode.CHECK_DATA = False`` or
``NUMASCHED_CHECK_DATA=0`` (they synchronise with the GPU).
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import mappings as M
from .mappings import default_policy as _default_policy, lookup as _lookup
from . import topology as _topology
from ._validate import check_same, check_tensor, kernel_device_ok, launch_device

__all__ = ["flash_decode", "CHECK_DATA"]

CHECK_DATA = os.environ.get("NUMASCHED_CHECK_DATA", "1") != "0"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int  # 0: contiguous cache
    capacity: int  # tokens a sequence can hold
    num_pages: int


# ----------------------------------------------------------------------------- checks
def _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping) -> _Shape:
    """Checks that need no tensor data (so they also run on fake tensors under torch.compile)."""
    check_tensor("q", q, ndim=3, dtypes=DTYPES, contiguous_last=True)
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, contiguous_last=True)
    check_tensor("v_cache", v_cache, ndim=4, contiguous_last=True)
    check_same("q", q, "k_cache", k_cache)
    check_same("q", q, "v_cache", v_cache)
    B, H, D = q.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}; "
                         f"they must match")
    n0, n1, HK, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache head_dim ({Dk}) must equal q head_dim ({D})")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q head_dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    if H < 1:  # batch 0 is allowed: an empty call (as in torch)
        raise ValueError(f"q must have heads >= 1, got shape {tuple(q.shape)}")
    if HK < 1 or H % HK:
        raise ValueError(f"q heads ({H}) must be a multiple of k_cache kv_heads ({HK})")
    if block_table is None:
        if n0 != B:
            raise ValueError(f"k_cache batch ({n0}) must equal q batch ({B}) for a contiguous cache "
                             f"(pass block_table for a paged cache)")
        page_size, capacity, num_pages = 0, n1, 0
    else:
        check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
        if block_table.shape[0] != B:
            raise ValueError(f"block_table has {block_table.shape[0]} rows but q batch is {B}")
        num_pages, page_size = n0, n1
        if page_size < 1 or block_table.shape[1] < 1:
            raise ValueError(f"paged cache needs page_size >= 1 and block_table.shape[1] >= 1, got k_cache "
                             f"{tuple(k_cache.shape)} and block_table {tuple(block_table.shape)}")
        capacity = block_table.shape[1] * page_size
        if capacity > INT32_MAX:
            raise ValueError(f"block_table.shape[1] * page_size = {capacity} token positions overflows int32")
    if capacity > INT32_MAX:
        raise ValueError(f"k_cache max_len {capacity} overflows int32 token positions")
    if cache_seqlens is not None:
        check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,), device=dev)
        if cache_seqlens.shape[0] != B:
            raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries but q batch is {B}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if not isinstance(mapping, (str, M.Policy)):
        raise ValueError(f"mapping must be 'auto', a policy name or a Policy, got {type(mapping).__name__}")
    if isinstance(mapping, str) and mapping != "auto":
        M.get(mapping)  # unknown names raise here, naming the mapping
    return _Shape(B, H, HK, D, page_size, capacity, num_pages)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_data(shape: _Shape, cache_seqlens, block_table) -> None:
    """Range checks that read tensor data (one device sync); skipped while capturing a CUDA graph."""
    if cache_seqlens is not None:
        lens = cache_seqlens.to(torch.int64)
        bad = (lens < 0) | (lens > shape.capacity)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            where = "max_len" if shape.page_size == 0 else "block_table.shape[1] * page_size"
            raise ValueError(f"cache_seqlens[{i}] = {int(lens[i])} is outside [0, {where} = {shape.capacity}]")
    if block_table is not None:
        # only the pages a sequence uses must be valid (padding entries such as -1 are allowed)
        if cache_seqlens is None:
            used_pages = torch.full((shape.batch, 1), block_table.shape[1], device=block_table.device)
        else:
            used_pages = (cache_seqlens.to(torch.int64)[:, None] + shape.page_size - 1) // shape.page_size
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < used_pages
        bad = used & ((block_table < 0) | (block_table >= shape.num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is outside [0, num_pages = "
                             f"{shape.num_pages}) (k_cache.shape[0])")


# ----------------------------------------------------------------------------- torch fallback
_WARNED = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"numasched.flash_decode: running the torch fallback (slow) because {reason}", stacklevel=4)


def _torch_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, shape: _Shape):
    """Reference-style implementation in fp32: gathers the cache into (B, L, HK, D) and masks."""
    B, H, HK, D = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    G = H // HK
    if block_table is not None:
        bt = block_table.long().clamp(0, shape.num_pages - 1)  # unused entries may be padding
        k = k_cache[bt].reshape(B, -1, HK, D)
        v = v_cache[bt].reshape(B, -1, HK, D)
    else:
        k, v = k_cache, v_cache
    L = k.shape[1]
    lens = (cache_seqlens.long() if cache_seqlens is not None
            else torch.full((B,), shape.capacity, dtype=torch.long, device=q.device))
    qf = q.float().reshape(B, HK, G, D)
    s = torch.einsum("bkgd,blkd->bkgl", qf, k.float()) * scale
    valid = torch.arange(L, device=q.device)[None, :] < lens[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for empty sequences
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bkgl,blkd->bkgd", p, v.float())
    return out.reshape(B, H, D).to(q.dtype), lse.reshape(B, H).float()


# ----------------------------------------------------------------------------- implementation
def _new_output(shape, dtype, device) -> torch.Tensor:
    # one place that allocates the outputs (tests poison them here to check every element is written)
    return torch.empty(shape, dtype=dtype, device=device)


# Plans per input metadata. A decode step of a serving loop calls with the same shapes, strides
# and dtypes every time: the checks that need no data, the policy, the split count and the kernel
# constexprs are worked out once (the first call) and looked up afterwards.
_PLANS: dict = {}
MAX_PLANS = 256  # the dict is cleared when it grows past this (e.g. many distinct batch sizes)


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, ok):
    # Objects enter the key by identity (a registered policy, a Policy argument, the topology, the
    # default decode policy); the entry keeps references to them, so their ids stay theirs.
    # Reading the registry's dicts directly sees a re-registered name or a new default at once.
    registered = _lookup(mapping) if isinstance(mapping, str) else mapping
    return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, _meta(cache_seqlens), _meta(block_table), scale,
            num_splits, mapping if isinstance(mapping, str) else None, id(registered),
            id(_topology.current()), id(_default_policy("decode")), _kernels().knobs(), ok)


_FD = None


def _kernels():
    global _FD  # imported on first use: importing triton is slow and CPU-only users may not need it
    if _FD is None:
        from .kernels import flash_decode
        _FD = flash_decode
    return _FD


class _Entry:
    __slots__ = ("shape", "scale", "plan", "refs")

    def __init__(self, shape, scale, plan, refs):
        self.shape, self.scale, self.plan, self.refs = shape, scale, plan, refs


def _build_entry(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, ok) -> _Entry:
    shape = _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(shape.head_dim)
    topo = _topology.current()
    refs = (mapping, _lookup(mapping) if isinstance(mapping, str) else None, topo,
            _default_policy("decode"))
    if not ok or shape.batch == 0:  # no kernel to plan (batch 0: empty outputs, see below)
        return _Entry(shape, scale, None, refs)
    from .kernels.flash_decode import DecodePlan, choose_num_splits, num_sms

    S = num_splits or choose_num_splits(shape.batch, shape.kv_heads, shape.capacity, num_sms(q.device))
    policy = M.resolve(mapping, "decode", topo, M.DecodeGrid(shape.batch, shape.kv_heads, S))
    plan = DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table, scale=scale, seqlen_max=shape.capacity,
                      page_size=shape.page_size, num_splits=S, policy=policy, num_domains=topo.num_domains)
    return _Entry(shape, scale, plan, refs)


def _flash_decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping):
    ok = kernel_device_ok(q)
    key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, ok)
    entry = _PLANS.get(key)
    if entry is None:
        entry = _build_entry(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, ok)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = entry
    shape = entry.shape
    if CHECK_DATA and not _capturing(q):
        _check_data(shape, cache_seqlens, block_table)
    if entry.plan is None:
        if shape.batch == 0:
            return (_new_output((0, shape.heads, shape.head_dim), q.dtype, q.device),
                    _new_output((0, shape.heads), torch.float32, q.device))
        _warn_once(f"the Triton kernel cannot run on {q.device} tensors (needs a GPU, or TRITON_INTERPRET=1 "
                   f"for CPU tensors)")
        return _torch_decode(q, k_cache, v_cache, cache_seqlens, block_table, entry.scale, shape)
    out = _new_output((shape.batch, shape.heads, shape.head_dim), q.dtype, q.device)
    lse = _new_output((shape.batch, shape.heads), torch.float32, q.device)
    with launch_device(q):
        entry.plan.launch(q, k_cache, v_cache, cache_seqlens, block_table, out, lse)
    return out, lse


@torch.library.custom_op("numasched::flash_decode", mutates_args=())
def _flash_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                     scale: Optional[float], num_splits: Optional[int], mapping: str
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    return _flash_decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping)


@_flash_decode_op.register_fake
def _flash_decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping):
    s = _check_inputs(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping)
    return (q.new_empty((s.batch, s.heads, s.head_dim)),
            q.new_empty((s.batch, s.heads), dtype=torch.float32))


# ----------------------------------------------------------------------------- public call
def flash_decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, scale=None, num_splits=None,
                 mapping="auto", return_lse=False):
    """Decode attention of one query token per sequence against a KV cache (split-KV Flash Decode).

    Args:
        q: (batch, heads, head_dim), bf16 / fp16 / fp32; last dimension unit-stride.
        k_cache, v_cache: contiguous (batch, max_len, kv_heads, head_dim), any strides with a
            unit-stride last dimension; or paged (num_pages, page_size, kv_heads, head_dim) when
            ``block_table`` is given. Same dtype and device as q; heads % kv_heads == 0 (GQA/MQA/MHA).
        cache_seqlens: int32 (batch,) valid tokens per sequence, or an int for all; default the
            whole cache (max_len, or max_pages * page_size).
        block_table: int32 (batch, max_pages) page indices into the paged cache.
        scale: softmax scale; default 1/sqrt(head_dim).
        num_splits: KV splits per (batch, kv_head); default chosen from the shape and SM count.
        mapping: "auto", a decode (attention-kind) policy name, or a ``Policy``; decides which
            (batch, kv_head, split) each program runs. It does not change the result beyond rounding.
        return_lse: also return the log-sum-exp (batch, heads), fp32, natural log (-inf for
            empty sequences), for merging attention over several caches or devices.

    Returns:
        out (batch, heads, head_dim) in q's dtype, or (out, lse) if ``return_lse``.
    """
    # argument types first: the custom op would otherwise reject them with a less clear message
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is not None and not isinstance(t, (torch.Tensor, int)) or isinstance(t, bool):
            raise TypeError(f"{name} must be a torch.Tensor{', an int' if name == 'cache_seqlens' else ''} or None, "
                            f"got {type(t).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if isinstance(block_table, int):
        raise TypeError("block_table must be a torch.Tensor or None, got int")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= INT32_MAX:
            raise ValueError(f"cache_seqlens = {cache_seqlens} is outside [0, {INT32_MAX}]")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if isinstance(mapping, M.Policy):
        try:
            registered = M.get(mapping.name)
        except ValueError:
            registered = None
        if registered is not mapping:
            # an unregistered Policy object cannot cross the custom-op boundary: call directly
            out, lse = _flash_decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits,
                                          mapping)
            return (out, lse) if return_lse else out
        mapping = mapping.name
    if not isinstance(mapping, str):
        raise ValueError(f"mapping must be 'auto', a policy name or a Policy, got {type(mapping).__name__}")
    if scale is not None:
        scale = float(scale)
    if _needs_op(q, k_cache, v_cache):
        out, lse = torch.ops.numasched.flash_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                                    num_splits, mapping)
    else:
        # Plain eager call: skip the custom-op dispatcher (about twice the Python time of the rest
        # of the call); torch.compile, fake/subclass tensors and dispatch modes still get the op.
        out, lse = _flash_decode_impl(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping)
    return (out, lse) if return_lse else out


def _needs_op(q, k_cache, v_cache) -> bool:
    return (torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k_cache) is not torch.Tensor
            or type(v_cache) is not torch.Tensor or torch._C._len_torch_dispatch_stack() > 0
            or (torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)))
