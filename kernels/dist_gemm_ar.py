"""GEMM + all-reduce in one kernel: ``out = sum over ranks of A_r @ B_r`` on every rank, each output
tile pushed to the peers as soon as it is computed and summed a tile later (dataflow
synchronisation instead of a kernel boundary between the GEMM and the all-reduce).

Work: the output's tiles ``t = p, p + P, p + 2P, ...`` belong to program ``p`` on every rank, so
program ``p`` only ever waits for program ``p`` of its peers. Per tile, in two stages one tile
apart (so a program does not wait for the tile whose stores are still in flight):

    stage 1  acc = A[rows] @ B[:, cols] (fp32); raise the previous tile's ``flags[rank, t-1]``
             to the call's epoch on every peer (its stores drained during this K loop); store
             acc into every rank's ``recv[slot, rank]`` (the peers' copies by remote stores, ours
             locally)
    stage 2  wait for every peer's ``flags[src, t] >= epoch``, sum the W partials of the tile in
             rank order 0..W-1 (fp32: bit-identical on every rank), store ``out[rows, cols]``

Partials travel in the output's dtype (as an all-reduce of the GEMM's output would; summed in
fp32). Small M takes narrow pointer-loaded tiles (every SM streams a strip of the weight); large M
the TMA-fed 128 x 256 tiles of the other fused GEMMs, so the tiles' pushes overlap the GEMM. ``recv`` is double-buffered by the
epoch's parity, flags are epoch counters that only grow: see dist_common and dist_gemm for why
that is enough. ``STAGES`` runs a subset of the stages (the CPU simulation runs stage 1 on every
rank before stage 2). Host side: numasched/distributed/matmul_all_reduce.py (``impl="fused"``).
"""
import triton
import triton.language as tl

from .dist_common import epoch_begin, epoch_end, fence_sys, signal, signal_peers, translate, wait_flag
from .dist_gemm import _tile_matmul
from numasched.kernels.pdl import pdl_enter


@triton.jit
def _tile_acc_tma(a_desc, off_m, b_desc, off_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr):
    """fp32 tile through TMA descriptors: A (M, K) row-major; B (K, N), or with B_TRANS its (N, K)
    storage (the ``w.T`` of an F.linear weight), loaded as [BLOCK_N, BLOCK_K] and transposed in
    registers (free for wgmma). Out-of-range rows, columns and K read as zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        if B_TRANS:
            b = b_desc.load([off_n, k * BLOCK_K]).T
        else:
            b = b_desc.load([k * BLOCK_K, off_n])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _push_chunk(src, dst_base, rank, heap_bases, r0, rows0, cols0, M, N, WORLD: tl.constexpr, CH: tl.constexpr,
                BLOCK_N: tl.constexpr, REMOTE: tl.constexpr = True):
    """Rows r0 .. r0 + CH of a pushed tile (top-left (rows0, cols0)) from our copy ``src`` (an
    (M, N) plane of our heap) to every peer's ``dst_base`` plane."""
    rows = rows0 + r0 + tl.arange(0, CH)
    cols = cols0 + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    v = tl.load(src + offs, mask=mask, cache_modifier=".cg")
    for d in tl.static_range(WORLD):
        if d != rank:
            tl.store(translate(dst_base + offs, rank, d if REMOTE else rank, heap_bases), v, mask=mask)


@triton.jit
def _acc_pushing(a_ptr, stride_am, stride_ak, rm, b_ptr, stride_bk, stride_bn, rn, a_desc, off_m, b_desc, off_n,
                 K, src, dst_base, rank, heap_bases, prev_rows0, prev_cols0, prev_ok, M, N,
                 WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, B_TRANS: tl.constexpr, CH: tl.constexpr,
                 REMOTE: tl.constexpr):
    """This tile's fp32 accumulator while the previous tile goes to the peers CH rows per K step
    (its first BLOCK_M / CH steps; the rest after the loop when K is short): a tile pushed at
    once after its K loop stalls the program until the link drains it, and every program of a
    wave pushes at the same time, so the link bursts while the tensor cores wait."""
    NCH: tl.constexpr = BLOCK_M // CH
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kt = tl.cdiv(K, BLOCK_K)
    if not USE_TMA:
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    for k in range(0, kt):
        if USE_TMA:
            a = a_desc.load([off_m, k * BLOCK_K])
            if B_TRANS:
                b = b_desc.load([off_n, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, off_n])
        else:
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)
                b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        acc = tl.dot(a, b, acc)
        if prev_ok & (k < NCH):
            _push_chunk(src, dst_base, rank, heap_bases, k * CH, prev_rows0, prev_cols0, M, N, WORLD, CH, BLOCK_N,
                        REMOTE)
    if prev_ok:
        for k in range(kt, NCH):
            _push_chunk(src, dst_base, rank, heap_bases, k * CH, prev_rows0, prev_cols0, M, N, WORLD, CH, BLOCK_N,
                        REMOTE)
    return acc


@triton.jit
def matmul_all_reduce_kernel(a_ptr, b_ptr, out_ptr, recv_ptr, a_desc, b_desc, flags_ptr, status_ptr, epoch_ptr,
                             counters_ptr, heap_bases, rank, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                             stride_om, stride_on, wait_bound,
                             WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, B_TRANS: tl.constexpr,
                             STAGES: tl.constexpr, BUMP_EPOCH: tl.constexpr, WAIT_CLOCK: tl.constexpr,
                             DEFER: tl.constexpr = False, CH: tl.constexpr = 4, REMOTE: tl.constexpr = True,
                             REL32: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    # DEFER: a tile goes to our own plane only; the peers get it CH rows per K step of the next
    # tile (_acc_pushing), the last tile's after the loop. REMOTE=False (timing only, phase
    # "nocomm"): the pushes land in our own heap and nobody waits (the flags still go out): the
    # kernel's time without the remote stores, its results wrong. REL32: the tile epilogue and the
    # sums address a tile as a scalar 64-bit base plus 32-bit offsets (fewer instructions a tile)
    # a: (M, K), b: (K, N) this rank's operands (USE_TMA: also as descriptors); out: (M, N);
    # recv: heap (2, WORLD, M, N) in out's dtype; flags: heap int64 (WORLD, tiles)
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic stays 32-bit
    p = tl.program_id(0)
    P = tl.num_programs(0)
    TN = tl.cdiv(N, BLOCK_N)
    T = tl.cdiv(M, BLOCK_M) * TN
    mine = tl.cdiv(T - p, P)                     # tiles of this program
    part = (tl.zeros([], tl.int64) + M) * N   # M may be the constant 1 (batch-1 decode)
    recv = recv_ptr + (slot * WORLD).to(tl.int64) * part
    for i in range(0, mine + 1):
        # ---- stage 1: compute tile i; raise tile i-1's flag (its remote stores drained during
        #      this tile's K loop: raised right after its stores, the release fence would stall
        #      the program until they land); then push tile i
        if (STAGES & 1) != 0:
            if i < mine:
                t = p + i * P
                tm = t // TN
                tn = t % TN
                rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
                cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                if DEFER:   # tile i - 1 goes to the peers during this K loop
                    pt = t - P
                    acc = _acc_pushing(a_ptr, stride_am, stride_ak, rows % M, b_ptr, stride_bk, stride_bn, cols % N,
                                       a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, recv + rank * part,
                                       recv + rank * part, rank, heap_bases, (pt // TN) * BLOCK_M,
                                       (pt % TN) * BLOCK_N, i >= 1, M, N, WORLD, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                       USE_TMA, B_TRANS, CH, REMOTE)
                elif USE_TMA:
                    acc = _tile_acc_tma(a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                        B_TRANS)
                else:
                    acc = _tile_matmul(a_ptr, stride_am, stride_ak, rows % M, b_ptr, stride_bk, stride_bn, cols % N,
                                       K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
                if i >= 1:
                    signal_peers(flags_ptr + rank * T + (t - P), e, rank, heap_bases, WORLD, WAIT_CLOCK)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                part_tile = acc.to(recv_ptr.dtype.element_ty)
                if REL32:   # a scalar 64-bit tile base, 32-bit offsets inside the tile
                    tbase = recv + rank * part + (tm * BLOCK_M).to(tl.int64) * N + tn * BLOCK_N
                    loc = tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :]
                    for d in tl.static_range(WORLD):
                        if d == rank:
                            tl.store(tbase + loc, part_tile, mask=mask)
                        elif not DEFER:
                            tl.store(translate(tbase, rank, d if REMOTE else rank, heap_bases) + loc, part_tile,
                                     mask=mask)
                else:
                    dst = recv + rank * part + rows.to(tl.int64)[:, None] * N + cols[None, :]
                    for d in tl.static_range(WORLD):
                        if d == rank:
                            tl.store(dst, part_tile, mask=mask)
                        elif not DEFER:
                            tl.store(translate(dst, rank, d if REMOTE else rank, heap_bases), part_tile, mask=mask)
                # our own copy is read back (stage 2; DEFER: the next K loop) by other threads
                tl.debug_barrier()
            else:   # past the last tile: (DEFER: push it, then) raise its flag
                if i >= 1:
                    lt = p + (i - 1) * P
                    if DEFER:
                        for k in range(0, BLOCK_M // CH):
                            _push_chunk(recv + rank * part, recv + rank * part, rank, heap_bases, k * CH,
                                        (lt // TN) * BLOCK_M, (lt % TN) * BLOCK_N, M, N, WORLD, CH, BLOCK_N, REMOTE)
                    signal_peers(flags_ptr + rank * T + lt, e, rank, heap_bases, WORLD, WAIT_CLOCK)
        # ---- stage 2: sum tile i - 1 over the ranks
        if (STAGES & 2) != 0:
            j = i - 1
            if j >= 0:
                t = p + j * P
                tm = t // TN
                tn = t % TN
                rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
                cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if REL32:
                    tile0 = (tm * BLOCK_M).to(tl.int64) * N + tn * BLOCK_N
                    loc = tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :]
                    for src in tl.static_range(WORLD):   # rank order: the same rounding on every rank
                        if (src != rank) & REMOTE:
                            wait_flag(flags_ptr + src * T + t, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                        total += tl.load(recv + src * part + tile0 + loc, mask=mask, other=0.0).to(tl.float32)
                    obase = out_ptr + (tm * BLOCK_M).to(tl.int64) * stride_om + (tn * BLOCK_N).to(tl.int64) * stride_on
                    oloc = tl.arange(0, BLOCK_M)[:, None] * stride_om + tl.arange(0, BLOCK_N)[None, :] * stride_on
                    tl.store(obase + oloc, total.to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
                    for src in tl.static_range(WORLD):   # rank order: the same rounding on every rank
                        if (src != rank) & REMOTE:
                            wait_flag(flags_ptr + src * T + t, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                        total += tl.load(recv + src * part + offs, mask=mask, other=0.0).to(tl.float32)
                    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
                    tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)

    epoch_end(epoch_ptr, counters_ptr, P, e, BUMP_EPOCH)


# ============================================================================ dedicated communication programs
@triton.jit
def _cs_gemm_tiles(a_ptr, b_ptr, planes_ptr, a_desc, b_desc, flags_ptr, heap_bases, rank, M, N, K, T, TN, g, PG, e,
                   stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, B_TRANS: tl.constexpr):
    """GEMM program ``g``: tiles g, g + PG, ...; each partial tile into our plane ``rank`` (output
    dtype), then our own ``flags[rank, t] = e``."""
    plane = (tl.zeros([], tl.int64) + M) * N
    mine = planes_ptr + rank * plane
    for t in range(g, T, PG):
        tm = t // TN
        tn = t % TN
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        if USE_TMA:
            acc = _tile_acc_tma(a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS)
        else:
            acc = _tile_matmul(a_ptr, stride_am, stride_ak, rows % M, b_ptr, stride_bk, stride_bn, cols % N,
                               K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(mine + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(planes_ptr.dtype.element_ty), mask=mask)
        signal(flags_ptr + rank * T + t, e, rank, rank, heap_bases)


@triton.jit
def _cs_fence(ONE_FENCE: tl.constexpr):
    """Every thread's stores so far before the flags raised next (ONE_FENCE: one system-scope
    fence here, then relaxed flag writes; else each flag write is a release)."""
    tl.debug_barrier()
    if ONE_FENCE:
        fence_sys()


@triton.jit
def _cs_raise(flag_ptr, e, rank, to_rank, heap_bases, ONE_FENCE: tl.constexpr):
    if ONE_FENCE:
        tl.atomic_xchg(translate(flag_ptr, rank, to_rank, heap_bases), e, sem="relaxed", scope="sys")
    else:
        tl.atomic_xchg(translate(flag_ptr, rank, to_rank, heap_bases), e, sem="release", scope="sys")


@triton.jit
def _cs_slice(tm, tn, r0, M, N, SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows r0 .. r0 + SUB of tile (tm, tn): offsets in a dense (M, N) plane, rows, columns, mask."""
    rows = tm * BLOCK_M + r0 + tl.arange(0, SUB)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows.to(tl.int64)[:, None] * N + cols[None, :], rows, cols, mask


@triton.jit
def matmul_all_reduce_cs_kernel(a_ptr, b_ptr, out_ptr, planes_ptr, a_desc, b_desc, flags_ptr, status_ptr, epoch_ptr,
                                counters_ptr, heap_bases, rank, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                stride_om, stride_on, wait_bound,
                                WORLD: tl.constexpr, COMM: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                                USE_TMA: tl.constexpr, B_TRANS: tl.constexpr, STAGES: tl.constexpr,
                                BUMP_EPOCH: tl.constexpr, WAIT_CLOCK: tl.constexpr, SUB: tl.constexpr = 32,
                                GROUP: tl.constexpr = 1, ONE_FENCE: tl.constexpr = False, PDL: tl.constexpr = False):
    """The same sum with the exchange taken off the GEMM's SMs. When every GEMM program pushes its
    tile at the end of each K loop (the kernel above) the programs of a wave push at once: the
    link bursts while the tensor cores idle, then idles while they compute. Here the last
    ``COMM`` programs only communicate, at their own pace, while the others only compute.
    ``planes`` (heap, WORLD + 1 planes of M x N): plane s < WORLD holds rank s's partials of the
    tiles we own (ours: of every tile), plane WORLD the sums of the tiles we do not own.

        GEMM program g < P - COMM   tiles g, g + (P - COMM), ...: acc -> our plane ``rank``;
                                    our ``flags[rank, t] = e`` (stage 1)
        comm program c, pass 1      tiles c, c + COMM, ... in order, once our GEMM left them: a
                                    tile owned by a peer (rank t % WORLD) is pushed to the owner's
                                    plane ``rank`` and its ``flags[rank, t]`` raised; a tile we own
                                    waits for every peer's, is summed in rank order into ``out``
                                    and pushed to every peer's plane WORLD, ``flags[WORLD, t]``
                                    raised there (stages 2 and 4: the CPU simulation runs
                                    every rank's pushes before any rank's sums)
        comm program c, pass 2      the tiles a peer owns: wait for its flag, plane WORLD -> ``out``
                                    (stage 8)

    Only pushes cross the link (remote loads are latency-bound: a first version that pulled ran at
    a few GB/s per SM). Measured on two H100s it is still slower than the kernel above (4096 x
    4096 x 2048: 211 us at its best, 32 programs, against 194): a program moving tiles through
    its registers drains only a few GB/s to the peer, so carrying the exchange takes more SMs than
    the GEMM can spare. Opt-in (numasched/distributed/matmul_all_reduce.py). One rank sums each tile and the others copy it: bit-identical outputs
    everywhere. Buffers are single: a peer's partial of tile t is read by the owner before the
    owner raises the flag that the peer waits for (pass 2) before it leaves the call, and a sum
    is rewritten only after the peer's partial of the next call arrived. Pass 1 waits only for
    GEMM programs (ours, or a peer's through its pass 1, which waits only for its GEMM), pass 2
    for pass 1: no cycle. Host side: numasched/distributed/matmul_all_reduce.py."""
    pdl_enter(PDL)
    e = epoch_begin(epoch_ptr)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    PG = P - COMM
    TN = tl.cdiv(N, BLOCK_N)
    T = tl.cdiv(M, BLOCK_M) * TN
    plane = (tl.zeros([], tl.int64) + M) * N   # M may be the constant 1
    mine = planes_ptr + rank * plane
    sums = planes_ptr + WORLD * plane
    if p < PG:
        if (STAGES & 1) != 0:
            _cs_gemm_tiles(a_ptr, b_ptr, planes_ptr, a_desc, b_desc, flags_ptr, heap_bases, rank, M, N, K, T, TN, p,
                           PG, e, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                           USE_TMA, B_TRANS)
    else:
        if (STAGES & 6) != 0:
            # GROUP of this program's tiles at a time: their pushes, one system-scope fence, their
            # flags; then the sums of the ones we own, one fence, their flags (a fence per tile
            # waits for the tile's remote stores to land before the next tile's can start). Pushes
            # before sums inside a group: a peer's sum may wait for our push of a tile of the group.
            for g0 in range(p - PG, T, COMM * GROUP):
                if (STAGES & 2) != 0:
                    for j in tl.static_range(GROUP):
                        t = g0 + j * COMM
                        if (t < T) & (t % WORLD != rank):
                            wait_flag(flags_ptr + rank * T + t, e, rank, status_ptr, wait_bound, WAIT_CLOCK)
                            for r0 in tl.static_range(0, BLOCK_M, SUB):
                                offs, rows, cols, mask = _cs_slice(t // TN, t % TN, r0, M, N, SUB, BLOCK_M, BLOCK_N)
                                y = tl.load(mine + offs, mask=mask)
                                tl.store(translate(mine + offs, rank, t % WORLD, heap_bases), y, mask=mask)
                    _cs_fence(ONE_FENCE)
                    for j in tl.static_range(GROUP):
                        t = g0 + j * COMM
                        if (t < T) & (t % WORLD != rank):
                            _cs_raise(flags_ptr + rank * T + t, e, rank, t % WORLD, heap_bases, ONE_FENCE)
                if (STAGES & 4) != 0:
                    for j in tl.static_range(GROUP):
                        t = g0 + j * COMM
                        if (t < T) & (t % WORLD == rank):
                            for src in tl.static_range(WORLD):
                                wait_flag(flags_ptr + src * T + t, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                            # in slices of SUB rows: a whole tile's 64-bit offsets would fill the registers
                            for r0 in tl.static_range(0, BLOCK_M, SUB):
                                offs, rows, cols, mask = _cs_slice(t // TN, t % TN, r0, M, N, SUB, BLOCK_M, BLOCK_N)
                                total = tl.zeros((SUB, BLOCK_N), dtype=tl.float32)
                                for src in tl.static_range(WORLD):   # rank order: one rounding, copied everywhere
                                    total += tl.load(planes_ptr + src * plane + offs, mask=mask,
                                                     other=0.0).to(tl.float32)
                                y = total.to(out_ptr.dtype.element_ty)
                                tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on,
                                         y, mask=mask)
                                for d in tl.static_range(WORLD):
                                    if d != rank:
                                        tl.store(translate(sums + offs, rank, d, heap_bases),
                                                 y.to(sums.dtype.element_ty), mask=mask)
                    _cs_fence(ONE_FENCE)
                    for j in tl.static_range(GROUP):
                        t = g0 + j * COMM
                        if (t < T) & (t % WORLD == rank):
                            for d in tl.static_range(WORLD):
                                if d != rank:
                                    _cs_raise(flags_ptr + WORLD * T + t, e, rank, d, heap_bases, ONE_FENCE)
        if (STAGES & 8) != 0:
            for t in range(p - PG, T, COMM):
                owner = t % WORLD
                if owner != rank:
                    tm = t // TN
                    tn = t % TN
                    wait_flag(flags_ptr + WORLD * T + t, e, owner, status_ptr, wait_bound, WAIT_CLOCK)
                    for r0 in tl.static_range(0, BLOCK_M, SUB):
                        offs, rows, cols, mask = _cs_slice(tm, tn, r0, M, N, SUB, BLOCK_M, BLOCK_N)
                        y = tl.load(sums + offs, mask=mask)
                        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on,
                                 y.to(out_ptr.dtype.element_ty), mask=mask)
    epoch_end(epoch_ptr, counters_ptr, P, e, BUMP_EPOCH)
