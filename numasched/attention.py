"""Prefill attention: check, plan, run; the one call ``attention_forward``; the drop-in SDPA.

    >>> out, lse = numasched.attention_forward(q, k, v, causal=True)          # (B, H, S, D)
    >>> plan = numasched.plan_attention(q, k, v, causal=True)                  # once per shape
    >>> out, lse = plan.run(q, k, v)                                           # every call
    >>> out = numasched.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's signature

The plan holds what depends only on the inputs' signatures and the process state: the policy,
the kernel config (autotuned on the first GPU run unless given), the grid, TMA eligibility.
``run`` launches the compiled kernel directly.

``attention_forward`` is the torch custom op ``numasched::attention_forward`` (with a fake
implementation) under torch.compile, tracing and autograd, so it works there and inside CUDA
graphs (warm it up once before capturing: the first call on a GPU autotunes).

``scaled_dot_product_attention`` has torch's signature and semantics and routes each call:
  * query length 1 (not causal, or causal with one key) -> Flash Decode (numasched.decode);
  * 2 to 16 queries against more keys with a bottom-right causal diagonal (``causal_offset =
    Lk - Lq > 0``, what the HF integration passes for a cached step with several new tokens)
    -> multi-token Flash Decode (the keys as a contiguous cache, every query's keys in it);
  * what the prefill kernel supports -> the kernel;
  * anything else (an arbitrary ``attn_mask``, dropout, autograd, CPU without the Triton
    interpreter, other dtypes or head dims, ...) -> torch's own implementation, with a warning
    given once per reason. ``numasched.observe`` reports which path ran.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import caps
from . import mappings as M
from . import observe as _observe
from . import options as _options
from . import topology as _topology
from ._launch import ensure_scratch_allocator
from ._plan import _REG, PLANS, Plan, scratch, signature
from ._route import mapping_token, plain_eager, refuse_grad, warn_once
from ._validate import check_bool, check_config, check_int32_indexing, check_same, check_scale, check_tensor

__all__ = ["attention_forward", "plan_attention", "check_attention", "AttentionPlan",
           "scaled_dot_product_attention", "SUPPORTED_DTYPES", "supported_head_dim"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def supported_head_dim(d: int) -> bool:
    """Head dims the kernel takes: multiples of 8 from 16 to 256 (padded to a power of two inside)."""
    return 16 <= d <= MAX_HEAD_DIM and d % 8 == 0


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int


# ------------------------------------------------------------------------------ checks
def check_attention(q, k, v, *, causal=False, scale=None, causal_offset=0, mapping="auto") -> AttentionShape:
    """Check an attention call without reading tensor data (works on fake and meta tensors).
    TypeError for a wrong type, ValueError for a wrong value or shape; errors name the argument."""
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
    check_bool("causal", causal)
    if isinstance(causal_offset, bool) or not isinstance(causal_offset, int):
        raise TypeError(f"causal_offset must be an int, got {type(causal_offset).__name__}")
    if abs(causal_offset) >= 2**31 - 2**20:
        raise ValueError(f"causal_offset {causal_offset} overflows int32")
    check_scale(scale, D)
    mapping_token(mapping, "attention")
    return AttentionShape(B, H, HK, Lq, k.shape[2], D)


def _out_like(q: torch.Tensor) -> torch.Tensor:
    # (B, H, Lq, D) as a view of (B, Lq, H, D) memory, like torch's flash path: the usual next
    # step (transpose(1, 2) and merge heads) is then free.
    B, H, Lq, D = q.shape
    return q.new_empty(B, Lq, H, D).transpose(1, 2)


def _tma_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and 16-byte multiples for every non-unit stride."""
    for t in tensors:
        es = t.element_size()
        try:
            if t.data_ptr() % 16:
                return False
        except RuntimeError:
            pass
        if any((s * es) % 16 for s in t.stride()[:-1]) or (t.shape[-1] * es) % 16:
            return False
    return True


_TMA_BROKEN: list = []  # set when the TMA variant failed to compile here (then never tried again)


# ------------------------------------------------------------------------------ the plan
class AttentionPlan(Plan):
    """A planned attention forward: made by :func:`plan_attention`, run with :meth:`run`.

    Attributes: shape, scale, causal, causal_offset, policy, topology, mode ("kernel",
    "interpreter" or "empty"), grid (None until the autotuner chose BLOCK_M), config, tma,
    workspace_bytes (0), tensors."""

    op = "attention"

    def __init__(self, q, k, v, *, causal=False, scale=None, causal_offset=0, mapping="auto", config=None,
                 options: Optional[_options.Options] = None, lpt: Optional[bool] = None):
        shape = check_attention(q, k, v, causal=causal, scale=scale, causal_offset=causal_offset, mapping=mapping)
        options = options if options is not None else _options.current()
        self.shape = shape
        self.scale = check_scale(scale, shape.head_dim)
        self.causal, self.causal_offset = bool(causal), int(causal_offset)
        self.tensors = dict(query=signature(q), key=signature(k), value=signature(v))
        self.device = dev = q.device
        self.topology = _topology.current()
        self.workspace_bytes = 0
        B, H, Lq, D = q.shape
        HK, Lk = k.shape[1], k.shape[2]
        self._out_size, self._out_stride = (B, H, Lq, D), (Lq * H * D, D, H * D, 1)
        self.policy, self.grid, self.config, self.tma = None, None, None, False
        if q.numel() == 0 or Lk == 0:
            self.mode = "empty"
            self._freeze()
            return
        interp = caps.interpreting()
        if not interp and dev.type != "cuda":
            raise ValueError(f"query is on {dev}: the Triton kernel needs a CUDA device "
                             f"(or CPU tensors with TRITON_INTERPRET=1)")
        self.mode = "interpreter" if interp else "kernel"
        from .kernels import attention_fwd as K

        bm = (config or {}).get("BLOCK_M", 32)  # autotuning: the smallest BLOCK_M bounds the grid
        self.policy = M.resolve(mapping, "attention", self.topology, M.AttentionGrid(B, H, HK, -(-Lq // bm)),
                                causal=causal)
        if lpt is None:
            lpt = bool(causal) and not interp
        # bf16 dots are wrong in Triton's interpreter: compute in fp32 there (never a wrong result)
        self._upcast = interp and q.dtype == torch.bfloat16
        self.tma = (not interp) and not _TMA_BROKEN and caps.tma_supported(dev) and _tma_ok(q, k, v)
        fp32 = q.dtype == torch.float32 or self._upcast
        self._constexprs = dict(Q_BUCKET=K.bucket(Lq), K_BUCKET=K.bucket(Lk), TMA_OK=int(self.tma), HEAD_DIM=D,
                                CAUSAL=bool(causal), LPT=bool(lpt), DOT_PRECISION="ieee" if fp32 else None,
                                BLOCK_D=K.block_d(D),
                                MAPPING=self.policy.constexpr(self.topology.num_domains))
        self._ints = (B, H, HK, Lq, Lk, self.scale * caps.LOG2E, self.causal_offset)
        self._strides = None if interp else self._stride_args(q, k, v, self._out_stride)
        self._options = options
        self._config_arg = config
        self._build(K, config, options)
        self._freeze()

    def _build(self, K, config, options) -> None:
        from ._launch import Launch

        B, H, Lq = self.shape.batch, self.shape.heads, self.shape.q_len
        grid_of = lambda kw: (B * H * -(-Lq // kw["BLOCK_M"]),)  # noqa: E731
        dev, const = self.device, self._constexprs
        if self.mode == "interpreter":
            self._launch = Launch(K.attn_fwd_kernel, grid_of, const, config=K.INTERPRETER_CONFIG, device=dev,
                                  interpret=True)
        else:
            fixed = K.fixed_config(torch.float32 if const["DOT_PRECISION"] == "ieee" else torch.bfloat16,
                                   self.shape.head_dim, self.tma)
            if config is None and not options.autotune:
                cfg = fixed
            elif config is not None:
                cfg = dict(config)
                if cfg.get("USE_TMA") and not self.tma:
                    cfg["USE_TMA"] = False
            else:
                cfg = None
            if self.tma:
                ensure_scratch_allocator()  # device-side descriptors take their scratch from it
            if cfg is None:
                self._launch = Launch(K.attn_fwd_kernel, grid_of, const, device=dev, tuner=K.attn_fwd_autotuned,
                                      fixed=fixed)
            else:
                self._launch = Launch(K.attn_fwd_kernel, grid_of, const, config=cfg, device=dev)
        object.__setattr__(self, "config", self._launch.config)
        object.__setattr__(self, "grid", self._launch.grid[:1] if self._launch.grid else None)

    @staticmethod
    def _stride_args(q, k, v, out_stride) -> tuple:
        return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), out_stride[0], out_stride[1], out_stride[2])

    # ---------------------------------------------------------------- run
    def run(self, q, k, v, *, out=None, lse=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Launch on tensors with the signatures the plan was made for; returns ``(out, lse)``.

        ``out`` (B, H, Lq, D), given or not, has the strides of a (B, Lq, H, D) tensor viewed as
        (B, H, Lq, D) (``torch.empty(B, Lq, H, D).transpose(1, 2)``); ``lse`` (B, H, Lq) fp32."""
        self.check_signatures(query=q, key=k, value=v)
        if out is not None:
            check_tensor("out", out, ndim=4, dtypes=(q.dtype,), device=q.device)
            if tuple(out.shape) != self._out_size or out.stride() != self._out_stride or out.data_ptr() % 16:
                raise ValueError(f"out must have shape {self._out_size} and strides {self._out_stride} (a "
                                 f"(B, Lq, H, D) tensor viewed as (B, H, Lq, D)) and a 16-byte aligned data pointer, "
                                 f"got {tuple(out.shape)} with strides {out.stride()}")
        if lse is not None:
            check_tensor("lse", lse, ndim=3, dtypes=(torch.float32,), device=q.device)
            if tuple(lse.shape) != self._out_size[:3] or not lse.is_contiguous() or lse.data_ptr() % 16:
                raise ValueError(f"lse must be a contiguous {self._out_size[:3]} tensor, got {tuple(lse.shape)}")
        return self._run(q, k, v, out, lse)

    def _run(self, q, k, v, out=None, lse=None, want_lse=True):
        if out is None:
            out = torch.empty_strided(self._out_size, self._out_stride, dtype=q.dtype, device=self.device)
        if lse is None:
            if want_lse or self.mode != "kernel":
                lse = torch.empty(self._out_size[:3], dtype=torch.float32, device=self.device)
            else:  # nobody reads it (the SDPA drop-in): a buffer reused per stream
                lse = scratch(self._out_size[:3], torch.float32, self.device, caps.stream_handle(self.device))
        mode = self.mode
        if mode == "empty":
            if self.shape.q_len and not self.shape.k_len:  # no key at all: every row is fully masked
                out.zero_()
                lse.fill_(float("-inf"))
            return out, lse
        launch = self._launch
        if mode == "interpreter":
            res = out
            if self._upcast:
                q, k, v = q.float(), k.float(), v.float()
                out = torch.empty_strided(self._out_size, self._out_stride, dtype=torch.float32, device=self.device)
            if _observe.OBSERVERS:
                _observe.notify(self.op, "attention", launch.grid[:1], (res, lse), self)
            launch(q, k, v, out, lse, *self._stride_args(q, k, v, out.stride()), *self._ints)
            if out is not res:
                res.copy_(out)
            return res, lse
        if _observe.OBSERVERS:
            _observe.notify(self.op, "attention", launch.grid[:1] if launch.grid else (), (out, lse), self)
        with caps.launch_device(q):
            if launch.raw is not None:  # compiled, direct path: pointers as integers
                launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), *self._strides,
                       *self._ints)
            elif launch.compiled is not None:
                launch(q, k, v, out, lse, *self._strides, *self._ints)
            else:
                self._first_launch(q, k, v, out, lse)
        return out, lse

    def _first_launch(self, q, k, v, out, lse) -> None:
        try:
            self._launch(q, k, v, out, lse, *self._strides, *self._ints)
        except Exception as e:  # the TMA variant is new in Triton; keep working without it
            if not self.tma:
                raise
            warn_once(f"numasched attention: the TMA variant failed ({type(e).__name__}: {e}); using pointer "
                      f"loads from now on")
            _TMA_BROKEN.append(repr(e))
            from .kernels import attention_fwd as K

            object.__setattr__(self, "tma", False)
            self._constexprs["TMA_OK"] = 0
            self._build(K, self._config_arg, self._options)
            self._launch(q, k, v, out, lse, *self._strides, *self._ints)
        object.__setattr__(self, "config", self._launch.config)
        if self._launch.grid:
            object.__setattr__(self, "grid", self._launch.grid[:1])


def plan_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None, causal_offset: int = 0,
                   mapping="auto", config: Optional[dict] = None,
                   options: Optional[_options.Options] = None) -> AttentionPlan:
    """Plan an attention forward for inputs like these (real, meta or fake tensors: only their
    signatures are read). Arguments as :func:`attention_forward`; ``config`` fixes the kernel
    config (BLOCK_M, BLOCK_N, USE_TMA, num_warps, num_stages) instead of autotuning; ``options``
    overrides the current options for this plan."""
    if options is not None and not isinstance(options, _options.Options):
        raise TypeError(f"options must be a numasched.options.Options, got {type(options).__name__}")
    config = check_config("config", config, ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), flags=("USE_TMA",))
    return AttentionPlan(q, k, v, causal=causal, scale=scale, causal_offset=causal_offset,
                         mapping="auto" if mapping is None else mapping, config=config, options=options)


def _key(q, k, v, causal, scale, causal_offset, mapping, config) -> tuple:
    """The plan-cache key of a call (a flat tuple, see numasched._plan; built on every call). The
    types of the flags count: ``scale=True`` must not find a plan made for ``scale=1``."""
    return ("attention", q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15, k.shape, k.stride(), k.dtype,
            k.device, k.data_ptr() & 15, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15, causal, scale,
            type(scale), causal_offset, mapping, None if config is None else tuple(sorted(config.items())),
            q.device.type != "cuda" and caps.interpreting(), _topology.current(), _REG._VERSION[0], _options._CURRENT)


def _planned(q, k, v, causal, scale, causal_offset, mapping, config=None) -> AttentionPlan:
    key, plan = PLANS.find(_key, q, k, v, causal, scale, causal_offset, mapping, config)
    if plan is None:
        plan = plan_attention(q, k, v, causal=causal, scale=scale, causal_offset=causal_offset, mapping=mapping,
                              config=config)
        if key is not None:
            PLANS.put(key, plan)
    return plan


# ------------------------------------------------------------------------------ the custom op
@torch.library.custom_op("numasched::attention_forward", mutates_args=())
def _attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                          causal_offset: int, mapping: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return _planned(q, k, v, causal, scale, causal_offset, mapping)._run(q, k, v)


@_attention_forward_op.register_fake
def _(q, k, v, causal, scale, causal_offset, mapping):
    B, H, Lq, D = q.shape
    return _out_like(q), q.new_empty(B, H, Lq, dtype=torch.float32)


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
        mapping: "auto" (or None), a registered attention policy name, or a Policy: which program
            runs which (batch, head, q_block) work item.
        causal_offset: 0 (default) is torch's top-left aligned ``is_causal``; ``Lk - Lq`` is the
            bottom-right alignment of FlashAttention and KV caches. Rows that see no key get
            zeros and lse = -inf.
        _config: fixed kernel config (BLOCK_M, BLOCK_N, USE_TMA, num_warps, num_stages) instead
            of autotuning; for tests and benchmarks.

    Returns:
        out (B, H, Lq, D) in q's dtype (a view of (B, Lq, H, D) memory), and lse (B, H, Lq)
        float32, natural log.
    """
    if mapping is None:
        mapping = "auto"
    eager = plain_eager(q, k, v)
    if eager and type(causal) is bool:
        key, plan = PLANS.find(_key, q, k, v, causal, scale, causal_offset, mapping, _config)
        if plan is not None:
            return plan._run(q, k, v)
    check_attention(q, k, v, causal=causal, scale=scale, causal_offset=causal_offset, mapping=mapping)
    refuse_grad("attention_forward", q, k, v)
    if not caps.kernel_device_ok(q):
        raise ValueError(f"query is on {q.device}: the Triton kernel needs a CUDA device "
                         f"(or CPU tensors with TRITON_INTERPRET=1)")
    if eager or _config is not None:
        return _planned(q, k, v, causal, scale, causal_offset, mapping, _config)._run(q, k, v)
    # torch.compile, tracing modes: the custom op (it has no backward)
    return _attention_forward_op(q, k, v, causal, check_scale(scale, q.shape[-1]), causal_offset,
                                 mapping_token(mapping, "attention"))


# ------------------------------------------------------------------------------ SDPA drop-in
def _fallback(reason: str, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    warn_once(f"numasched.scaled_dot_product_attention: {reason}; using torch's implementation (warned once)")
    if _observe.OBSERVERS:
        _observe.notify("scaled_dot_product_attention", "torch", reason=reason)
    kw = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if enable_gqa:
        kw["enable_gqa"] = True
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kw)


class _SdpaRoute:
    """A cached SDPA routing decision: the plan to run and how to reshape around it."""

    __slots__ = ("plan", "decode", "multi", "three_d")

    def __init__(self, plan, decode: bool, three_d: bool, multi: bool = False):
        self.plan, self.decode, self.multi, self.three_d = plan, decode, multi, three_d

    def run(self, query, key, value):
        if self.three_d:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if self.decode:
            out, _ = self.plan._run(query[:, :, 0, :], key.transpose(1, 2), value.transpose(1, 2), None, None,
                                    want_lse=False)
            out = out.unsqueeze(2)
        elif self.multi:
            # (B, H, Lq, D) as (B, Lq, H, D); the output (B, Lq, H, D) contiguous, returned as its
            # (B, H, Lq, D) view (the attention kernel's output layout too)
            out, _ = self.plan._run(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
                                    want_lse=False)
            out = out.transpose(1, 2)
        else:
            out, _ = self.plan._run(query, key, value, want_lse=False)
        return out.squeeze(1) if self.three_d else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, mapping="auto") -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same layout and semantics).

    query (N, ..., Hq, L, E), key/value (N, ..., H, S, E); ``is_causal`` is top-left aligned
    (``ones(L, S).tril()``) as in torch. ``enable_gqa`` lets Hq be a multiple of H; a key/value
    with one head broadcasts over the query heads as in torch. The Triton kernels run where they
    apply (see the module doc); elsewhere torch's implementation runs, with a one-time warning per
    reason. ``mapping`` picks the kernels' mapping policy.
    """
    if attn_mask is None and not dropout_p and type(is_causal) is bool and plain_eager(query, key, value):
        _, route = PLANS.find(_sdpa_key, query, key, value, is_causal, scale, enable_gqa, mapping, 0)
        if route is not None:
            return route.run(query, key, value)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, mapping)


def _sdpa_key(query, key, value, is_causal, scale, enable_gqa, mapping, causal_offset) -> tuple:
    """The cache key of an SDPA routing decision (a flat tuple, see numasched._plan)."""
    q, k, v = query, key, value
    return ("sdpa", q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15, k.shape, k.stride(), k.dtype,
            k.device, k.data_ptr() & 15, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15, is_causal, scale,
            type(scale), enable_gqa, type(enable_gqa), mapping, causal_offset, q.device.type != "cuda" and caps.interpreting(), _topology.current(),
            _REG._VERSION[0], _options._CURRENT)


def _max_decode_tokens() -> int:
    from .decode import MAX_QUERY_TOKENS

    return MAX_QUERY_TOKENS


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
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if mapping is None:
        mapping = "auto"
    mapping_token(mapping, "attention")
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
        if not enable_gqa:
            # as torch: equal heads, or key/value heads of 1 broadcast (batch-dim broadcasting)
            for name, h in (("key", Hk), ("value", Hv)):
                if h != Hq and h != 1:
                    raise ValueError(f"query has {Hq} heads and {name} {h}; they must match (or be 1) unless "
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
    if not caps.kernel_device_ok(query):
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
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (q, k, v)):
        return fb("inputs whose last dimension is not unit-stride (call .contiguous())")
    Lq, Lk = q.shape[2], k.shape[2]
    # ---- query length 1: Flash Decode ----
    sees_all = not is_causal or causal_offset >= Lk - 1  # every query row sees every key
    decode = Lq == 1 and sees_all
    # ---- a few new tokens at the end of a cache (bottom-right causal): multi-token Flash Decode,
    # whose query i sees the keys < Lk - Lq + i + 1 ----
    multi = bool(is_causal) and 1 < Lq < Lk and causal_offset == Lk - Lq and Lq <= _max_decode_tokens()
    if not plain_eager(query, key, value):  # torch.compile, tracing: through the custom ops
        sc = None if scale is None else float(scale)
        if decode:
            from .decode import flash_decode

            out = flash_decode(q[:, :, 0, :], k.transpose(1, 2), v.transpose(1, 2), scale=sc,
                               mapping=mapping).unsqueeze(2)
        elif multi:
            from .decode import flash_decode

            out = flash_decode(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=sc,
                               mapping=mapping).transpose(1, 2)
        else:
            out, _ = attention_forward(q, k, v, causal=bool(is_causal) and not sees_all, scale=sc, mapping=mapping,
                                       causal_offset=int(causal_offset))
        return out.squeeze(1) if three_d else out
    if decode:
        from .decode import _planned as _decode_plan

        # (B, H, 1, D) -> (B, H, D) and (B, HK, Lk, D) -> (B, Lk, HK, D): views, no copies
        plan = _decode_plan(q[:, :, 0, :], k.transpose(1, 2), v.transpose(1, 2), None, None,
                            None if scale is None else float(scale), None, mapping)
    elif multi:
        from .decode import _planned as _decode_plan

        # (B, H, Lq, D) -> (B, Lq, H, D) and (B, HK, Lk, D) -> (B, Lk, HK, D): views, no copies
        plan = _decode_plan(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None,
                            None if scale is None else float(scale), None, mapping)
    else:
        plan = _planned(q, k, v, bool(is_causal) and not sees_all, None if scale is None else float(scale),
                        int(causal_offset), mapping)
    route = _SdpaRoute(plan, decode, three_d, multi)
    k_, _ = PLANS.find(_sdpa_key, query, key, value, is_causal, scale, enable_gqa, mapping, causal_offset)
    if k_ is not None:
        PLANS.put(k_, route)
    return route.run(query, key, value)
