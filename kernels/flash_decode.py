"""Flash Decode: one query token per sequence, split-KV, log-sum-exp combine.

Decode reads the whole KV cache to produce one output row per query head, so it is bound by
memory bandwidth. The plan, top to bottom:

1. Work items are (batch, kv_head, split). One program reads a contiguous chunk of its
   sequence's K/V exactly once and serves all G = heads / kv_heads query heads of that KV head
   (G is padded up to 16 rows so the scores and the P @ V product use ``tl.dot``; the padding is
   free since the tensor cores are idle in decode anyway, and ``tl.dot`` operands are what
   Triton's software pipeliner streams through shared memory with async copies).
2. A program id becomes a work item through the mapping policy's REMAP / ORDER device
   functions (``numasched.mappings``), so every policy runs with this one kernel.
3. Each split keeps an online softmax (running max ``m``, running sum ``l``, accumulator) in the
   log2 domain, and writes a normalised partial output plus its log2-sum-exp.
4. The partials are merged by a log-sum-exp combine: either a second small kernel, or inside the
   first one by whichever split of a (batch, kv_head) finishes last (an atomic arrival counter
   that the last arrival resets, so the kernel can be replayed in a CUDA graph). With one split
   the first kernel writes the output directly.

The KV cache is either contiguous ``(batch, max_len, kv_heads, head_dim)`` with any strides
(only the last dimension unit-stride), or paged ``(num_pages, page_size, kv_heads, head_dim)``
with an int32 block table ``(batch, max_pages)``; positions at or beyond a sequence's length
are never read. Offsets are int64 where a cache can exceed 2^31 elements (``INT64``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634

# How many times the Triton path has launched (tests check that the kernel, not a fallback, ran).
LAUNCHES = 0


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
    B, HK, S, seqlen_max,
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
    REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr, ORDER: tl.constexpr, ORDER_PARAM: tl.constexpr,
    NUM_DOMAINS: tl.constexpr,
):
    # -- which (batch, kv_head, split) this program owns: the policy decides
    pid = tl.program_id(0)
    W = B * HK * S
    g = REMAP(pid, W, NUM_DOMAINS, REMAP_PARAM)
    b, kvh, split = ORDER(g, B, HK, HK, S, NUM_DOMAINS, ORDER_PARAM)

    # -- this split's token range: the sequence is cut into S near-equal chunks (balanced per
    #    sequence; a chunk need not be a multiple of BLOCK_N, its last tile is masked)
    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b * stride_sb)
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
    if not kept:  # head dim 256 in fp32: the smallest tile
        kept = [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages))]
    return kept


_flash_decode_tuned = triton.autotune(
    configs=_GPU_CONFIGS,
    # COMBINE and G only change the prologue/epilogue: the tuned config is shared (fewer compiles)
    key=["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "INT64", "tune_key"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_flash_decode_kernel)

# On the interpreter (CPU tests) one small config keeps the runs short.
INTERPRET_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1)
# Fixed GPU configs: used when autotuning is off (NUMASCHED_AUTOTUNE=0; GPU tests, to keep compiles
# few), and while a CUDA graph is being captured before this key was tuned (autotuning launches
# and synchronises, which capture forbids).
DEFAULT_GPU_CONFIG = {False: dict(BLOCK_N=64, num_warps=4, num_stages=3),  # contiguous
                      True: dict(BLOCK_N=64, num_warps=4, num_stages=5)}  # paged
AUTOTUNE = os.environ.get("NUMASCHED_AUTOTUNE", "1") != "0"
# Autotuner key -> the Config it chose. Once a key is tuned, launches call the plain kernel with that
# config: the autotuner's own per-call key building costs tens of microseconds of Python.
_TUNED_CONFIGS: dict = {}
# Caches spanning more elements than this get int64 row offsets (tests lower it to cover that path).
INT64_THRESHOLD = 2**31 - 1

# ----------------------------------------------------------------------------- splits
# Waves: programs the GPU runs at once, in units of SMs. Measured on an H200 (bf16, d128, GQA 32/8,
# batch 1, split sweep in bench/results/decode-sweep-h200-2026-11-22.csv): one program per SM is
# best at every context from 1k to 128k (16 splits: 13.4 / 23.7 / 52.1 / 141 us at 1k / 8k / 32k /
# 128k, against 20.1 / 28.9 / 57.8 / 149 us with 64 splits and 52 / 55 / 91 / 178 us with 256):
# extra programs per SM add partials and combine work without adding bandwidth.
PROGRAMS_PER_SM = 1
# Cost of starting a program, in tokens of streaming (first-load latency, partial write).
PROGRAM_OVERHEAD_TOKENS = 128
# Splits as short as one 64-token block still pay off when they fill the GPU (batch 1 x 1k: 16
# splits of 64 tokens, 13.4 us, against 16.7 us with 4 splits of 256).
MIN_SPLIT_TOKENS = 64
# Automatic splits: up to 256, so that a single (batch, kv_head) pair still fills a GPU of up to
# 256 SMs/CUs (MI300X has 304 CUs: nearly); the combine merges them in chunks of
# COMBINE_MAX_BLOCK_S. An explicit num_splits may be larger.
MAX_SPLITS = 256
COMBINE_MAX_BLOCK_S = 64  # the combine reads partials in chunks of this many splits


def choose_num_splits(batch: int, kv_heads: int, max_seqlen: int, num_sms: int) -> int:
    """Splits per (batch, kv_head) for a cache of ``max_seqlen`` tokens on ``num_sms`` SMs/CUs.

    Model: programs run in waves of ``num_sms * PROGRAMS_PER_SM``; a program costs its chunk of
    tokens plus a fixed overhead. Among 1 .. min(MAX_SPLITS, max_seqlen // MIN_SPLIT_TOKENS)
    splits, pick the lowest ``waves * (tokens per split + overhead)`` (the fewest splits within 2%
    of it). So batch * kv_heads * splits reaches about PROGRAMS_PER_SM programs per SM when the
    context is long enough, the last wave is not mostly empty, and one split (no combine at all)
    is used when there are enough (batch, kv_head) pairs.
    """
    items = max(1, batch * kv_heads)
    slots = max(1, num_sms * PROGRAMS_PER_SM)
    s_max = max(1, min(MAX_SPLITS, max_seqlen // MIN_SPLIT_TOKENS))
    costs = [-(-items * s // slots) * (-(-max(max_seqlen, 1) // s) + PROGRAM_OVERHEAD_TOKENS)
             for s in range(1, s_max + 1)]
    # the fewest splits within 2% of the best (fewer partials to write and merge)
    return next(s for s, c in enumerate(costs, 1) if c <= 1.02 * min(costs))


_NUM_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small pretend GPU, so tests exercise several splits
    n = _NUM_SMS.get(device.index)
    if n is None:  # get_device_properties costs microseconds per call: ask once per device
        n = _NUM_SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


def knobs() -> tuple:
    """Module settings a plan depends on (callers that cache plans put these in their key)."""
    return (COMBINE_MODE, INT64_THRESHOLD, PROGRAMS_PER_SM, PROGRAM_OVERHEAD_TOKENS, MIN_SPLIT_TOKENS, MAX_SPLITS,
            COMBINE_MAX_BLOCK_S)


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


def _stream_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: ~10x cheaper
    return raw(device.index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _counters(device: torch.device, n: int, stream: Optional[int] = None) -> torch.Tensor:
    key = (device.type, device.index, _stream_of(device) if stream is None else stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


# "auto": the fused combine (one launch) when heads / kv_heads <= 16, else the combine kernel;
# "fused" / "kernel" force one (the bench times both).
COMBINE_MODE = os.environ.get("NUMASCHED_DECODE_COMBINE", "auto")


def _tune_bucket(tokens_per_split: int) -> int:
    """Coarse bucket of tokens per split (best BLOCK_N / stages differ for short and long splits)."""
    return min(4, max(0, (max(tokens_per_split, 1) - 1).bit_length() - 8) // 2)


def _span(t: torch.Tensor) -> int:
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0) + 1


# ----------------------------------------------------------------------------- plan
class DecodePlan:
    """Everything about a launch that depends only on shapes, strides, dtypes and settings.

    Building one costs the Python work (split choice, policy arguments, constexprs, autotuner
    key); ``launch`` then only gathers pointers and launches. ``numasched.decode`` keeps plans
    in a dict keyed on the inputs' metadata, so a decode step in a serving loop pays only ``launch``.
    """

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, *, scale: float, seqlen_max: int,
                 page_size: int, num_splits: Optional[int], policy, num_domains: int,
                 combine: Optional[str] = None):
        from numasched import mappings as M

        B, H, D = q.shape
        HK = k_cache.shape[2]
        G = H // HK
        dev = q.device
        S = int(num_splits) if num_splits is not None else choose_num_splits(B, HK, seqlen_max, num_sms(dev))
        grid_w = M.DecodeGrid(B, HK, S)  # checks the program count fits int32
        policy.check_grid(grid_w)
        mode = combine or COMBINE_MODE
        if mode not in ("auto", "fused", "kernel"):
            raise ValueError(f"combine must be 'auto', 'fused' or 'kernel', got {mode!r}")
        # auto: fused, unless a KV head has many query heads (the merge is unrolled over them)
        fused = mode == "fused" or (mode == "auto" and G <= 16)
        self.combine = 0 if S == 1 else (2 if fused else 1)
        self.device, self.num_splits, self.heads, self.items = dev, S, H, B * HK
        self.po_shape, self.pl_shape = (B, H, S, D), (B, H, S)
        n_po = B * H * S * D
        self.pl_offset = -(-n_po // 32) * 32  # keeps the lse partials 128-byte aligned
        self.ws_numel = self.pl_offset + B * H * S
        self._views: dict = {}

        BLOCK_G = max(16, triton.next_power_of_2(G))
        self.block_s = 16 if S <= 16 else COMBINE_MAX_BLOCK_S  # two sizes only: each is a separate compile
        self.block_d = BLOCK_D = max(16, triton.next_power_of_2(D))
        INT64 = max(_span(k_cache), _span(v_cache)) > INT64_THRESHOLD
        stride_sb = cache_seqlens.stride(0) if cache_seqlens is not None else 0
        stride_tb, stride_tp = block_table.stride() if block_table is not None else (0, 0)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
        self.tune_key = _tune_bucket(-(-seqlen_max // S)) * 2 + int(k_cache.stride(1) == D)
        # scalar arguments between the pointers and the output strides
        self.scalars = (float(scale) * LOG2E, B, HK, S, int(seqlen_max),
                        q.stride(0), q.stride(1),
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                        stride_sb, stride_tb, stride_tp)
        self.meta = dict(G=G, BLOCK_G=BLOCK_G, HEAD_DIM=D, BLOCK_D=BLOCK_D, PAGE_SIZE=int(page_size),
                         HAS_SEQLENS=cache_seqlens is not None, COMBINE=self.combine, INT64=INT64,
                         INPUT_PRECISION=precision, COMBINE_BLOCK_S=self.block_s, **policy.kernel_args(num_domains))
        self.grid = (B * HK * S,)
        self.interpret = _interpreting(dev)
        # the autotuner's key: its key columns plus every tensor argument's dtype (stand-ins keep
        # these the same with and without cache_seqlens / block_table / partials)
        self.tune_id = (D, int(page_size), BLOCK_G, INT64, self.tune_key, q.dtype, k_cache.dtype)
        cfg = dict(DEFAULT_GPU_CONFIG[page_size > 0])
        if D > 128:  # keep the K/V tiles within shared memory
            cfg["BLOCK_N"] = 32
        self.meta_fixed = {**self.meta, **cfg}
        self.meta_interp = {**self.meta, **INTERPRET_CONFIG}
        self._tuned = (None, None)  # (Config, meta with it)

    def _partials(self, stream: int, capturing: bool):
        if capturing:
            return (torch.empty(self.po_shape, dtype=torch.float32, device=self.device),
                    torch.empty(self.pl_shape, dtype=torch.float32, device=self.device))
        key = (self.device.type, self.device.index, stream)
        flat = _WORKSPACE.get(key)
        hit = self._views.get(stream)
        if hit is not None and hit[0] is flat:
            return hit[1], hit[2]
        if flat is None or flat.numel() < self.ws_numel:
            # a replaced buffer is freed stream-ordered by the caching allocator: safe to drop
            flat = _WORKSPACE[key] = torch.empty(self.ws_numel, dtype=torch.float32, device=self.device)
        po = flat[: self.po_shape[0] * self.heads * self.num_splits * self.po_shape[3]].view(self.po_shape)
        pl = flat[self.pl_offset: self.pl_offset + self.po_shape[0] * self.heads * self.num_splits].view(self.pl_shape)
        self._views[stream] = (flat, po, pl)
        return po, pl

    def launch(self, q, k_cache, v_cache, cache_seqlens, block_table, out, lse) -> int:
        """Launch on inputs with the metadata this plan was built for; fills ``out`` and ``lse``."""
        global LAUNCHES
        dev = self.device
        stream = _stream_of(dev)
        capturing = _capturing(dev)
        counter = _counters(dev, self.items, stream)
        po, pl = self._partials(stream, capturing) if self.combine else (lse, lse)
        # Unused pointer arguments get stand-ins of the same dtype, so the autotuner's key (which
        # includes every tensor's dtype) is the same with and without them.
        args = (q, k_cache, v_cache, cache_seqlens if cache_seqlens is not None else counter,
                block_table if block_table is not None else counter, out, lse, po, pl, counter,
                *self.scalars, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), self.tune_key)
        if self.interpret:
            _flash_decode_kernel[self.grid](*args, **self.meta_interp)
        elif not AUTOTUNE:
            _flash_decode_kernel[self.grid](*args, **self.meta_fixed)
        else:
            cfg = _TUNED_CONFIGS.get(self.tune_id)
            if cfg is not None:
                if self._tuned[0] is not cfg:
                    self._tuned = (cfg, {**self.meta, **cfg.all_kwargs()})
                _flash_decode_kernel[self.grid](*args, **self._tuned[1])
            elif capturing:  # tuning launches and synchronises, which capture forbids
                _flash_decode_kernel[self.grid](*args, **self.meta_fixed)
            else:
                _flash_decode_tuned[self.grid](*args, **self.meta)
                _TUNED_CONFIGS[self.tune_id] = _flash_decode_tuned.best_config
        if self.combine == 1:
            _combine_kernel[(self.po_shape[0] * self.heads,)](
                po, pl, out, lse, self.heads, self.num_splits, out.stride(0), out.stride(1), lse.stride(0),
                lse.stride(1), HEAD_DIM=self.po_shape[3], BLOCK_D=self.block_d, BLOCK_S=self.block_s, num_warps=4)
        LAUNCHES += 1
        return self.num_splits


# ----------------------------------------------------------------------------- launch
def flash_decode_launch(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, *, scale: float,
                        seqlen_max: int, page_size: int, num_splits: Optional[int], policy, num_domains: int,
                        combine: Optional[str] = None) -> int:
    """Launch the kernels on checked inputs; fills ``out`` (B, H, D) and ``lse`` (B, H). Returns the split count.

    ``seqlen_max`` is the cache capacity in tokens (max_len, or max_pages * page_size) and, when
    ``cache_seqlens`` is None, every sequence's length. ``page_size`` is 0 for a contiguous cache.
    Builds a one-off ``DecodePlan``; ``numasched.flash_decode`` caches plans instead.
    """
    plan = DecodePlan(q, k_cache, v_cache, cache_seqlens, block_table, scale=scale, seqlen_max=seqlen_max,
                      page_size=page_size, num_splits=num_splits, policy=policy, num_domains=num_domains,
                      combine=combine)
    return plan.launch(q, k_cache, v_cache, cache_seqlens, block_table, out, lse)
