"""Prefill attention: ``attention_forward`` (the kernel call) and a drop-in ``scaled_dot_product_attention``.

    >>> out, lse = numasched.attention.attention_forward(q, k, v, causal=True)      # (B, H, S, D)
    >>> out = numasched.scaled_dot_product_attention(q, k, v, is_causal=True)        # torch's signature

``attention_forward`` runs the Triton kernel of ``numasched/kernels/attention_fwd.py`` under a
mapping policy (``mapping="auto"``, a registered name or a Policy) and returns the output and the
log-sum-exp. It is registered as the torch custom op ``numasched::attention_forward`` (with a fake
implementation), so it works under ``torch.compile`` and inside CUDA graphs (warm it up once
before capturing: the first call on a GPU autotunes).

``scaled_dot_product_attention`` has torch's signature and semantics and routes each call:
  * query length 1 (not causal, or causal with one key) -> Flash Decode (numasched.decode);
  * what the prefill kernel supports -> the kernel;
  * anything else (an arbitrary ``attn_mask``, dropout, autograd, CPU without the Triton
    interpreter, other dtypes or head dims, ...) -> torch's own implementation, with a warning
    given once per reason.
``calls`` counts which path ran (keys "kernel", "decode", "fallback").
"""
from __future__ import annotations

import collections
import math
import os
import warnings
from typing import Optional, Tuple

import torch

from . import mappings as M
from . import topology as _topology
from .mappings import default_policy as _default_policy, lookup as _lookup
from ._validate import check_int32_indexing, check_same, check_tensor, kernel_device_ok, launch_device

__all__ = ["attention_forward", "scaled_dot_product_attention", "calls", "SUPPORTED_DTYPES",
           "supported_head_dim"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

#: how many times each path ran: "kernel" (Triton launches), "decode", "fallback"
calls: collections.Counter = collections.Counter()
#: tests set this: outputs are filled with NaN before the kernel runs, so an unwritten element shows
POISON_OUTPUTS = False


def supported_head_dim(d: int) -> bool:
    """Head dims the kernel takes: multiples of 8 from 16 to 256 (padded to a power of two inside)."""
    return 16 <= d <= MAX_HEAD_DIM and d % 8 == 0


# ------------------------------------------------------------------------------ policies by key
# The custom op takes strings only; a Policy object (e.g. a composed, unregistered one) is passed
# by a key into this table. Bounded (least recently passed out first), so that a program making
# a new Policy object per call does not grow it forever; an eager call sets its key just before
# use, so only a compiled graph holding one of 4096 older keys could find it gone.
_POLICY_KEYS: "collections.OrderedDict" = collections.OrderedDict()
MAX_POLICY_KEYS = 4096


def _mapping_key(mapping) -> str:
    if mapping is None or (isinstance(mapping, str) and mapping == "auto"):
        return "auto"
    if isinstance(mapping, M.Policy):
        if mapping.kind != "attention":
            raise ValueError(f"mapping {mapping.name!r} is a {mapping.kind} policy and cannot serve attention "
                             f"kernels; choose one of {M.available('attention')}")
        key = f"policy:{id(mapping)}"
        _POLICY_KEYS[key] = mapping
        _POLICY_KEYS.move_to_end(key)
        while len(_POLICY_KEYS) > MAX_POLICY_KEYS:
            _POLICY_KEYS.popitem(last=False)
        return key
    if not isinstance(mapping, str):
        raise ValueError(f"mapping must be 'auto', a policy name or a Policy, got {type(mapping).__name__}")
    p = M.get(mapping)  # unknown names raise here, naming the mapping
    if p.kind != "attention":
        raise ValueError(f"mapping {p.name!r} is a {p.kind} policy and cannot serve attention kernels; "
                         f"choose one of {M.available('attention')}")
    return mapping


def _policy_of(key: str, grid, causal: bool):
    mapping = _POLICY_KEYS.get(key, key)
    return M.resolve(mapping, "attention", _topology.current(), grid, causal=causal)


# ------------------------------------------------------------------------------ the custom op
def _out_like(q: torch.Tensor) -> torch.Tensor:
    # (B, H, Lq, D) as a view of (B, Lq, H, D) memory, like torch's flash path: the usual next
    # step (transpose(1, 2) and merge heads) is then free.
    B, H, Lq, D = q.shape
    return q.new_empty(B, Lq, H, D).transpose(1, 2)


# ------------------------------------------------------------------------------ launch plans
# Host work that depends only on shapes, strides, dtypes, flags and the policy (checks, policy
# resolution, autotuner keys, grid, strides) is done once per such key and kept here: at small
# sizes a prefill call is otherwise bound by Python, not by the GPU.
_PLANS: dict = {}
_MAX_PLANS = 4096  # HF calls see many sequence lengths: bound the memory, start over when full

try:  # a tracing/fake-tensor mode is active: leave the call to the custom op
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - older torch
    def _get_current_dispatch_mode():
        return True


class _Plan:
    __slots__ = ("launch", "policy_args", "scale", "mkey", "out_size", "out_stride", "lse_size", "dtype",
                 "device", "refs")


def _state_key(q, k, v, mapping):
    """What a plan depends on besides the call's own arguments: topology, default mapping, the
    policy registered under a mapping name (``register(..., replace=True)`` can swap it),
    NUMASCHED_AUTOTUNE, and the inputs' 16-byte alignment (TMA) -- read on every call."""
    return (id(_topology.current()), id(_default_policy("attention")),
            id(_lookup(mapping)) if type(mapping) is str else 0, os.environ.get("NUMASCHED_AUTOTUNE"),
            (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15)


def _make_plan(q, k, v, causal: bool, scale: float, causal_offset: int, mkey: str, config) -> _Plan:
    """Resolve the policy and plan the launch for validated, non-empty inputs."""
    from .kernels import attention_fwd as K

    B, H, Lq, D = q.shape
    HK = k.shape[1]
    bm = (config or {}).get("BLOCK_M", 32)  # autotuning: the smallest BLOCK_M bounds the grid
    grid = M.AttentionGrid(B, H, HK, -(-Lq // bm))
    topo = _topology.current()
    policy = _policy_of(mkey, grid, causal)
    p = _Plan()
    p.policy_args = policy.kernel_args(topo.num_domains)
    p.scale, p.mkey, p.dtype, p.device = scale, mkey, q.dtype, q.device
    # (B, H, Lq, D) as a view of (B, Lq, H, D) memory (see _out_like)
    p.out_size, p.out_stride = (B, H, Lq, D), (Lq * H * D, D, H * D, 1)
    p.lse_size = (B, H, Lq)
    out = torch.empty_strided(p.out_size, p.out_stride, dtype=q.dtype, device=q.device)
    p.launch = K.plan_launch(q, k, v, out, scale=scale, causal=causal, causal_offset=causal_offset,
                             policy_args=p.policy_args, config=config)
    # keep the objects whose ids are in keys alive
    p.refs = (topo, _default_policy("attention"), _POLICY_KEYS.get(mkey), _lookup(mkey))
    return p


def _store(key, plan) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def _run_plan(plan: _Plan, q, k, v, causal: bool, causal_offset: int):
    from .kernels import attention_fwd as K

    out = torch.empty_strided(plan.out_size, plan.out_stride, dtype=plan.dtype, device=plan.device)
    lse = torch.empty(plan.lse_size, dtype=torch.float32, device=plan.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    # through attention_fwd (not run_plan) so that a test's spy on it still sees every launch
    with launch_device(q):
        K.attention_fwd(q, k, v, out, lse, scale=plan.scale, causal=causal, causal_offset=causal_offset,
                        policy_args=plan.policy_args, plan=plan.launch)
    calls["kernel"] += 1
    return out, lse


def _forward_impl(q, k, v, causal: bool, scale: float, causal_offset: int, mapping: str,
                  config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if q.numel() == 0 or Lk == 0:  # batch, heads or Lq of 0: empty outputs, no launch
        out = _out_like(q)
        lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
        if Lq and not Lk:  # no key at all: every row is fully masked
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    key = ("op", q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, causal, scale,
           causal_offset, mapping, _config_key(config), _state_key(q, k, v, mapping))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, k, v, causal, scale, causal_offset, mapping, config)
        _store(key, plan)
    return _run_plan(plan, q, k, v, causal, causal_offset)


def _config_key(config):
    return None if config is None else tuple(sorted(config.items()))


@torch.library.custom_op("numasched::attention_forward", mutates_args=())
def _attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                          causal_offset: int, mapping: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, causal, scale, causal_offset, mapping)


@_attention_forward_op.register_fake
def _(q, k, v, causal, scale, causal_offset, mapping):
    B, H, Lq, D = q.shape
    return _out_like(q), q.new_empty(B, H, Lq, dtype=torch.float32)


# ------------------------------------------------------------------------------ attention_forward
def _check_qkv(q, k, v) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_tensor(name, t, ndim=4, dtypes=SUPPORTED_DTYPES, contiguous_last=True)
    check_same("query", q, "key", k)
    check_same("query", q, "value", v)
    B, H, Lq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"key has batch {k.shape[0]} but query has batch {B}; they must match")
    if v.shape != k.shape:
        raise ValueError(f"value has shape {tuple(v.shape)} but key has {tuple(k.shape)}; they must match "
                         f"(batch, kv_heads, Lk, head_dim)")
    if k.shape[3] != D:
        raise ValueError(f"key has head dim {k.shape[3]} but query has {D}; they must match")
    if not supported_head_dim(D):
        raise ValueError(f"query head dim {D} is not supported (multiples of 8 from 16 to {MAX_HEAD_DIM})")
    HK = k.shape[1]
    if H and (HK < 1 or H % HK):  # H == 0 (with any HK) is an empty call, as in torch
        raise ValueError(f"query has {H} heads, which is not a multiple of the {HK} heads of key")
    # the kernel offsets (batch, head) slices in 64 bits and indexes inside a slice in 32 bits
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.numel():
            check_int32_indexing(name, t[0, 0])


def _check_scale(scale, D) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      scale: Optional[float] = None, mapping="auto", causal_offset: int = 0,
                      _config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward with the Triton kernel: returns ``(out, lse)``.

    Args:
        q: (B, H, Lq, D) query; k, v: (B, HK, Lk, D) with HK dividing H (GQA). float16, bfloat16
            or float32 (fp32 dots in IEEE precision on GPU, not TF32), any strides with a unit
            last stride, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``).
        causal: mask key j from query i unless ``j <= i + causal_offset``.
        scale: softmax scale, default 1/sqrt(D).
        mapping: "auto", a registered attention policy name, or a Policy: which program runs
            which (batch, head, q_block) work item.
        causal_offset: 0 (default) is torch's top-left aligned ``is_causal``; ``Lk - Lq`` is the
            bottom-right alignment of FlashAttention and KV caches. Rows that see no key get
            zeros and lse = -inf.
        _config: fixed kernel config (BLOCK_M, BLOCK_N, USE_TMA, num_warps, num_stages) instead
            of autotuning; for tests and benchmarks.

    Returns:
        out (B, H, Lq, D) in q's dtype (a view of (B, Lq, H, D) memory), and lse (B, H, Lq)
        float32, natural log.
    """
    # Fast path: a call like an earlier one (same shapes, strides, dtypes, devices, flags, mapping)
    # reuses that call's checks and plan. Only for plain eager calls with exact-typed arguments;
    # everything else takes the checked path below.
    key = None
    if (not torch.compiler.is_compiling() and type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and type(causal) is bool and type(causal_offset) is int
            and (scale is None or type(scale) is float or type(scale) is int)
            and (type(mapping) is str or isinstance(mapping, M.Policy))):
        key = ("fwd", q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, scale, causal_offset,
               mapping if type(mapping) is str else id(mapping), _config_key(_config), _state_key(q, k, v, mapping),
               kernel_device_ok(q))
        plan = _PLANS.get(key)
        if plan is not None and _eager(q, k, v):
            return _run_plan(plan, q, k, v, causal, causal_offset)
    _check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, int):
        raise TypeError(f"causal_offset must be an int, got {type(causal_offset).__name__}")
    if abs(causal_offset) >= 2**31 - 2**20:
        raise ValueError(f"causal_offset {causal_offset} overflows int32")
    scale = _check_scale(scale, q.shape[-1])
    mkey = _mapping_key(mapping)
    if not kernel_device_ok(q):
        raise ValueError(f"query is on {q.device}: the Triton kernel needs a CUDA device "
                         f"(or CPU tensors with TRITON_INTERPRET=1)")
    eager = _eager(q, k, v)
    if _config is None and not eager:  # torch.compile, tracing modes, autograd: the custom op
        return _attention_forward_op(q, k, v, causal, scale, causal_offset, mkey)
    if eager and key is not None and q.numel() and k.shape[2]:
        plan = _make_plan(q, k, v, causal, scale, causal_offset, mkey, _config)
        # a Policy object's id is in the key: the plan keeps the object alive, so the id stays its own
        plan.refs = plan.refs + (mapping,)
        _store(key, plan)
        return _run_plan(plan, q, k, v, causal, causal_offset)
    return _forward_impl(q, k, v, causal, scale, causal_offset, mkey, config=_config)


def _eager(q, k, v) -> bool:
    """A plain eager call: not compiling, no tracing or fake-tensor mode, no autograd to record.
    Such calls skip the custom-op dispatcher (tens of microseconds of Python per call); the op
    serves torch.compile, tracing, and autograd (which then reports the missing backward)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


# ------------------------------------------------------------------------------ SDPA drop-in
_WARNED: set = set()


def _fallback(reason: str, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"numasched.scaled_dot_product_attention: {reason}; using torch's implementation "
                      f"(warned once)", RuntimeWarning, stacklevel=3)
    calls["fallback"] += 1
    kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if enable_gqa:
        kw["enable_gqa"] = True
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kw)


def _decode_fn():
    """numasched.decode.flash_decode if that module is present, else None."""
    try:
        from .decode import flash_decode
    except ImportError:
        return None
    return flash_decode


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, mapping="auto") -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same layout and semantics).

    query (N, ..., Hq, L, E), key/value (N, ..., H, S, E); ``is_causal`` is top-left aligned
    (``ones(L, S).tril()``) as in torch. ``enable_gqa`` lets Hq be a multiple of H. The Triton
    kernels run where they apply (see the module doc); elsewhere torch's implementation runs,
    with a one-time warning per reason. ``mapping`` picks the kernels' mapping policy.
    """
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, mapping)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, mapping,
          causal_offset: int = 0, mask_for_fallback=None):
    """The routing behind the drop-in. ``causal_offset`` shifts the causal diagonal (the HF
    integration passes Lk - Lq for a bottom-right causal mask); the fallback then gets
    ``mask_for_fallback`` (the equivalent boolean mask) instead of ``is_causal``."""
    def fb(why):
        if mask_for_fallback is not None:
            return _fallback(why, query, key, value, mask_for_fallback, dropout_p, False, scale, enable_gqa)
        return _fallback(why, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    check_same("query", query, "key", key)
    check_same("query", query, "value", value)
    if not (query.dim() == key.dim() == value.dim()) or query.dim() < 3:
        return fb(f"inputs of rank {query.dim()}/{key.dim()}/{value.dim()} (the kernels take 3-D or 4-D)")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"key has head dim {key.shape[-1]} but query has {query.shape[-1]}; they must match")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"value has length {value.shape[-2]} but key has {key.shape[-2]}; they must match")
    if query.dim() >= 4:
        Hq, Hk, Hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if not enable_gqa and not (Hq == Hk == Hv):
            raise ValueError(f"query has {Hq} heads, key {Hk} and value {Hv}; they must match unless "
                             f"enable_gqa=True")
        for name, h in (("key", Hk), ("value", Hv)):
            if enable_gqa and (h < 1 or Hq % h):
                raise ValueError(f"query has {Hq} heads, which is not a multiple of the {h} heads of {name}")
    if query.dim() > 4:
        return fb(f"inputs of rank {query.dim()} (the kernels take 3-D or 4-D)")
    # ---- what the kernels do not do ----
    if attn_mask is not None:
        return fb("an explicit attn_mask is not supported by the kernels")
    if dropout_p:
        return fb("dropout_p > 0 is not supported by the kernels")
    if query.dtype not in SUPPORTED_DTYPES:
        return fb(f"dtype {query.dtype} is not supported by the kernels (float16, bfloat16, float32)")
    if not kernel_device_ok(query):
        return fb(f"tensors on {query.device} need TRITON_INTERPRET=1 for the kernels (CPU) or a GPU")
    if not supported_head_dim(query.shape[-1]) or value.shape[-1] != query.shape[-1]:
        return fb(f"head dims {query.shape[-1]}/{value.shape[-1]} are not supported by the kernels "
                  f"(equal, multiples of 8 from 16 to {MAX_HEAD_DIM})")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return fb("the kernels have no backward pass (inputs require grad)")
    if scale is not None and not (float(scale) > 0 and math.isfinite(float(scale))):
        return fb("a scale that is <= 0, NaN or infinite is not supported by the kernels")
    three_d = query.dim() == 3
    q, k, v = (t.unsqueeze(1) for t in (query, key, value)) if three_d else (query, key, value)
    if q.shape[0] != k.shape[0] or k.shape[1] != v.shape[1]:
        return fb("broadcast batch dims or different key/value head counts are not supported by the kernels")
    if q.numel() == 0 or k.shape[2] == 0:
        return fb("empty inputs")
    q, k, v = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in (q, k, v))
    Lq, Lk = q.shape[2], k.shape[2]
    # ---- query length 1: Flash Decode ----
    sees_all = not is_causal or causal_offset >= Lk - 1  # every query row sees every key
    flash_decode = _decode_fn() if Lq == 1 and sees_all else None
    if flash_decode is not None:
        # (B, H, 1, D) -> (B, H, D) and (B, HK, Lk, D) -> (B, Lk, HK, D): views, no copies
        out = flash_decode(q[:, :, 0, :], k.transpose(1, 2), v.transpose(1, 2), scale=scale, mapping=mapping)
        calls["decode"] += 1
        out = out.unsqueeze(2)
    else:
        out, _ = attention_forward(q, k, v, causal=bool(is_causal) and not sees_all, scale=scale, mapping=mapping,
                                   causal_offset=int(causal_offset))
    return out.squeeze(1) if three_d else out
