"""Distributed Flash Decode: exchange per-rank partial (out, lse) and combine them on arrival.

The KV sequence is split across ranks; each rank has already computed, for its part of the
context, a partial attention output ``out_r`` (B, H, D) and its log-sum-exp ``lse_r`` (B, H)
(natural log). The exact result is the softmax-weighted merge

    m = max_r lse_r,   w_r = exp(lse_r - m),   out = sum_r w_r out_r / sum_r w_r,
    lse = m + log(sum_r w_r).

One program per batch row: it pushes its row of (out, lse) into every peer's receive buffer
``[slot][rank]`` (remote stores), sets the peer's flag ``flag[rank, b] = epoch`` (release, sys),
then waits for each peer's row (acquire, sys) and merges all ranks in the fixed order 0..world-1,
so every rank computes bitwise the same result. A rank whose part of the context is empty for a
row has lse = -inf; its (possibly NaN) out is ignored, and a row empty everywhere gives out = 0,
lse = -inf. Flags, epochs and bounded waits: :mod:`.dist_common`. Double buffering is enough
here for the same reason as in :mod:`.dist_gemm` (each call waits for data from every peer).
"""
import triton
import triton.language as tl

from .dist_common import epoch_begin, epoch_end, signal_peers, translate, wait_flag


@triton.jit
def decode_exchange_combine_kernel(
        out_ptr, lse_ptr, ro_ptr, rl_ptr, flags_ptr, res_ptr, res_lse_ptr,
        status_ptr, epoch_ptr, counters_ptr, heap_bases,
        rank, B, H, D, stride_ob, stride_oh, stride_od, stride_lb, stride_lh,
        num_programs, wait_bound,
        WORLD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        DO_PUSH: tl.constexpr, DO_COMBINE: tl.constexpr, WAIT: tl.constexpr, BUMP_EPOCH: tl.constexpr,
        WAIT_CLOCK: tl.constexpr):
    # out_ptr/lse_ptr: this rank's partials (any strides). ro_ptr: heap [2, WORLD, B, H, D] (out
    # dtype), rl_ptr: heap fp32 [2, WORLD, B, H], flags_ptr: heap int32 [WORLD, B].
    # res_ptr (B, H, D) and res_lse_ptr (B, H): contiguous results.
    pid = tl.program_id(0)
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic and TMA offsets stay 32-bit
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < H
    m2 = hm[:, None] & (d[None, :] < D)
    row = H * D
    for b in range(pid, B, num_programs):
        o = tl.load(out_ptr + b * stride_ob + h[:, None] * stride_oh + d[None, :] * stride_od, mask=m2, other=0.0)
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh, mask=hm, other=float("-inf"))
        packed = h[:, None] * D + d[None, :]      # the receive buffers are contiguous
        if DO_PUSH:
            for i in tl.static_range(1, WORLD):
                dest = (rank + i) % WORLD
                ro = ro_ptr + ((slot * WORLD + rank) * B + b).to(tl.int64) * row
                rl = rl_ptr + ((slot * WORLD + rank) * B + b).to(tl.int64) * H
                tl.store(translate(ro, rank, dest, heap_bases) + packed, o, mask=m2)
                tl.store(translate(rl, rank, dest, heap_bases) + h, lse, mask=hm)
            signal_peers(flags_ptr + rank * B + b, e, rank, heap_bases, WORLD, WAIT_CLOCK)
        if DO_COMBINE:
            m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
            s = tl.zeros((BLOCK_H,), tl.float32)
            acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
            for src in tl.static_range(WORLD):     # fixed rank order: bitwise equal on all ranks
                if src == rank:
                    o_r = o.to(tl.float32)
                    l_r = lse.to(tl.float32)
                else:
                    if WAIT:   # off only when timing with communication switched off
                        wait_flag(flags_ptr + src * B + b, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                    base = ((slot * WORLD + src) * B + b).to(tl.int64)
                    o_r = tl.load(ro_ptr + base * row + packed, mask=m2, other=0.0).to(tl.float32)
                    l_r = tl.load(rl_ptr + base * H + h, mask=hm, other=float("-inf"))
                m_new = tl.maximum(m, l_r)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # all -inf so far: weights 0
                alpha = tl.exp(m - m_ref)
                beta = tl.exp(l_r - m_ref)
                o_r = tl.where((l_r == float("-inf"))[:, None], 0.0, o_r)  # empty part: out may be NaN
                acc = acc * alpha[:, None] + o_r * beta[:, None]
                s = s * alpha + beta
                m = m_new
            res = tl.where((s > 0)[:, None], acc / tl.where(s > 0, s, 1.0)[:, None], 0.0)
            tl.store(res_ptr + b * row + packed, res.to(res_ptr.dtype.element_ty), mask=m2)
            tl.store(res_lse_ptr + b * H + h, tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), float("-inf")),
                     mask=hm)
    epoch_end(epoch_ptr, counters_ptr, num_programs, e, BUMP_EPOCH)
