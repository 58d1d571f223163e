"""All-reduce over the symmetric heap: one-shot and two-shot, pipelined chunk by chunk.

Every rank holds ``x`` (n elements); every rank gets ``out = x_0 + x_1 + ... + x_{W-1}``, summed
in fp32 in rank order, so the result is bit-identical on every rank. Host side:
numasched/distributed/all_reduce.py.

The work is cut into chunks of ``BLOCK`` elements; program ``p`` of ``P`` owns chunks
``p, p + P, p + 2P, ...`` (its ``iters`` chunks), on every rank alike, so program ``p`` of a rank
only ever waits for program ``p`` of its peers: no program waits for another program of its own
GPU, and with ``P`` <= SMs every program is resident.

one-shot (``TWO_SHOT=False``), chunk i:
    stage 1  push x[chunk] into every peer's ``buf[slot, rank]``, raise flag (0, rank, p) there
    stage 2  (one chunk behind) wait for every peer's flag, sum the W copies, store out[chunk]
two-shot (``TWO_SHOT=True``): rank r owns shard r of ``shard`` elements; chunk i of a shard:
    stage 1  push x[shard d, chunk] into rank d's ``buf[slot, rank]``; flag (0, rank, p) on d
    stage 2  (one behind) wait, sum shard r's chunk from all W, store out and push the sum into
             every peer's ``buf2[slot]`` at its place; flag (1, rank, p) there
    stage 3  (two behind) wait for every peer's flag 1, copy its reduced chunk from buf2 to out
One-shot moves (W-1) n elements out of each rank, two-shot 2 (W-1)/W n: the host picks.

Stages lag one chunk behind each other so a program never waits for the chunk it has just pushed
(whose stores are still in flight over NVLink), and pushing overlaps reducing. ``BULK`` (large
messages) runs each stage over all of a program's chunks before its one signal instead: a signal
is a system-scope fence, a round trip over the link, and the pipelined loop pays two per chunk.

Flags are int64 counters, one per (phase, source rank, program). Chunk i of call e raises its
flag to ``(e - 1) * iters + i + 1``: values only grow across calls, so nothing is ever cleared
and a CUDA graph replays correctly (the epoch lives in device memory, see dist_common). Receive
buffers are double-buffered by the epoch's parity: a peer can only be one call ahead (it cannot
finish call e + 1 before we pushed our part of it, which we do after our call e has finished
reading). ``STAGES`` (a bit mask) runs a subset of the stages: the CPU simulation runs each
stage on every rank before the next (the interpreter runs one program at a time).
"""
import triton
import triton.language as tl

from numasched.kernels.dist_common import (cta_barrier, epoch_begin, epoch_end, ll_tag, signal_peers, store_words,
                                           translate, wait_flag, wait_words)
from numasched.kernels.pdl import pdl_enter


@triton.jit
def _ld(ptr, m, EVEN: tl.constexpr):
    # a whole chunk needs no mask: unmasked 16-byte vector loads whatever n is
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=m, other=0.0)


@triton.jit
def _st(ptr, v, m, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, v)
    else:
        tl.store(ptr, v, mask=m)


@triton.jit
def _push_chunk(src_ptr, dst_local, d, rank, heap_bases, m, EVEN: tl.constexpr):
    """Copy one chunk from local ``src_ptr`` into rank ``d``'s copy of heap address ``dst_local``."""
    _st(translate(dst_local, rank, d, heap_bases), _ld(src_ptr, m, EVEN), m, EVEN)


@triton.jit
def _reduce_chunk(x_ptr, recv, span, c, g, m, out_ptr, flags_ptr, P, p, target, rank, status_ptr, wait_bound,
                  WORLD: tl.constexpr, BLOCK: tl.constexpr, WAIT_CLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Sum the WORLD copies of one chunk in rank order (x for our own), store it at out + g."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):   # rank order: the same rounding on every rank
        if src == rank:
            total += _ld(x_ptr + g, m, EVEN).to(tl.float32)
        else:
            wait_flag(flags_ptr + src * P + p, target, src, status_ptr, wait_bound, WAIT_CLOCK)
            total += _ld(recv + src * span + c, m, EVEN).to(tl.float32)
    res = total.to(out_ptr.dtype.element_ty)
    _st(out_ptr + g, res, m, EVEN)
    return res


@triton.jit
def _stage_push(x_ptr, recv, span, nn, i, P, p, offs, rank, heap_bases, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                TWO_SHOT: tl.constexpr):
    """Stage 1 for chunk i: two-shot, x's chunk of shard d into rank d's receive slot; one-shot,
    x's chunk into every peer's. No signal (the caller raises it)."""
    c0 = (i * P + p).to(tl.int64) * BLOCK
    c = c0 + offs                                      # offset inside a shard (or x)
    if TWO_SHOT:
        for d in tl.static_range(WORLD):
            if d != rank:
                lim = tl.minimum(span, nn - d * span)   # this shard's length
                m = c < lim
                if c0 + BLOCK <= lim:
                    _push_chunk(x_ptr + d * span + c, recv + rank * span + c, d, rank, heap_bases, m, True)
                else:
                    _push_chunk(x_ptr + d * span + c, recv + rank * span + c, d, rank, heap_bases, m, False)
    else:
        m = c < nn
        for d in tl.static_range(WORLD):
            if d != rank:
                if c0 + BLOCK <= nn:
                    _push_chunk(x_ptr + c, recv + rank * span + c, d, rank, heap_bases, m, True)
                else:
                    _push_chunk(x_ptr + c, recv + rank * span + c, d, rank, heap_bases, m, False)


@triton.jit
def _stage_reduce(x_ptr, out_ptr, recv, reduced, span, nn, j, target, flags_ptr, P, p, offs, rank, heap_bases,
                  status_ptr, wait_bound, WORLD: tl.constexpr, BLOCK: tl.constexpr, TWO_SHOT: tl.constexpr,
                  WAIT_CLOCK: tl.constexpr):
    """Stage 2 for chunk j once the peers' flag 0 reaches ``target``: sum it (two-shot: of our own
    shard, and push the sum into every peer's reduced slot). No signal."""
    c0 = (j * P + p).to(tl.int64) * BLOCK
    c = c0 + offs
    if TWO_SHOT:
        lim = tl.minimum(span, nn - rank * span)
        g = rank * span + c
    else:
        lim = nn
        g = c
    m = c < lim
    if c0 + BLOCK <= lim:
        _reduce_share(x_ptr, out_ptr, recv, reduced, span, c, g, m, flags_ptr, P, p, target, rank, heap_bases,
                      status_ptr, wait_bound, WORLD, BLOCK, TWO_SHOT, WAIT_CLOCK, True)
    else:
        _reduce_share(x_ptr, out_ptr, recv, reduced, span, c, g, m, flags_ptr, P, p, target, rank, heap_bases,
                      status_ptr, wait_bound, WORLD, BLOCK, TWO_SHOT, WAIT_CLOCK, False)


@triton.jit
def _reduce_share(x_ptr, out_ptr, recv, reduced, span, c, g, m, flags_ptr, P, p, target, rank, heap_bases,
                  status_ptr, wait_bound, WORLD: tl.constexpr, BLOCK: tl.constexpr, TWO_SHOT: tl.constexpr,
                  WAIT_CLOCK: tl.constexpr, EVEN: tl.constexpr):
    """One chunk of stage 2: the sum (stored at out + g), and two-shot its push to every peer."""
    res = _reduce_chunk(x_ptr, recv, span, c, g, m, out_ptr, flags_ptr, P, p, target, rank, status_ptr, wait_bound,
                        WORLD, BLOCK, WAIT_CLOCK, EVEN)
    if TWO_SHOT:
        for d in tl.static_range(WORLD):
            if d != rank:
                _st(translate(reduced + g, rank, d, heap_bases), res, m, EVEN)


@triton.jit
def _stage_gather(out_ptr, reduced, span, nn, k, target, flags_ptr, P, p, offs, rank, status_ptr, wait_bound,
                  WORLD: tl.constexpr, BLOCK: tl.constexpr, WAIT_CLOCK: tl.constexpr):
    """Stage 3 (two-shot) for chunk k: once each peer's flag 1 reaches ``target``, copy its reduced
    chunk from our reduced slots into out."""
    c0 = (k * P + p).to(tl.int64) * BLOCK
    c = c0 + offs
    for src in tl.static_range(WORLD):
        if src != rank:
            g = src * span + c
            lim = tl.minimum(span, nn - src * span)
            m = c < lim
            wait_flag(flags_ptr + (WORLD + src) * P + p, target, src, status_ptr, wait_bound, WAIT_CLOCK)
            if c0 + BLOCK <= lim:
                _st(out_ptr + g, _ld(reduced + g, m, True), m, True)
            else:
                _st(out_ptr + g, _ld(reduced + g, m, False), m, False)


@triton.jit(do_not_specialize=["n", "iters"])
def all_reduce_kernel(x_ptr, out_ptr, buf_ptr, buf2_ptr, flags_ptr, status_ptr, epoch_ptr, counters_ptr,
                      heap_bases, rank, n, shard, iters, wait_bound,
                      WORLD: tl.constexpr, BLOCK: tl.constexpr, TWO_SHOT: tl.constexpr, STAGES: tl.constexpr,
                      BUMP_EPOCH: tl.constexpr, WAIT_CLOCK: tl.constexpr, PDL: tl.constexpr = False,
                      ONE_PROGRAM: tl.constexpr = False, BULK: tl.constexpr = False):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    # x_ptr, out_ptr: (n,) contiguous (out may be x). buf_ptr: heap (2, WORLD, span) received
    # copies (span = shard: n rounded up to 16 one-shot, the shard two-shot); buf2_ptr: heap (2, WORLD * shard) reduced shards
    # (two-shot). flags_ptr: heap int64 (2, WORLD, P). A chunk that lies wholly inside its
    # tensor or shard runs unmasked (EVEN): n need not be a multiple of anything.
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic and TMA offsets stay 32-bit
    p = tl.program_id(0)
    P = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    nn = tl.zeros([], tl.int64) + n
    base = (e - 1).to(tl.int64) * iters
    # the receive buffer's stride per source: the shard (two-shot), or n rounded up to 16
    # elements (one-shot), a multiple of 16 Triton knows of, so pushes stay 16-byte vectors
    span = tl.zeros([], tl.int64) + shard
    recv = buf_ptr + (slot * WORLD).to(tl.int64) * span     # this call's receive slots, by source
    reduced = buf2_ptr + (slot * WORLD).to(tl.int64) * span
    flag0 = flags_ptr + rank * P + p                        # (0, rank, p): ours, as peers see it
    flag1 = flags_ptr + (WORLD + rank) * P + p              # (1, rank, p)

    if BULK:
        # Large messages: each stage over all of this program's chunks, then one signal. Two
        # system-scope fences a call instead of two a chunk, and every push of a stage in flight
        # at once; the flags jump straight to the call's last value, base + iters.
        done = base + iters
        if (STAGES & 1) != 0:
            for i in range(0, iters):
                _stage_push(x_ptr, recv, span, nn, i, P, p, offs, rank, heap_bases, WORLD, BLOCK, TWO_SHOT)
            signal_peers(flag0, done, rank, heap_bases, WORLD, WAIT_CLOCK)
        if (STAGES & 2) != 0:
            for j in range(0, iters):
                _stage_reduce(x_ptr, out_ptr, recv, reduced, span, nn, j, done, flags_ptr, P, p, offs, rank,
                              heap_bases, status_ptr, wait_bound, WORLD, BLOCK, TWO_SHOT, WAIT_CLOCK)
            if TWO_SHOT:
                signal_peers(flag1, done, rank, heap_bases, WORLD, WAIT_CLOCK)
        if TWO_SHOT:
            if (STAGES & 4) != 0:
                for k in range(0, iters):
                    _stage_gather(out_ptr, reduced, span, nn, k, done, flags_ptr, P, p, offs, rank, status_ptr,
                                  wait_bound, WORLD, BLOCK, WAIT_CLOCK)
    else:
        for i in range(0, iters + 2):   # stages run 0, 1 and 2 chunks behind (one-shot: the last trip idles)
            if (STAGES & 1) != 0:       # stage 1: push chunk i
                if i < iters:
                    _stage_push(x_ptr, recv, span, nn, i, P, p, offs, rank, heap_bases, WORLD, BLOCK, TWO_SHOT)
                    signal_peers(flag0, base + i + 1, rank, heap_bases, WORLD, WAIT_CLOCK)
            if (STAGES & 2) != 0:       # stage 2: reduce chunk i - 1
                j = i - 1
                if (j >= 0) & (j < iters):
                    _stage_reduce(x_ptr, out_ptr, recv, reduced, span, nn, j, base + j + 1, flags_ptr, P, p, offs,
                                  rank, heap_bases, status_ptr, wait_bound, WORLD, BLOCK, TWO_SHOT, WAIT_CLOCK)
                    if TWO_SHOT:
                        signal_peers(flag1, base + j + 1, rank, heap_bases, WORLD, WAIT_CLOCK)
            if TWO_SHOT:                # stage 3: gather chunk i - 2 of every peer's reduced shard
                if (STAGES & 4) != 0:
                    k = i - 2
                    if (k >= 0) & (k < iters):
                        _stage_gather(out_ptr, reduced, span, nn, k, base + k + 1, flags_ptr, P, p, offs, rank,
                                      status_ptr, wait_bound, WORLD, BLOCK, WAIT_CLOCK)

    epoch_end(epoch_ptr, counters_ptr, P, e, BUMP_EPOCH, ONE_PROGRAM)


@triton.jit
def _push_row(v, dst, m, flag, value, rank, heap_bases, WORLD: tl.constexpr, WAIT_CLOCK: tl.constexpr):
    """The row ``v`` into every peer's copy of ``dst`` (our heap's address), then ``flag`` raised
    to ``value`` on every peer (signal_peers: after the stores)."""
    for d in tl.static_range(WORLD):
        if d != rank:
            tl.store(translate(dst, rank, d, heap_bases), v, mask=m)
    signal_peers(flag, value, rank, heap_bases, WORLD, WAIT_CLOCK)


@triton.jit
def _ll_pack(v, tag):
    """A row (BLOCK_N elements of 16 or 32 bits) as LL words: two 16-bit elements' bits (or one
    32-bit element's) in the low half of each int64, ``tag`` in the high half."""
    if v.dtype.primitive_bitwidth == 16:
        bits = v.to(tl.uint16, bitcast=True)
        lo, hi = tl.split(tl.reshape(bits, (v.shape[0] // 2, 2)))
        d32 = lo.to(tl.uint32) | (hi.to(tl.uint32) << 16)
    else:
        d32 = v.to(tl.uint32, bitcast=True)
    return (tag.to(tl.int64) << 32) | d32.to(tl.int64)


@triton.jit
def _ll_unpack(w, dtype: tl.constexpr):
    """A row (fp32) from its LL words ``w`` (the inverse of :func:`_ll_pack`): each word polled once,
    then its two 16-bit elements interleaved back into the row's order (a layout change on chip)."""
    if dtype.primitive_bitwidth == 16:
        lo = (w & 0xFFFF).to(tl.uint16)
        hi = ((w >> 16) & 0xFFFF).to(tl.uint16)
        bits = tl.reshape(tl.join(lo, hi), (w.shape[0] * 2,))
    else:
        bits = (w & 0xFFFFFFFF).to(tl.uint32)
    return bits.to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _add_norm_store(total, r_in, w, res_out_ptr, y_ptr, x_ptr, offs, m, N, eps):
    """s = total rounded to x's dtype (as an all-reduce returns it); r = residual + s, rounded
    (the new residual stream, stored); y = w * round(r / rms(r)) (transformers' RMSNorm)."""
    s = total.to(x_ptr.dtype.element_ty)
    r = (r_in + s.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + offs, r, mask=m)
    rf = r.to(tl.float32)
    # the sum's order follows the row's register layout, which differs between the flag and LL
    # forms (8 against 2 elements a thread on sm_90): their y can differ by one rounding in rare
    # rows (two H200s: 23 elements of one row in 3200); r never does. Summing in fp64 removes it
    # and cost a median 0.4 us (7.6 %) a call there, slower in 62 of 78 paired runs
    # (bench/results/tp2-s51/arn-ab/): 64 calls a TP 2 decode step, so it stays fp32
    inv = 1.0 / tl.sqrt(tl.sum(rf * rf, 0) / N + eps)
    normed = (rf * inv).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, (w * normed.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["M", "iters"])
def all_reduce_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, res_out_ptr, y_ptr, buf_ptr, flags_ptr, status_ptr,
                                  epoch_ptr, counters_ptr, heap_bases, rank, M, N, iters, eps, wait_bound, ll_ptr,
                                  pcount_ptr, signals,
                                  WORLD: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                                  BUMP_EPOCH: tl.constexpr, WAIT_CLOCK: tl.constexpr, PDL: tl.constexpr = False,
                                  ONE_PROGRAM: tl.constexpr = False, ONE_ROW: tl.constexpr = False,
                                  LL: tl.constexpr = False, PUSHED: tl.constexpr = False):
    """One-shot all-reduce of x (M, N) fused with the transformer's residual add and RMSNorm:

        s = sum over ranks of x        (fp32 in rank order, rounded to x's dtype, as an all-reduce returns it)
        r = residual + s                (rounded: the new residual stream)
        y = w * round(r / rms(r))       (transformers' RMSNorm: normalise in fp32, round, then scale)

    Program p owns rows p, p + P, ... (a row must be whole for its norm: decode-sized M). Stage 1
    pushes row i to every peer and raises flag (rank, p) to ``(epoch - 1) * iters + i + 1``;
    stage 2, one row behind, waits, sums, adds, normalises and stores r and y (ONE_ROW, a row per
    program: stage 2 loads all but the peers' parts before it waits; with LL the row goes as
    tagged 8-byte words into ll_ptr, heap int64 (2, WORLD, M, ceil(N / PACK)), polled until every
    word carries the call's tag: no fence, no flag). buf: heap
    (2, WORLD, M, N) in x's dtype; flags: heap int64 (WORLD, P).

    PUSHED (ONE_ROW, flag form): the kernel that produced x already stored every peer's part into
    our ``buf`` (its slot ``epoch % 2``, as here) and, after its stores, added ``signals`` to our
    ``pcount_ptr[src]`` (heap int64 (WORLD,), release at system scope; e.g. one add a 64-column
    band: kernels/gemm_weight_first.py, and ``arn_push_kernel`` below). Nothing is pushed here: a
    program waits until ``pcount[src] >= epoch * signals`` for each peer, then sums as above.
    The counts only grow, so a plan's calls must all be pushed ones (the host keys them apart)."""
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic and TMA offsets stay 32-bit
    p = tl.program_id(0)
    P = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    part = tl.zeros([], tl.int64) + M * N
    recv = buf_ptr + (slot * WORLD).to(tl.int64) * part
    base = (e - 1).to(tl.int64) * iters
    flag = flags_ptr + rank * P + p
    if ONE_ROW:
        # decode (iters == 1: a row per program; options.arn_one_row=False on the host for an A/B):
        # the row's own part, its residual and the norm weight are loaded before the wait for the
        # peers' parts, so their latency hides under the link's round trip instead of following
        # it; then the same sum, in rank order, as below
        row = p.to(tl.int64)
        m = cmask & (row < M)
        # LL: PACK elements a word (16-bit dtypes 2, 32-bit 1); words of rows past M are not sent
        PACK: tl.constexpr = 2 if x_ptr.dtype.element_ty.primitive_bitwidth == 16 else 1
        llw = (N + PACK - 1) // PACK
        words = tl.arange(0, BLOCK_N // PACK)
        wmask = (words < llw) & (row < M)
        ll_part = tl.zeros([], tl.int64) + M * llw
        ll_recv = ll_ptr + (slot * WORLD).to(tl.int64) * ll_part + row * llw + words
        tag = ll_tag(e)
        if ((STAGES & 1) != 0) & (not PUSHED):
            v = tl.load(x_ptr + row * N + cols, mask=m, other=0.0)   # (LL: the last word's lane past N is 0)
            if LL:
                packed = _ll_pack(v, tag)
                for d in tl.static_range(WORLD):
                    if d != rank:
                        store_words(translate(ll_recv + rank * ll_part, rank, d, heap_bases), packed, wmask,
                                    WAIT_CLOCK)   # WAIT_CLOCK: a compiled NVIDIA kernel
            else:
                _push_row(v, recv + rank * part + row * N + cols, m, flag, base + 1, rank, heap_bases, WORLD,
                          WAIT_CLOCK)
        if (STAGES & 2) != 0:
            own = tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            r_in = tl.load(res_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for src in tl.static_range(WORLD):
                if src == rank:
                    total += own
                elif LL:   # the peer's words, polled until every one is tagged, then unpacked
                    got = wait_words(ll_recv + src * ll_part, wmask, tag, src, status_ptr, wait_bound, WAIT_CLOCK)
                    total += tl.where(m, _ll_unpack(got, x_ptr.dtype.element_ty), 0.0)
                else:
                    if PUSHED:   # the producer's count of this call: `signals` adds an epoch
                        wait_flag(pcount_ptr + src, e * signals, src, status_ptr, wait_bound, WAIT_CLOCK)
                    else:
                        wait_flag(flags_ptr + src * P + p, base + 1, src, status_ptr, wait_bound, WAIT_CLOCK)
                    total += tl.load(recv + src * part + row * N + cols, mask=m, other=0.0).to(tl.float32)
            _add_norm_store(total, r_in, w, res_out_ptr, y_ptr, x_ptr, row * N + cols, m, N, eps)
    else:
        for i in range(0, iters + 1):
            if (STAGES & 1) != 0:
                if i < iters:
                    row = (p + i * P).to(tl.int64)
                    m = cmask & (row < M)
                    v = tl.load(x_ptr + row * N + cols, mask=m)
                    _push_row(v, recv + rank * part + row * N + cols, m, flag, base + i + 1, rank, heap_bases, WORLD,
                              WAIT_CLOCK)
            if (STAGES & 2) != 0:
                j = i - 1
                if j >= 0:
                    row = (p + j * P).to(tl.int64)
                    m = cmask & (row < M)
                    total = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for src in tl.static_range(WORLD):
                        if src == rank:
                            total += tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
                        else:
                            wait_flag(flags_ptr + src * P + p, base + j + 1, src, status_ptr, wait_bound, WAIT_CLOCK)
                            total += tl.load(recv + src * part + row * N + cols, mask=m, other=0.0).to(tl.float32)
                    r_in = tl.load(res_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                    _add_norm_store(total, r_in, w, res_out_ptr, y_ptr, x_ptr, row * N + cols, m, N, eps)

    epoch_end(epoch_ptr, counters_ptr, P, e, BUMP_EPOCH, ONE_PROGRAM)


@triton.jit
def arn_push_kernel(x_ptr, buf_ptr, pcount_ptr, epoch_ptr, heap_bases, rank, M, N,
                    WORLD: tl.constexpr, BAND: tl.constexpr, BLOCK_M: tl.constexpr):
    """The producer's side of a PUSHED ``all_reduce_add_rmsnorm_kernel`` as a kernel of its own (the
    reference for the GEMM epilogue that does the same: kernels/gemm_weight_first.py, and the
    CPU tests' producer): program b stores x's columns [b * BAND, (b + 1) * BAND) of every row into
    every peer's ``buf[slot, rank]`` (slot = the coming call's epoch % 2, read from the consumer's
    own ``epoch_ptr``), then adds 1 to the peer's ``pcount[rank]`` after those stores (release,
    system scope). The consumer then waits for ``epoch * cdiv(N, BAND)`` adds."""
    b = tl.program_id(0)
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)
    part = tl.zeros([], tl.int64) + M * N
    rows = tl.arange(0, BLOCK_M)
    cols = b * BAND + tl.arange(0, BAND)
    m = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    v = tl.load(x_ptr + offs, mask=m)
    dst = buf_ptr + (slot * WORLD + rank).to(tl.int64) * part + offs
    for d in tl.static_range(WORLD):
        if d != rank:
            tl.store(translate(dst, rank, d, heap_bases), v, mask=m)
    cta_barrier(False)
    for d in tl.static_range(WORLD):
        if d != rank:
            tl.atomic_add(translate(pcount_ptr + rank, rank, d, heap_bases), 1, sem="release", scope="sys")
