"""Flash Decode: one (or a few) query tokens per sequence, split-KV, log-sum-exp combine.

Decode reads the whole KV cache to produce one output row per query head, so it is bound by
memory bandwidth. The plan, top to bottom:

1. Work items are (batch, kv_head, split). One program reads a contiguous chunk of its
   sequence's K/V exactly once and serves all G = heads / kv_heads query heads of that KV head
   (G is padded up to 16 rows so the scores and the P @ V product use ``tl.dot``; the padding is
   free since the tensor cores are idle in decode anyway, and ``tl.dot`` operands are what
   Triton's software pipeliner streams through shared memory with async copies).
   Multi-token decode (``SQ`` > 1 new tokens per sequence, speculative decoding) packs the SQ
   tokens with the G heads into the rows: row r is token r // G, head r % G, so one K/V read
   still serves every query that needs it. Each row has its own causal limit (bottom-right
   aligned: token t sees positions < len - SQ + t + 1). Rows beyond ``BLOCK_G`` (at most
   ``MAX_ROWS``) go to further programs (``ROW_GROUPS`` per KV head).
2. A program id becomes a work item through the mapping policy (``MAPPING``, one constexpr;
   ``numasched.mappings.jit.decode_item``), so every policy runs with this one kernel.
3. Each split keeps an online softmax (running max ``m``, running sum ``l``, accumulator) in the
   log2 domain, and writes a normalised partial output plus its log2-sum-exp.
4. (PREFETCH_TOKENS, ``options.decode_prefetch``, PDL only) Before its PDL wait a program asks the
   first PREFETCH_TOKENS tokens of its chunk into L2 (one bulk prefetch per token row of K and of
   V), and the kernel before this one (the RoPE + cache write) barely uses the memory bus: the
   loop then starts on L2 hits. A prefetch returns no data, so it is safe even on the newest row,
   which that kernel may be writing at the time (L2 is where the GPU's writes meet: the loop reads
   the written row). The length and page indices it reads before the wait only pick prefetch
   addresses (clamped into the cache): a stale value costs a useless prefetch, never a wrong
   result; the kernel reads both again after the wait.
5. The partials are merged by a log-sum-exp combine: either a second small kernel, or inside the
   first one by whichever split of a (batch, kv_head) finishes last (an atomic arrival counter
   that the last arrival resets, so the kernel can be replayed in a CUDA graph). With one split
   the first kernel writes the output directly.

The KV cache is either contiguous ``(batch, max_len, kv_heads, head_dim)`` with any strides
(only the last dimension unit-stride), or paged ``(num_pages, page_size, kv_heads, head_dim)``
with an int32 block table ``(batch, max_pages)``; positions at or beyond a sequence's length
are never read, and indices read from memory are bounded (a length is clamped to the cache, a
page index to [0, num_pages)), so bad metadata can give a wrong row but never an out-of-bounds
read. Offsets are int64 where a cache can exceed 2^31 elements (``INT64``).

Host planning (split count, buffers, launches) is numasched/decode.py's.
"""
from __future__ import annotations

import triton
import triton.language as tl

from numasched import caps
from numasched.caps import LN2 as _LN2
from numasched.mappings.jit import decode_item
from numasched.kernels.pdl import late_point, pdl_enter, pdl_late, pdl_trigger, prefetch_l2

LN2 = tl.constexpr(_LN2)


# ----------------------------------------------------------------------------- combine helpers
# Partial values one combine step loads at once (fp32; 64 registers per thread at 4 warps).
COMBINE_CHUNK_ELEMS = 8192


@triton.constexpr_function
def _pow2_at_least(n):
    return 1 << max(0, int(n) - 1).bit_length()


@triton.constexpr_function
def _combine_chunk(heads_p2, block_d, block_s):
    """Splits merged per step: all of them (up to ``block_s``) while heads x splits x head_dim
    partial values stay within COMBINE_CHUNK_ELEMS."""
    cap = max(1, COMBINE_CHUNK_ELEMS // (int(heads_p2) * int(block_d)))
    return min(int(block_s), 1 << (cap.bit_length() - 1))


@triton.jit
def _combine_heads(PO, PL, O, LSE, row0, S, stride_oh, stride_lh,
                   NH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                   CACHE: tl.constexpr):
    """Merge the S partials of NH consecutive partial rows into O (q dtype) and LSE (natural log).

    Head i's partials are rows row0 + i*S .. row0 + i*S + S-1 of the (rows, D) / (rows,) fp32
    buffers; its output goes to O + i*stride_oh and LSE + i*stride_lh (O and LSE point at the
    first head's output). Partial s holds o_s, already divided by its own softmax sum, and
    lse2_s, its log-sum-exp of the scores in base 2. The merge is
    out = sum_s 2^(lse2_s - M) o_s / sum_s 2^(lse2_s - M), M = max_s lse2_s, done online over chunks
    of splits. All NH heads are merged together, in a (heads, splits, head_dim) tile: the loads of
    every head are in flight at once, so a small decode's merge (the last program's tail, on the
    critical path) costs one memory round trip per chunk, not one per head. With the usual
    S <= 16 and G <= 4 (d128) it is one chunk.
    Empty splits have lse2 = -inf and weigh nothing; an empty sequence gives zeros, lse = -inf.
    """
    NH_P: tl.constexpr = _pow2_at_least(NH)
    CS: tl.constexpr = _combine_chunk(NH_P, BLOCK_D, BLOCK_S)
    offs_h = tl.arange(0, NH_P)
    offs_s = tl.arange(0, CS)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < NH
    dmask = offs_d < HEAD_DIM
    head_row = row0 + offs_h * S  # first partial row of each head
    m = tl.full([NH_P], float("-inf"), tl.float32)
    den = tl.zeros([NH_P], tl.float32)
    acc = tl.zeros([NH_P, BLOCK_D], tl.float32)
    for s0 in range(0, S, CS):
        rows = head_row[:, None] + (s0 + offs_s)[None, :]  # (heads, splits)
        ok = hmask[:, None] & ((s0 + offs_s) < S)[None, :]
        ls = tl.load(PL + rows, mask=ok, other=float("-inf"), cache_modifier=CACHE)
        o = tl.load(PO + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=ok[:, :, None] & dmask[None, None, :], other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m, tl.max(ls, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: avoid -inf - -inf
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(ls - m_safe[:, None])
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    nonempty = den > 0
    den_safe = tl.where(nonempty, den, 1.0)
    lse = tl.where(nonempty, (m + tl.math.log2(den_safe)) * LN2, float("-inf"))
    tl.store(O + offs_h[:, None] * stride_oh + offs_d[None, :], (acc / den_safe[:, None]).to(O.dtype.element_ty),
             mask=hmask[:, None] & dmask[None, :])
    tl.store(LSE + offs_h * stride_lh, lse, mask=hmask)


@triton.jit
def _combine_rows(PO, PL, O, LSE, prow, o_off, l_off, rmask, S,
                  BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
                  CACHE: tl.constexpr):
    """The same merge for a tile of BLOCK_R rows at once (the multi-token fused combine): row r's
    partials are rows prow[r] .. prow[r] + S-1, its output O + o_off[r] and LSE + l_off[r]; rows
    outside ``rmask`` are neither read nor written. Loops over the splits, UNROLL at a time (their
    loads are independent, so they are in flight together)."""
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s0 in range(0, S, UNROLL):
        for j in tl.static_range(UNROLL):
            ok = rmask & (s0 + j < S)
            ls = tl.load(PL + prow + s0 + j, mask=ok, other=float("-inf"), cache_modifier=CACHE)
            o = tl.load(PO + (prow + s0 + j)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & dmask[None, :],
                        other=0.0, cache_modifier=CACHE)
            m_new = tl.maximum(m, ls)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_safe)
            w = tl.math.exp2(ls - m_safe)
            den = den * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o
            m = m_new
    nonempty = den > 0
    den_safe = tl.where(nonempty, den, 1.0)
    lse = tl.where(nonempty, (m + tl.math.log2(den_safe)) * LN2, float("-inf"))
    tl.store(O + o_off[:, None] + offs_d[None, :], (acc / den_safe[:, None]).to(O.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE + l_off, lse, mask=rmask)


# ----------------------------------------------------------------------------- the KV loop
@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, n, valid, row_hi, qk_scale,
                  CAUSAL_ROWS: tl.constexpr, MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One tile of the online softmax: scores of the rows ``q`` against the tile's keys ``k``
    (tokens ``n``), then the running max / sum / accumulator updated with the tile's values ``v``.
    ``MASKED``: columns outside ``valid`` score -inf (a partial tile; its masked K/V rows were
    loaded as zeros); ``CAUSAL_ROWS``: row r sees only tokens < row_hi[r] (and may see none)."""
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if not CAUSAL_ROWS:
        if MASKED:
            qk = tl.where(valid[None, :], qk, float("-inf"))
        # -- every tile has at least one valid column, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        qk = tl.where(n[None, :] < row_hi[:, None], qk, float("-inf"))
        # -- a row may have seen nothing yet (m = -inf): exponents against 0 instead
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend(q, K, V, BLOCK_TABLE, b64, kvh64, lo, hi, row_hi, offs_n, offs_d, qk_scale, num_pages,
            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_tb, stride_tp,
            CAUSAL_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, INT64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
            KD=None, VD=None):
    """Online softmax of the BLOCK_G query rows ``q`` over the tokens [lo, hi) of sequence b64's KV
    head kvh64; returns (m, l, acc) in the log2 domain (scores times ``qk_scale``), unnormalised.

    Contiguous cache (PAGE_SIZE 0): token t is row t of (b, :, kvh); paged: slot t % PAGE_SIZE of
    page BLOCK_TABLE[b, t // PAGE_SIZE], the page index clamped to [0, num_pages). ``CAUSAL_ROWS``:
    row r sees only tokens < row_hi[r] (multi-token decode; a row may see nothing, m = -inf);
    otherwise every row sees every token of the range. Shared by the split kernel and the worklist
    kernel (kernels/flash_decode_worklist.py). ``offs_n``, ``offs_d``: tl.arange(0, BLOCK_N) and
    tl.arange(0, BLOCK_D) of the caller (made there: the compiled code then matches the loop's
    former inline form).

    ``KD``/``VD`` (contiguous cache, NVIDIA sm_90+): TMA descriptors of K and V as 4-D (batch,
    token, kv_head, head_dim) tensors with boxes of (1, BLOCK_N, 1, BLOCK_D). The whole tiles of
    the range then arrive by bulk tensor copies (one instruction per box, no per-thread address
    math; a padded head dim is zero-filled by the copy), and only the last, partial tile takes the
    masked loads: a TMA box past ``hi`` would read the cache's rows beyond the sequence, whose
    values (possibly NaN) must not meet a zero probability."""
    if PAGE_SIZE == 0:
        k_base = K + b64 * stride_kb + kvh64 * stride_kh
        v_base = V + b64 * stride_vb + kvh64 * stride_vh
    else:
        k_base = K + kvh64 * stride_kh
        v_base = V + kvh64 * stride_vh
        bt_base = BLOCK_TABLE + b64 * stride_tb

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    first = lo
    if KD is not None:
        whole = lo + (hi - lo) // BLOCK_N * BLOCK_N
        b32 = b64.to(tl.int32)
        kvh32 = kvh64.to(tl.int32)
        for start in range(lo, whole, BLOCK_N):
            k = KD.load([b32, start, kvh32, 0]).reshape(BLOCK_N, BLOCK_D)
            v = VD.load([b32, start, kvh32, 0]).reshape(BLOCK_N, BLOCK_D)
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, start + offs_n, offs_n < BLOCK_N, row_hi,
                                          qk_scale, CAUSAL_ROWS, False, INPUT_PRECISION)
        first = whole
    for start in range(first, hi, BLOCK_N):
        n = start + offs_n
        nmask = n < hi
        # -- row offsets of this tile's tokens (paged: through the block table)
        if PAGE_SIZE == 0:
            if INT64:
                rows = n.to(tl.int64)
            else:
                rows = n
            k_off = rows * stride_kn
            v_off = rows * stride_vn
        else:
            page = tl.load(bt_base + (n // PAGE_SIZE) * stride_tp, mask=nmask, other=0)
            # bounded: a bad page index (checks off) reads a wrong page, never outside the cache
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            if INT64:
                page = page.to(tl.int64)
            slot = n % PAGE_SIZE
            k_off = page * stride_kb + slot * stride_kn
            v_off = page * stride_vb + slot * stride_vn
        # The mask varies along rows only (unless the head dim is padded), which keeps the
        # loads 16-byte vectors along head_dim.
        if HEAD_DIM == BLOCK_D:
            kv_mask = nmask[:, None]
        else:
            kv_mask = nmask[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, n, nmask, row_hi, qk_scale, CAUSAL_ROWS, True,
                                      INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _split_range(SEQLENS, b, stride_sb, seqlen_max, S, split, HAS_SEQLENS: tl.constexpr):
    """(seqlen, lo, hi): sequence b's length and its split's token range. The sequence is cut into
    S near-equal chunks (balanced per sequence; a chunk need not be a multiple of BLOCK_N, its last
    tile is masked); a length outside [0, capacity] is clamped, so no read goes beyond the cache."""
    if HAS_SEQLENS:
        seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b * stride_sb), 0), seqlen_max)
    else:
        seqlen = seqlen_max
    chunk = tl.cdiv(seqlen, S)
    lo = split * chunk
    return seqlen, lo, tl.minimum(lo + chunk, seqlen)


@triton.jit
def _prefetch_kv(K, V, SEQLENS, BLOCK_TABLE, b, kvh, split, S, seqlen_max, num_pages,
                 stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_sb, stride_tb, stride_tp,
                 HAS_SEQLENS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr):
    """L2 prefetch of the first TOKENS token rows of K and V of this program's chunk (step 4 of the
    module doc): the chunk as the kernel computes it, from a length and page indices read now
    (before the PDL wait: hints only, clamped into the cache). One row is HEAD_DIM elements, a
    multiple of 16 bytes (the host checks)."""
    _, lo, hi = _split_range(SEQLENS, b, stride_sb, seqlen_max, S, split, HAS_SEQLENS)
    n = lo + tl.arange(0, TOKENS)
    live = n < hi
    b64 = b.to(tl.int64)
    if PAGE_SIZE == 0:
        k_row = K + b64 * stride_kb + n.to(tl.int64) * stride_kn
        v_row = V + b64 * stride_vb + n.to(tl.int64) * stride_vn
    else:
        page = tl.load(BLOCK_TABLE + b64 * stride_tb + (n // PAGE_SIZE) * stride_tp, mask=live, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        slot = (n % PAGE_SIZE).to(tl.int64)
        k_row = K + page * stride_kb + slot * stride_kn
        v_row = V + page * stride_vb + slot * stride_vn
    nbytes = tl.zeros([TOKENS], tl.int32) + HEAD_DIM * (K.dtype.element_ty.primitive_bitwidth // 8)
    prefetch_l2(k_row + kvh.to(tl.int64) * stride_kh, nbytes, live)
    prefetch_l2(v_row + kvh.to(tl.int64) * stride_vh, nbytes, live)


# ----------------------------------------------------------------------------- split kernel
@triton.jit
def _flash_decode_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O, LSE, PO, PL, COUNTER,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    B, HK, S, seqlen_max, num_pages,
    stride_qb, stride_qs, stride_qh,  # q (B, H, D): stride_qs unused; (B, SQ, H, D): per token
    stride_kb, stride_kn, stride_kh,  # contiguous: batch, token, head; paged: page, slot, head
    stride_vb, stride_vn, stride_vh,
    stride_sb, stride_tb, stride_tp,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,  # *_os, *_ls: per token (SQ > 1)
    tune_key,  # unused in the kernel: tokens-per-split bucket and layout, so autotune re-tunes per class
    KD, VD,  # None, or TMA descriptors of K and V (contiguous cache; _attend)
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # 0: contiguous cache
    HAS_SEQLENS: tl.constexpr,
    COMBINE: tl.constexpr,  # 0: one split, write O directly; 1: partials for the combine kernel; 2: fused
    INT64: tl.constexpr, INPUT_PRECISION: tl.constexpr, COMBINE_BLOCK_S: tl.constexpr,
    SQ: tl.constexpr,  # query tokens per sequence (1: the single-token decode)
    ROW_GROUPS: tl.constexpr,  # programs per (batch, kv_head, split) when SQ * G rows exceed BLOCK_G
    BLOCK_N: tl.constexpr,
    MAPPING: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    PREFETCH_TOKENS: tl.constexpr = 0,  # tokens of the chunk asked into L2 before the PDL wait (step 4)
):
    # -- which (batch, kv_head, split) this program owns: the policy decides. Row groups of one
    #    KV head are neighbouring "heads" of the policy's grid (they read the same K/V). Index
    #    math only: it may run before the PDL wait.
    if ROW_GROUPS == 1:
        b, kvh, split = decode_item(tl.program_id(0), B, HK, S, MAPPING)
        item = b.to(tl.int64) * HK + kvh  # arrival counter of the fused combine
        rg = 0
    else:
        b, kvr, split = decode_item(tl.program_id(0), B, HK * ROW_GROUPS, S, MAPPING)
        item = b.to(tl.int64) * (HK * ROW_GROUPS) + kvr
        kvh = kvr // ROW_GROUPS
        rg = kvr % ROW_GROUPS
    if PREFETCH_TOKENS > 0:   # step 4 (the host sets it with PDL, one query token, ROW_GROUPS == 1)
        pdl_trigger(PDL)
        _prefetch_kv(K, V, SEQLENS, BLOCK_TABLE, b, kvh, split, S, seqlen_max, num_pages,
                     stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_sb, stride_tb, stride_tp,
                     HAS_SEQLENS, PAGE_SIZE, HEAD_DIM, PREFETCH_TOKENS)
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)

    # -- this split's token range
    seqlen, lo, hi = _split_range(SEQLENS, b, stride_sb, seqlen_max, S, split, HAS_SEQLENS)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)

    if SQ == 1:
        # -- the G query heads of this KV head, padded to BLOCK_G rows
        gmask = offs_g < G
        heads = kvh * G + offs_g
        q_ptrs = Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        row_hi = hi  # (unused: one query token has no per-row causal limit)
    else:
        # -- rows (token, head): row r of group rg is token (rg*BLOCK_G + r) // G, head % G
        gr = rg * BLOCK_G + offs_g
        tok = gr // G
        gmask = gr < SQ * G
        heads = kvh * G + gr % G
        q_ptrs = Q + b64 * stride_qb + tok[:, None] * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
        # causal, bottom-right: token t sees positions < seqlen - SQ + 1 + t (those of this split
        # below hi); a row whose limit is <= lo sees nothing here
        row_hi = tl.minimum(seqlen - (SQ - 1) + tok, hi)
        if ROW_GROUPS > 1:
            # the group's last token bounds the loop (groups without the last token stop earlier)
            hi = tl.minimum(hi, seqlen - (SQ - 1) + tl.minimum(SQ - 1, (rg * BLOCK_G + BLOCK_G - 1) // G))
    if HEAD_DIM == BLOCK_D:
        q = tl.load(q_ptrs, mask=gmask[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=gmask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    m_i, l_i, acc = _attend(q, K, V, BLOCK_TABLE, b64, kvh64, lo, hi, row_hi, offs_n, offs_d, qk_scale, num_pages,
                            stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_tb, stride_tp,
                            SQ > 1, BLOCK_G, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, INT64, INPUT_PRECISION, KD, VD)
    # PDL "late": the next kernel launches once every program is past its K/V loop, not at the
    # start: an early launch placed the next call's programs in this one's free SM slots, and
    # they piled up unevenly (32/8 32 x 32k back to back, H200: 986 us with the early trigger,
    # 945 without PDL, cuDNN 936; bench/results/decode-s36-pdl/)
    pdl_late(PDL)

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(nonempty, m_i + tl.math.log2(l_safe), float("-inf"))
    omask = gmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    if SQ == 1:
        o_off = b64 * stride_ob + heads * stride_oh
        l_off = b64 * stride_lb + heads * stride_lh
        # partials (B, H, S, D) and (B, H, S), fp32, contiguous: a head's splits are adjacent rows
        prow = (b64 * (HK * G) + heads) * S
    else:
        o_off = b64 * stride_ob + tok * stride_os + heads * stride_oh
        l_off = b64 * stride_lb + tok * stride_ls + heads * stride_lh
        # partials (B, SQ, H, S, D) and (B, SQ, H, S)
        prow = (b64 * (SQ * HK * G) + tok * (HK * G) + heads) * S

    if COMBINE == 0:
        # one split: this is the answer
        tl.store(O + o_off[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=omask)
        tl.store(LSE + l_off, lse2 * LN2, mask=gmask)
    else:
        rows = prow + split
        tl.store(PO + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=omask)
        tl.store(PL + rows, lse2, mask=gmask)
        if COMBINE == 2:
            # The last split of this (b, kvh, row group) to arrive merges all of them. The barrier
            # orders every thread's partial stores before the release of the arrival; the reads use
            # .cg (L2, not this SM's L1) so they see the other programs' partials.
            tl.debug_barrier()
            ctr = COUNTER + item
            arrived = tl.atomic_add(ctr, 1, sem="acq_rel")
            if arrived == S - 1:
                if SQ == 1:
                    _combine_heads(PO, PL, O + b64 * stride_ob + (kvh * G) * stride_oh,
                                   LSE + b64 * stride_lb + (kvh * G) * stride_lh, (b64 * (HK * G) + kvh * G) * S, S,
                                   stride_oh, stride_lh, G, HEAD_DIM, BLOCK_D, COMBINE_BLOCK_S, ".cg")
                else:
                    # splits merged UNROLL at a time: 64 // BLOCK_G keeps the loads at 64 rows
                    # (BLOCK_G <= MAX_ROWS = 64 with SQ > 1)
                    _combine_rows(PO, PL, O, LSE, prow, o_off, l_off, gmask, S, BLOCK_G, HEAD_DIM, BLOCK_D,
                                  64 // BLOCK_G, ".cg")
                tl.atomic_xchg(ctr, 0)  # ready for the next launch (and CUDA graph replays)


late_point(_flash_decode_kernel)


@triton.jit
def _combine_kernel(PO, PL, O, LSE, H, S, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                    SQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    # one program per (batch, query head), or per (batch, token, query head) with SQ tokens; the
    # partial rows follow the same order, so program pid merges rows pid*S .. pid*S + S-1
    pid = tl.program_id(0)
    if SQ == 1:
        b = pid // H
        o_off = b.to(tl.int64) * stride_ob + (pid % H) * stride_oh
        l_off = b.to(tl.int64) * stride_lb + (pid % H) * stride_lh
    else:
        b = pid // (SQ * H)
        t = (pid // H) % SQ
        o_off = b.to(tl.int64) * stride_ob + t * stride_os + (pid % H) * stride_oh
        l_off = b.to(tl.int64) * stride_lb + t * stride_ls + (pid % H) * stride_lh
    _combine_heads(PO, PL, O + o_off, LSE + l_off, pid.to(tl.int64) * S, S, stride_oh, stride_lh,
                   1, HEAD_DIM, BLOCK_D, BLOCK_S, "")


# ----------------------------------------------------------------------------- configs
# (BLOCK_N, num_warps, num_stages). Triton's pipeliner keeps num_stages - 1 K/V tiles in flight for
# the contiguous cache, but only (num_stages - 1) // 2 for the paged one (the block-table load
# takes a stage of its own ahead of the K/V loads it addresses, checked by compiling for sm_90),
# so paged configs use more stages.
# Small tiles with 2 warps give more independent programs per SM (fewer cross-warp reductions per
# byte); large tiles with 8 warps move more bytes per iteration. fixed_config picks by default;
# with decode_schedule="autotune" the autotuner picks among these per tokens-per-split class.
_CONTIGUOUS_CONFIGS = [(32, 2, 4), (64, 2, 3), (32, 4, 4), (64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 4),
                       (128, 4, 3), (128, 8, 3), (128, 8, 4)]
_PAGED_CONFIGS = [(32, 2, 5), (64, 2, 5), (32, 4, 5), (32, 4, 7), (64, 4, 5), (64, 4, 7), (64, 8, 5),
                  (128, 4, 5), (128, 4, 7), (128, 8, 5)]
# (the model's deep 64-token paged tile, DEEP_PAGED_CONFIG, is not among them: the tune buckets of
# splits past 2048 tokens offer 128-token tiles only, and below that it ran within -5..+3 % of
# five stages)
_GPU_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                for bn, w, st in sorted(set(_CONTIGUOUS_CONFIGS) | set(_PAGED_CONFIGS))]
SMEM_LIMIT = 200 * 1024


def _kv_buffers(num_stages: int, paged: bool) -> int:
    return max(1, (num_stages - 1) // 2) if paged else max(1, num_stages - 1)


# Splits longer than 2048 tokens (tune bucket >= 2) stream long enough that 128-token tiles win:
# measured on an H200 (bf16, d128, GQA 32/8; bench/results/decode-configs-h200-2026-11-22.log),
# 128/4w/3s was within 3.5% of the best config at every batch 1-16, 64k-256k context and 2-16 splits,
# while 32-token tiles took up to 1.8x as long at 32k tokens per split (batch 4 x 128k, 4 splits:
# 871 us against 478 us). A bucket is tuned on the first shape that reaches it, so a config that
# only suits that shape must not be on offer: these buckets choose among the 128-token tiles only.
LONG_SPLIT_BUCKET = 2
LONG_SPLIT_BLOCK_N = 128
# The model's 128-token config (fixed_config): (BLOCK_N, num_warps, num_stages) per layout
# (paged: two K/V tiles in flight take five stages, see _kv_buffers).
LONG_SPLIT_CONFIG = {False: (128, 4, 3), True: (128, 4, 5)}


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs of this cache kind whose K/V tiles fit in shared memory (and, for long
    splits, have 128-token tiles; for multi-token tiles of 32+ rows, 4 or 8 warps)."""
    paged = kwargs.get("PAGE_SIZE", 0) > 0
    wanted = set(_PAGED_CONFIGS if paged else _CONTIGUOUS_CONFIGS)
    block_d = kwargs.get("BLOCK_D", 128)
    elt = named_args["K"].element_size()
    kept = [c for c in configs
            if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted
            and _kv_bytes(dict(c.kwargs, num_stages=c.num_stages), block_d, elt, paged) <= SMEM_LIMIT]
    key = int(named_args.get("tune_key", 0))
    if key >= MULTI_TOKEN_TUNE and kwargs.get("BLOCK_G", 16) >= 32:
        # multi-token tiles of 32-64 rows: 2 warps would need 400+ registers per thread (spills)
        kept = [c for c in kept if c.num_warps >= 4] or kept
    if (key % MULTI_TOKEN_TUNE) // 2 >= LONG_SPLIT_BUCKET:
        kept = [c for c in kept if c.kwargs["BLOCK_N"] == LONG_SPLIT_BLOCK_N] or kept  # d256: none fit
    if caps.is_hip():  # LDS of an AMD block (gfx942: 64 KiB)
        kept = [c for c in kept if c.num_stages <= caps.AMD_MAX_STAGES["decode"]]
    if not kept:  # head dim 256 in fp32: the smallest tile
        kept = [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages))]
    return kept


_flash_decode_tuned = triton.autotune(
    configs=_GPU_CONFIGS,
    # COMBINE, G, SQ and ROW_GROUPS only change the prologue/epilogue and masks: the tuned config is
    # shared (fewer compiles); BLOCK_G (rows) is in the key
    key=["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "INT64", "tune_key"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_flash_decode_kernel)

# Tuning buckets of tokens per split (the autotuner's ``tune_key`` argument).
def tune_bucket(tokens_per_split: int) -> int:
    """Coarse bucket of tokens per split (best BLOCK_N / stages differ for short and long splits)."""
    return min(4, max(0, (max(tokens_per_split, 1) - 1).bit_length() - 8) // 2)


# Added to the tune key of multi-token launches: a single-token and a multi-token launch with the
# same BLOCK_G (e.g. 32 heads per KV head, or 8 tokens x 4 heads) are tuned apart (their register
# pressure differs), while every q_len with one row tile shares a tuning.
MULTI_TOKEN_TUNE = 16


def tune_key(tokens_per_split: int, contiguous_rows: bool, multi_token: bool) -> int:
    """The ``tune_key`` argument: bucket * 2 + (K/V rows contiguous) (+ MULTI_TOKEN_TUNE)."""
    return tune_bucket(tokens_per_split) * 2 + int(contiguous_rows) + (MULTI_TOKEN_TUNE if multi_token else 0)


# Rows of one program with several query tokens (SQ * G rows, padded to a power of two >= 16):
# more go to further programs (row groups). 64 rows keep q, the scores and the accumulator in
# registers at 4 warps with head dim 128.
MAX_ROWS = 64
MAX_QUERY_TOKENS = 16


def row_tiling(q_len: int, group: int):
    """(BLOCK_G, ROW_GROUPS) for ``q_len`` query tokens of ``group`` query heads per KV head.

    One token: the G heads padded to a power of two >= 16, one group (the single-token kernel,
    any G). Several: the q_len * G (token, head) rows in groups of at most MAX_ROWS."""
    if q_len == 1:
        return max(16, 1 << max(0, group - 1).bit_length()), 1
    rows = q_len * group
    groups = -(-rows // MAX_ROWS)
    per = -(-rows // groups)
    return max(16, 1 << max(0, per - 1).bit_length()), groups


# The combine reads partials in chunks of this many splits (two sizes only: each compiles apart).
COMBINE_MAX_BLOCK_S = 64


def combine_block_s(splits: int) -> int:
    return 16 if splits <= 16 else COMBINE_MAX_BLOCK_S


def fixed_config(paged: bool, head_dim: int, block_g: int = 16, tokens_per_split: int = 0,
                 elt_bytes: int = 2, programs: int = 0, num_sms: int = 0, smem_limit: int = SMEM_LIMIT,
                 fused: bool = False, stream_scale: float = 1.0) -> dict:
    """The config of the model (no autotuning; also used during graph capture before a shape was
    tuned), from the tokens per split T and the programs P of the launch on ``num_sms`` SMs
    (one tile of <= 16 rows, 16-bit d <= 128 on NVIDIA; otherwise, or without P and T, the
    64-token DEFAULT_GPU_CONFIG, with 32-token tiles for head_dim > 128 and 8 warps for row
    tiles of 32+). A pick whose K/V tiles exceed ``smem_limit`` (the device's
    shared memory per block: 99 KB on sm_86/89) falls back to the default:

    * P <= SMs and T >= 256: 128-token tiles (one program per SM streams with two 64 KB tiles
      in flight; with 256-1024 tokens per split they took 0.6-0.95x the time of 64-token ones);
    * SMs < P <= 3 SMs: 64-token tiles (three resident programs per SM: every program starts
      at once; contiguous 4 warps, paged 2 warps);
    * P > 3 SMs: contiguous T <= 2048: 32-token tiles of 2 warps while the grid is one round of
      resident programs (four per SM), beyond it 64-token tiles of 4 warps up to T = 1024 and
      128-token ones above (H100 sweep, 768-4096 programs: the pick within 4 % of the best at
      35/35 points, the former 32-token rule 33/35, worst 1.19); paged T <= 8192: 32-token
      tiles of 2 warps while the grid is one round of resident programs (``_resident``: five
      per SM on an H100/H200, four with the fused combine, ``fused``: its registers), 64-token
      tiles of 2 warps beyond (at 768 programs, 5.8 per SM,
      32-token tiles took 1.11-1.31x as long on both GPUs; at 1024-2048 programs up to 1.21x on
      an H100 with 1k-token splits, within -4..+8 % on an H200); on a GPU of more bandwidth
      per SM (``stream_scale`` >= DEEP_PAGED_MIN_STREAM_SCALE: the H200) those 64-token tiles
      keep one more K/V tile in flight (DEEP_PAGED_CONFIG) for splits of DEEP_PAGED_MIN_TOKENS
      and more at DEEP_PAGED_MIN_PER_SM to DEEP_PAGED_MAX_PER_SM programs per SM; longer splits
      128-token tiles (many waves of one per SM, the last nearly full), on such a GPU the deep
      64-token tiles at 7-8 programs per SM and from DEEP_LONG_MIN_PER_SM programs per SM the
      128-token tile one K/V tile deeper (DEEP_LONG_CONFIG). The figures below are for
      ``stream_scale`` 1 (the rule without the deep tiles).

    Paged rule with one round, measured on an H100 (pages of 16 and 64, 512-2048 programs, 1k-8k
    tokens, bench/results/decode-s21-paged/): the pick within 5 % of the best at 49/49 points
    (worst 1.02; the former rounds rule 33/49, worst 1.21), and on the H200 sweeps' paged groups
    78/82 (former 76/82).
    Measured on an H200 (bf16, d128; bench/results/decode-configs-*-h200-2026-11-23.csv): the pick
    is within 5 % of the best config of its sweep at 106 of 117 (sweep, point, split count)
    groups (batch 1-128 x 512-128k tokens, 1-32 splits, contiguous and pages of 16; the former
    rule: 82); the misses are 1.05-1.29x, and 1.36x at 8 x 512 contiguous with 2 splits, a 13-us
    point that read 11.9 us with the pick in another sweep. The former fixed 64-token / 4-warp
    tile took up to 1.3x as long (8 x 32k paged, 2 splits: 321 against 253 us; 64 x 8k paged:
    588 against 493).
    Wave counts explain most of it: with 512 programs 64-token paged tiles (three resident per
    SM, 1.3 waves) ran 588 us, 32-token ones (one wave) 493 and 128-token ones (3.9 waves) 497."""
    cfg = dict(DEFAULT_GPU_CONFIG[paged])
    if (programs and num_sms and tokens_per_split and block_g < 32 and head_dim <= 128 and elt_bytes == 2
            and not caps.is_hip()):  # AMD: a 128-token K+V tile alone fills the LDS; not measured there
        if programs <= num_sms:
            pick = LONG_SPLIT_CONFIG[paged] if tokens_per_split >= 2 * LONG_SPLIT_BLOCK_N else None
        elif programs <= 3 * num_sms:
            pick = (64, 2, 5) if paged else (64, 4, 3)
            if (not paged and tokens_per_split >= ROUND_SHORT_MIN_TOKENS
                    and -(-programs // num_sms) <= _resident((32, 2, 4), head_dim, elt_bytes, paged, smem_limit, fused)):
                pick = (32, 2, 4)   # long contiguous splits: four resident 32-token programs an SM
        elif paged and tokens_per_split <= 8192:
            # 32-token tiles while every program is resident at once (one round: five per SM),
            # 64-token ones beyond (768 programs, 5.8 per SM: 32-token tiles took 1.11-1.31x as
            # long on both GPUs; 1024-2048 programs on an H100 up to 1.21x, on an H200 within
            # -4..+8 % of the 64-token ones)
            per_sm = -(-programs // num_sms)
            short = (32, 2, 5)
            deep = _deep_paged(False, tokens_per_split, per_sm, head_dim, elt_bytes, smem_limit, stream_scale)
            pick = short if per_sm <= _resident(short, head_dim, elt_bytes, paged, smem_limit, fused) else (
                deep or (64, 2, 5))
        elif paged and stream_scale >= DEEP_PAGED_MIN_STREAM_SCALE:
            # longer paged splits on a GPU of more bandwidth per SM: the 128-token tile holds two
            # K/V tiles in flight (128 KB an SM), the deeper forms three (192 KB), as the mid rule
            per_sm = -(-programs // num_sms)
            pick = (_deep_paged(True, tokens_per_split, per_sm, head_dim, elt_bytes, smem_limit, stream_scale)
                    or LONG_SPLIT_CONFIG[paged])
        elif not paged and tokens_per_split <= 2048:
            # the same one-round rule: 32-token tiles while every program is resident at once (four
            # per SM), beyond it 64-token tiles up to 1024 tokens a split and 128-token ones above
            # (H100, 768-4096 programs: 32-token tiles took up to 1.19x as long; the H200 sweeps'
            # points of more than one round, 1024 programs, agree within 1 %)
            per_sm = -(-programs // num_sms)
            if per_sm <= _resident((32, 2, 4), head_dim, elt_bytes, paged, smem_limit, fused):
                pick = (32, 2, 4)
            else:
                pick = (64, 4, 3) if tokens_per_split <= 1024 else LONG_SPLIT_CONFIG[paged]
        else:
            pick = LONG_SPLIT_CONFIG[paged]
        if pick is not None:
            cfg = dict(BLOCK_N=pick[0], num_warps=pick[1], num_stages=pick[2])
            if _kv_bytes(cfg, head_dim, elt_bytes, paged) > min(smem_limit, SMEM_LIMIT):
                cfg = dict(DEFAULT_GPU_CONFIG[paged])   # e.g. 128-token tiles on a 99 KB GPU
    if head_dim > 128:  # keep the K/V tiles within shared memory
        cfg["BLOCK_N"] = 32
    if block_g >= 32:
        # multi-token rows: q, scores and accumulator of 32-64 rows need 200-254 registers per
        # thread at 4 warps (sm_90, d128); 8 warps halve that
        cfg["num_warps"] = 8
    cfg["num_stages"] = caps.cap_stages("decode", cfg["num_stages"])
    # whatever the rule, the K/V tiles must fit the device: fewer tiles in flight, then shorter
    # tiles (fp32 with a large head dim on a 99 KB GPU)
    while _kv_bytes(cfg, head_dim, elt_bytes, paged) > min(smem_limit, SMEM_LIMIT) and (
            cfg["num_stages"] > 2 or cfg["BLOCK_N"] > 16):
        if _kv_buffers(cfg["num_stages"], paged) > 1:
            cfg["num_stages"] -= 1
        else:
            cfg["BLOCK_N"] //= 2
    return cfg


# Contiguous splits of this many tokens and more with one to three programs an SM take the
# 32-token tile of two warps (up to four resident an SM) instead of the 64-token one of four
# (three). H200, one split, 256 programs, BLHD (bench/results/decode-s53/cfg.csv, after a read
# flush): 32/8 32 x 128k 3689 against 3766 us (cuDNN 3742), 32/32 8 x 8k 241 against 246 (cuDNN
# 243), 8 x 128k 3702 against 3754, 32 x 16k 471 against 474; earlier sweeps (back to back) at
# 256 programs: 32k tokens 0.3-0.5 % from the best against 1.4-1.5 % for the 64-token tile, while
# at 1k-2k tokens either tile led by up to 5 % (decode-s34-configs/).
ROUND_SHORT_MIN_TOKENS = 8192


# The paged 64-token tile one K/V tile deeper (three in flight, two programs per SM: 192 KB an SM
# against three programs of two) where the memory is faster per SM. H200 sweeps (one split;
# bench/results/decode-configs-joint-h200-2026-11-23.csv, decode-s35-configs-h200/): at 1024
# programs (8 per SM) and 4k-8k tokens 3.0-4.8 % faster than five stages (32/8 128 x 8k: 954
# against 999 us, FlashInfer 959), at 1k-2k within -5..+3 %; at 768 programs (6 per SM) +1.1 %
# (32/8) and -1.6..-1.9 % (64/8), so from DEEP_PAGED_MIN_PER_SM (7-8 per SM: 793-1056 programs on
# 132 SMs); at 2048 programs 3.8-4.5 % slower. No H100 sweep of it at these sizes (seventh
# session: 0.9-2.5 % slower there).
DEEP_PAGED_CONFIG = (64, 2, 7)
DEEP_PAGED_MIN_STREAM_SCALE = 1.1
DEEP_PAGED_MIN_TOKENS = 4096
DEEP_PAGED_MIN_PER_SM = 7
DEEP_PAGED_MAX_PER_SM = 8
# Longer paged splits (> 8192 tokens) on such a GPU, 640-4096 programs (H200 sweeps,
# bench/results/decode-s35-configs-h200/; FlashInfer led the grid there by 1.5-3.5 %): against
# the 128-token tile of five stages, the deep 64-token tile ran 1.1 % faster at 1024 programs
# (8 per SM), 2.3 % at 768 (6 per SM: not taken, as above) and 12 % slower at 640 (two resident:
# a third round of a few programs); the 128-token tile of seven stages 2.9-3.8 % faster at
# 2048-4096 programs (16-31 per SM), 0.3-2.6 % slower at 640-1024. Between 8 and 16 programs per
# SM: not measured, the five stages.
DEEP_LONG_CONFIG = (128, 4, 7)
DEEP_LONG_MIN_PER_SM = 16


def _deep_paged(long: bool, tokens_per_split: int, per_sm: int, head_dim: int, elt_bytes: int,
                smem_limit: int, stream_scale: float):
    """The deeper paged tile for a grid of ``per_sm`` programs per SM (DEEP_PAGED_*, DEEP_LONG_*;
    ``long``: splits past the mid rule's 8192 tokens), or None: a GPU of at most
    DEEP_PAGED_MIN_STREAM_SCALE, another grid, or a tile the device's shared memory holds fewer
    of than the rule counts (two of the 64-token form, one of the 128-token one)."""
    if stream_scale < DEEP_PAGED_MIN_STREAM_SCALE:
        return None
    if DEEP_PAGED_MIN_PER_SM <= per_sm <= DEEP_PAGED_MAX_PER_SM and tokens_per_split >= DEEP_PAGED_MIN_TOKENS:
        pick, need = DEEP_PAGED_CONFIG, 2
    elif long and per_sm >= DEEP_LONG_MIN_PER_SM:
        pick, need = DEEP_LONG_CONFIG, 1
    else:
        return None
    return pick if _smem_resident(pick, head_dim, elt_bytes, True, smem_limit) >= need else None

# Registers per thread of the 2-warp tiles with the fused combine (COMBINE=2: the last split's
# program merges): sm_90 compiles of the d128 bf16 kernel took 184 (contiguous, 32-token tiles)
# and 190 (paged) against 128-139 without it, 255 for the 64-token paged tile (192 without). An
# NVIDIA SM's register file is four 16K-register quarters, each warp's registers in one of them
# (allocated per warp in 256-register units), so at 190 a quarter holds two warps and an SM four
# 2-warp programs where shared memory alone would hold five. Measured (H100, pages of 16, 32/8
# heads, batch 17-24 x 4k-32k, bench/results/decode-s34-past1wave/): 544-640 programs of the
# 32-token paged tile in 3-4 splits (fused) ran 1.17-1.29x as long as the best other split count,
# as a second round of a few programs would. Counted for head tiles of 128 (d 65-128, as
# measured); smaller heads take fewer registers and were not compiled for it.
FUSED_COMBINE_REGISTERS = 192
SM_REGISTER_QUARTERS, QUARTER_REGISTERS = 4, 16384


def _resident(pick: tuple, head_dim: int, elt_bytes: int, paged: bool, smem_limit: int, fused: bool = False) -> int:
    """Programs of config ``pick`` (BLOCK_N, warps, stages) one SM holds at once, by shared memory
    (_smem_resident) and, for a 2-warp tile with the fused combine, by registers (FUSED_COMBINE_REGISTERS); at
    least one."""
    n = max(1, _smem_resident(pick, head_dim, elt_bytes, paged, smem_limit))
    if fused and pick[1] == 2 and int(max(16, _pow2_at_least(head_dim))) == 128:
        per_warp = -(-FUSED_COMBINE_REGISTERS * 32 // 256) * 256
        n = min(n, max(1, SM_REGISTER_QUARTERS * (QUARTER_REGISTERS // per_warp) // pick[1]))
    return n


def _smem_resident(pick: tuple, head_dim: int, elt_bytes: int, paged: bool, smem_limit: int) -> int:
    """Programs of config ``pick`` that an SM's shared memory holds (0: not even one): the K/V
    tiles plus about 8 KB of the kernel's own (sm_90 compiles of the d128 bf16 kernel measured
    5.4-8 KB above _kv_bytes); an SM's shared memory is about the per-block limit + 1 KB."""
    cfg = dict(BLOCK_N=pick[0], num_warps=pick[1], num_stages=pick[2])
    return (smem_limit + 1024) // (_kv_bytes(cfg, head_dim, elt_bytes, paged) + 8192)


def _kv_bytes(cfg: dict, head_dim: int, elt_bytes: int, paged: bool) -> int:
    """Shared memory of a config's K/V tiles in flight (head dim padded as the kernel pads it)."""
    block_d = max(16, _pow2_at_least(head_dim))
    return 2 * cfg["BLOCK_N"] * block_d * elt_bytes * _kv_buffers(cfg["num_stages"], paged)


# On the interpreter (CPU tests) one small config keeps the runs short.
INTERPRET_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
# The fallback of fixed_config (no program count or split length, shapes outside its rules, tiles
# too big for the device's shared memory).
DEFAULT_GPU_CONFIG = {False: dict(BLOCK_N=64, num_warps=4, num_stages=3),  # contiguous
                      True: dict(BLOCK_N=64, num_warps=4, num_stages=5)}  # paged
