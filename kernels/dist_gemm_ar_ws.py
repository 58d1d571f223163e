"""Fused GEMM + all-reduce of two ranks on the warp-specialised Gluon GEMM (kernels/gemm_ws.py).

``out = a @ b_local`` summed over two ranks (``matmul_all_reduce``'s FLAT tile pairs, with TMA
stores instead of register pushes). Why: the Triton kernel's pushes are 16-byte remote stores
issued by the warps that run the MMA, and they cost 36-49 us of its 50-75 us exchange
(bench/results, twenty-seventh session); asynchronous TMA copies of the same bytes, paced over the
next tile's K loop, cost 31-52 us over a GEMM that already runs at cuBLAS's time.

Tiles and their order are the FLAT pairs' (kernels/dist_gemm_ar.py, ``_flat_tile``): tile t is
rank ``t % 2``'s; program p walks pairs p, p + P, ..., the peer's tile (A) first, then its own (B).
Warps, as in the WS GEMM: a loader warp (TMA loads of A and B into a ring of stages) and two
consumer warpgroups, each owning 64 rows of every 128 x 256 tile. A consumer's epilogue:

* A (the peer's tile): the partial, rounded to out's dtype, into a staging tile in shared memory;
  from there, into the peer's ``recv[slot, rank]`` by TMA;
* B (ours): wait for the peer's flag of this half tile, TMA-load its partial from our
  ``recv[slot, peer]``, add ours in fp32 (RESIDUAL: then out's residual, as the unfused
  all-reduce's bits), stage the sum, TMA-store it into our ``out`` and into the peer's (DIRECT:
  the peer's ``out`` at the same heap offset; else its ``recv[slot, rank]``).

The copy to the peer leaves in 64-column chunks spread over the next tile's K loop (a wave of
programs finishes together; its copies at once would queue on the link). After that K loop the
consumer waits for the copy's completion (``cp.async.bulk.wait_group 0``), fences the async proxy
and raises the half tile's flag in the peer's memory (release, system scope). At the end it waits
for the peer's flags of its A tiles (the sums it needs in ``out``; not DIRECT: copies them from
``recv`` into ``out``). Every wait is bounded (``timeout_s`` of ``%globaltimer``); on a timeout
it sets the peer's bit in the status word, which the host turns into a TimeoutError naming the
rank.

``RS`` makes it ``matmul_reduce_scatter`` of two ranks: M is a slice's rows (a has 2 M). Programs
walk the peer slice's tiles (our partial leaves, paced, into the peer's receive slot) and ours
(the peer's partial read, the sum stored into our slice): in pairs (``RS_PAIRS``) or as one list,
the peer's first; nothing goes back. Every
program raises its A tiles' flags before its first wait, so no two programs wait on each other.
``RS_EARLY`` moves that exchange into the K loop: a staged partial's copies over the first half of
the next loop, its flag at 5/8, and at 7/8 of an own tile's loop the wait for the peer's partial
and its TMA load, which the epilogue then only waits for. ``GROUP`` > 0 walks the tiles (a slice's,
or the all-reduce's output) in groups of GROUP tile rows, column by column, as the WS GEMM does.

Flags: ``flags[src, 2 t + half]`` holds the epoch of the last call whose half tile arrived from
rank src. The epoch is read at the start and the last program to leave publishes it (as the
Triton kernels' epoch_begin / epoch_end).

Two ranks, M a multiple of 64 (a receive slot is addressed as rows of one (2 x 2 x M, N) tensor,
so half tiles must not straddle slots), operands TMA-compatible. Gluon: compiled only on CPU.
"""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.language.core import _aggregate as aggregate

    from numasched.kernels.gemm_ws import HAVE_GLUON, _load_b, _mma_step, _stage_a, _tile_of
except ImportError:  # pragma: no cover - triton without Gluon
    HAVE_GLUON = False
from numasched.kernels import gluon_wait

if HAVE_GLUON:
    _wait_flag = gluon_wait.wait_flag

    @aggregate
    class MarArgs:
        """What every partition sees (constexpr fields stay compile-time in the partitions)."""
        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        out_desc: tma.tensor_descriptor        # our out (M, N), (64, BLOCK_N) boxes
        out_peer_desc: tma.tensor_descriptor   # DIRECT: the peer's out; else out_desc again
        recv_desc: tma.tensor_descriptor       # our recv as (2 * 2 * M, N)
        recv_peer_desc: tma.tensor_descriptor  # the peer's recv as (2 * 2 * M, N)
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        flags: gl.tensor                       # our flags (2, 2 T) int64
        peer_flags: gl.tensor                  # the peer's flags
        status: gl.tensor                      # int32 status word (bit r: rank r timed out)
        bound: gl.tensor                       # us a wait may take (%globaltimer; int32 for any timeout)
        e: gl.tensor                           # this call's epoch
        rank: gl.tensor
        M: gl.tensor
        N: gl.tensor
        K: gl.tensor
        RESIDUAL: gl.constexpr
        DIRECT: gl.constexpr
        RS: gl.constexpr                       # the reduce-scatter: M is a slice's rows (see the module doc)
        RS_PAIRS: gl.constexpr                 # RS in pairs (the peer slice's tile q, then ours)
        RS_EARLY: gl.constexpr                 # RS: the flag raised and the peer's partial fetched in the K loop
        GROUP: gl.constexpr                    # tiles in groups of GROUP tile rows, column by column (0: row by row)

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, out_desc, out_peer_desc, recv_desc, recv_peer_desc, a_bufs, b_bufs,
                     ready, empty, flags, peer_flags, status, bound, e, rank, M, N, K, RESIDUAL, DIRECT, RS, RS_PAIRS,
                     RS_EARLY, GROUP):
            self.a_desc, self.b_desc, self.out_desc, self.out_peer_desc = a_desc, b_desc, out_desc, out_peer_desc
            self.recv_desc, self.recv_peer_desc = recv_desc, recv_peer_desc
            self.a_bufs, self.b_bufs, self.ready, self.empty = a_bufs, b_bufs, ready, empty
            self.flags, self.peer_flags, self.status, self.bound = flags, peer_flags, status, bound
            self.e, self.rank, self.M, self.N, self.K = e, rank, M, N, K
            self.RESIDUAL, self.DIRECT, self.RS = gl.constexpr(RESIDUAL), gl.constexpr(DIRECT), gl.constexpr(RS)
            self.RS_PAIRS, self.RS_EARLY = gl.constexpr(RS_PAIRS), gl.constexpr(RS_EARLY)
            self.GROUP = gl.constexpr(GROUP)

    @gluon.jit
    def _my_tiles(T, rank):
        """(n, odd_last, p, P): this program's tile count in the pair order (see _pair_tile)."""
        p = gl.program_id(0)
        P = gl.num_programs(0)
        mine = gl.cdiv(gl.cdiv(T, 2) - p, P)
        q_last = p + (mine - 1) * P
        odd_last = (mine > 0) & (2 * q_last + 1 >= T)
        return 2 * mine - odd_last.to(gl.int32), odd_last, p, P

    @gluon.jit
    def _pair_tile(j, n, odd_last, rank, p, P):
        """(half, tile) of the program's j-th tile: half 0 the peer's tile of pair j // 2, 1 ours;
        an odd last pair's single tile is rank 0's B or rank 1's A (dist_gemm_ar._flat_tile)."""
        half = (j % 2) | ((j == n - 1) & odd_last & (rank == 0)).to(gl.int32)
        return half, 2 * (p + (j // 2) * P) + (half + 1 - rank) % 2

    @gluon.jit
    def _schedule(p, T):
        """(n, odd_last, p, P): the program's tile count. RS (T a slice's tiles): RS_PAIRS, pairs
        (the peer slice's tile q, then ours) for q = p, p + P, ...; else positions p, p + P, ...
        below 2 T, the peer slice's T tiles then ours (2 ceil(T / P) rounds against ceil(2 T / P):
        4 against 3 at 160 tiles on 132 SMs; where they are equal, pairs spread the copies evenly
        over the call). Else _my_tiles."""
        if p.RS:
            pid = gl.program_id(0)
            P = gl.num_programs(0)
            if p.RS_PAIRS:
                n = 2 * gl.cdiv(T - pid, P)
            else:
                n = gl.cdiv(2 * T - pid, P)
            return n, n < 0, pid, P
        else:
            return _my_tiles(T, p.rank)

    @gluon.jit
    def _tile_rc(p, t, TN, BLOCK_M: gl.constexpr):
        """(tile row, tile column) of tile id ``t`` (of M's rows, TN columns): the WS GEMM's grouped
        order (``GROUP`` tile rows, column by column), or row by row (GROUP 0). Grouped, the tiles
        that run at once share B's columns as the GEMM's do: two H100s, Qwen3-32B down's
        reduce-scatter at 16384 rows ran 3.19-3.22 ms against 3.69-3.94 row by row."""
        if p.GROUP > 0:
            tm, tn = _tile_of(t, gl.cdiv(p.M, BLOCK_M), TN, p.GROUP)
        else:
            tm = t // TN
            tn = t % TN
        return tm, tn

    @gluon.jit
    def _tile_at(p, j, n, odd_last, pid, P, TN, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(half, tile id (flags), A's first row, out's first row, first column) of the program's
        j-th tile. RS: tile q of the peer's slice (half 0: A's rows there) or of ours (half 1);
        out is our slice. Else the pair order over the whole output."""
        if p.RS:
            if p.RS_PAIRS:
                half = j % 2
                q = pid + (j // 2) * P
            else:
                T = gl.cdiv(p.M, BLOCK_M) * TN
                pos = pid + j * P
                half = (pos >= T).to(gl.int32)
                q = pos - half * T
            dest = gl.where(half == 0, 1 - p.rank, p.rank)
            tm, tn = _tile_rc(p, q, TN, BLOCK_M)
            return half, q, dest * p.M + tm * BLOCK_M, tm * BLOCK_M, tn * BLOCK_N
        else:
            half, t = _pair_tile(j, n, odd_last, p.rank, pid, P)
            tm, tn = _tile_rc(p, t, TN, BLOCK_M)
            return half, t, tm * BLOCK_M, tm * BLOCK_M, tn * BLOCK_N

    @gluon.jit
    def _raise_flag(ptr, value):
        """Our TMA copies complete (writes, not only the shared-memory reads), ordered before the
        flag's release store in the peer's memory."""
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r",
                                  [], dtype=gl.int32, is_pure=False, pack=1)
        gl.thread_barrier()
        gl.atomic_xchg(ptr, value, sem="release", scope="sys")

    @gluon.jit
    def _copy_chunk(p, stage, j: gl.constexpr, row, col, into_recv, rrow):
        """Chunk j (64 columns) of the staged half tile into the peer: its recv rows ``rrow`` or its out."""
        CH: gl.constexpr = p.recv_peer_desc.block_type.shape[1]
        if into_recv:
            tma.async_copy_shared_to_global(p.recv_peer_desc, [rrow, col + j * CH], stage.slice(j * CH, CH, dim=1))
        else:
            tma.async_copy_shared_to_global(p.out_peer_desc, [row, col + j * CH], stage.slice(j * CH, CH, dim=1))

    @gluon.jit
    def _issue_fill(desc, row, col, lbar, stage):
        """A (64, BLOCK_N) box of ``desc`` into the staging tile by TMA, issued (after every
        thread's last read of it, ordered before the async write); ``lbar`` completes it."""
        gl.thread_barrier()
        fence_async_shared()
        mbarrier.expect(lbar, stage.type.shape[0] * stage.type.shape[1] * 2)
        tma.async_copy_global_to_shared(desc, [row, col], lbar, stage)

    @gluon.jit
    def _fill_stage(desc, row, col, lbar, lphase, stage):
        """_issue_fill, then its wait; returns the barrier's next phase."""
        _issue_fill(desc, row, col, lbar, stage)
        mbarrier.wait(lbar, lphase)
        return lphase ^ 1

    @gluon.jit
    def _mar_loader(p):
        """One warp: TMA loads of every (tile, K step) of this program in the pair order."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        NBYTES: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        TN = gl.cdiv(p.N, BLOCK_N)
        T = gl.cdiv(p.M, BLOCK_M) * TN
        n, odd_last, pid, P = _schedule(p, T)
        k_steps = gl.cdiv(p.K, BLOCK_K)
        it = 0
        for j in range(n):
            half, t, off_m, o_row, off_n = _tile_at(p, j, n, odd_last, pid, P, TN, BLOCK_M, BLOCK_N)
            for kk in range(k_steps):
                bar, s = _stage_a(p, it, off_m, kk, NBYTES)
                _load_b(p, off_n, kk * BLOCK_K, bar, p.b_bufs.index(s))
                it += 1

    @gluon.jit
    def _mar_consumer(p, ROLE: gl.constexpr):
        """One warpgroup: rows [ROLE * 64, ROLE * 64 + 64) of this program's tiles (see the module doc)."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        ROWS: gl.constexpr = p.out_desc.block_type.shape[0]
        CH: gl.constexpr = p.recv_peer_desc.block_type.shape[1]
        NCH: gl.constexpr = BLOCK_N // CH
        dt: gl.constexpr = p.out_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        stage = gl.allocate_shared_memory(dt, [ROWS, BLOCK_N], p.out_desc.layout)
        lbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(lbar, count=1)
        TN = gl.cdiv(p.N, BLOCK_N)
        T = gl.cdiv(p.M, BLOCK_M) * TN
        n, odd_last, pid, P = _schedule(p, T)
        k_steps = gl.cdiv(p.K, BLOCK_K)
        peer = 1 - p.rank
        slot = (p.e % 2).to(gl.int32)
        own_rows = (slot * 2 + p.rank) * p.M    # our partials' rows in the peer's recv
        peer_rows = (slot * 2 + peer) * p.M     # the peer's partials' rows in ours
        pace = gl.maximum(k_steps // NCH, 1)
        # RS_EARLY: the chunks over the first half of the K loop, the flag once all have left
        # (at 5/8 or later), the fetch after it (at 7/8 or later); past the loop: after it
        epace = gl.maximum(k_steps // (2 * NCH), 1)
        flag_at = gl.maximum((5 * k_steps) // 8, (NCH - 1) * epace)
        fetch_at = gl.maximum((7 * k_steps) // 8, flag_at)
        acc = gl.zeros((ROWS, BLOCK_N), gl.float32, acc_layout)
        lphase = 0
        it = 0
        # the staged half tile still to be copied to the peer (``pending``), where, and its flag
        pending = 0
        p_row = 0
        p_col = 0
        p_recv = 0
        p_flag = 0
        for j in range(n):
            half, t, a_row, o_row, col0 = _tile_at(p, j, n, odd_last, pid, P, TN, BLOCK_M, BLOCK_N)
            row0 = o_row + ROLE * ROWS
            # RS_EARLY: a staged partial leaves over the first half of this K loop and its flag goes
            # up at 5/8 of it; at 7/8 of an own tile's loop the peer's partial of it (pairs: its flag
            # raised at 5/8 of the peer's loop; one list: long before) is fetched into the staging
            # tile, so the epilogue neither polls nor waits for a load
            fetched = 0
            prev = 0
            for kk in range(k_steps):
                acc, s = _mma_step(p, acc, it, kk, prev, ROLE, ROWS)
                if p.RS_EARLY:
                    for c in gl.static_range(NCH):
                        if (pending != 0) & (kk == c * epace):
                            _copy_chunk(p, stage, c, p_row, p_col, p_recv != 0, own_rows + p_row)
                    if (pending != 0) & (kk == flag_at):
                        _raise_flag(p.peer_flags + p_flag, p.e)   # (its copies done: the staging tile is free)
                        pending = 0
                    if (half == 1) & (row0 < p.M) & (pending == 0) & (kk == fetch_at):
                        # the staging tile is free: its partial's copies completed (the flag above), or
                        # it last held a sum whose store to out has had 7/8 of this loop to drain
                        tma.store_wait(pendings=0)
                        _wait_flag(p.flags + (peer * T + t) * 2 + ROLE, p.e, peer, p.status, p.bound)
                        _issue_fill(p.recv_desc, peer_rows + row0, col0, lbar, stage)
                        fetched = 1
                else:
                    # the previous half tile's copy, paced over this K loop
                    for c in gl.static_range(NCH):
                        if (pending != 0) & (kk == c * pace):
                            _copy_chunk(p, stage, c, p_row, p_col, p_recv != 0, own_rows + p_row)
                prev = s
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(p.empty.index(prev), count=1, pred=k_steps > 0)
            # ---- the previous half tile: the chunks the K loop did not reach, then its flag
            if pending != 0:
                for c in gl.static_range(NCH):
                    if c * (epace if p.RS_EARLY else pace) >= k_steps:
                        _copy_chunk(p, stage, c, p_row, p_col, p_recv != 0, own_rows + p_row)
                _raise_flag(p.peer_flags + p_flag, p.e)
            pending = 0
            if row0 < p.M:   # M is a multiple of 64: a half tile is whole or absent
                flag = (p.rank * T + t) * 2 + ROLE
                if p.RS:   # our last sum's TMA store may still read the staging tile (the all-reduce's
                    # next flag waits for it: _raise_flag); RS sends no sums, so wait here
                    tma.store_wait(pendings=0)
                    gl.thread_barrier()
                if half == 0:   # A: our partial of the peer's tile, into its recv
                    stage.store(acc.to(dt))
                    fence_async_shared()
                    p_recv = 1
                else:           # B: ours; the peer's partial, (the residual,) the sum
                    if fetched != 0:   # (RS_EARLY) fetched in the K loop
                        mbarrier.wait(lbar, lphase)
                        lphase = lphase ^ 1
                    else:
                        _wait_flag(p.flags + (peer * T + t) * 2 + ROLE, p.e, peer, p.status, p.bound)
                        lphase = _fill_stage(p.recv_desc, peer_rows + row0, col0, lbar, lphase, stage)
                    # in place in the accumulator (the next tile's first wgmma ignores it): no
                    # second fp32 tile in registers; our partial rounded as the peer's was
                    acc = acc.to(dt).to(gl.float32) + stage.load(acc_layout).to(gl.float32)
                    if p.RESIDUAL:   # out holds the residual: h + sum, rounded as the unfused ops'
                        lphase = _fill_stage(p.out_desc, row0, col0, lbar, lphase, stage)
                        acc = acc.to(dt).to(gl.float32) + stage.load(acc_layout).to(gl.float32)
                    gl.thread_barrier()
                    stage.store(acc.to(dt))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(p.out_desc, [row0, col0], stage)
                    p_recv = 0 if p.DIRECT else 1
                pending = 1
                if p.RS:   # the reduce-scatter sends partials only: our slice's sums stay here
                    pending = (half == 0).to(gl.int32)
                p_row = row0
                p_col = col0
                p_flag = flag
        # ---- the last half tile's copy and flag
        if pending != 0:
            for c in gl.static_range(NCH):
                _copy_chunk(p, stage, c, p_row, p_col, p_recv != 0, own_rows + p_row)
            _raise_flag(p.peer_flags + p_flag, p.e)
        # ---- the peer's sums of our A tiles: in out (DIRECT) or in recv (copied here); none (RS)
        for j in range(0 if p.RS else n):
            half, t, a_row, o_row, c0 = _tile_at(p, j, n, odd_last, pid, P, TN, BLOCK_M, BLOCK_N)
            row0 = o_row + ROLE * ROWS
            if (half == 0) & (row0 < p.M):
                _wait_flag(p.flags + (peer * T + t) * 2 + ROLE, p.e, peer, p.status, p.bound)
                if not p.DIRECT:
                    lphase = _fill_stage(p.recv_desc, peer_rows + row0, c0, lbar, lphase, stage)
                    tma.async_copy_shared_to_global(p.out_desc, [row0, c0], stage)
                    tma.store_wait(pendings=0)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _mar_consumer_lo(p):
        _mar_consumer(p, 0)

    @gluon.jit
    def _mar_consumer_hi(p):
        _mar_consumer(p, 1)

    @gluon.jit(do_not_specialize=["rank", "M", "N", "K", "bound"])
    def matmul_all_reduce_ws_kernel(a_desc, b_desc, out_desc, out_peer_desc, recv_desc, recv_peer_desc,
                                    flags, peer_flags, status, epoch, counters, bound, rank, M, N, K,
                                    STAGES: gl.constexpr, RESIDUAL: gl.constexpr, DIRECT: gl.constexpr,
                                    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, RS: gl.constexpr = False,
                                    RS_PAIRS: gl.constexpr = False, RS_EARLY: gl.constexpr = False,
                                    GROUP: gl.constexpr = 0):
        """Two ranks: out = sum over ranks of a @ b (see the module doc); RS: out = our slice of it
        (M: a slice's rows; a has 2 M). num_warps=4, about one program per SM, at most one per
        tile pair."""
        gl.static_assert(not (RS and (RESIDUAL or DIRECT)), "the reduce-scatter has no residual, no DIRECT")
        gl.static_assert(not RS_EARLY or RS, "RS_EARLY is the reduce-scatter's")
        e = gl.load(epoch) + 1
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        p = MarArgs(a_desc, b_desc, out_desc, out_peer_desc, recv_desc, recv_peer_desc, a_bufs, b_bufs, ready,
                    empty, flags, peer_flags, status, bound, e, rank, M, N, K, RESIDUAL, DIRECT, RS, RS_PAIRS, RS_EARLY,
                    GROUP)
        gl.warp_specialize([
            (_mar_consumer_lo, (p,)),
            (_mar_consumer_hi, (p,)),
            (_mar_loader, (p,)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        # the last program out resets the exit counter and publishes the epoch
        done = gl.atomic_add(counters + 1, 1, sem="acq_rel", scope="gpu")
        if done == gl.num_programs(0) - 1:
            gl.atomic_xchg(counters + 1, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(epoch, e, sem="release", scope="gpu")
