"""Flash Decode over a work list: a persistent grid walks KV chunks of near-equal cost.

The split kernel (kernels/flash_decode.py) cuts every (batch, kv_head) into the same number of
splits of *its own* length, so with ragged lengths the programs of long sequences run much longer
than those of short ones and the launch takes as long as the longest chunk. Here the host
(numasched/decode_worklist.py) cuts the batch into work items of about equal cost once per batch
layout, and a persistent grid of P programs walks them:

1. Work items are rows of ``WORK`` (int32, ``WORK_FIELDS`` per item, grouped by program):
   ``(pair, start, end, j, n, prow0)`` -- pair = batch * HK + kv_head; tokens [start, end) of that
   sequence, ``end = -1`` meaning "to the sequence's length at run time" (the last item of a
   pair: the plan stays valid while sequences grow); j is the item's index among the n items of
   its pair; prow0 the pair's first row in the partial buffers. Program g runs items
   ``PROG[g] .. PROG[g + 1] - 1``, in that order (the host decides which program runs what:
   on a multi-domain GPU each domain's programs take items of their domain's queue).
2. Each item computes the online softmax of the pair's G query heads (packed into the rows of one
   tile, as the split kernel does) over its token range with the split kernel's KV loop
   (``_attend``: tl.dot, contiguous or paged cache, bounded indices, int64 offsets when asked).
3. A pair with one item writes out and lse directly. Otherwise each item writes its normalised
   partial (fp32, row prow0 + head * n + j) and its log2-sum-exp, then bumps the pair's arrival
   counter; the item that arrives last merges the pair's n partials with the split kernel's
   ``_combine_heads`` and resets the counter (so CUDA-graph replays start from zero).

Run-time lengths come from ``SEQLENS`` on the device (clamped to the capacity): an item whose
range starts at or beyond the current length is empty (lse -inf, weighs nothing in the merge), so
any lengths give the right result; only the balance depends on how close they are to the planned
ones. An empty sequence gives zeros and lse = -inf.
"""
from __future__ import annotations

import triton
import triton.language as tl

from numasched.caps import LN2 as _LN2

from .flash_decode import _attend, _combine_heads
from numasched.kernels.pdl import pdl_enter

LN2 = tl.constexpr(_LN2)

# int32 fields per work item (32-byte rows): pair, start, end (-1: open), j, n, prow0, 2 spare.
WORK_FIELDS = 8
F_PAIR, F_START, F_END, F_J, F_N, F_PROW = 0, 1, 2, 3, 4, 5


@triton.jit
def _flash_decode_worklist_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O, LSE, PO, PL, COUNTER, WORK, PROG,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    HK, seqlen_max, num_pages,
    stride_qb, stride_qh,
    stride_kb, stride_kn, stride_kh,  # contiguous: batch, token, head; paged: page, slot, head
    stride_vb, stride_vn, stride_vh,
    stride_sb, stride_tb, stride_tp,
    stride_ob, stride_oh, stride_lb, stride_lh,
    tune_key,  # unused in the kernel: tokens-per-item bucket and layout (autotuning key)
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # 0: contiguous cache
    HAS_SEQLENS: tl.constexpr, INT64: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    COMBINE_BLOCK_S: tl.constexpr, WORK_STRIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    pid = tl.program_id(0)
    t_lo = tl.load(PROG + pid)
    t_hi = tl.load(PROG + pid + 1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_f = tl.arange(0, WORK_STRIDE)
    gmask = offs_g < G
    omask = gmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    for t in range(t_lo, t_hi):
        # the item's fields in one 32-byte load (separate scalar loads keep more registers live
        # across the item loop: 8 bytes of spills at 128 registers on sm_90, checked offline)
        f = tl.load(WORK + t * WORK_STRIDE + offs_f)
        pair = tl.sum(tl.where(offs_f == 0, f, 0), 0)
        lo = tl.sum(tl.where(offs_f == 1, f, 0), 0)
        end = tl.sum(tl.where(offs_f == 2, f, 0), 0)
        j = tl.sum(tl.where(offs_f == 3, f, 0), 0)
        n = tl.sum(tl.where(offs_f == 4, f, 0), 0)
        prow0 = tl.sum(tl.where(offs_f == 5, f, 0), 0).to(tl.int64)
        b = pair // HK
        kvh = pair % HK
        b64 = b.to(tl.int64)
        kvh64 = kvh.to(tl.int64)
        if HAS_SEQLENS:
            # bounded: a length outside [0, capacity] reads no memory beyond the cache
            seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b64 * stride_sb), 0), seqlen_max)
        else:
            seqlen = seqlen_max
        # the last item runs to the current length; the others stop at theirs (or at the length)
        hi = tl.where(end < 0, seqlen, tl.minimum(end, seqlen))

        heads = kvh * G + offs_g
        q_ptrs = Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        if HEAD_DIM == BLOCK_D:
            q = tl.load(q_ptrs, mask=gmask[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=gmask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        m_i, l_i, acc = _attend(q, K, V, BLOCK_TABLE, b64, kvh64, lo, hi, hi, offs_n, offs_d, qk_scale, num_pages,
                                stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_tb,
                                stride_tp, False, BLOCK_G, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, INT64,
                                INPUT_PRECISION)
        nonempty = l_i > 0
        l_safe = tl.where(nonempty, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse2 = tl.where(nonempty, m_i + tl.math.log2(l_safe), float("-inf"))
        if n == 1:
            # the pair's only item: this is the answer
            tl.store(O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty),
                     mask=omask)
            tl.store(LSE + b64 * stride_lb + heads * stride_lh, lse2 * LN2, mask=gmask)
        else:
            # partial rows of the pair: head i's n partials are rows prow0 + i*n .. + n-1
            rows = prow0 + offs_g.to(tl.int64) * n + j
            tl.store(PO + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=omask)
            tl.store(PL + rows, lse2, mask=gmask)
            # The last item of the pair to arrive merges all n. The barrier orders every thread's
            # partial stores before the release of the arrival; the merge reads with .cg (L2, not
            # this SM's L1) so it sees the other programs' partials.
            tl.debug_barrier()
            ctr = COUNTER + pair
            arrived = tl.atomic_add(ctr, 1, sem="acq_rel")
            if arrived == n - 1:
                _combine_heads(PO, PL, O + b64 * stride_ob + (kvh * G) * stride_oh,
                               LSE + b64 * stride_lb + (kvh * G) * stride_lh, prow0, n, stride_oh, stride_lh,
                               G, HEAD_DIM, BLOCK_D, COMBINE_BLOCK_S, ".cg")
                tl.atomic_xchg(ctr, 0)  # ready for the next launch (and CUDA graph replays)


# ----------------------------------------------------------------------------- configs
# Programs per SM the persistent grid is planned for (numasched.decode_worklist.PROGRAMS_PER_SM).
RESIDENT_PROGRAMS = 2


def max_registers(num_warps: int, hip: bool = False):
    """The ``maxnreg`` launch option: with 4 warps or fewer, up to 248 registers per thread (two
    programs still fit an SM's 64K registers). Without it ptxas aims at more resident blocks than
    the grid has per SM and spills: offline sm_90 compiles of the split kernel's configs on this
    kernel (d64/d128, G 1/4/8) spilled 4-24 bytes in 7 of 57 (at 96 or 128 registers), none with
    the option. 8 warps: None (ptxas's own choice, as for the split kernel). AMD: None (no such
    option)."""
    if hip or num_warps > 4:
        return None
    return min(255, 65536 // (RESIDENT_PROGRAMS * 32 * num_warps)) // 8 * 8


def with_registers(config: dict, hip: bool = False) -> dict:
    """A kernel config with its ``maxnreg`` (see :func:`max_registers`)."""
    mx = max_registers(int(config.get("num_warps", 4)), hip)
    return dict(config, maxnreg=mx) if mx is not None else dict(config)


def _tuned():
    """The autotuned form: the split kernel's configs (with :func:`max_registers`) and pruning
    (same argument names K, tune_key, PAGE_SIZE, BLOCK_D, BLOCK_G). Items are whole 128-token
    granules of >= 256 tokens, so the tune key's bucket is the item length."""
    from numasched import caps

    from .flash_decode import _GPU_CONFIGS, _prune_configs

    hip = caps.is_hip()
    configs = [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages,
                             maxnreg=max_registers(c.num_warps, hip)) for c in _GPU_CONFIGS]
    return triton.autotune(configs=configs, key=["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "INT64", "tune_key"],
                           prune_configs_by={"early_config_prune": _prune_configs})(_flash_decode_worklist_kernel)


_flash_decode_worklist_tuned = _tuned()
