"""Flash Decode: one query token per sequence, split-KV, log-sum-exp combine.

Decode reads the whole KV cache to produce one output row per query head, so it is bound by
memory bandwidth. The plan, top to bottom:

1. Work items are (batch, kv_head, split). One program reads a contiguous chunk of its
   sequence's K/V exactly once and serves all G = heads / kv_heads query heads of that KV head
   (G is padded up to 16 rows so the scores and the P @ V product use ``tl.dot``; the padding is
   free since the tensor cores are idle in decode anyway, and ``tl.dot`` operands are what
   Triton's software pipeliner streams through shared memory with async copies).
2. A program id becomes a work item through the mapping policy (``MAPPING``, one constexpr;
   ``numasched.mappings.jit.decode_item``), so every policy runs with this one kernel.
3. Each split keeps an online softmax (running max ``m``, running sum ``l``, accumulator) in the
   log2 domain, and writes a normalised partial output plus its log2-sum-exp.
4. The partials are merged by a log-sum-exp combine: either a second small kernel, or inside the
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

LN2 = tl.constexpr(_LN2)


# ----------------------------------------------------------------------------- combine helper
@triton.jit
def _combine_heads(PO, PL, O, LSE, b, h0, H, S, stride_ob, stride_oh, stride_lb, stride_lh,
                   NH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                   CACHE: tl.constexpr):
    """Merge the S partials of query heads h0 .. h0+NH-1 of batch b into O (q dtype) and LSE (natural log).

    Partial s of head h (row (b*H + h)*S + s of the (B, H, S, D) buffer) holds o_s, already divided
    by its own softmax sum, and lse2_s, its log-sum-exp of the scores in base 2. The merge is
    out = sum_s 2^(lse2_s - M) o_s / sum_s 2^(lse2_s - M), M = max_s lse2_s, done online over chunks
    of BLOCK_S splits: with S <= BLOCK_S (the usual case) it is one vector load of all partials.
    Empty splits have lse2 = -inf and weigh nothing; an empty sequence gives zeros, lse = -inf.
    """
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    for i in tl.static_range(NH):
        h = h0 + i
        row0 = (b.to(tl.int64) * H + h) * S
        m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            smask = (s0 + offs_s) < S
            ls = tl.load(PL + row0 + s0 + offs_s, mask=smask, other=float("-inf"), cache_modifier=CACHE)
            o = tl.load(PO + (row0 + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=smask[:, None] & dmask[None, :], other=0.0, cache_modifier=CACHE)
            m_new = tl.maximum(m, tl.max(ls, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: avoid -inf - -inf
            alpha = tl.math.exp2(m - m_safe)
            w = tl.math.exp2(ls - m_safe)
            den = den * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            m = m_new
        nonempty = den > 0
        den_safe = tl.where(nonempty, den, 1.0)
        lse = tl.where(nonempty, (m + tl.math.log2(den_safe)) * LN2, float("-inf"))
        tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, (acc / den_safe).to(O.dtype.element_ty),
                 mask=dmask)
        tl.store(LSE + b.to(tl.int64) * stride_lb + h * stride_lh, lse)


# ----------------------------------------------------------------------------- split kernel
@triton.jit
def _flash_decode_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O, LSE, PO, PL, COUNTER,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    B, HK, S, seqlen_max, num_pages,
    stride_qb, stride_qh,
    stride_kb, stride_kn, stride_kh,  # contiguous: batch, token, head; paged: page, slot, head
    stride_vb, stride_vn, stride_vh,
    stride_sb, stride_tb, stride_tp,
    stride_ob, stride_oh, stride_lb, stride_lh,
    tune_key,  # unused in the kernel: tokens-per-split bucket and layout, so autotune re-tunes per class
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # 0: contiguous cache
    HAS_SEQLENS: tl.constexpr,
    COMBINE: tl.constexpr,  # 0: one split, write O directly; 1: partials for the combine kernel; 2: fused
    INT64: tl.constexpr, INPUT_PRECISION: tl.constexpr, COMBINE_BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    MAPPING: tl.constexpr,
):
    # -- which (batch, kv_head, split) this program owns: the policy decides
    b, kvh, split = decode_item(tl.program_id(0), B, HK, S, MAPPING)

    # -- this split's token range: the sequence is cut into S near-equal chunks (balanced per
    #    sequence; a chunk need not be a multiple of BLOCK_N, its last tile is masked)
    if HAS_SEQLENS:
        # bounded: a length outside [0, capacity] reads no memory beyond the cache
        seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b * stride_sb), 0), seqlen_max)
    else:
        seqlen = seqlen_max
    chunk = tl.cdiv(seqlen, S)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)

    # -- the G query heads of this KV head, padded to BLOCK_G rows
    q_ptrs = Q + b64 * stride_qb + (kvh * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        q = tl.load(q_ptrs, mask=gmask[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=gmask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

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

    for start in range(lo, hi, BLOCK_N):
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
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        # -- online softmax: every tile has at least one valid column, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(nonempty, m_i + tl.math.log2(l_safe), float("-inf"))
    omask = gmask[:, None] & (offs_d[None, :] < HEAD_DIM)

    if COMBINE == 0:
        # one split: this is the answer
        heads = kvh * G + offs_g
        tl.store(O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=omask)
        tl.store(LSE + b64 * stride_lb + heads * stride_lh, lse2 * LN2, mask=gmask)
    else:
        # partials (B, H, S, D) and (B, H, S), fp32, contiguous: a head's splits are adjacent rows
        rows = (b64 * (HK * G) + kvh * G + offs_g) * S + split
        tl.store(PO + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=omask)
        tl.store(PL + rows, lse2, mask=gmask)
        if COMBINE == 2:
            # The last split of (b, kvh) to arrive merges all of them. The barrier orders every
            # thread's partial stores before the release of the arrival; the reads use .cg
            # (L2, not this SM's L1) so they see the other programs' partials.
            tl.debug_barrier()
            ctr = COUNTER + b64 * HK + kvh
            arrived = tl.atomic_add(ctr, 1, sem="acq_rel")
            if arrived == S - 1:
                _combine_heads(PO, PL, O, LSE, b, kvh * G, HK * G, S, stride_ob, stride_oh, stride_lb, stride_lh,
                               G, HEAD_DIM, BLOCK_D, COMBINE_BLOCK_S, ".cg")
                tl.atomic_xchg(ctr, 0)  # ready for the next launch (and CUDA graph replays)


@triton.jit
def _combine_kernel(PO, PL, O, LSE, H, S, stride_ob, stride_oh, stride_lb, stride_lh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # one program per (batch, query head)
    pid = tl.program_id(0)
    _combine_heads(PO, PL, O, LSE, pid // H, pid % H, H, S, stride_ob, stride_oh, stride_lb, stride_lh,
                   1, HEAD_DIM, BLOCK_D, BLOCK_S, "")


# ----------------------------------------------------------------------------- configs
# (BLOCK_N, num_warps, num_stages). Triton's pipeliner keeps num_stages - 1 K/V tiles in flight for
# the contiguous cache, but only (num_stages - 1) // 2 for the paged one (the block-table load
# takes a stage of its own ahead of the K/V loads it addresses, checked by compiling for sm_90),
# so paged configs use more stages.
# Small tiles with 2 warps give more independent programs per SM (fewer cross-warp reductions per
# byte); large tiles with 8 warps move more bytes per iteration. The autotuner picks per shape.
_CONTIGUOUS_CONFIGS = [(32, 2, 4), (64, 2, 3), (32, 4, 4), (64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 4),
                       (128, 4, 3), (128, 8, 3), (128, 8, 4)]
_PAGED_CONFIGS = [(32, 2, 5), (64, 2, 5), (32, 4, 5), (32, 4, 7), (64, 4, 5), (64, 4, 7), (64, 8, 5),
                  (128, 4, 5), (128, 8, 5)]
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


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs of this cache kind whose K/V tiles fit in shared memory (and, for long
    splits, have 128-token tiles)."""
    paged = kwargs.get("PAGE_SIZE", 0) > 0
    wanted = set(_PAGED_CONFIGS if paged else _CONTIGUOUS_CONFIGS)
    block_d = kwargs.get("BLOCK_D", 128)
    elt = named_args["K"].element_size()
    kept = [c for c in configs
            if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted
            and 2 * c.kwargs["BLOCK_N"] * block_d * elt * _kv_buffers(c.num_stages, paged) <= SMEM_LIMIT]
    if int(named_args.get("tune_key", 0)) // 2 >= LONG_SPLIT_BUCKET:
        kept = [c for c in kept if c.kwargs["BLOCK_N"] == LONG_SPLIT_BLOCK_N] or kept  # d256: none fit
    if caps.is_hip():  # LDS of an AMD block (gfx942: 64 KiB)
        kept = [c for c in kept if c.num_stages <= caps.AMD_MAX_STAGES["decode"]]
    if not kept:  # head dim 256 in fp32: the smallest tile
        kept = [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages))]
    return kept


_flash_decode_tuned = triton.autotune(
    configs=_GPU_CONFIGS,
    # COMBINE and G only change the prologue/epilogue: the tuned config is shared (fewer compiles)
    key=["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "INT64", "tune_key"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_flash_decode_kernel)

# Tuning buckets of tokens per split (the autotuner's ``tune_key`` argument).
def tune_bucket(tokens_per_split: int) -> int:
    """Coarse bucket of tokens per split (best BLOCK_N / stages differ for short and long splits)."""
    return min(4, max(0, (max(tokens_per_split, 1) - 1).bit_length() - 8) // 2)


# The combine reads partials in chunks of this many splits (two sizes only: each compiles apart).
COMBINE_MAX_BLOCK_S = 64


def combine_block_s(splits: int) -> int:
    return 16 if splits <= 16 else COMBINE_MAX_BLOCK_S


def fixed_config(paged: bool, head_dim: int) -> dict:
    """The config used without autotuning (and during graph capture before a shape was tuned)."""
    cfg = dict(DEFAULT_GPU_CONFIG[paged])
    if head_dim > 128:  # keep the K/V tiles within shared memory
        cfg["BLOCK_N"] = 32
    cfg["num_stages"] = caps.cap_stages("decode", cfg["num_stages"])
    return cfg


# On the interpreter (CPU tests) one small config keeps the runs short.
INTERPRET_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
# Fixed GPU configs: used when autotuning is off (NUMASCHED_AUTOTUNE=0; GPU tests, to keep compiles
# few), and while a CUDA graph is being captured before this key was tuned (autotuning launches
# and synchronises, which capture forbids).
DEFAULT_GPU_CONFIG = {False: dict(BLOCK_N=64, num_warps=4, num_stages=3),  # contiguous
                      True: dict(BLOCK_N=64, num_warps=4, num_stages=5)}  # paged
