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

``LAG=False`` (two ranks; the host's choice where every program has at most one tile): each tile
is summed right after its push, our own partial kept in registers instead of stored and read
back (less memory traffic; the same bits, since fp32 addition of the two rounded partials
commutes). ``PAIRS`` (two ranks, several tiles per program, where pairs add no round of tiles):
the all-reduce of each tile pair in two halves, the peer's tile first (``_pairs`` below).

Partials travel in the output's dtype (as an all-reduce of the GEMM's output would; summed in
fp32). Small M takes narrow pointer-loaded tiles (every SM streams a strip of the weight); large M
the TMA-fed 128 x 256 tiles of the other fused GEMMs, so the tiles' pushes overlap the GEMM. ``recv`` is double-buffered by the
epoch's parity, flags are epoch counters that only grow: see dist_common and dist_gemm for why
that is enough. ``STAGES`` runs a subset of the stages (the CPU simulation runs stage 1 on every
rank before stage 2). Host side: numasched/distributed/matmul_all_reduce.py (``impl="fused"``).
"""
import triton
import triton.language as tl

from .dist_common import epoch_begin, epoch_end, signal_peers, tma_store_drain, translate, wait_flag
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
def _tile_place(t, TN, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where output tile ``t`` (row-major over TN column tiles) lies: (tm, tn, rows, cols, the
    in-range mask, its offset tile0 in an (M, N) buffer, and its elements' offsets loc from there)."""
    tm = t // TN
    tn = t % TN
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    # a scalar 64-bit base plus 32-bit offsets (1 % faster than 64-bit offsets per element at
    # 4096 x 4096 x 2048 on two H100s)
    tile0 = (tm * BLOCK_M).to(tl.int64) * N + tn * BLOCK_N
    loc = tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :]
    return tm, tn, rows, cols, mask, tile0, loc


@triton.jit
def _tile_acc(tm, tn, rows, cols, a_ptr, a_desc, b_ptr, b_desc, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              USE_TMA: tl.constexpr, B_TRANS: tl.constexpr):
    """The fp32 accumulator of tile (tm, tn): TMA descriptors or pointer loads."""
    if USE_TMA:
        acc = _tile_acc_tma(a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS)
    else:
        acc = _tile_matmul(a_ptr, stride_am, stride_ak, rows % M, b_ptr, stride_bk, stride_bn, cols % N,
                           K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    return acc


@triton.jit
def _store_out(total, out_ptr, tm, tn, tile0, loc, mask, stride_om, stride_on, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CONTIG: tl.constexpr):
    """The summed tile into ``out`` in its dtype: any strides, or with CONTIG (a contiguous out)
    at the receive buffer's offsets tile0 + loc, in registers already (fewer registers: the
    PAIRS epilogue with a residual spilled with a second set of offsets)."""
    if CONTIG:
        tl.store(out_ptr + tile0 + loc, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        obase = out_ptr + (tm * BLOCK_M).to(tl.int64) * stride_om + (tn * BLOCK_N).to(tl.int64) * stride_on
        oloc = tl.arange(0, BLOCK_M)[:, None] * stride_om + tl.arange(0, BLOCK_N)[None, :] * stride_on
        tl.store(obase + oloc, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _plus_residual(total, out_ptr, tile0, loc, mask, RESIDUAL: tl.constexpr):
    """RESIDUAL: ``out`` (contiguous: CONTIG) holds the layer's residual; the tile's sum,
    rounded to out's dtype as an all-reduce's output is, added to it in fp32 and rounded again:
    the bits of ``h + sum`` after the unfused all-reduce. Else the sum as it is. The tile's
    offsets are the receive buffer's (tile0 + loc), not recomputed from strides: no second set
    of per-element offsets in registers (the PAIRS epilogue spilled with one)."""
    if RESIDUAL:
        h = tl.load(out_ptr + tile0 + loc, mask=mask, other=0.0)
        dt = out_ptr.dtype.element_ty
        total = (total.to(dt).to(tl.float32) + h.to(tl.float32)).to(dt)
    return total


@triton.jit
def _push(x, recv, part, tile0, loc, mask, rank, to, heap_bases, REMOTE: tl.constexpr):
    """Tile ``x`` into rank ``to``'s ``recv[slot, rank]`` (REMOTE=False: our own heap's)."""
    tl.store(translate(recv + rank * part + tile0, rank, to if REMOTE else rank, heap_bases) + loc, x, mask=mask)


@triton.jit
def _raise(flags_ptr, T, t, e, rank, heap_bases, WORLD: tl.constexpr, ONE_FENCE: tl.constexpr):
    """Our flag of tile ``t`` up to epoch ``e`` on every peer, after this program's stores."""
    signal_peers(flags_ptr + rank * T + t, e, rank, heap_bases, WORLD, ONE_FENCE)


@triton.jit
def _copy_sum(t, TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr, wait_bound, M, N, stride_om, stride_on,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WAIT_CLOCK: tl.constexpr, REMOTE: tl.constexpr,
              CONTIG: tl.constexpr, DIRECT: tl.constexpr):
    """PAIRS: the sum of peer-owned tile ``t``, pushed by its owner into our ``recv[slot, peer]``,
    into ``out`` once its flag is up (DIRECT: the owner stored it into our ``out`` itself; only
    the wait, so that ``out`` is whole when the kernel ends)."""
    tm, tn, rows, cols, mask, tile0, loc = _tile_place(t, TN, M, N, BLOCK_M, BLOCK_N)
    if REMOTE:
        wait_flag(flags_ptr + peer * T + t, e, peer, status_ptr, wait_bound, WAIT_CLOCK)
    if not DIRECT:
        x = tl.load(recv + peer * part + tile0 + loc, mask=mask, other=0.0)
        _store_out(x, out_ptr, tm, tn, tile0, loc, mask, stride_om, stride_on, BLOCK_M, BLOCK_N, CONTIG)


@triton.jit
def _pairs(a_ptr, b_ptr, out_ptr, recv, a_desc, b_desc, flags_ptr, status_ptr, heap_bases, rank, e, p, P, T, TN,
           part, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on, wait_bound,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
           USE_TMA: tl.constexpr, B_TRANS: tl.constexpr, STAGES: tl.constexpr, WAIT_CLOCK: tl.constexpr,
           REMOTE: tl.constexpr, RESIDUAL: tl.constexpr, CONTIG: tl.constexpr, DIRECT: tl.constexpr):
    """PAIRS (two ranks, several tiles per program): an all-reduce in two halves per tile pair.

    Output tiles go in pairs (2q, 2q + 1); rank r owns tile 2q + r of each. Program p takes pairs
    p, p + P, ... and for each computes first the tile its peer owns (A: its partial pushed into
    the peer's recv[slot, rank]), then its own (B: the peer's partial of it, pushed during the
    peer's A, is summed with ours, kept in registers; the sum goes to out and to the peer's recv).
    The peer's sum of the tile we pushed arrives during our next pair and is copied into out then
    (C). So no program waits for a tile just computed (the peer pushed it a K loop earlier), each
    flag goes up a K loop after its stores (the release fence finds them drained), and every tile
    crosses the link twice in all (partial one way, sum the other), as in the one-shot form.
    The sum is the same fp32 addition of the two rounded partials as in the other forms (two
    ranks: a + b == b + a), computed once by the owner: the same bits on both ranks.
    DIRECT (``out`` in the symmetric heap at the same offset on both ranks): the owner stores the
    sum straight into the peer's ``out``, and C only waits for its flag: no receive slot written
    and read back, no copy (a quarter of the epilogue's memory traffic). The peer's ``out`` is
    free to take it: the sum of a tile exists only after the peer pushed its partial of it in
    this call, i.e. after every earlier reader of its ``out`` on its stream.
    STAGES 7 runs the interleaved loop; the CPU simulation runs A (1), B (2) and C (4) as three
    launches, each flag raised right after its stores."""
    peer = 1 - rank
    DEFER: tl.constexpr = STAGES == 7
    mine = tl.cdiv(tl.cdiv(T, 2) - p, P)   # pairs of this program
    for i in range(0, mine + 1):
        q = p + i * P
        t_o = 2 * q + 1 - rank     # the peer's tile of pair q
        t_m = 2 * q + rank         # ours
        tp_o = t_o - 2 * P         # the previous pair's
        tp_m = t_m - 2 * P
        has_o = (i < mine) & (t_o < T)
        has_m = (i < mine) & (t_m < T)
        # ---- A: the peer's tile, its partial pushed
        if (STAGES & 1) != 0:
            if has_o:
                tm, tn, rows, cols, mask, tile0, loc = _tile_place(t_o, TN, M, N, BLOCK_M, BLOCK_N)
                acc = _tile_acc(tm, tn, rows, cols, a_ptr, a_desc, b_ptr, b_desc, M, N, K, stride_am, stride_ak,
                                stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, B_TRANS)
                if DEFER:   # the previous pair's sum left during this K loop
                    if (i >= 1) & (tp_m < T):
                        _raise(flags_ptr, T, tp_m, e, rank, heap_bases, 2, WAIT_CLOCK)
                _push(acc.to(recv.dtype.element_ty), recv, part, tile0, loc, mask, rank, peer, heap_bases, REMOTE)
                if DEFER:
                    if not has_m:   # no K loop of ours follows to hide the fence behind
                        _raise(flags_ptr, T, t_o, e, rank, heap_bases, 2, WAIT_CLOCK)
                else:
                    _raise(flags_ptr, T, t_o, e, rank, heap_bases, 2, WAIT_CLOCK)
            elif DEFER:
                if (i >= 1) & (tp_m < T):
                    _raise(flags_ptr, T, tp_m, e, rank, heap_bases, 2, WAIT_CLOCK)
        # ---- B: our tile, summed with the peer's partial (C for the previous pair before the wait)
        if (STAGES & 2) != 0:
            if has_m:
                tm, tn, rows, cols, mask, tile0, loc = _tile_place(t_m, TN, M, N, BLOCK_M, BLOCK_N)
                acc = _tile_acc(tm, tn, rows, cols, a_ptr, a_desc, b_ptr, b_desc, M, N, K, stride_am, stride_ak,
                                stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, B_TRANS)
                own = acc.to(recv.dtype.element_ty)
                if DEFER:
                    if has_o:   # A's push drained during this K loop
                        _raise(flags_ptr, T, t_o, e, rank, heap_bases, 2, WAIT_CLOCK)
                    if (i >= 1) & (tp_o < T):
                        _copy_sum(tp_o, TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr, wait_bound, M, N,
                                  stride_om, stride_on, BLOCK_M, BLOCK_N, WAIT_CLOCK, REMOTE, CONTIG, DIRECT)
                if REMOTE:
                    wait_flag(flags_ptr + peer * T + t_m, e, peer, status_ptr, wait_bound, WAIT_CLOCK)
                theirs = tl.load(recv + peer * part + tile0 + loc, mask=mask, other=0.0)
                total = (own.to(tl.float32) + theirs.to(tl.float32)).to(recv.dtype.element_ty)
                # RESIDUAL: the owner adds the residual (the same on every rank in TP) and sends
                # h + sum, so the peer's copy (C) stores it as it comes
                total = _plus_residual(total, out_ptr, tile0, loc, mask, RESIDUAL)
                _store_out(total, out_ptr, tm, tn, tile0, loc, mask, stride_om, stride_on, BLOCK_M, BLOCK_N, CONTIG)
                if DIRECT:   # into the peer's out (a contiguous out: the receive buffer's offsets)
                    tl.store(translate(out_ptr + tile0, rank, peer if REMOTE else rank, heap_bases) + loc, total,
                             mask=mask)
                else:
                    _push(total, recv, part, tile0, loc, mask, rank, peer, heap_bases, REMOTE)
                if not DEFER:
                    _raise(flags_ptr, T, t_m, e, rank, heap_bases, 2, WAIT_CLOCK)
            elif DEFER:   # no B this time (the last, odd pair, or the loop's end)
                if (i >= 1) & (tp_o < T):
                    _copy_sum(tp_o, TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr, wait_bound, M, N,
                              stride_om, stride_on, BLOCK_M, BLOCK_N, WAIT_CLOCK, REMOTE, CONTIG, DIRECT)
        # ---- C (the simulation's third launch): the peer's sums into out
        if (STAGES & 4) != 0:
            if not DEFER:
                if has_o:
                    _copy_sum(t_o, TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr, wait_bound, M, N,
                              stride_om, stride_on, BLOCK_M, BLOCK_N, WAIT_CLOCK, REMOTE, CONTIG, DIRECT)


@triton.jit
def _raise_flat(flags_ptr, T, t, e, rank, heap_bases):
    """``_raise`` in ``_pairs_flat`` (two ranks, compiled NVIDIA): one fence, the CTA barrier as
    inline PTX, which keeps the loop pipelined (dist_common.cta_barrier)."""
    signal_peers(flags_ptr + rank * T + t, e, rank, heap_bases, 2, True, True)


@triton.jit
def _flat_tile(j, n, odd_last, rank, p, P):
    """(half, tile) of a program's ``j``-th tile in ``_pairs_flat``: half 0 the peer's tile of pair
    ``j // 2`` (A), 1 ours (B); an odd last pair's single tile is rank 0's B or rank 1's A."""
    half = (j % 2) | ((j == n - 1) & odd_last & (rank == 0)).to(tl.int32)
    return half, 2 * (p + (j // 2) * P) + (half + 1 - rank) % 2


@triton.jit
def _pairs_flat(out_ptr, recv, a_desc, b_desc, flags_ptr, status_ptr, heap_bases, rank, e, p, P, T, TN,
                part, M, N, K, stride_om, stride_on, wait_bound,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr,
                WAIT_CLOCK: tl.constexpr, REMOTE: tl.constexpr, RESIDUAL: tl.constexpr, CONTIG: tl.constexpr,
                DIRECT: tl.constexpr, TMA_PUSH: tl.constexpr, WAITS: tl.constexpr = True):
    """PAIRS' interleaved loop (STAGES 7, TMA) as one loop over this program's tiles with the K
    loop directly inside it, so that Triton fuses the two (``flatten``) and the pipeliner issues
    the next tile's first operand loads before this tile's epilogue (the pushes, the peer's
    partial and the residual read, the stores): the operand pipeline no longer drains and refills
    at every tile. The same tiles, order, waits and stores as ``_pairs`` with STAGES 7; tile ``j``
    of the program is half ``j % 2`` of pair ``j // 2`` (0: the peer's tile A, 1: ours B), except
    that an odd last pair (T odd) has one tile: rank 0's B or rank 1's A. Every epilogue first
    raises the previous tile's flag (its stores drained during this K loop).

    TMA_PUSH (not DIRECT; N a multiple of 8): each epilogue's one push, the partial (A) or the
    sum (B), leaves as two asynchronous TMA stores of half a tile through a descriptor of the
    peer's receive slot (made in the kernel: ``tl.make_tensor_descriptor`` on the translated
    address), so the program goes on to its next K loop while the 64 KB cross the link, instead
    of holding the load/store units with 16-byte remote stores. A's partial is the same ``total``
    as B's sum with the peer's partial and the residual read as zeros (masked), so one store
    serves both. The flag goes up a K loop later, after a wait for the stores' completion.

    WAITS=False (timing only, communicate="nowait"): the same pushes and flags, no wait for the
    peer's: what the waits cost against the full exchange (the results are not whole)."""
    peer = 1 - rank
    mine = tl.cdiv(tl.cdiv(T, 2) - p, P)     # pairs of this program
    q_last = p + (mine - 1) * P
    odd_last = (mine > 0) & (2 * q_last + 1 >= T)
    n = 2 * mine - odd_last.to(tl.int32)     # tiles of this program
    k_tiles = tl.cdiv(K, BLOCK_K)
    if TMA_PUSH:
        tl.static_assert(not DIRECT, "TMA_PUSH pushes into the receive slots")
        push_desc = tl.make_tensor_descriptor(translate(recv + rank * part, rank, peer if REMOTE else rank, heap_bases),
                                              shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
    for j in tl.range(0, n, flatten=True):
        i = j // 2
        half, t = _flat_tile(j, n, odd_last, rank, p, P)
        tm = t // TN
        tn = t % TN
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_tiles):
            a = a_desc.load([tm * BLOCK_M, k * BLOCK_K])
            if B_TRANS:
                b = b_desc.load([tn * BLOCK_N, k * BLOCK_K]).T
            else:
                b = b_desc.load([k * BLOCK_K, tn * BLOCK_N])
            acc = tl.dot(a, b, acc)
        # ---- epilogue. Its tensor work is predicated (masks), not branched: Triton 3.6's loop
        # fusion fails on an scf.if that uses the K loop's accumulator
        if j >= 1:
            if TMA_PUSH:   # the previous push's TMA stores complete before its flag
                tma_store_drain()
            _raise_flat(flags_ptr, T, _flat_tile(j - 1, n, odd_last, rank, p, P)[1], e, rank, heap_bases)
        tm, tn, rows, cols, mask, tile0, loc = _tile_place(t, TN, M, N, BLOCK_M, BLOCK_N)
        own = acc.to(recv.dtype.element_ty)
        is_b = half != 0
        # A: the peer's tile, our partial pushed
        if not TMA_PUSH:
            _push(own, recv, part, tile0, loc, mask & (half == 0), rank, peer, heap_bases, REMOTE)
        # B: ours; first C of the previous pair's peer tile, then the sum
        if is_b & (i >= 1):
            _copy_sum(t - 2 * P + 1 - 2 * rank, TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr,
                      wait_bound, M, N, stride_om, stride_on, BLOCK_M, BLOCK_N, WAIT_CLOCK, REMOTE and WAITS, CONTIG,
                      DIRECT)
        if is_b & REMOTE & WAITS:
            wait_flag(flags_ptr + peer * T + t, e, peer, status_ptr, wait_bound, WAIT_CLOCK)
        mask_b = mask & is_b
        theirs = tl.load(recv + peer * part + tile0 + loc, mask=mask_b, other=0.0)
        total = (own.to(tl.float32) + theirs.to(tl.float32)).to(recv.dtype.element_ty)
        total = _plus_residual(total, out_ptr, tile0, loc, mask_b, RESIDUAL)
        _store_out(total, out_ptr, tm, tn, tile0, loc, mask_b, stride_om, stride_on, BLOCK_M, BLOCK_N, CONTIG)
        if TMA_PUSH:   # A: total is own (zeros added, up to a zero's sign); B: the sum
            halves = tl.permute(tl.reshape(total, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            x0, x1 = tl.split(halves)
            push_desc.store([tm * BLOCK_M, tn * BLOCK_N], x0)   # TMA clips what lies past M and N
            push_desc.store([tm * BLOCK_M, tn * BLOCK_N + BLOCK_N // 2], x1)
        elif DIRECT:
            tl.store(translate(out_ptr + tile0, rank, peer if REMOTE else rank, heap_bases) + loc, total,
                     mask=mask_b)
        else:
            _push(total, recv, part, tile0, loc, mask_b, rank, peer, heap_bases, REMOTE)
    # ---- tail: the last tile's flag, then C of the peer tiles no B of ours copied: the last
    # pair's (rank 0 in an odd last pair has none), and with rank 1's odd last pair (A only)
    # also the pair before's
    if n > 0:
        if TMA_PUSH:
            tma_store_drain()
        _raise_flat(flags_ptr, T, _flat_tile(n - 1, n, odd_last, rank, p, P)[1], e, rank, heap_bases)
    if (rank == 1) & odd_last & (mine >= 2):
        _copy_sum(2 * (q_last - P), TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr, wait_bound,
                  M, N, stride_om, stride_on, BLOCK_M, BLOCK_N, WAIT_CLOCK, REMOTE and WAITS, CONTIG, DIRECT)
    if (mine > 0) & ((rank == 1) | (not odd_last)):
        _copy_sum(2 * q_last + 1 - rank, TN, recv, part, peer, out_ptr, flags_ptr, T, e, status_ptr, wait_bound,
                  M, N, stride_om, stride_on, BLOCK_M, BLOCK_N, WAIT_CLOCK, REMOTE and WAITS, CONTIG, DIRECT)


@triton.jit
def matmul_all_reduce_kernel(a_ptr, b_ptr, out_ptr, recv_ptr, a_desc, b_desc, flags_ptr, status_ptr, epoch_ptr,
                             counters_ptr, heap_bases, rank, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                             stride_om, stride_on, wait_bound,
                             WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, B_TRANS: tl.constexpr,
                             STAGES: tl.constexpr, BUMP_EPOCH: tl.constexpr, WAIT_CLOCK: tl.constexpr,
                             REMOTE: tl.constexpr = True, PDL: tl.constexpr = False, LAG: tl.constexpr = True,
                             PAIRS: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                             CONTIG: tl.constexpr = False, DIRECT: tl.constexpr = False,
                             FLAT: tl.constexpr = False, TMA_PUSH: tl.constexpr = False,
                             WAITS: tl.constexpr = True):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    # REMOTE=False (timing only, communicate=False): the pushes land in our own heap and nobody
    # waits (the flags still go out): the kernel's time without the exchange, its results wrong
    # a: (M, K), b: (K, N) this rank's operands (USE_TMA: also as descriptors); out: (M, N);
    # recv: heap (2, WORLD, M, N) in out's dtype; flags: heap int64 (WORLD, tiles); RESIDUAL: out
    # holds the layer's residual (the same on every rank) and gets residual + sum; CONTIG: out is
    # contiguous (RESIDUAL needs it), its tiles addressed at the receive buffer's offsets
    # DIRECT (PAIRS): out in the symmetric heap at the same offset on every rank, the sums stored
    # into the peer's out
    tl.static_assert(CONTIG or not RESIDUAL, "RESIDUAL reads a contiguous out")
    tl.static_assert(not DIRECT or (PAIRS and CONTIG), "DIRECT is PAIRS' with a contiguous out")
    e = epoch_begin(epoch_ptr)
    slot = (e % 2).to(tl.int32)   # the epoch is int64; buffer arithmetic stays 32-bit
    p = tl.program_id(0)
    P = tl.num_programs(0)
    TN = tl.cdiv(N, BLOCK_N)
    T = tl.cdiv(M, BLOCK_M) * TN
    mine = tl.cdiv(T - p, P)                     # tiles of this program
    part = (tl.zeros([], tl.int64) + M) * N   # M may be the constant 1 (batch-1 decode)
    recv = recv_ptr + (slot * WORLD).to(tl.int64) * part
    if PAIRS:
        tl.static_assert(WORLD == 2, "PAIRS is the two-rank form")
        if FLAT:
            tl.static_assert(USE_TMA and STAGES == 7, "FLAT is the TMA form's interleaved loop")
            _pairs_flat(out_ptr, recv, a_desc, b_desc, flags_ptr, status_ptr, heap_bases, rank, e, p, P, T, TN,
                        part, M, N, K, stride_om, stride_on, wait_bound, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS,
                        WAIT_CLOCK, REMOTE, RESIDUAL, CONTIG, DIRECT, TMA_PUSH, WAITS)
        else:
            _pairs(a_ptr, b_ptr, out_ptr, recv, a_desc, b_desc, flags_ptr, status_ptr, heap_bases, rank, e, p, P,
                   T, TN, part, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                   wait_bound, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, B_TRANS, STAGES, WAIT_CLOCK, REMOTE,
                   RESIDUAL, CONTIG, DIRECT)
    elif not LAG:
        # LAG=False (two ranks): each tile summed as soon as it is pushed. Only the peer's copy is
        # stored; ours stays in registers, rounded to the partials' dtype as the peer's is, and
        # the two are added in fp32 (a + b == b + a: the same bits on both ranks, and as LAG's
        # rank-order sum). The tile is not read back: 192 KB of memory traffic a 128 x 256 bf16
        # tile (push, the peer's partial read, the output) instead of 320. The price: the program
        # waits for the peer's tile right after its own push. (The CPU simulation's consume
        # phase, another launch, recomputes the tile.)
        tl.static_assert(WORLD == 2, "LAG=False is the two-rank form")
        peer = 1 - rank
        for i in range(0, mine):
            t = p + i * P
            tm, tn, rows, cols, mask, tile0, loc = _tile_place(t, TN, M, N, BLOCK_M, BLOCK_N)
            acc = _tile_acc(tm, tn, rows, cols, a_ptr, a_desc, b_ptr, b_desc, M, N, K, stride_am, stride_ak,
                            stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, B_TRANS)
            own = acc.to(recv_ptr.dtype.element_ty)
            if (STAGES & 1) != 0:
                _push(own, recv, part, tile0, loc, mask, rank, peer, heap_bases, REMOTE)
                _raise(flags_ptr, T, t, e, rank, heap_bases, WORLD, WAIT_CLOCK)
            if (STAGES & 2) != 0:
                if REMOTE:
                    wait_flag(flags_ptr + peer * T + t, e, peer, status_ptr, wait_bound, WAIT_CLOCK)
                theirs = tl.load(recv + peer * part + tile0 + loc, mask=mask, other=0.0)
                total = _plus_residual(own.to(tl.float32) + theirs.to(tl.float32), out_ptr, tile0, loc, mask, RESIDUAL)
                _store_out(total, out_ptr, tm, tn, tile0, loc, mask, stride_om, stride_on, BLOCK_M, BLOCK_N, CONTIG)
    else:
        for i in range(0, mine + 1):
            # ---- stage 1: compute tile i; raise tile i-1's flag (its remote stores drained during
            #      this tile's K loop: raised right after its stores, the release fence would stall
            #      the program until they land); then push tile i
            if (STAGES & 1) != 0:
                if i < mine:
                    t = p + i * P
                    tm, tn, rows, cols, mask, tile0, loc = _tile_place(t, TN, M, N, BLOCK_M, BLOCK_N)
                    acc = _tile_acc(tm, tn, rows, cols, a_ptr, a_desc, b_ptr, b_desc, M, N, K, stride_am, stride_ak,
                                    stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, B_TRANS)
                    if i >= 1:
                        _raise(flags_ptr, T, t - P, e, rank, heap_bases, WORLD, WAIT_CLOCK)
                    part_tile = acc.to(recv_ptr.dtype.element_ty)
                    tbase = recv + rank * part + tile0
                    for d in tl.static_range(WORLD):
                        if d == rank:
                            tl.store(tbase + loc, part_tile, mask=mask)
                        else:
                            _push(part_tile, recv, part, tile0, loc, mask, rank, d, heap_bases, REMOTE)
                    # our own copy is read back in stage 2 by other threads of this program
                    tl.debug_barrier()
                else:   # past the last tile: raise the last tile's flag
                    if i >= 1:
                        _raise(flags_ptr, T, p + (i - 1) * P, e, rank, heap_bases, WORLD, WAIT_CLOCK)
            # ---- stage 2: sum tile i - 1 over the ranks
            if (STAGES & 2) != 0:
                j = i - 1
                if j >= 0:
                    t = p + j * P
                    tm, tn, rows, cols, mask, tile0, loc = _tile_place(t, TN, M, N, BLOCK_M, BLOCK_N)
                    # rank order: the same rounding on every rank; the sum starts from rank 0's
                    # partial (not from +0: two -0 partials sum to -0, as the unlagged form's do)
                    for src in tl.static_range(WORLD):
                        if (src != rank) & REMOTE:
                            wait_flag(flags_ptr + src * T + t, e, src, status_ptr, wait_bound, WAIT_CLOCK)
                        x = tl.load(recv + src * part + tile0 + loc, mask=mask, other=0.0).to(tl.float32)
                        if src == 0:
                            total = x
                        else:
                            total += x
                    total = _plus_residual(total, out_ptr, tile0, loc, mask, RESIDUAL)
                    _store_out(total, out_ptr, tm, tn, tile0, loc, mask, stride_om, stride_on, BLOCK_M, BLOCK_N, CONTIG)

    epoch_end(epoch_ptr, counters_ptr, P, e, BUMP_EPOCH)
