"""Fused QKV split + RoPE + paged KV-cache write: the step between a decoder layer's QKV
projection and its decode attention, in one launch instead of three.

A decode step's layer otherwise runs an elementwise kernel (split the fused QKV rows, Qwen3's
per-head RMSNorm of q and k, rotate q and k) and then two scatters (``index_copy_`` of k and v
into the cache's slots): three kernel boundaries per layer for a few KB of data. Here program
(tb, h) takes BLOCK_T tokens of head h of the fused row, h in [0, HQ + 2 HK):

* h < HQ: a query head: (norm,) rotate, store into ``q_out[t, h]``;
* HQ <= h < HQ + HK: a key head: (norm,) rotate, store into row ``slots[t]`` of the K cache;
* else a value head: copied into row ``slots[t]`` of the V cache.

A slot outside the cache's rows (-1: a padding token) writes nothing. A slot is a row of the
cache seen as (rows, HK, HEAD_DIM) (PAGE 1), or page * PAGE + offset of a paged cache (pages,
PAGE, HK, HEAD_DIM) with any strides (PAGE > 1: e.g. head-major pages, whose rows do not flatten).

RoPE as transformers applies it: ``y = x * cos + rotate_half(x) * sin`` with cos/sin (T, D)
(the two halves' frequencies repeated), ``rotate_half(x)[j] = -x[j + D/2]`` for j < D/2 and
``x[j - D/2]`` above. The per-head norm follows transformers' RMSNorm: normalise in fp32, round to
the input's dtype, scale by the weight (rounded to the dtype again); the rotation runs in fp32
and rounds once on the store (transformers' eager code rounds each product and the sum: the two
differ by about one unit in the last place). Host side: numasched/rope_cache.py.
"""
import triton
import triton.language as tl

from numasched.kernels.pdl import pdl_enter


@triton.jit
def _normed(x, w_ptr, offs, dmask, r, DTYPE: tl.constexpr):
    """RMSNorm's output for row factors ``r``: (x r) rounded to DTYPE, times the weight, rounded."""
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    return ((x * r[:, None]).to(DTYPE).to(tl.float32) * w[None, :]).to(DTYPE).to(tl.float32)


@triton.jit
def _slot(SLOTS, t, tmask, rows, stride_page, stride_slot, PAGE: tl.constexpr):
    # (element offset of the slot's row, write?): a slot outside [0, rows) -- -1 marks a padding
    # token -- writes nothing
    slot = tl.load(SLOTS + t, mask=tmask, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < rows)
    if PAGE == 1:
        return slot * stride_page, ok
    return (slot // PAGE) * stride_page + (slot % PAGE) * stride_slot, ok


@triton.jit
def qkv_rope_cache_kernel(QKV, COS, SIN, QW, KW, Q_OUT, K_CACHE, V_CACHE, SLOTS, K_OUT, V_OUT, RS,
                          T, stride_qkv_t, stride_cos_t, stride_sin_t, stride_q_t, stride_q_h,
                          stride_kc_page, stride_kc_slot, stride_kc_h, stride_vc_page, stride_vc_slot, stride_vc_h,
                          eps, rows,
                          HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_T: tl.constexpr, QK_NORM: tl.constexpr, KV_OUT: tl.constexpr = False,
                          PDL: tl.constexpr = False, ROW_SCALE: tl.constexpr = False, PAGE: tl.constexpr = 1):
    # KV_OUT (a prefill, whose attention reads k and v contiguous): the rotated k and the v of
    # every token also go to K_OUT / V_OUT, contiguous (T, HK, HEAD_DIM). ROW_SCALE: token t's
    # row counts as RS[t] (fp32) times the stored one (the layer's RMSNorm folded into the QKV
    # weight: its 1 / rms per token, applied here instead of to the projection's input)
    pdl_enter(PDL)  # PDL: wait for the previous kernel (the QKV projection) here (kernels/pdl.py)
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    mask = tmask[:, None] & dmask[None, :]
    DTYPE: tl.constexpr = Q_OUT.dtype.element_ty
    row = QKV + t64[:, None] * stride_qkv_t + h * HEAD_DIM
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:
        rs = tl.load(RS + t, mask=tmask, other=0.0)[:, None]
        x = x * rs
    if h < HQ + HK:
        # the partner element of rotate_half and its sign
        HALF: tl.constexpr = HEAD_DIM // 2
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROW_SCALE:
            xp = xp * rs
        if QK_NORM:
            r = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
            if h < HQ:
                x, xp = _normed(x, QW, d, dmask, r, DTYPE), _normed(xp, QW, partner, dmask, r, DTYPE)
            else:
                x, xp = _normed(x, KW, d, dmask, r, DTYPE), _normed(xp, KW, partner, dmask, r, DTYPE)
        c = tl.load(COS + t64[:, None] * stride_cos_t + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(SIN + t64[:, None] * stride_sin_t + d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * c + tl.where((d < HALF)[None, :], -xp, xp) * s
        if h < HQ:
            tl.store(Q_OUT + t64[:, None] * stride_q_t + h * stride_q_h + d[None, :], y.to(DTYPE), mask=mask)
        else:
            at, ok = _slot(SLOTS, t, tmask, rows, stride_kc_page, stride_kc_slot, PAGE)
            tl.store(K_CACHE + at[:, None] + (h - HQ) * stride_kc_h + d[None, :], y.to(DTYPE),
                     mask=mask & ok[:, None])
            if KV_OUT:
                tl.store(K_OUT + (t64[:, None] * HK + (h - HQ)) * HEAD_DIM + d[None, :], y.to(DTYPE), mask=mask)
    else:
        at, ok = _slot(SLOTS, t, tmask, rows, stride_vc_page, stride_vc_slot, PAGE)
        tl.store(V_CACHE + at[:, None] + (h - HQ - HK) * stride_vc_h + d[None, :], x.to(DTYPE),
                 mask=mask & ok[:, None])
        if KV_OUT:
            tl.store(V_OUT + (t64[:, None] * HK + (h - HQ - HK)) * HEAD_DIM + d[None, :], x.to(DTYPE), mask=mask)
