"""Fused all-gather + GEMM and GEMM + reduce-scatter over a symmetric heap (Iris memory model).

Both kernels are persistent: ``num_programs`` programs (about one per SM) take tiles from a
device-side ticket counter, so programs that spent time moving data join the GEMM as soon as they
are free and the tile order is the ticket order (:mod:`.dist_order`). Flags, epochs and bounded
waits are explained in :mod:`.dist_common`.

All-gather + GEMM (A sharded by rows: rank r holds rows [r*Ml, (r+1)*Ml) of A, every rank holds
the same B (K, N)):

* programs ``0 .. COMM_PROGRAMS-1`` first *push* this rank's A shard, one BLOCK_M-row block at a
  time, into every peer's gather buffer ``G[slot][rank]`` (remote stores over NVLink), then set
  the peer's ready flag ``flag[rank, tm] = epoch`` (release, sys). Peer ``rank-1`` is served first
  because it visits our shard first (its order is rank-1, rank, rank+1, ...).
* every program then loops over tiles; a tile of shard ``src != rank`` first waits for
  ``flag[src, tm] >= epoch`` (acquire, sys), then reads A from the local gather buffer (local
  HBM, no remote loads inside the K loop). Tiles of our own shard read the caller's ``a_local``
  directly and come first, so they hide the transfer.

GEMM + reduce-scatter (A sharded by columns (M, Kl), B by rows (Kl, N); rank r returns rows
[r*Ms, (r+1)*Ms) of the sum over ranks):

* tiles of peer slices come first (rank+1, rank+2, ...): each is computed and stored from
  registers straight into the owner's partial buffer ``P[slot][rank]`` (fused sequential), then
  the owner's flag ``flag[rank, tile] = epoch`` is set;
* this rank's own slice comes last: for each tile it waits for every peer's partial tile and sums
  the partials, its own rounded to the output's dtype as the peers' are, in rank order
  0..world-1 (fp32), then writes the output.

Double buffering (``slot = epoch mod 2``) is enough to keep a push of call e+2 from overwriting a
buffer a slow peer still reads in call e: the pusher's call e+1 could only finish after receiving
the reader's call-(e+1) data, which the reader sends only after its call e kernel has ended (the
protocol model in ``numasched.distributed.protocol`` checks this for world sizes up to 8).
"""
import triton
import triton.language as tl

from .dist_common import epoch_begin, epoch_end, fence_proxy_async, next_ticket, signal, translate, wait_flag
from .dist_order import shard_order


@triton.jit
def _tile_matmul(a_base, stride_am, stride_ak, rm, b_ptr, stride_bk, stride_bn, rn, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] (fp32) = A[rm, :] @ B[:, rn] (rm, rn already wrapped into range)."""
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_base + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _tile_matmul_tma(a_desc, off_am, b_desc, off_n, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Same accumulator through TMA descriptors (Hopper): A rows from ``off_am``, B columns from
    ``off_n``. Out-of-range rows/columns/K read as zeros (rows past a shard read the next shard:
    those outputs are masked at the store)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_am, k * BLOCK_K])
        b = b_desc.load([k * BLOCK_K, off_n])
        acc = tl.dot(a, b, acc)
    return acc


# ============================================================================ all-gather + GEMM
@triton.jit
def all_gather_matmul_kernel(
        a_ptr, g_ptr, b_ptr, c_ptr, a_desc, g_desc, b_desc, flags_ptr, status_ptr, epoch_ptr, counters_ptr, heap_bases,
        rank, Ml, N, K, stride_bk, stride_bn, stride_cm, stride_cn,
        num_programs, wait_bound, TICKET_LO, TICKET_HI,
        MAPPING: tl.constexpr, WORLD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        COMM_PROGRAMS: tl.constexpr, PUSH_CHUNK: tl.constexpr,
        DO_PUSH: tl.constexpr, WAIT: tl.constexpr, BUMP_EPOCH: tl.constexpr, USE_TMA: tl.constexpr,
        PROXY_FENCE: tl.constexpr, WAIT_CLOCK: tl.constexpr):
    # a_ptr: (Ml, K) contiguous, this rank's rows. g_ptr: heap [2, WORLD, Ml, K] gather buffers.
    # flags_ptr: heap int32 [WORLD, TMS]. c_ptr: (WORLD*Ml, N). USE_TMA: a_desc, g_desc (the
    # gather buffers as one (2*WORLD*Ml, K) matrix) and b_desc are TMA descriptors of the same.
    pid = tl.program_id(0)
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic and TMA offsets stay 32-bit
    TMS = tl.cdiv(Ml, BLOCK_M)
    TN = tl.cdiv(N, BLOCK_N)
    shard = (tl.zeros([], tl.int64) + Ml) * K   # Ml may be the constant 1 (one row per rank)
    my_buf = g_ptr + (slot * WORLD + rank).to(tl.int64) * shard

    # ---- producer: push our shard, block of rows by block of rows, to every peer
    if DO_PUSH:
        if pid < COMM_PROGRAMS:
            for item in range(pid, (WORLD - 1) * TMS, COMM_PROGRAMS):
                dest = (rank + WORLD - 1 - item // TMS) % WORLD   # rank-1 first: it needs us first
                tm = item % TMS
                start = (tm * BLOCK_M).to(tl.int64) * K
                n = tl.minimum(BLOCK_M, Ml - tm * BLOCK_M) * K
                dst = translate(my_buf + start, rank, dest, heap_bases)
                src = a_ptr + start
                for off in range(0, n, PUSH_CHUNK):
                    idx = off + tl.arange(0, PUSH_CHUNK)
                    m = idx < n
                    tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
                signal(flags_ptr + rank * TMS + tm, e, rank, dest, heap_bases)

    # ---- consumer: GEMM tiles in ticket order (own shard first)
    t = next_ticket(counters_ptr, TICKET_LO)
    while t < TICKET_HI:
        src, tm, tn = shard_order(t, rank, WORLD, 0, TMS, TN, MAPPING)
        if src == rank:
            a_base = a_ptr
        else:
            a_base = g_ptr + (slot * WORLD + src).to(tl.int64) * shard
            if WAIT:
                wait_flag(flags_ptr + src * TMS + tm, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                if PROXY_FENCE:   # the TMA loads below read what the peer wrote
                    fence_proxy_async()
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        if USE_TMA:
            # pick the descriptor first: one K loop (two loops would each get their own 3-stage
            # shared-memory pipeline, 2 x 147 KB, more than an SM has)
            if src == rank:
                a_d = a_desc
                off_am = tm * BLOCK_M
            else:
                a_d = g_desc
                off_am = (slot * WORLD + src) * Ml + tm * BLOCK_M
            acc = _tile_matmul_tma(a_d, off_am, b_desc, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            # wrap out-of-range rows/cols onto valid ones: loads need no mask; the store is masked
            acc = _tile_matmul(a_base, K, 1, rows % Ml, b_ptr, stride_bk, stride_bn, cols % N, K,
                               BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        c_ptrs = c_ptr + (src * Ml + rows).to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < Ml) & (cols[None, :] < N))
        t = next_ticket(counters_ptr, TICKET_LO)

    epoch_end(epoch_ptr, counters_ptr, num_programs, e, BUMP_EPOCH)


# ============================================================================ GEMM + reduce-scatter
@triton.jit
def _rs_signal_pushed(t, flags_ptr, e, rank, heap_bases, TMS, TN, TS, MAPPING: tl.constexpr, WORLD: tl.constexpr):
    """Ticket ``t``'s flag on its owner, if it was a peer's tile (pushed); the CTA barrier as
    inline PTX (FLAT's loop stays pipelined)."""
    dest, tm, tn = shard_order(t, rank, WORLD, 1, TMS, TN, MAPPING)
    if dest != rank:
        signal(flags_ptr + rank * TS + tm * TN + tn, e, rank, dest, heap_bases, True)


@triton.jit
def _rs_flat(out_ptr, p_ptr, a_desc, b_desc, flags_ptr, status_ptr, heap_bases, rank, e, slot, Ms, N, Kl,
             stride_om, stride_on, num_programs, wait_bound, TICKET_LO, TICKET_HI, TMS, TN, TS, part,
             MAPPING: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, COMM: tl.constexpr, WAIT_CLOCK: tl.constexpr, OUT_CONTIG: tl.constexpr):
    """The reduce-scatter's tiles with static tickets (program p: LO + p, LO + p + P, ...; the
    same order, peer slices first) in one loop over (tile, K step) that Triton fuses and
    pipelines, so the next tile's operand loads are in flight during an epilogue. A dynamic
    ticket (an atomic per tile) would make the tile loop a while loop, which Triton does not fuse.
    The epilogue's tensor work is predicated (masks), not branched, and each flag goes up one
    tile late (after the next K loop), before the program waits for anything, as in the
    ticketed loop. The CTA barriers before the flags are inline PTX (dist_common.cta_barrier).
    Two ranks (at four the rank-order sum spilled 1.7 KB of registers, sm_90)."""
    tl.static_assert(WORLD == 2, "FLAT is the two-rank form")
    p = tl.program_id(0)
    k_tiles = tl.cdiv(Kl, BLOCK_K)
    for t in tl.range(TICKET_LO + p, TICKET_HI, num_programs, flatten=True):
        dest, tm, tn = shard_order(t, rank, WORLD, 1, TMS, TN, MAPPING)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_tiles):
            a = a_desc.load([dest * Ms + tm * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([k * BLOCK_K, tn * BLOCK_N])
            acc = tl.dot(a, b, acc)
        # ---- epilogue: first the previous tile's flag (its stores drained during this K loop)
        if COMM & (t - num_programs >= TICKET_LO):
            _rs_signal_pushed(t - num_programs, flags_ptr, e, rank, heap_bases, TMS, TN, TS, MAPPING, WORLD)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < Ms) & (cols[None, :] < N)
        tile0 = (tm * BLOCK_M).to(tl.int64) * N + tn * BLOCK_N
        loc = tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :]
        tile = tm * TN + tn
        own = acc.to(p_ptr.dtype.element_ty)
        peer_tile = dest != rank
        # a peer's tile: into its partial buffer (communication off, timing: our own)
        mine = p_ptr + (slot * WORLD + rank).to(tl.int64) * part + tile0
        if COMM:
            tl.store(translate(mine, rank, dest, heap_bases) + loc, own, mask=mask & peer_tile)
        else:
            tl.store(mine + loc, own, mask=mask & peer_tile)
        # ours: our partial plus the peer's (two ranks: a + b == b + a, the rank-order sum's bits),
        # the peer's loaded in its dtype and added (no spills; off: its partial counts as zeros)
        ours = mask & (dest == rank)
        total = own.to(tl.float32)
        if COMM:
            if dest == rank:
                wait_flag(flags_ptr + (1 - rank) * TS + tile, e, 1 - rank, status_ptr, wait_bound, WAIT_CLOCK)
            x = tl.load(p_ptr + (slot * WORLD + 1 - rank).to(tl.int64) * part + tile0 + loc, mask=ours, other=0.0)
            total = total + x.to(tl.float32)
        if OUT_CONTIG:   # the partials' offsets (no second set of offsets in registers)
            tl.store(out_ptr + tile0 + loc, total.to(out_ptr.dtype.element_ty), mask=ours)
        else:
            obase = out_ptr + (tm * BLOCK_M).to(tl.int64) * stride_om + (tn * BLOCK_N).to(tl.int64) * stride_on
            oloc = tl.arange(0, BLOCK_M)[:, None] * stride_om + tl.arange(0, BLOCK_N)[None, :] * stride_on
            tl.store(obase + oloc, total.to(out_ptr.dtype.element_ty), mask=ours)
    # the last tile's flag
    last = TICKET_LO + p + (tl.cdiv(TICKET_HI - TICKET_LO - p, num_programs) - 1) * num_programs
    if COMM & (last >= TICKET_LO + p):
        _rs_signal_pushed(last, flags_ptr, e, rank, heap_bases, TMS, TN, TS, MAPPING, WORLD)


@triton.jit
def matmul_reduce_scatter_kernel(
        a_ptr, b_ptr, out_ptr, p_ptr, a_desc, b_desc, flags_ptr, status_ptr, epoch_ptr, counters_ptr, heap_bases,
        rank, Ms, N, Kl, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
        num_programs, wait_bound, TICKET_LO, TICKET_HI,
        MAPPING: tl.constexpr, WORLD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        COMM: tl.constexpr, BUMP_EPOCH: tl.constexpr, USE_TMA: tl.constexpr, WAIT_CLOCK: tl.constexpr,
        FLAT: tl.constexpr = False, OUT_CONTIG: tl.constexpr = False):
    # a_ptr: (WORLD*Ms, Kl); b_ptr: (Kl, N); out_ptr: (Ms, N); p_ptr: heap [2, WORLD, Ms, N]
    # partial tiles (slot, src); flags_ptr: heap int32 [WORLD, TMS*TN]. USE_TMA: a_desc, b_desc.
    # FLAT (TMA, compiled NVIDIA): static tickets, one loop over (tile, K step) (_rs_flat below);
    # OUT_CONTIG there: out is contiguous, (Ms, N) with row stride N.
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic and TMA offsets stay 32-bit
    TMS = tl.cdiv(Ms, BLOCK_M)
    TN = tl.cdiv(N, BLOCK_N)
    TS = TMS * TN
    part = (tl.zeros([], tl.int64) + Ms) * N   # Ms may be the constant 1
    if FLAT:
        tl.static_assert(USE_TMA, "FLAT is the TMA form")
        _rs_flat(out_ptr, p_ptr, a_desc, b_desc, flags_ptr, status_ptr, heap_bases, rank, e, slot, Ms, N, Kl,
                 stride_om, stride_on, num_programs, wait_bound, TICKET_LO, TICKET_HI, TMS, TN, TS, part,
                 MAPPING, WORLD, BLOCK_M, BLOCK_N, BLOCK_K, COMM, WAIT_CLOCK, OUT_CONTIG)
        epoch_end(epoch_ptr, counters_ptr, num_programs, e, BUMP_EPOCH)
        return

    # The flag of a pushed tile is raised one tile late: its release fence waits until the tile's
    # remote stores have landed, which over NVLink takes about as long as a short-K tile's GEMM.
    # Raised right after the store, that wait stalls the program; raised after the next tile's
    # K loop, the stores have drained meanwhile. A program raises its pending flag before it
    # waits for anything (own-slice tiles below) and when it runs out of tiles, so no program
    # waits while holding a flag a peer needs.
    pend_dest = -1
    pend_tile = 0
    t = next_ticket(counters_ptr, TICKET_LO)
    while t < TICKET_HI:
        dest, tm, tn = shard_order(t, rank, WORLD, 1, TMS, TN, MAPPING)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        if USE_TMA:
            acc = _tile_matmul_tma(a_desc, dest * Ms + tm * BLOCK_M, b_desc, tn * BLOCK_N, Kl, BLOCK_M, BLOCK_N,
                                   BLOCK_K)
        else:
            acc = _tile_matmul(a_ptr, stride_am, stride_ak, dest * Ms + rows % Ms, b_ptr, stride_bk, stride_bn,
                               cols % N, Kl, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        if COMM:
            if pend_dest >= 0:
                signal(flags_ptr + rank * TS + pend_tile, e, rank, pend_dest, heap_bases)
                pend_dest = -1
        mask = (rows[:, None] < Ms) & (cols[None, :] < N)
        # a scalar 64-bit base plus 32-bit offsets, not a 64-bit offset per element: with those
        # the 128 x 256 epilogue needed 912 bytes of spills (sm_90, 255 registers)
        tile0 = (tm * BLOCK_M).to(tl.int64) * N + tn * BLOCK_N
        loc = tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :]
        tile = tm * TN + tn
        # the partial in the output's dtype, as a reduce-scatter of the GEMM's output would have
        # it; the fp32 accumulator is dead from here (fewer registers in the epilogue)
        own = acc.to(p_ptr.dtype.element_ty)
        if dest != rank:
            mine = p_ptr + (slot * WORLD + rank).to(tl.int64) * part + tile0
            if COMM:   # from registers straight into the owner's partial buffer; its flag next trip
                tl.store(translate(mine, rank, dest, heap_bases) + loc, own, mask=mask)
                pend_dest = dest
                pend_tile = tile
            else:      # communication off (timing): same work, local store
                tl.store(mine + loc, own, mask=mask)
        else:
            # rank order 0..WORLD-1 from rank 0's partial (not from +0): the same rounding as a sum
            # of the ranks' rounded partials in that order
            for src in tl.static_range(WORLD):
                if src == rank:
                    x = own.to(tl.float32)
                elif COMM:
                    wait_flag(flags_ptr + src * TS + tile, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                    x = tl.load(p_ptr + (slot * WORLD + src).to(tl.int64) * part + tile0 + loc, mask=mask,
                                other=0.0).to(tl.float32)
                else:   # communication off (timing): the peers' partials count as zeros
                    x = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if src == 0:
                    total = x
                else:
                    total += x
            obase = out_ptr + (tm * BLOCK_M).to(tl.int64) * stride_om + (tn * BLOCK_N).to(tl.int64) * stride_on
            oloc = tl.arange(0, BLOCK_M)[:, None] * stride_om + tl.arange(0, BLOCK_N)[None, :] * stride_on
            tl.store(obase + oloc, total.to(out_ptr.dtype.element_ty), mask=mask)
        t = next_ticket(counters_ptr, TICKET_LO)
    if COMM:
        if pend_dest >= 0:
            signal(flags_ptr + rank * TS + pend_tile, e, rank, pend_dest, heap_bases)

    epoch_end(epoch_ptr, counters_ptr, num_programs, e, BUMP_EPOCH)
