"""QKV split + RoPE + KV-cache write in one launch: check, plan, run.

    q = numasched.qkv_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads=32, kv_heads=8)
    plan = numasched.plan_qkv_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads=32, kv_heads=8)
    q = plan.run(qkv, cos, sin, k_cache, v_cache, slots)      # every step (graph-safe)

A decoder layer's fused QKV projection gives rows of ``(heads + 2 kv_heads) * head_dim``: q heads,
then k heads, then v heads. Before attention, q and k are rotated (RoPE; Qwen3 first normalises
each head, ``q_weight`` / ``k_weight``) and k and v are written into the cache's slots. Done as
an elementwise kernel and two ``index_copy_`` scatters, that is three kernel boundaries per layer
for a few KB at decode sizes; here it is one (kernels/rope_cache.py), and q is the only output.

Arguments: ``qkv`` (T, (heads + 2 kv_heads) D), ``cos``/``sin`` (T, D) (the halves' frequencies
repeated, as transformers builds them), ``k_cache``/``v_cache`` any shape ending in (kv_heads, D)
whose leading dimensions flatten to rows, or a paged cache (pages, page_size, kv_heads, D) with any
strides (e.g. the view of head-major pages, numasched.models.PagedKVCache(head_major=True)); a
row of a paged cache is page * page_size + offset. ``slots`` (T,) contiguous int32/int64: the row
each token's k and v go to, or -1 for a token whose k and v are not written (padding). With ``options.check_data``
(the default) the slots are range-checked on the host (one device sync; never inside a CUDA-graph
capture); the kernel writes no slot outside [0, rows) either way.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import caps
from . import observe as _observe
from . import options as _options
from ._plan import PLANS, Plan, signature
from ._route import refuse_grad
from ._validate import check_int32_indexing, check_no_overlap, check_positive_int, check_tensor

__all__ = ["qkv_rope_cache", "plan_qkv_rope_cache", "check_qkv_rope_cache", "RopeCachePlan"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_T = 16   # tokens per program: a decode step's batch in one program row, prefill in row blocks


def _paged(cache: torch.Tensor) -> tuple:
    """(rows, page, stride_page, stride_slot, stride_h) of a (pages, page, kv_heads, D) cache."""
    return cache.shape[0] * cache.shape[1], cache.shape[1], cache.stride(0), cache.stride(1), cache.stride(2)


def _addressing(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, d: int) -> tuple:
    """(rows, page, K's (stride_page, stride_slot, stride_h), V's): both caches addressed alike
    (:func:`_rows`); pages of one shape of which only one flattens to rows are both addressed by
    page and offset. ValueError naming the caches otherwise."""
    k, v = _rows("k_cache", k_cache, kv_heads, d), _rows("v_cache", v_cache, kv_heads, d)
    if k[0] != v[0]:
        raise ValueError(f"k_cache has {k[0]} rows but v_cache has {v[0]}")
    if k[1] != v[1]:
        if not (k_cache.dim() == v_cache.dim() == 4 and k_cache.shape[:2] == v_cache.shape[:2]):
            raise ValueError(f"k_cache and v_cache cannot be addressed alike: shapes {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}, strides {k_cache.stride()} and {v_cache.stride()} (rows of "
                             f"both, or pages (pages, page_size, kv_heads, D) of one shape)")
        k, v = _paged(k_cache), _paged(v_cache)
    return k[0], k[1], k[2:], v[2:]


def _rows(name: str, cache: torch.Tensor, kv_heads: int, d: int) -> tuple:
    """How the kernel addresses ``cache``'s rows: (rows, page, stride_page, stride_slot, stride_h)
    in elements. page 1: ``cache`` viewed as (rows, kv_heads, D) without a copy, row r at
    r * stride_page; else a paged (pages, page, kv_heads, D) tensor whose rows do not flatten (any
    strides), row r at (r // page) * stride_page + (r % page) * stride_slot. ValueError naming
    ``name`` if it is neither."""
    if cache.dim() < 3 or tuple(cache.shape[-2:]) != (kv_heads, d):
        raise ValueError(f"{name} must end in (kv_heads, head_dim) = ({kv_heads}, {d}), got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides {cache.stride()}")
    if cache.numel() == 0:
        raise ValueError(f"{name} has no rows (shape {tuple(cache.shape)})")
    try:
        flat = cache.view(-1, kv_heads, d)
        return flat.shape[0], 1, flat.stride(0), 0, flat.stride(1)
    except RuntimeError:
        pass
    if cache.dim() == 4 and cache.shape[1] > 1:
        return _paged(cache)
    raise ValueError(f"{name} (shape {tuple(cache.shape)}, strides {cache.stride()}) cannot be viewed as "
                     f"(rows, {kv_heads}, {d}) without a copy, and it is not a paged (pages, page_size, "
                     f"{kv_heads}, {d}) cache: its leading dimensions must be one uniform run of rows, or pages")


def check_qkv_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, *, heads: int, kv_heads: int,
                         q_weight=None, k_weight=None, eps: float = 1e-6, out=None, row_scale=None) -> tuple:
    """Check without reading data; returns (T, heads, kv_heads, head_dim, dtype)."""
    heads = check_positive_int("heads", heads, allow_none=False)
    kv_heads = check_positive_int("kv_heads", kv_heads, allow_none=False)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    check_tensor("qkv", qkv, ndim=2, dtypes=DTYPES)
    T, width = qkv.shape
    if width % (heads + 2 * kv_heads):
        raise ValueError(f"qkv has {width} columns, not a multiple of heads + 2 kv_heads = {heads + 2 * kv_heads}")
    d = width // (heads + 2 * kv_heads)
    if d == 0 or d % 2:
        raise ValueError(f"head_dim (qkv's columns / (heads + 2 kv_heads)) must be even and positive for RoPE, "
                         f"got {d}")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv's columns must be contiguous (stride 1), got strides {qkv.stride()}")
    dt, dev = qkv.dtype, qkv.device
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=(dt,), device=dev)
        if tuple(t.shape) != (T, d) or t.stride(1) != 1:
            raise ValueError(f"{name} must be a ({T}, {d}) tensor with contiguous rows, got shape "
                             f"{tuple(t.shape)}, strides {t.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dtypes=(dt,), device=dev)
        check_no_overlap(t, name)   # the kernel writes its rows: none may share memory
    _check_two_caches(k_cache, v_cache)
    _addressing(k_cache, v_cache, kv_heads, d)   # rows are indexed in int64 by the kernel
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    if slots.shape[0] != T:
        raise ValueError(f"slots must hold one row per token ({T}), got {slots.shape[0]}")
    if T > 1 and slots.stride(0) != 1:
        raise ValueError(f"slots must be contiguous (stride 1), got stride {slots.stride(0)}; call .contiguous()")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together (Qwen3's per-head norms): pass both or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None:
            check_tensor(name, w, ndim=1, dtypes=(dt,), device=dev)
            if w.shape[0] != d or (d > 1 and w.stride(0) != 1):
                raise ValueError(f"{name} must be a contiguous ({d},) tensor, got shape {tuple(w.shape)}, "
                                 f"strides {w.stride()}")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(dt,), device=dev)
        if tuple(out.shape) != (T, heads, d) or out.stride(2) != 1:
            raise ValueError(f"out must be a ({T}, {heads}, {d}) tensor with contiguous heads, got shape "
                             f"{tuple(out.shape)}, strides {out.stride()}")
    if row_scale is not None:
        check_tensor("row_scale", row_scale, ndim=1, dtypes=(torch.float32,), device=dev)
        if row_scale.shape[0] != T or (T > 1 and row_scale.stride(0) != 1):
            raise ValueError(f"row_scale must be a contiguous ({T},) fp32 tensor (one factor per token), got shape "
                             f"{tuple(row_scale.shape)}, strides {row_scale.stride()}")
    check_int32_indexing("qkv", qkv)
    return T, heads, kv_heads, d, dt


def _check_two_caches(k_cache, v_cache) -> None:
    """Two caches, not one tensor given twice (v would overwrite the rotated k): checked on every
    call, since a plan's signatures hold layouts, not addresses."""
    if (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor) and k_cache.numel()
            and k_cache.device.type != "meta" and k_cache.data_ptr() == v_cache.data_ptr()):
        raise ValueError("k_cache and v_cache start at the same address: v would overwrite the rotated k; pass "
                         "two caches")


def check_slots(slots: torch.Tensor, rows: int) -> None:
    """Range check of the slots (reads them: one device sync); -1 (not written) is allowed."""
    bad = (slots < -1) | (slots >= rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"slots[{i}] = {int(slots[i])} is outside the cache's rows [0, {rows}) (or -1: not written)")


class RopeCachePlan(Plan):
    """A planned :func:`qkv_rope_cache`. Attributes: T, heads, kv_heads, head_dim, qk_norm, rows
    (the cache's), row_scale (whether it takes one), mode ("kernel", "interpreter", "torch",
    "empty"), grid, config, tensors."""

    op = "qkv_rope_cache"

    def __init__(self, qkv, cos, sin, k_cache, v_cache, slots, *, heads: int, kv_heads: int, q_weight=None,
                 k_weight=None, eps: float = 1e-6, out=None, return_kv: bool = False,
                 options: Optional[_options.Options] = None, row_scale=None):
        T, H, HK, d, dt = check_qkv_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads=heads,
                                               kv_heads=kv_heads, q_weight=q_weight, k_weight=k_weight, eps=eps,
                                               out=out, row_scale=row_scale)
        self.row_scale = row_scale is not None
        self.options = options if options is not None else _options.current()
        self.T, self.heads, self.kv_heads, self.head_dim, self.eps = T, H, HK, d, float(eps)
        self.qk_norm = q_weight is not None
        if not isinstance(return_kv, bool):
            raise TypeError(f"return_kv must be True or False, got {return_kv!r}")
        self.return_kv = return_kv
        # (run: the signatures fix both caches' shapes and strides)
        self.rows, self.page, self._kstrides, self._vstrides = _addressing(k_cache, v_cache, HK, d)
        self.tensors = dict(qkv=signature(qkv), cos=signature(cos), sin=signature(sin), k_cache=signature(k_cache),
                            v_cache=signature(v_cache), slots=signature(slots), q_weight=signature(q_weight),
                            k_weight=signature(k_weight), out=signature(out), row_scale=signature(row_scale))
        self.device = qkv.device
        self.policy = self.topology = None
        self.workspace_bytes = 0
        self.mode = "empty" if T == 0 else caps.launch_mode(self.device)
        self.grid, self.config, self._launch = (), None, None
        if self.mode in ("kernel", "interpreter"):
            from ._launch import Launch
            from .kernels import rope_cache as K

            bd = 1 << max(0, (d - 1).bit_length())
            self.config = dict(num_warps=4 if BLOCK_T * bd >= 2048 else 2)
            self.grid = (-(-T // BLOCK_T), H + 2 * HK)
            const = dict(HQ=H, HK=HK, HEAD_DIM=d, BLOCK_D=bd, BLOCK_T=BLOCK_T, QK_NORM=self.qk_norm,
                         KV_OUT=self.return_kv, ROW_SCALE=self.row_scale, PAGE=self.page)
            self._launch = Launch(K.qkv_rope_cache_kernel, self.grid, const, config=self.config, device=self.device,
                                  interpret=self.mode == "interpreter", options=self.options)
        self._freeze()

    def run(self, qkv, cos, sin, k_cache, v_cache, slots, q_weight=None, k_weight=None, out=None, row_scale=None):
        """Rotate q into ``out`` (a new (T, heads, head_dim) tensor when None) and write the rotated
        k and the v of each token into row ``slots[t]`` of the caches; returns q, or with
        ``return_kv`` (q, k, v), k and v new contiguous (T, kv_heads, head_dim) tensors. With
        ``row_scale`` (a plan made with one), token t's row is first multiplied by row_scale[t]."""
        self.check_signatures(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slots=slots,
                              q_weight=q_weight, k_weight=k_weight,
                              out=out if self.tensors["out"] is not None else None, row_scale=row_scale)
        T, H, HK, d = self.T, self.heads, self.kv_heads, self.head_dim
        if out is None:
            out = torch.empty((T, H, d), dtype=qkv.dtype, device=qkv.device)
        elif self.tensors["out"] is None:
            check_tensor("out", out, ndim=3, dtypes=(qkv.dtype,), device=qkv.device)
            if tuple(out.shape) != (T, H, d) or out.stride() != (H * d, d, 1) or out.data_ptr() % 16:
                raise ValueError(f"out must be a contiguous, 16-byte aligned ({T}, {H}, {d}) tensor for this plan "
                                 f"(it was made without out), got shape {tuple(out.shape)}, strides {out.stride()}"
                                 f"{', a misaligned data pointer' if out.data_ptr() % 16 else ''}")
        kv = ((torch.empty((T, HK, d), dtype=qkv.dtype, device=qkv.device),
               torch.empty((T, HK, d), dtype=qkv.dtype, device=qkv.device)) if self.return_kv else ())
        if self.mode == "empty":
            return (out, *kv) if kv else out
        if self.options.check_data and not caps.capturing(self.device):
            check_slots(slots, self.rows)
        if self.mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out,), self,
                                f"no Triton kernel can run on {self.device} (CPU tensors need TRITON_INTERPRET=1)")
            src = qkv if row_scale is None else (qkv.float() * row_scale[:, None]).to(qkv.dtype)
            q, k, v = reference(src, cos, sin, H, HK, q_weight, k_weight, self.eps)
            idx = slots.to(torch.int64)
            keep = (idx >= 0) & (idx < self.rows)   # as the kernel: a slot outside the rows writes nothing
            if self.page == 1:
                k_cache.view(-1, HK, d).index_copy_(0, idx[keep], k[keep])
                v_cache.view(-1, HK, d).index_copy_(0, idx[keep], v[keep])
            else:
                at = (torch.div(idx[keep], self.page, rounding_mode="floor"), idx[keep] % self.page)
                k_cache.index_put_(at, k[keep])
                v_cache.index_put_(at, v[keep])
            if kv:
                kv[0].copy_(k)
                kv[1].copy_(v)
                return out.copy_(q), *kv
            return out.copy_(q)
        if _observe.OBSERVERS:
            # only q is a whole output: the caches are written at their slots (poisoning them would
            # erase the earlier tokens)
            _observe.notify(self.op, "kernel", self.grid, (out, *kv), self)
        qw = q_weight if q_weight is not None else qkv
        kw = k_weight if k_weight is not None else qkv
        ko, vo = kv if kv else (out, out)
        with caps.launch_device(qkv):
            self._launch(qkv, cos, sin, qw, kw, out, k_cache, v_cache, slots, ko, vo,
                         row_scale if row_scale is not None else cos, T, qkv.stride(0), cos.stride(0),
                         sin.stride(0), out.stride(0), out.stride(1), *self._kstrides, *self._vstrides, self.eps,
                         self.rows)
        return (out, *kv) if kv else out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32 (float64 stays float64), round to x's dtype, then
    scale. The decoder's norms (numasched.models) are this function."""
    xf = x if x.dtype == torch.float64 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


def reference(qkv, cos, sin, heads: int, kv_heads: int, q_weight=None, k_weight=None, eps: float = 1e-6):
    """Contiguous (q, k, v) of the fused QKV rows as transformers computes them (Qwen3's per-head
    RMSNorm when the weights are given, then ``x * cos + rotate_half(x) * sin``), in the inputs'
    dtype: the torch fallback, the decoder's unfused path (numasched.models.llama.qkv_rope) and
    the tests' reference (pass float64 tensors for an exact one)."""
    T = qkv.shape[0]
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    q = qkv[:, :heads * d].view(T, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(T, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(T, kv_heads, d)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    c, s = cos[:, None, :], sin[:, None, :]
    return _rotate(q, c, s).contiguous(), _rotate(k, c, s).contiguous(), v.contiguous()


def plan_qkv_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, *, heads: int, kv_heads: int, q_weight=None,
                        k_weight=None, eps: float = 1e-6, out=None, return_kv: bool = False,
                        options: Optional[_options.Options] = None, row_scale=None) -> RopeCachePlan:
    """Plan :func:`qkv_rope_cache` for tensors like these (only their signatures are read)."""
    return RopeCachePlan(qkv, cos, sin, k_cache, v_cache, slots, heads=heads, kv_heads=kv_heads, q_weight=q_weight,
                         k_weight=k_weight, eps=eps, out=out, return_kv=return_kv, options=options,
                         row_scale=row_scale)


def _key(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_weight, k_weight, eps, out, return_kv,
         row_scale=None):
    sig = lambda t: None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)  # noqa: E731
    return ("qkv_rope_cache", sig(qkv), sig(cos), sig(sin), sig(k_cache), sig(v_cache), sig(slots), heads, kv_heads,
            sig(q_weight), sig(k_weight), float(eps), sig(out), bool(return_kv), sig(row_scale),
            qkv.device.type != "cuda" and caps.interpreting(), _options._CURRENT)


def qkv_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, *, heads: int, kv_heads: int, q_weight=None,
                   k_weight=None, eps: float = 1e-6, out=None, return_kv: bool = False, row_scale=None):
    """Split ``qkv``, (normalise and) rotate q and k, write k and v into row ``slots[t]`` of the
    caches; returns q (T, heads, head_dim), or with ``return_kv`` (q, k, v): the rotated k and
    the v of every token also as new contiguous (T, kv_heads, head_dim) tensors (a prefill's
    attention reads them so; one launch instead of an elementwise kernel and two scatters).
    ``row_scale`` (T,) fp32: token t's row counts as ``row_scale[t] * qkv[t]`` (the layer's
    RMSNorm with its weight folded into the QKV weight: its 1 / rms per token). See the module doc."""
    # before the key, where True == 1 would find a plan made for heads=1 (and 1 one made for return_kv=True)
    check_positive_int("heads", heads, allow_none=False), check_positive_int("kv_heads", kv_heads, allow_none=False)
    if not isinstance(return_kv, bool):
        raise TypeError(f"return_kv must be True or False, got {return_kv!r}")
    refuse_grad("qkv_rope_cache", qkv, cos, sin, q_weight, k_weight, row_scale)
    _check_two_caches(k_cache, v_cache)
    key, plan = PLANS.find(_key, qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_weight, k_weight, eps,
                           out, return_kv, row_scale)
    if plan is None:
        plan = RopeCachePlan(qkv, cos, sin, k_cache, v_cache, slots, heads=heads, kv_heads=kv_heads,
                             q_weight=q_weight, k_weight=k_weight, eps=eps, out=out, return_kv=return_kv,
                             row_scale=row_scale)
        if key is not None:
            PLANS.put(key, plan)
    return plan.run(qkv, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, out, row_scale)
