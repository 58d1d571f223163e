"""Decode attention (one query token, or a few, per sequence) over a KV cache: check, plan, run.

    out = numasched.flash_decode(q, k_cache, v_cache, cache_seqlens=lens)                  # one call
    out = numasched.flash_decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=bt)  # paged

    plan = numasched.plan_decode(q, k_cache, v_cache, cache_seqlens=lens)   # once per batch layout
    out = plan.run(q, k_cache, v_cache, cache_seqlens=lens)                  # every step (graph-safe)

Layouts follow FlashAttention's ``flash_attn_with_kvcache`` and vLLM:

* q: (batch, heads, head_dim); out has q's shape and dtype; lse (batch, heads) fp32, natural log.
* multi-token decode (speculative decoding: several new tokens per sequence, already written to
  the cache and counted in cache_seqlens): q (batch, q_len, heads, head_dim) with
  1 <= q_len <= 16; out (batch, q_len, heads, head_dim) contiguous, lse (batch, q_len, heads).
  Causal, bottom-right aligned as ``flash_attn_with_kvcache(causal=True)``: query token i sees
  the cache positions < len - q_len + i + 1 (len: the sequence's cache_seqlens, or the
  capacity); a token that sees no position gets zeros and lse = -inf. q_len 1 gives the 3-D
  result.
* contiguous cache: k_cache, v_cache (batch, max_len, kv_heads, head_dim); any strides with a
  unit-stride last dimension (so ``k.transpose(1, 2)`` of a (B, H, S, D) tensor works as is).
* paged cache: (num_pages, page_size, kv_heads, head_dim) with ``block_table`` int32
  (batch, max_pages): token t of sequence b is slot t % page_size of page
  block_table[b, t // page_size]. Unused slots may hold anything (-1 is usual).
* cache_seqlens: int32 (batch,) (or an int), the number of valid tokens per sequence; default
  the whole cache. A sequence of length 0 gives zeros and lse = -inf.

The plan holds what depends only on the inputs' signatures (shapes, strides, dtypes, device,
alignment) and the process state (topology, mappings, options): the split count, the policy, the
kernel config and grid, the workspace. ``run`` launches (the compiled kernel directly, after the
first call). Checks that read tensor data (block-table range, lengths within the cache) run when
``options.check_data`` is on, outside graph capture; they synchronise with the GPU. With them off,
the kernel bounds every index it reads, so bad metadata gives wrong rows, never a crash.

The one-call form is the torch custom op ``numasched::flash_decode`` under torch.compile, for fake
or subclass tensors, inside dispatch modes and when autograd records; a plain eager call skips the
op dispatcher.
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
from ._plan import _REG, PLANS, Plan, fast_signature, grow_only, scratch, signature
from ._launch import HostDesc, TensorDescriptor
from ._route import mapping_token, plain_eager, refuse_grad, warn_once
from ._validate import check_bool, check_config, check_no_overlap, check_positive_int, check_same, check_tensor

__all__ = ["flash_decode", "plan_decode", "check_decode", "DecodePlan", "DecodeShape", "choose_num_splits"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
MAX_QUERY_TOKENS = 16  # query tokens per sequence of a 4-D q (multi-token decode)
INT32_MAX = caps.INT32_MAX
# Caches spanning more elements than this get int64 row offsets (a test lowers it to cover that path).
INT64_THRESHOLD = INT32_MAX


@dataclass(frozen=True)
class DecodeShape:
    """The sizes a decode call implies (from :func:`check_decode`)."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int  # 0: contiguous cache
    capacity: int  # tokens a sequence can hold
    num_pages: int
    q_len: int = 1  # query tokens per sequence
    q_4d: bool = False  # q is (batch, q_len, heads, head_dim)

    @property
    def out_shape(self) -> tuple:
        return ((self.batch, self.q_len, self.heads, self.head_dim) if self.q_4d
                else (self.batch, self.heads, self.head_dim))

    @property
    def lse_shape(self) -> tuple:
        return (self.batch, self.q_len, self.heads) if self.q_4d else (self.batch, self.heads)


# ----------------------------------------------------------------------------- checks
def check_decode(q, k_cache, v_cache, cache_seqlens=None, block_table=None, scale=None, num_splits=None,
                 mapping="auto") -> DecodeShape:
    """Check a decode call's arguments without reading tensor data (works on fake and meta tensors);
    returns the sizes. Errors name the argument: TypeError for a wrong type, ValueError for a wrong
    value or shape."""
    check_tensor("q", q, dtypes=DTYPES, contiguous_last=True)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must have 3 dimensions (batch, heads, head_dim) or 4 (batch, q_len, heads, head_dim), "
                         f"got shape {tuple(q.shape)}")
    q_4d = q.dim() == 4
    if q_4d:
        B, Sq, H, D = q.shape
        if not 1 <= Sq <= MAX_QUERY_TOKENS:
            raise ValueError(f"q has {Sq} query tokens per sequence (shape {tuple(q.shape)}); multi-token decode "
                             f"takes 1 to {MAX_QUERY_TOKENS} (use numasched.attention_forward for more)")
    else:
        (B, H, D), Sq = q.shape, 1
    dev = q.device
    check_tensor("k_cache", k_cache, ndim=4, contiguous_last=True)
    check_tensor("v_cache", v_cache, ndim=4, contiguous_last=True)
    check_same("q", q, "k_cache", k_cache)
    check_same("q", q, "v_cache", v_cache)
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
        if page_size < 1 or block_table.shape[1] < 1 or num_pages < 1:
            raise ValueError(f"paged cache needs num_pages, page_size and block_table.shape[1] >= 1, got k_cache "
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
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    check_positive_int("num_splits", num_splits)
    mapping_token(mapping, "decode")  # type, name and kind of the mapping
    return DecodeShape(B, H, HK, D, page_size, capacity, num_pages, Sq, q_4d)


def check_decode_data(shape: DecodeShape, cache_seqlens, block_table) -> None:
    """Range checks that read tensor data (one device sync)."""
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
                             f"{shape.num_pages}) (k_cache.shape[0]); with options check_data=False the kernel "
                             f"would clamp it and return a wrong row for sequence {b}")


# ----------------------------------------------------------------------------- splits
# Waves: programs the GPU runs at once, in units of SMs. Measured on an H200 (bf16, d128, GQA 32/8,
# batch 1, split sweep in bench/results/decode-sweep-h200-2026-11-22.csv): one program per SM is
# best at every context from 1k to 128k (16 splits: 13.4 / 23.7 / 52.1 / 141 us at 1k / 8k / 32k /
# 128k, against 20.1 / 28.9 / 57.8 / 149 us with 64 splits and 52 / 55 / 91 / 178 us with 256):
# extra programs per SM add partials and combine work without adding bandwidth.
# Tried and reverted (2026-11-23): two programs per SM where the pairs nearly fill the GPU and
# splits stay >= 2048 tokens. With fixed configs it won at 16 x 8k (paged 16: 140 vs 174 us at
# 32/8 heads), but in the autotuned decoder it did not (Llama-3-8B TP 2, 16 x 8k: 5.50 vs 5.30 ms
# per step; bench/results/e2e-llama3-8b-longsplits-tried-*).
PROGRAMS_PER_SM = 1
# Cost of starting a program, in tokens of streaming (first-load latency, partial write).
PROGRAM_OVERHEAD_TOKENS = 128
# A split decode also pays once for its merge (the partials' stores, the ticket, the last program's
# loads: the combine's latency), in tokens of streaming. Fitted to an H200 sweep of splits 1/2/4/8
# at batch 2-32 x 512/1024 tokens for 32/8, 64/8, 28/4 and 32/32 heads, contiguous and paged
# (bench/results/decode-s10-shortsplits/): 64 (batch, kv_head) pairs x 512 tokens ran 13.6-13.8 us
# in one split against 15.4-16.1 in two (cuDNN 13.6-13.9); with this term the pick is within 3 %
# of the sweep's best at 102 of 120 points (90 without), worst 1.11x (1.18x). It moves 10 picks
# of the grid and the off-grid batches, all to one split at 512-2048 tokens.
# Refit to 384 with an H100 sweep of the same kind (splits 1/2/4/8, batch 1-32 x 512/1024, four
# head configs, both contiguous layouts; bench/results/decode-s32/): at 32 pairs x 512 tokens
# (32/8 and 64/8 at batch 4, 28/4 at 8, 32/32 at 1: the grid's slowest points against cuDNN,
# 0.93-0.96) one split ran 13.5-13.6 us against 13.8-14.3 in four (cuDNN 13.3-13.5; eight
# splits within 1.5 % of one either way). On the H200 sweep one split was 0.2-3 % faster than
# four there, and eight another 1-4 % faster (not taken: no single merge term picks eight there
# without moving points the sweeps have faster as they are). Picks within 3 % of the sweep's
# best: H100 60 -> 66 of 72, H200 49 -> 51 of 60; no other pick of the grid moves. A paged
# cache keeps 256 (PAGED_SPLIT_MERGE_TOKENS): there one split of 512 tokens was 1.5-3 % slower
# than four on the H200 (pages of 16, the same three head configs; eight 4-10 % faster than
# four, not taken either).
SPLIT_MERGE_TOKENS = 384
PAGED_SPLIT_MERGE_TOKENS = 256
# HBM serves about this many programs per SM streaming at a program's full rate: more programs
# (splits) then add merge work and no bandwidth. An H100 sweep at 64 (batch, kv_head) pairs x 1k-8k
# tokens (bench/results/decode-s32-64pairs/: 32/8 and 64/8 at batch 8, 28/4 at 16): one split ran
# 1-10 % faster than the rule's two at 23 of 24 points (e.g. 22.9-23.9 against 24.5-25.3 us at
# 1k, 103-107 against 105-108 at 8k), three and four splits slower still; the H200's sweep agrees
# at 1k (contiguous 3-7 %, paged within 1 %). So the token cost of any split count is at least the
# pairs' tokens spread over that many streams -- from FLOOR_MIN_PAIRS_PER_SM pairs per SM (64 pairs
# on 132 SMs, the fewest measured) up. Below, the chain cost alone decides, as measured: at 8-32
# pairs x 8k-128k (bench/results/decode-s32-long/) the floor would have taken 10 splits at 1 x
# 32k (32/8), and 12 ran 4.6 % slower than the 16 picked; pair counts between 32 and 64 were not
# measured. Picks within 3 % of the sweeps' best: H100 73 -> 88 of 88, H200 80 -> 86 of 90.
STREAMS_PER_SM = 0.5
FLOOR_MIN_PAIRS_PER_SM = 0.48
# ... on the H100's memory per SM. A GPU with more bandwidth per SM needs more streams to fill it
# (a program's rate is its bytes in flight over the latency, which does not grow with it): the
# floor's streams grow by STREAMS_BW_GAIN of the excess (stream_scale). On an H200 (4.3 against
# 3.0 TB/s on 132 SMs: 1.22x the streams at the gain of 0.5 below, 1.43x at the full gain that
# replaced it) the H100's constant kept one split for 64 pairs x 4k
# tokens, 52.6-60.1 us against 47.8-49.8 in two (the H200 grid, bench/results/decode-s34-grid-h200/,
# beside the seventh session's H200 grid in two splits; cuDNN and FlashInfer within 0.5 % in both);
# with it two from 2k (one split 1.00-1.04x of two at 2k; at 1k 0.94x, where a contiguous cache
# keeps one, and 0.98x for a paged one, which takes two there).
# Gains from 0.46 to 0.69 pick the same on every H200 sweep and grid point recorded (the H200
# split sweep, decode-s10-shortsplits/: within 3 % of the best at 117 of 120 either way); the
# full gain (1.43x) took two splits at 1k (6 % slower). GPUs with less bandwidth per SM (the
# MI300X's CUs by the datasheet) keep the H100's constant: nothing was measured there.
# Refit to the full gain (1.0: the streams grow with the bandwidth per SM, as the rate argument
# above has it) on H200 sweeps timed after a *read* L2 flush (bench decode --flush read, the
# fifty-second session, bench/results/decode-s52/sweep/). Every earlier sweep was timed after
# triton's do_bench flush, which writes 256 MB: the call then starts with an L2 (60 MiB) of dirty
# lines to write back (about 9 us of every contender's time at >= 134 MB of K/V, decode-s52/flush-*),
# and in that window extra streams bought nothing. After a read flush, 64 pairs x 1k ran 17.1-17.6
# us in two splits against 18.2-19.6 in one (three head configs, both layouts; cuDNN 18.6-18.9),
# and at 72-144 pairs x 1.5k-8k (32/8, off the grid) the full gain's picks are within 3 % of the
# best at 44 of 50 points (0.5: 25 of 50, worst 1.113 -> 1.070). On the earlier sweeps it stays
# within 3 % at 815 of 855 points (829 with 0.5): their 64 pairs x 1k points had one split 3-6 %
# ahead under the written flush.
STREAMS_BW_GAIN = 1.0
# ... but the memory's full rate needs (nearly) every SM streaming: where the floor applies, it
# grows by IDLE_SM_COST per unit of the waves' mean idle fraction (1 - programs / (waves * SMs)).
# An H100 sweep at 96 pairs x 16k-32k (bench/results/decode-s33-sweep/, decode-s33-pairs/: 32/8 at
# batch 12) ran one split (96 programs, 2.91 TB/s) 5-7 % slower than four or eight (2.9 and 5.8
# waves, 3.0 TB/s; cuDNN 3.04), while 128 pairs in one split reach cuDNN's rate (the grid,
# decode-s33-grid/); and at 64 pairs a paged cache's one split (48 % of the SMs) ran 6-8 % slower
# than two to four at 8k (FlashInfer 3-4 % ahead), where a contiguous one is within 2 % either way.
# Picks within 3 % of the sweeps' best: 374 -> 380 of 400 (H200 + H100). Checked afterwards on
# sweeps it was not fitted to (decode-s33-check/: 80, 96 and 112 pairs x 8k-32k, three head
# configs; decode-s33-64pairs/: the grid's 64-pair points it moved): 30 -> 38 of 45 and paged
# 64 pairs x 8k at 1.012-1.034 of FlashInfer (one split: 0.952-0.983); the contiguous 64-pair
# points it moved to two splits ran 0.998-1.026 of cuDNN (one split 0.996-1.053). Not captured:
# 80 pairs, where one split was best and the term takes three (2-4 % slower, contiguous), and
# 112 pairs, where eight beat one by 2-4 %.
IDLE_SM_COST = 0.15
# A paged cache's programs stream better two to an SM (their page-table loads hide behind the other
# program's), so between PAGED_FILL_MIN_PAIRS_PER_SM and PAGED_FILL_MAX_PAIRS_PER_SM pairs per SM (32-66
# pairs on 132 SMs) it takes at least the most splits, a power of two, that keep the grid within
# PAGED_PROGRAMS_PER_SM programs per SM. Sweeps: at 32 pairs eight splits ran 1-10 % faster than the
# rule's four (H200, 512-1024 tokens, pages of 16: bench/results/decode-s10-shortsplits/; H100, 2k-32k,
# pages of 16 and 64: decode-s33-sweep/; within 0.1 % at 32k), at 40 pairs four 1-5 % faster than
# three, at 48 pairs x 2k four 1-2 % faster than two. Picks within 3 % of the sweeps' best 450 ->
# 461 of 477, worst 1.10 -> 1.05; no sweep's paged point slower by more than 0.4 %. Below 32
# pairs (16 pairs x 1k: sixteen splits, never timed) and for a contiguous cache (four and eight
# within 3 % either way at 32 pairs) the cost model alone decides.
# Where the GPU has more bandwidth per SM than the H100 (stream_scale > 1) and the cache holds
# PAGED_FILL_WIDE_MIN_TOKENS to PAGED_FILL_WIDE_MAX_TOKENS, the range's top is
# PAGED_FILL_MAX_PAIRS_PER_SM (64 pairs on 132 SMs in it), else just under FLOOR_MIN_PAIRS_PER_SM:
# at 64 pairs on an H200 (pages of 16 and 64, bench/results/decode-s55/p64pairs-*/ and
# tp2-sweep/: 32/8 x 8 at 2k-32k, 28/4 x 16 at 2k-8k, 16/4 x 16 at 32k) four splits ran 0.7-4.4 %
# faster than the cost model's two at every point (geomean against FlashInfer 1.041-1.094 ->
# 1.076-1.138), where on an H100 one split was the fastest at 2k-4k (decode-s33-64pairs/) and on
# an H200 at 1k one to three splits ran within 1.5 % (decode-s52/sweep/; four not timed). Not for
# the decoder's calls (``prefetch``): 256 programs leave the K/V prefetch out, and two H200s ran the
# TP 2 step at 16 x 32k (64 pairs a rank, pages of 16) in 10.92 ms with four splits against
# 10.60 with two (tp2-s55/final/, wf2/). Nor past PAGED_FILL_WIDE_MAX_TOKENS: the grid's 64-pair
# points in four splits (decode-s56/p64-*/, 2k-128k, four head configs, pages of 16 and 64) ran
# 0.8-6.2 % faster than the fifty-fourth session's two at 2k-4k, -0.6 to +2.0 % at 8k, within
# 1.9 % either way at 16k-32k (all 1.007-1.038x FlashInfer), and 0.7-2.2 % slower at 128k in six
# of eight (splits of 32k tokens; 0.993-1.011x FlashInfer); side by side at 16/4 x 16 (64 pairs,
# decode-s56/p64-64k/) two splits ran as fast as four or 0.6-1.1 % faster at 64k and 128k.
PAGED_FILL_MIN_PAIRS_PER_SM = 0.24
PAGED_FILL_MAX_PAIRS_PER_SM = 0.5
PAGED_FILL_WIDE_MIN_TOKENS = 2048
PAGED_FILL_WIDE_MAX_TOKENS = 32768
PAGED_PROGRAMS_PER_SM = 2
# Past one wave: a contiguous cache of more pairs than SMs in one split puts two programs on some
# SMs (co-resident) and one on the others, and the SMs with two set the time. Measured on an H100
# (32/8 heads at batch 17-31, 28/4 at 40-56: 136-248 pairs x 4k-32k, splits 1-6;
# bench/results/decode-s34-past1wave/, decode-s34-past1wave-b/): one split ran up to 8.5 % slower
# than the best (192 pairs x 16k-32k: 1146 against 1056 us), and four splits of at least
# PAST_WAVE_MIN_SPLIT_TOKENS (one 128-token program per SM at a time, 4-8 waves the block
# scheduler evens out) were within 1.5 % of the best at 8k-32k wherever more than
# PAST_WAVE_MIN_SHORT of the SMs hold one program fewer (up to 240 pairs on 132 SMs; at 248 one and
# four splits were within 2.5 % of each other). Shorter splits (4k tokens) ran 4-9 % slower in four
# than in one. Picks within 3 % of the best over the 170 swept points past one wave 146 -> 165;
# no point of the grid moves (its pair counts are 128 and 256 there). A paged cache keeps
# the cost model's pick (four splits ranged 0.99-1.06x of one). No AMD GPU was measured.
# The minimum split length grows with stream_scale, as the floor's streams do: on an H200
# (bench/results/decode-s35-past1wave-h200/: 160-224 pairs x 8k-32k, splits 1-6) four splits of
# 2048 tokens ran 1.00-1.05x the time of one (24 x 8k: 203 against 194 us), four of 4096 and 8192
# within 0.2 % of the best; with the scaled length (2492 tokens there) the 8k points keep one.
PAST_WAVE_SPLITS = 4
PAST_WAVE_MIN_SPLIT_TOKENS = 2048
PAST_WAVE_MIN_SHORT = 0.125
# Splits as short as one 64-token block still pay off when they fill the GPU (batch 1 x 1k: 16
# splits of 64 tokens, 13.4 us, against 16.7 us with 4 splits of 256).
MIN_SPLIT_TOKENS = 64
# A program streams its split in tiles of this many tokens (the fixed configs' BLOCK_N): the split
# model charges whole tiles.
SPLIT_TILE_TOKENS = 64
# Automatic splits: up to 256, so that a single (batch, kv_head) pair still fills a GPU of up to
# 256 SMs/CUs (MI300X has 304 CUs: nearly). An explicit num_splits may be larger.
MAX_SPLITS = 256
# The fused combine (the last split's program merges) pays while the merge is short: its merge is
# the kernel's tail, one program's serial loads, where the combine kernel spreads the merge over
# one program per head and, with PDL, launches while the split kernel runs. Measured on an H200
# (bf16, d128, the 246-point decode grid x three layouts, CUDA graphs, fused against kernel in one
# run; bench/results/decode-grid-*-h200-2026-11-23.csv): kernel / fused time 0.99-1.02 (geomean
# per split count and group size) with 2-4 splits, 0.97-0.98 with 8, 0.91-0.99 with 16 and 0.84
# (worst 0.735) with 32 splits of 7 heads.
FUSED_MAX_SPLITS = 4
# options.decode_prefetch applies only to calls made with prefetch=True (numasched's decoder, where
# the RoPE + cache write runs before): standalone, after a kernel that uses the bus (the bench's
# flush read, another decode), it made 128-program calls 1.1-1.6 us slower on an H200 (32/8 and
# 28/4, batch 16-32 x 1k-4k: 0.94-0.99 of cuDNN with it, 1.00-1.05 without; decode-s53/pf/).
# It applies from this batch up. Llama-3-8B TP 2 decode step on two H100s,
# 128 tokens, each setting in two launches (bench/results/tp2-s20d/): batch 16 25-67 us a step
# faster (2k-32k), batch 4 between 4 us faster and 9 slower, batch 1 11-33 us slower: the RoPE +
# cache write before the attention gives the prefetch its idle bus for longer the more tokens it
# writes, and at batch 1 the prefetch's dependent loads (length, page indices) fall on the
# critical path. And only while the grid is one program per SM at most: back to back
# (flash_decode after flash_decode, the issue-12 grid on an H100, bench/results/decode-s21-tma/)
# the prefetch cost 3-4.6 % at 1024 programs (128 x 512 32/8, 32 x 512 32/32), 1-2 % at 1024
# programs of 2k tokens and 0.7-0.9 % at 256 (32 x 512 32/8), nothing measurable with 32k tokens
# and more; every measured gain (the TP 2 step at batch 16) had 128 programs on 132 SMs.
PREFETCH_MIN_BATCH = 16
# ... and only where the prefetch is at most this fraction of a program's chunk (128 tokens: splits
# of 1024 tokens and more). flash_decode after flash_decode (H100, 16-32 x 512, 128 programs,
# bench/results/decode-s21-prefetch/) ran 4-9 % slower with it on chunks of 512 tokens, 0.4-1.2 %
# on 2048, the same from 8k; the TP 2 step's gain at 16 x 2k had chunks of 1024.
PREFETCH_CHUNK_RATIO = 8


# PDL trigger (options.pdl_trigger "late", the default): the split kernel lets the next kernel
# launch after its K/V loop (kernels/flash_decode.py) where the call reads at least this many
# bytes of K and V, else at its start. Side by side on an H200 (bench/results/decode-s36-pdl/, 75
# rows of batch 1-128 x 512-32k, graph replays): the early trigger ran 2-3 % faster at batch 1 x
# 512-2k (10-13 us), the late one 1 % faster at 1 x 32k and 4 % at 32/8 32 x 32k back to back
# (986 against 945 us without PDL: the next call's programs, placed early, piled up unevenly);
# elsewhere within 0.5 %. The plan counts the cache's capacity (it is made per layout, the
# lengths are data), so a large cache holding short sequences takes the late trigger.
PDL_LATE_MIN_BYTES = 128 << 20


def stream_scale(device) -> float:
    """The split rule's stream factor for ``device`` (see STREAMS_BW_GAIN): from the measured
    bandwidth of a known NVIDIA GPU (numasched.gemm_schedule's table) with its full SM count, so
    today more than 1 on an H200 only; 1 off CUDA, on AMD, on GPUs not in the table (their
    bandwidth is a guess), on partitions of one (MIG: fewer SMs) and where the bandwidth per SM is
    at most the H100's."""
    if device is None or torch.device(device).type != "cuda" or caps.is_hip():
        return 1.0
    from .gemm_schedule import _KNOWN

    props = torch.cuda.get_device_properties(caps._index(torch.device(device)))
    name, ref = props.name.lower(), _KNOWN["h100"]
    for key in ("h100", "h200"):
        m = _KNOWN[key]
        if key in name and props.multi_processor_count == m.sms:
            ratio = (m.hbm_bytes_per_s / m.sms) / (ref.hbm_bytes_per_s / ref.sms)
            return 1.0 + STREAMS_BW_GAIN * max(0.0, ratio - 1.0)
    return 1.0


def choose_num_splits(batch: int, kv_heads: int, max_seqlen: int, num_sms: int, paged: bool = False,
                      stream_scale: float = 1.0, prefetch: bool = False) -> int:
    """Splits per (batch, kv_head) for a cache of ``max_seqlen`` tokens on ``num_sms`` SMs/CUs.

    Model: programs run in waves of ``num_sms * PROGRAMS_PER_SM``; a program costs its chunk of
    tokens (in whole SPLIT_TILE_TOKENS tiles) plus a fixed overhead; the waves cost at least the
    bandwidth floor (every pair's tokens over ``STREAMS_PER_SM * stream_scale * num_sms`` streams,
    ``stream_scale`` from :func:`stream_scale` of the GPU, applied from
    FLOOR_MIN_PAIRS_PER_SM pairs per SM; while the pairs are fewer than the wave's slots it grows
    by IDLE_SM_COST times the waves' idle fraction); more than one split adds SPLIT_MERGE_TOKENS
    once (the merge; PAGED_SPLIT_MERGE_TOKENS for a paged cache). Among 1 .. min(MAX_SPLITS,
    max_seqlen // MIN_SPLIT_TOKENS) splits, pick the lowest ``max(waves * (tile-rounded tokens per
    split + overhead), floor) + (merge if splits > 1)`` (the fewest splits within 2% of it); a paged
    cache of PAGED_FILL_MIN_PAIRS_PER_SM up to PAGED_FILL_MAX_PAIRS_PER_SM pairs per SM then takes at
    least the most power-of-two splits that keep PAGED_PROGRAMS_PER_SM programs per SM (up to
    PAGED_FILL_MAX_PAIRS_PER_SM pairs per SM on a GPU of stream_scale > 1 at PAGED_FILL_WIDE_MIN_TOKENS
    to PAGED_FILL_WIDE_MAX_TOKENS, for calls without
    ``prefetch``, the decoder's K/V prefetch, which needs one program an SM at most), and a
    contiguous cache of more pairs than SMs (while more than PAST_WAVE_MIN_SHORT of the SMs would
    hold one program fewer in one split: up to 1.875 pairs per SM) at least PAST_WAVE_SPLITS splits
    where they are PAST_WAVE_MIN_SPLIT_TOKENS * stream_scale long or more. The constants were
    fitted on H200 and H100 sweeps (bench/results/decode-s10-shortsplits/, decode-s32*/,
    decode-s33*/, decode-s34*/, decode-s35*/, decode-s52/sweep/); no AMD GPU was measured. So with
    few pairs batch * kv_heads * splits reaches about PROGRAMS_PER_SM programs per SM when the
    context is long enough and the last wave is not mostly empty, and from about half as many pairs
    as SMs one split (no combine at all) is used while the context is short (64 pairs on 132 SMs at stream_scale 1, the H100:
    up to 4k tokens; two splits from 7k contiguous, 5k paged; on an H200 two from 896 tokens
    contiguous, 640 paged): those programs already stream at about the memory's rate.
    """
    items = max(1, batch * kv_heads)
    slots = max(1, num_sms * PROGRAMS_PER_SM)
    s_max = max(1, min(MAX_SPLITS, max_seqlen // MIN_SPLIT_TOKENS))
    merge = PAGED_SPLIT_MERGE_TOKENS if paged else SPLIT_MERGE_TOKENS
    sms = max(1, num_sms)
    floored = items >= FLOOR_MIN_PAIRS_PER_SM * sms
    floor = items * max(max_seqlen, 1) / (STREAMS_PER_SM * stream_scale * sms) if floored else 0.0
    costs = []
    for s in range(1, s_max + 1):
        waves = -(-items * s // slots)
        # a split streams whole tiles: 2048 tokens in 31 splits are 67 tokens each, i.e. a 64-token
        # tile and a 3-token one, as slow as 128 (32 splits of exactly one tile are faster)
        chain = waves * (_round_up(-(-max(max_seqlen, 1) // s), SPLIT_TILE_TOKENS) + PROGRAM_OVERHEAD_TOKENS)
        # (only while one split leaves SMs idle: past one wave the term was never timed)
        idle = 1.0 - items * s / (waves * slots) if floored and items < slots else 0.0
        costs.append(max(chain, floor * (1.0 + IDLE_SM_COST * idle)) + (merge if s > 1 else 0))
    # the fewest splits within 2% of the best (fewer partials to write and merge)
    pick = next(s for s, c in enumerate(costs, 1) if c <= 1.02 * min(costs))
    if (not paged and sms < items and 2.0 - items / sms > PAST_WAVE_MIN_SHORT
            and max_seqlen // PAST_WAVE_SPLITS >= PAST_WAVE_MIN_SPLIT_TOKENS * stream_scale):
        pick = max(pick, PAST_WAVE_SPLITS)   # past one wave: even the SMs' loads (PAST_WAVE_SPLITS)
    # the top as measured (below); not for a call that asks for the K/V prefetch (the decoder's),
    # which applies at one program an SM at most
    wide = (stream_scale > 1.0 and PAGED_FILL_WIDE_MIN_TOKENS <= max_seqlen <= PAGED_FILL_WIDE_MAX_TOKENS
            and not prefetch)
    below_top = items <= PAGED_FILL_MAX_PAIRS_PER_SM * sms if wide else items < FLOOR_MIN_PAIRS_PER_SM * sms
    if paged and PAGED_FILL_MIN_PAIRS_PER_SM * sms <= items and below_top:
        fill = 1   # the most splits (a power of two) that keep PAGED_PROGRAMS_PER_SM programs per SM
        while 2 * fill <= s_max and items * 2 * fill <= PAGED_PROGRAMS_PER_SM * sms:
            fill *= 2
        pick = max(pick, fill)
    return pick


# ----------------------------------------------------------------------------- per-stream buffers
# Arrival counters (fused combine) and partial buffers are per (device, stream): kernels on one
# stream run in order, so consecutive calls never use one buffer at the same time, while calls on
# different streams get different buffers. The counters are zeroed once and reset by the kernel.
# Inside CUDA-graph capture the partials are allocated fresh (the graph's pool owns them), because
# all graphs captured on torch's default capture stream would otherwise share one buffer and race
# if replayed concurrently on different streams. The counters keep the per-stream buffer (graphs
# replayed concurrently on different streams must be captured on different streams).
_COUNTERS: dict = {}
_WORKSPACE: dict = {}


def _counters(device: torch.device, n: int, stream: int) -> torch.Tensor:
    # grow-only: graphs captured earlier keep using the old buffer's address
    return grow_only(_COUNTERS, (device.type, device.index, stream), n, torch.int32, device, zero=True, minimum=1024)


def _span(t: torch.Tensor) -> int:
    return caps.span(t) + 1


# ----------------------------------------------------------------------------- torch fallback
def _torch_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, shape: DecodeShape):
    """Reference-style implementation in fp32: gathers the cache into (B, L, HK, D) and masks
    (token i of Sq sees positions < len - Sq + i + 1)."""
    B, H, HK, D, Sq = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.q_len
    G = H // HK
    if block_table is not None:
        bt = block_table.long().clamp(0, shape.num_pages - 1)  # unused entries may be padding
        k = k_cache[bt].reshape(B, -1, HK, D)
        v = v_cache[bt].reshape(B, -1, HK, D)
    else:
        k, v = k_cache, v_cache
    L = k.shape[1]
    lens = (cache_seqlens.long().clamp(0, shape.capacity) if cache_seqlens is not None
            else torch.full((B,), shape.capacity, dtype=torch.long, device=q.device))
    qf = q.float().reshape(B, Sq, HK, G, D)
    s = torch.einsum("btkgd,blkd->btkgl", qf, k.float()) * scale
    limit = lens[:, None] - Sq + 1 + torch.arange(Sq, device=q.device)[None, :]  # (B, Sq)
    valid = torch.arange(L, device=q.device)[None, None, :] < limit[:, :, None]
    s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see nothing
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("btkgl,blkd->btkgd", p, v.float())
    return out.reshape(shape.out_shape).to(q.dtype), lse.reshape(shape.lse_shape).float()


# ----------------------------------------------------------------------------- outputs
def prepare_outputs(plan, q, out, lse, want_lse: bool):
    """``(out, lse, thin)`` of a decode plan's run (the split and the work-list kernel): outputs
    allocated where not given (an lse nobody asked for is a per-stream scratch buffer under a
    compiled kernel). The compiled kernel is specialised on the layout of the outputs the plan
    allocates (q's layout for out, contiguous lse, 16-byte aligned): ``thin`` is False when a
    caller's outputs are laid out otherwise (they take Triton's own launch path)."""
    s, dev = plan.shape, plan.device
    thin = True
    if out is None:
        out = torch.empty(s.out_shape, dtype=q.dtype, device=dev) if s.q_4d else torch.empty_like(q)
    elif out.stride() != plan._out_stride or out.data_ptr() % 16:
        thin = False
    if lse is None:
        lse = (scratch(s.lse_shape, torch.float32, dev, caps.stream_handle(dev))
               if not want_lse and plan.mode == "kernel" else torch.empty(s.lse_shape, dtype=torch.float32, device=dev))
    elif lse.stride() != plan._lse_stride or lse.data_ptr() % 16:
        thin = False
    return out, lse, thin


# ----------------------------------------------------------------------------- the plan
class DecodePlan(Plan):
    """A planned decode: made by :func:`plan_decode`, run with :meth:`run`.

    Attributes:
        shape: DecodeShape of the call.
        scale: softmax scale.
        num_splits: KV splits per (batch, kv_head) (and row group).
        policy, topology: the mapping policy and the topology it was chosen for.
        combine: "none" (one split), "fused" (the last split merges) or "kernel" (a second launch).
        mode: "kernel" (compiled), "interpreter", "torch" (no Triton device: torch fallback) or
            "empty" (batch 0).
        grid: programs of the split kernel (batch * kv_heads * row_groups * num_splits).
        row_groups: programs per (batch, kv_head, split): 1, or more when q_len * heads / kv_heads
            (token, head) rows of a multi-token decode exceed one program's tile.
        config: kernel config: the model's (kernels/flash_decode.fixed_config) or the one given;
            None only under ``decode_schedule="autotune"`` until the first run has tuned it.
        workspace_bytes: partial buffers per stream (fp32).
        prefetch_tokens: tokens of each program's chunk asked into L2 before its PDL wait
            (``options.decode_prefetch`` rounded up to a power of two and to one per thread; 0 where
            it does not apply: a plan made without ``prefetch=True``, a batch below
            PREFETCH_MIN_BATCH, more programs than SMs, splits shorter than PREFETCH_CHUNK_RATIO
            times the prefetch, no PDL, several query tokens,
            rows not 16-byte aligned, the interpreter).
        tma: the whole K/V tiles arrive by TMA (``options.decode_tma``; contiguous cache, NVIDIA
            sm_90+ or the interpreter, 16-byte aligned rows, a known kernel config).
        tensors: the TensorSig of each argument the plan was made for.
    """

    op = "flash_decode"

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, *, scale, num_splits, mapping, config,
                 options: _options.Options, mode: Optional[str] = None, prefetch: bool = False):
        shape = check_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping)
        check_bool("prefetch", prefetch)
        self.shape = shape
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(shape.head_dim)
        self.options = options
        self.check_data = options.check_data
        self.tensors = dict(q=signature(q), k_cache=signature(k_cache), v_cache=signature(v_cache),
                            cache_seqlens=signature(cache_seqlens), block_table=signature(block_table))
        dev = q.device
        # the outputs run() allocates: out laid out as a 3-D q (torch.empty_like) or contiguous
        # (4-D q), lse contiguous
        self._out_stride = (torch.empty_like(q, device="meta").stride() if not shape.q_4d
                            else _contiguous_strides(shape.out_shape))
        self._lse_shape = shape.lse_shape
        self._lse_stride = _contiguous_strides(self._lse_shape)
        # the kernels' output strides for outputs of those layouts (the thin launch's)
        self._so = _strides_arg(self._out_stride, self._lse_stride, shape.q_4d)
        self.device = dev
        self.topology = _topology.current()
        if mode is None:
            mode = "empty" if shape.batch == 0 else caps.launch_mode(dev)
        self.mode = mode
        self.num_splits = S = 0
        self.row_groups = 0
        self.policy = None
        self.combine = "none"
        self.grid = ()
        self.config = None
        self.workspace_bytes = 0
        self.prefetch_tokens = 0   # options.decode_prefetch, where it applies (below)
        self.tma = False           # options.decode_tma, where it applies (below)
        self._tma_views = None
        self._launches = ()
        if mode in ("empty", "torch"):
            self._freeze()
            return
        B, H, HK, D, Sq = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.q_len
        G = H // HK
        from .kernels import flash_decode as K

        self._K = K
        block_g, R = K.row_tiling(Sq, G)
        self.row_groups = R
        streams = stream_scale(dev)
        # options.decode_prefetch_wide: the prefetch up to PAGED_PROGRAMS_PER_SM programs an SM, so
        # the split rule's two-an-SM fill applies to the decoder's calls too
        wide_prefetch = prefetch and options.decode_prefetch_wide
        S = int(num_splits) if num_splits is not None else options.decode_splits or choose_num_splits(
            B, HK * R, shape.capacity, caps.num_sms(dev), shape.page_size > 0, streams,
            prefetch=prefetch and not wide_prefetch)
        grid_w = M.DecodeGrid(B, HK * R, S)  # checks the program count fits int32
        self.policy = M.resolve(mapping, "decode", self.topology, grid_w)
        self.num_splits = S
        # the fused combine merges in the last split's program: one program's rows (G heads, or
        # the Sq * G rows of a row group) at most 16 and at most FUSED_MAX_SPLITS partials each,
        # else the parallel combine kernel
        rows = G if Sq == 1 else -(-Sq * G // R)
        fused = options.decode_combine == "fused" or (options.decode_combine == "auto" and rows <= 16
                                                       and S <= FUSED_MAX_SPLITS)
        self.combine = "none" if S == 1 else ("fused" if fused else "kernel")
        combine = {"none": 0, "kernel": 1, "fused": 2}[self.combine]
        self.grid = (B * HK * R * S,)
        self._items = B * HK * R
        if shape.q_4d:
            self._po_shape, self._pl_shape = (B, Sq, H, S, D), (B, Sq, H, S)
        else:
            self._po_shape, self._pl_shape = (B, H, S, D), (B, H, S)
        n_po = B * Sq * H * S * D
        self._pl_offset = -(-n_po // 32) * 32  # keeps the lse partials 128-byte aligned
        self._ws_numel = self._pl_offset + B * Sq * H * S if combine else 0
        self.workspace_bytes = 4 * self._ws_numel
        self._views: dict = {}
        # bf16 dots are wrong in Triton's interpreter: compute in fp32 there (never a wrong result)
        self._upcast = mode == "interpreter" and q.dtype == torch.bfloat16

        block_s = K.combine_block_s(S)
        paged = shape.page_size > 0
        int64 = max(_span(k_cache), _span(v_cache)) > INT64_THRESHOLD
        tune_key = K.tune_key(-(-shape.capacity // S), k_cache.stride(1) == D, Sq > 1)
        # 16-bit dots take the default precision (gfx950 refuses "tf32" for them; NVIDIA ignores it)
        precision = "ieee" if q.dtype == torch.float32 or self._upcast else None
        meta = dict(G=G, BLOCK_G=block_g, HEAD_DIM=D, BLOCK_D=max(16, _next_pow2(D)),
                    PAGE_SIZE=int(shape.page_size), HAS_SEQLENS=cache_seqlens is not None, COMBINE=combine,
                    INT64=int64, INPUT_PRECISION=precision, COMBINE_BLOCK_S=block_s, SQ=Sq, ROW_GROUPS=R,
                    MAPPING=self.policy.constexpr(self.topology.num_domains))
        self._tune_key = tune_key
        elt = k_cache.element_size()
        fixed = K.fixed_config(paged, D, block_g, -(-shape.capacity // S), elt, B * HK * R * S,
                               caps.num_sms(dev), caps.shared_memory_per_block(dev), fused=combine == 2,
                               stream_scale=streams)
        # options.decode_prefetch: the chunk's first tokens into L2 before the PDL wait (one query
        # token, batch >= PREFETCH_MIN_BATCH; token rows of a multiple of 16 bytes at 16-byte
        # aligned addresses, as the bulk prefetch needs). Lanes: a power of two, at least one per
        # thread of the fixed config (fewer would repeat a lane's prefetch on several threads).
        sigs = (self.tensors["k_cache"], self.tensors["v_cache"])
        tokens = max(32 * fixed["num_warps"], _next_pow2(options.decode_prefetch)) if options.decode_prefetch else 0
        if (tokens and prefetch and mode == "kernel" and Sq == 1 and R == 1 and B >= PREFETCH_MIN_BATCH
                and B * HK * S <= (PAGED_PROGRAMS_PER_SM if wide_prefetch else 1) * caps.num_sms(dev)
                and -(-shape.capacity // S) >= PREFETCH_CHUNK_RATIO * tokens
                and caps.pdl_supported(dev) and options.pdl and (D * elt) % 16 == 0
                and all(sig.aligned and all((st * elt) % 16 == 0 for st in sig.stride[:-1]) for sig in sigs)):
            self.prefetch_tokens = tokens
            meta["PREFETCH_TOKENS"] = self.prefetch_tokens
        from ._launch import Launch

        if mode == "interpreter":
            self.config = dict(K.INTERPRET_CONFIG)
            split = Launch(K._flash_decode_kernel, self.grid, meta, config=self.config, device=dev, interpret=True,
                           options=self.options)
        elif config is not None:
            self.config = dict(config)
            split = Launch(K._flash_decode_kernel, self.grid, meta, config=self.config, device=dev,
                           options=self.options)
        elif not options.autotune or options.decode_schedule == "model":
            self.config = fixed
            split = Launch(K._flash_decode_kernel, self.grid, meta, config=fixed, device=dev, options=self.options)
        else:
            split = Launch(K._flash_decode_kernel, self.grid, meta, device=dev, tuner=K._flash_decode_tuned,
                           fixed=fixed, options=self.options)
        if split.kwargs.get("PDL") == 3 and B * HK * shape.capacity * D * elt * 2 < PDL_LATE_MIN_BYTES:
            split.kwargs["PDL"] = 1   # a short call: the next kernel launches at the start (PDL_LATE_MIN_BYTES)
        launches = [split]
        if combine == 1:
            launches.append(Launch(K._combine_kernel, (B * Sq * H,),
                                   dict(SQ=Sq, HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_S=block_s, num_warps=4),
                                   device=dev, interpret=mode == "interpreter", options=self.options))
        self._launches = tuple(launches)
        self._split = split
        # options.decode_tma: 4-D (batch, token, kv_head, head_dim) descriptors of K and V, boxes of
        # one BLOCK_N-token tile of one head (the config must be known: the box is its BLOCK_N)
        if (options.decode_tma and not paged and self.config is not None and TensorDescriptor is not None
                and (mode == "interpreter" or (mode == "kernel" and caps.tma_supported(dev)))
                and all(sig.aligned and sig.stride[-1] == 1 and all((st * elt) % 16 == 0 for st in sig.stride[:-1])
                        for sig in sigs)):
            self.tma = True
            box = [1, int(self.config["BLOCK_N"]), 1, meta["BLOCK_D"]]
            self._tma_views = tuple((tuple(sig.shape), tuple(sig.stride), box) for sig in sigs)
        self._args_cache = None
        if mode == "kernel":
            self._args_cache = self._scalars(q, k_cache, v_cache, cache_seqlens, block_table)
        self._freeze()

    # ---------------------------------------------------------------- launch arguments
    def _scalars(self, q, k_cache, v_cache, cache_seqlens, block_table) -> tuple:
        s = self.shape
        stride_sb = cache_seqlens.stride(0) if cache_seqlens is not None else 0
        stride_tb, stride_tp = block_table.stride() if block_table is not None else (0, 0)
        qs = q.stride()
        return (self.scale * caps.LOG2E, s.batch, s.kv_heads, self.num_splits, int(s.capacity),
                max(s.num_pages, 1), qs[0], qs[1] if s.q_4d else 0, qs[-2],
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                stride_sb, stride_tb, stride_tp)

    def _partials(self, stream: int, capturing: bool):
        if capturing:
            return (torch.empty(self._po_shape, dtype=torch.float32, device=self.device),
                    torch.empty(self._pl_shape, dtype=torch.float32, device=self.device))
        key = (self.device.type, self.device.index, stream)
        flat = _WORKSPACE.get(key)
        hit = self._views.get(stream)
        if hit is not None and hit[0] is flat:
            return hit[1], hit[2]
        if flat is None or flat.numel() < self._ws_numel:
            flat = grow_only(_WORKSPACE, key, self._ws_numel, torch.float32, self.device)
        po = flat[:_prod(self._po_shape)].view(self._po_shape)
        pl = flat[self._pl_offset: self._pl_offset + _prod(self._pl_shape)].view(self._pl_shape)
        self._views[stream] = (flat, po, pl)
        return po, pl

    # ---------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None, *, out=None, lse=None,
            return_lse: bool = False):
        """Launch on tensors with the signatures the plan was made for; returns out (and lse).

        ``out`` (q's shape and dtype) and ``lse`` ((batch, heads), or (batch, q_len, heads) for a
        4-D q; fp32) are written when given (any strides), else allocated. Data checks run as the
        plan's options say (``check_data``), never during CUDA-graph capture."""
        self.check_signatures(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                              block_table=block_table)
        s = self.shape
        if out is not None:
            check_tensor("out", out, ndim=len(s.out_shape), dtypes=(q.dtype,), device=q.device)
            if tuple(out.shape) != s.out_shape:
                raise ValueError(f"out must have shape {s.out_shape}, got {tuple(out.shape)}")
            check_no_overlap(out, q=q, k_cache=k_cache, v_cache=v_cache)
        if lse is not None:
            check_tensor("lse", lse, ndim=len(s.lse_shape), dtypes=(torch.float32,), device=q.device)
            if tuple(lse.shape) != s.lse_shape:
                raise ValueError(f"lse must have shape {s.lse_shape}, got {tuple(lse.shape)}")
            check_no_overlap(lse, "lse", out=out)
        # an lse nobody asked for is the per-stream scratch, as flash_decode's (no allocation a call)
        o, l = self._run(q, k_cache, v_cache, cache_seqlens, block_table, out, lse,
                         want_lse=return_lse or lse is not None)
        return (o, l) if return_lse else o

    def _run(self, q, k_cache, v_cache, cache_seqlens, block_table, out=None, lse=None, want_lse=True):
        s = self.shape
        dev = self.device
        if self.check_data and (cache_seqlens is not None or block_table is not None) and not caps.capturing(dev):
            check_decode_data(s, cache_seqlens, block_table)
        out, lse, thin = prepare_outputs(self, q, out, lse, want_lse)
        mode = self.mode
        if mode == "empty":
            return out, lse
        if mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out, lse), self, self._fallback_reason())
            o, l = _torch_decode(q, k_cache, v_cache, cache_seqlens, block_table, self.scale, s)
            out.copy_(o)
            lse.copy_(l)
            return out, lse
        if mode == "interpreter":
            return self._run_interpreted(q, k_cache, v_cache, cache_seqlens, block_table, out, lse)
        stream = caps.stream_handle(dev)
        counter = _counters(dev, self._items, stream)
        if self._ws_numel:
            po, pl = self._partials(stream, caps.capturing(dev))
        else:
            po = pl = lse
        if _observe.OBSERVERS:
            _observe.notify(self.op, "flash_decode", self.grid, (out, lse), self)
        split = self._split if thin else self._split.triton_call
        # Unused pointer arguments get stand-ins of the same dtype, so the autotuner's key (which
        # includes every tensor's dtype) is the same with and without them.
        tensors = (q, k_cache, v_cache, counter if cache_seqlens is None else cache_seqlens,
                   counter if block_table is None else block_table, out, lse, po, pl, counter)
        if thin and split.raw is not None:
            # compiled, direct path: pointers as integers (the launcher then neither calls
            # data_ptr() nor asks the driver about each pointer; the plan checked the devices)
            tensors = tuple(t.data_ptr() for t in tensors)
        so = self._so if thin else _strides_arg(out.stride(), lse.stride(), s.q_4d)
        descs = self._descriptors(k_cache, v_cache, light=thin and self._split.compiled is not None)
        with caps.launch_device(q):
            split(*tensors, *self._args_cache, *so, self._tune_key, *descs)
            if self.combine == "kernel":
                if _observe.OBSERVERS:
                    _observe.notify(self.op, "flash_decode.combine", (s.batch * s.q_len * s.heads,), (out, lse), self)
                combine = self._launches[1] if thin else self._launches[1].triton_call
                combine(po, pl, out, lse, s.heads, self.num_splits, *so)
        if self.config is None and self._split.tuned:
            object.__setattr__(self, "config", dict(self._split.config))
        return out, lse

    def _run_interpreted(self, q, k_cache, v_cache, cache_seqlens, block_table, out, lse):
        res_out = out
        if self._upcast:  # fp32 copies: the interpreter's bf16 dot is wrong
            q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
            out = torch.empty(out.shape, dtype=torch.float32, device=self.device)
        stream = caps.stream_handle(self.device)
        counter = _counters(self.device, self._items, stream)
        po, pl = self._partials(stream, False) if self._ws_numel else (lse, lse)
        if _observe.OBSERVERS:
            _observe.notify(self.op, "flash_decode", self.grid, (res_out, lse), self)
        args = self._scalars(q, k_cache, v_cache, cache_seqlens, block_table)
        s = self.shape
        so = _strides_arg(out.stride(), lse.stride(), s.q_4d)
        self._split(q, k_cache, v_cache, counter if cache_seqlens is None else cache_seqlens,
                    counter if block_table is None else block_table, out, lse, po, pl, counter, *args,
                    *so, self._tune_key, *self._descriptors(k_cache, v_cache, light=False))
        if self.combine == "kernel":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "flash_decode.combine", (s.batch * s.q_len * s.heads,), (res_out, lse), self)
            self._launches[1](po, pl, out, lse, s.heads, self.num_splits, *so)
        if out is not res_out:
            res_out.copy_(out)
        return res_out, lse

    def _descriptors(self, k_cache, v_cache, light: bool) -> tuple:
        """(KD, VD) of the split kernel: None without TMA; Triton's TensorDescriptor for a launch
        through Triton's path, the light HostDesc once the kernel is compiled (the plan checked
        the layout)."""
        if not self.tma:
            return None, None
        make = HostDesc if light else TensorDescriptor
        return tuple(make(t, list(shape), list(stride), box)
                     for t, (shape, stride, box) in zip((k_cache, v_cache), self._tma_views))

    def _fallback_reason(self) -> str:
        return (f"the Triton kernel cannot run on {self.device} tensors (needs a GPU, or TRITON_INTERPRET=1 for "
                f"CPU tensors)")


def _strides_arg(so: tuple, sl: tuple, q_4d: bool) -> tuple:
    """(stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh) of the kernels from the
    strides of out and lse."""
    if q_4d:
        return so[0], so[1], so[2], sl[0], sl[1], sl[2]
    return so[0], 0, so[1], sl[0], 0, sl[1]


def _contiguous_strides(shape) -> tuple:
    strides, n = [], 1
    for x in reversed(shape):
        strides.append(n)
        n *= max(int(x), 1)
    return tuple(reversed(strides))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prod(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


# ----------------------------------------------------------------------------- planning
def plan_decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, scale=None, num_splits=None,
                mapping="auto", config: Optional[dict] = None, options: Optional[_options.Options] = None,
                prefetch: bool = False) -> DecodePlan:
    """Plan a decode for inputs like these (real, meta or fake tensors: only their signatures
    are read). The plan is valid for any tensors with the same shapes, strides, dtypes, device and
    16-byte alignment, whatever their values: make it once per batch layout, run it every step.

    Args: as :func:`flash_decode`, plus
        config: a fixed kernel config ``dict(BLOCK_N=..., num_warps=..., num_stages=...)`` instead
            of the model's pick (or the autotuner's under ``decode_schedule="autotune"``):
            benchmarks, sweeps.
        options: :class:`numasched.options.Options` for this plan (default: the current ones).
    """
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    opts = options if options is not None else _options.current()
    if not isinstance(opts, _options.Options):
        raise TypeError(f"options must be a numasched.options.Options, got {type(options).__name__}")
    config = check_config("config", config, ("BLOCK_N", "num_warps", "num_stages"))
    if config is None and opts.decode_config is not None:   # every plan's config (an A/B's knob)
        config = _options.decode_config_dict(opts.decode_config)
    return DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table, scale=scale, num_splits=num_splits,
                      mapping=mapping, config=config, options=opts, prefetch=prefetch)


def _key(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, prefetch=False) -> tuple:
    """The plan-cache key of a call (a flat tuple, see numasched._plan; built on every call)."""
    k, v = k_cache, v_cache
    return ("flash_decode", q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15, k.shape, k.stride(), k.dtype,
            k.device, k.data_ptr() & 15, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15,
            None if cache_seqlens is None else fast_signature(cache_seqlens),
            None if block_table is None else fast_signature(block_table), scale, type(scale), num_splits,
            type(num_splits), mapping, prefetch, type(prefetch),
            q.device.type != "cuda" and caps.interpreting(), _topology.current(), _REG._VERSION[0], _options._CURRENT)


def _planned(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping,
             prefetch=False) -> DecodePlan:
    """The cached plan of this call (made on a miss)."""
    key, plan = PLANS.find(_key, q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, prefetch)
    if plan is None:
        plan = plan_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, scale=scale,
                           num_splits=num_splits, mapping=mapping, prefetch=prefetch)
        if plan.mode == "torch":
            warn_once(f"numasched.flash_decode: running the torch fallback (slow) because {plan._fallback_reason()}")
        if key is not None:
            PLANS.put(key, plan)
    return plan


# ----------------------------------------------------------------------------- custom op
@torch.library.custom_op("numasched::flash_decode", mutates_args=())
def _flash_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                     scale: Optional[float], num_splits: Optional[int], mapping: str, prefetch: bool = False
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    plan = _planned(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, prefetch)
    return plan._run(q, k_cache, v_cache, cache_seqlens, block_table)


@_flash_decode_op.register_fake
def _flash_decode_fake(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, prefetch=False):
    s = check_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping)
    return q.new_empty(s.out_shape), q.new_empty(s.lse_shape, dtype=torch.float32)


# ----------------------------------------------------------------------------- one call
def flash_decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, scale=None, num_splits=None,
                 mapping="auto", return_lse=False, prefetch=False):
    """Decode attention of one query token per sequence against a KV cache (split-KV Flash Decode),
    or of a few (multi-token decode: speculative decoding's verification step).

    Args:
        q: (batch, heads, head_dim), bf16 / fp16 / fp32; last dimension unit-stride. Or
            (batch, q_len, heads, head_dim) with 1 <= q_len <= 16: the q_len newest tokens of
            each sequence (already in the cache and counted in ``cache_seqlens``), causal and
            bottom-right aligned: token i sees cache positions < len - q_len + i + 1, as
            FlashAttention's ``flash_attn_with_kvcache(causal=True)``.
        k_cache, v_cache: contiguous (batch, max_len, kv_heads, head_dim), any strides with a
            unit-stride last dimension; or paged (num_pages, page_size, kv_heads, head_dim) when
            ``block_table`` is given. Same dtype and device as q; heads % kv_heads == 0 (GQA/MQA/MHA).
        cache_seqlens: int32 (batch,) valid tokens per sequence, or an int for all; default the
            whole cache (max_len, or max_pages * page_size).
        block_table: int32 (batch, max_pages) page indices into the paged cache.
        scale: softmax scale; default 1/sqrt(head_dim).
        num_splits: KV splits per (batch, kv_head); default chosen from the shape and SM count.
        mapping: "auto" (or None), a decode (attention-kind) policy name, or a ``Policy``; decides
            which (batch, kv_head, split) each program runs. It does not change the result beyond
            rounding.
        prefetch: the kernel before this call barely uses the memory bus (in a decode step, the
            RoPE + cache write: numasched's decoder passes True): with PDL (``options.pdl``) each
            program then asks the first ``options.decode_prefetch`` tokens of its K/V chunk into L2
            before it waits for that kernel. Where it applies: one query token, batches of
            ``PREFETCH_MIN_BATCH`` and more, no more programs than SMs, splits of at least
            ``PREFETCH_CHUNK_RATIO`` times the prefetch (``DecodePlan.prefetch_tokens`` says). After
            a kernel that does use the bus it costs time (H200: 1.1-1.6 us at 128 programs of 1k-4k
            tokens), so the default is False. It never changes the result.
        return_lse: also return the log-sum-exp (batch, heads), or (batch, q_len, heads) for a
            4-D q, fp32, natural log (-inf for a query that sees no token), for merging attention
            over several caches or devices.

    Returns:
        out with q's shape and dtype (3-D: laid out as q; 4-D: contiguous), or (out, lse) if
        ``return_lse``. A query that sees no token (an empty sequence; with several tokens, a
        token i with len - q_len + i + 1 <= 0) gives zeros.
    """
    if mapping is None:
        mapping = "auto"
    # the plan cache first: a repeated call costs a key, a lookup and the launch
    if type(cache_seqlens) is not int and plain_eager(q, k_cache, v_cache):
        key, plan = PLANS.find(_key, q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping,
                               prefetch)
        if plan is not None:
            if return_lse is True:
                return plan._run(q, k_cache, v_cache, cache_seqlens, block_table)
            if return_lse is False:
                return plan._run(q, k_cache, v_cache, cache_seqlens, block_table, want_lse=False)[0]
            check_bool("return_lse", return_lse)
    # checked path: argument types, then the op or an eager call
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
    if isinstance(cache_seqlens, bool) or not (cache_seqlens is None or isinstance(cache_seqlens, (torch.Tensor, int))):
        raise TypeError(f"cache_seqlens must be a torch.Tensor, an int or None, got {type(cache_seqlens).__name__}")
    if block_table is not None and not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= INT32_MAX:
            raise ValueError(f"cache_seqlens = {cache_seqlens} is outside [0, {INT32_MAX}]")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    token = mapping_token(mapping, "decode")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        scale = float(scale)
    check_positive_int("num_splits", num_splits)
    check_bool("prefetch", prefetch)
    check_bool("return_lse", return_lse)
    refuse_grad("flash_decode", q, k_cache, v_cache)
    if plain_eager(q, k_cache, v_cache, cache_seqlens, block_table):
        plan = _planned(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits, mapping, prefetch)
        out, lse = plan._run(q, k_cache, v_cache, cache_seqlens, block_table)
    else:
        out, lse = torch.ops.numasched.flash_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                                                    num_splits, token, prefetch)
    return (out, lse) if return_lse else out
