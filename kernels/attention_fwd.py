"""Prefill attention forward (FlashAttention-2 style), one kernel for every mapping policy.

Layout: q (B, H, Lq, D), k and v (B, HK, Lk, D), any strides with a unit last stride; HK divides
H (GQA: query head h reads KV head h // (H // HK)). Outputs: o (B, H, Lq, D) (any strides) and
the log-sum-exp lse (B, H, Lq) in float32, natural log.

Masking: with CAUSAL, key j is visible to query i iff j <= i + causal_offset. causal_offset = 0
is torch's ``is_causal`` (top-left aligned); Lk - Lq is FlashAttention's bottom-right alignment.
A query row that sees no key gets zeros and lse = -inf (never NaN).

Work items: program ``pid`` works on query block m of head h of batch element b, where

    b, h, m = attention_item(pid, B, H, HK, NB, MAPPING)     # the mapping policy, one constexpr

so every registered attention policy runs with this one kernel (numasched/mappings).

The loop is FlashAttention-2's online softmax in base 2 (log2(e) folded into the scale), split
in two stages so that the common blocks pay for no mask at all:
  1. key blocks that every row of the query block sees in full: no masking;
  2. the blocks on the causal diagonal and the ragged end of the keys: masked.
Loads use TMA tensor descriptors (``tl.make_tensor_descriptor``, Hopper and later; zero padding
outside the tensor) or plain pointer loads (USE_TMA=False; the interpreter runs both).

Host planning (configs chosen, TMA eligibility, launches) is numasched/attention.py's.
"""
import torch
import triton
import triton.language as tl

from numasched import caps
from numasched.mappings.jit import attention_item


@triton.jit
def _attn_stage(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn,
                lo, hi, offs_m, Lk, qk_scale, causal_offset,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One stage of the online softmax over key blocks [lo, hi); MASKED adds the key mask."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kn = start_n + offs_n
        # -- load K and V for this block (zeros beyond Lk and beyond HEAD_DIM) --
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            kv_mask = offs_d[None, :] < HEAD_DIM
            if MASKED:
                kv_mask = kv_mask & (kn[:, None] < Lk)
            k = tl.load(k_ptr + kn[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kn[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            valid = kn[None, :] < Lk
            if CAUSAL:
                valid = valid & (kn[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(valid, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key yet keeps m = -inf; subtract 0 there so exp2 gives 0, not NaN
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_sub[:, None])
        else:
            # every score is finite here: scale after the row max (one FMA per score)
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE,
                    stride_qb, stride_qh, stride_qm,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_om,
                    B, H, HK, Lq, Lk, qk_scale, causal_offset,
                    Q_BUCKET, K_BUCKET, TMA_OK,  # autotuning keys and pruning only
                    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, LPT: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, MAPPING: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    USE_TMA: tl.constexpr):
    # ---- which work item: the mapping policy decides ----
    NB = tl.cdiv(Lq, BLOCK_M)
    b, h, m = attention_item(tl.program_id(0), B, H, HK, NB, MAPPING)
    if LPT:
        # causal: the policy's block m runs the (NB-1-m)-th block, so the costliest blocks of a
        # head start first (longest-processing-time order); which program shares K/V is unchanged
        m = NB - 1 - m
    hk = h // (H // HK)
    start_m = m * BLOCK_M

    # 64-bit offsets of this (batch, head) slice; the kernel indexes inside a slice in int32
    q_ptr = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_ptr = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    o_ptr = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    # ---- Q block: loaded once, stays in registers ----
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[Lq, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[Lk, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[Lk, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[Lq, HEAD_DIM], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        q = q_desc.load([start_m, 0])
    else:
        k_desc = 0
        v_desc = 0
        q_mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # ---- key ranges of the two stages ----
    if CAUSAL:
        # the first row of the block sees keys < start_m + causal_offset + 1, the last row keys
        # < start_m + BLOCK_M + causal_offset
        full_end = tl.minimum(start_m + causal_offset + 1, Lk)
        hi = tl.minimum(start_m + BLOCK_M + causal_offset, Lk)
    else:
        full_end = Lk
        hi = Lk
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, 0)

    # stage 1: key blocks every row sees in full
    acc, l_i, m_i = _attn_stage(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn,
                                0, full_end, offs_m, Lk, qk_scale, causal_offset,
                                False, CAUSAL, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, DOT_PRECISION)
    # stage 2: the diagonal and the ragged end, masked
    acc, l_i, m_i = _attn_stage(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn,
                                full_end, hi, offs_m, Lk, qk_scale, causal_offset,
                                True, CAUSAL, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, DOT_PRECISION)

    # ---- epilogue: normalise; rows that saw no key give 0 and lse = -inf ----
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    lse_ptr = LSE + (b.to(tl.int64) * H + h) * Lq
    tl.store(lse_ptr + offs_m, lse, mask=offs_m < Lq)
    if USE_TMA:
        o_desc.store([start_m, 0], out.to(O.dtype.element_ty))
    else:
        o_mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_ptr + offs_m[:, None] * stride_om + offs_d[None, :], out.to(O.dtype.element_ty), mask=o_mask)


# ------------------------------------------------------------------------------------ configs
def _config(bm, bn, warps, stages, tma):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}, num_warps=warps, num_stages=stages)


# Hopper guidance (triton.md, the Triton tutorial): BLOCK_M 128 with 8 warps (two warpgroups of
# 64 rows), BLOCK_N 64-128, 2-3 stages. Four warps on 128 rows fit registers only for D <= 64;
# a 64-row config covers short sequences and wide heads. (Compiled for sm_90 offline with
# compile_report: every 16-bit config below uses wgmma without spills at D 64 and 128.)
_GPU_SHAPES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]
_NARROW_SHAPES = [(128, 64, 4, 3), (128, 128, 4, 2)]  # D <= 64 only
# fp32 uses IEEE dots (FMA, not tensor cores): small tiles, to limit register spills
_FP32_SHAPES = [(32, 32, 4, 2), (64, 32, 8, 2), (32, 32, 8, 1)]
GPU_CONFIGS = [_config(bm, bn, w, s, tma) for tma in (True, False)
               for (bm, bn, w, s) in _GPU_SHAPES + _NARROW_SHAPES + _FP32_SHAPES]
_FP32_KEYS = set(_FP32_SHAPES)
_NARROW_KEYS = set(_NARROW_SHAPES)

# The interpreter: small blocks so tiny test shapes still cover several blocks and both stages.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, USE_TMA=False, num_warps=4, num_stages=1)
# A fixed GPU config (no autotuning: quick benchmarks, CUDA graph capture without warm-up).
DEFAULT_GPU_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, USE_TMA=True, num_warps=8, num_stages=3)


def fixed_config(dtype: torch.dtype, head_dim: int, tma_ok: bool = True) -> dict:
    """The config used without autotuning (NUMASCHED_AUTOTUNE=0, as the GPU tests run)."""
    if dtype == torch.float32:
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    elif head_dim > 128:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    else:
        cfg = dict(DEFAULT_GPU_CONFIG)
    cfg["USE_TMA"] = bool(tma_ok)
    cfg["num_stages"] = caps.cap_stages("attention", cfg["num_stages"])
    return cfg


def _keep(shape, tma, *, fp32: bool, head_dim: int, tma_ok: bool) -> bool:
    bm, bn, w, s = shape
    if tma and not tma_ok:
        return False
    if (shape in _FP32_KEYS) != fp32:
        return False
    if shape in _NARROW_KEYS and head_dim > 64:
        return False
    if head_dim > 128 and not fp32 and (bm > 64 or bn > 64):
        return False  # wide heads: keep Q, K and V tiles within shared memory
    return True


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    fp32 = args["Q"].dtype == torch.float32
    keep = [c for c in configs
            if _keep((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), c.kwargs["USE_TMA"],
                     fp32=fp32, head_dim=args["HEAD_DIM"], tma_ok=bool(args["TMA_OK"]))
            and c.num_stages == caps.cap_stages("attention", c.num_stages)]
    return keep or [_config(32, 32, 4, 2, False)]


attn_fwd_autotuned = triton.autotune(
    GPU_CONFIGS, key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "TMA_OK"],
    prune_configs_by={"early_config_prune": _prune})(attn_fwd_kernel)


# ------------------------------------------------------------------------------------ launch
def bucket(n: int) -> int:
    """Autotuning key for a length: the next power of two (so HF's many lengths share tunings)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (at least 16: the dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))
