"""Warp-specialised persistent GEMM for Hopper (sm_90), written in Gluon.

Why: the Triton kernels of kernels/gemm.py are software-pipelined. Every K step of their loop
holds CTA-wide barriers (four ``bar.sync`` in the sm_90 PTX), and Nsight Compute put 35-61 % of
their issue gaps at those barriers (bench/results, twenty-sixth session). Triton 3.6 does not
warp-specialise a ``tl.range`` on sm_90, but Gluon (its explicit-layout dialect) does. Here the
warps of a program split the work three ways, and they talk through mbarriers only:

* a **loader** warp walks the program's tiles and K steps and issues the TMA loads of A and B
  into a ring of STAGES shared-memory slots. It waits for a slot to be freed (``empty``), then
  arms its ``ready`` barrier with the bytes to expect;
* two **consumer** warpgroups each own half of the tile's rows (64 x BLOCK_N; tiles of 64 rows
  have one). They wait for
  ``ready``, issue an asynchronous wgmma and keep one in flight. After ``wait(1)`` the previous
  slot's wgmma is done, and each warpgroup releases that slot with one arrive (``empty`` counts two);
* the epilogue runs in each consumer: fp32 -> output dtype, into its own shared tile, then a TMA
  store. The store drains while the next tile's K loop runs, and the loader has already fetched
  that tile's first stages.

``GLU`` makes it the SwiGLU GEMM of an MLP (numasched.gemm_glu): B is the transpose of the
(2n, K) gate/up weight, each stage's B slot holds a gate box and the matching up box stacked, so
one wgmma of twice the width accumulates both (a thread holds the same columns of the two
halves), and the epilogue stores ``silu(gate) * up`` (with ``ROW_SCALE``, both first times a
factor per row: a norm folded into the GEMM).

No barrier spans the whole CTA inside the K loop. A, B and C go through host TMA descriptors, so
edges need no masks: TMA zero-fills the loads outside the tensor and clips the stores.

Tiles are walked persistently (one program per SM) in grouped order: GROUP_M tile rows share the
B columns of a tile column while they are in L2.

``SWAP_C`` runs F.linear's y = x W^T transposed: the weight is the kernel's A, the tokens its N,
and each consumer stores its tile through a transposing ``stmatrix`` into y's own layout, so a
tile's side along the tokens can be any width of two boxes (cuBLAS's ``_TNT`` kernels do the same).

Gluon has no interpreter: the CPU suite compiles this kernel for sm_90 offline and checks its
structure (tests/test_gemm_ws.py); correctness and speed come from the GPU tests and
``scripts/gemm_ws_probe.py``.
"""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.language.core import _aggregate as aggregate
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - triton without Gluon
    HAVE_GLUON = False

CONSUMER_ROWS = 64  # rows of the tile one consumer warpgroup owns (wgmma's M per warpgroup)

if HAVE_GLUON:
    @gluon.constexpr_function
    def _band_layout(block_n):
        """The banded merge's rows: 16-byte vectors, a warp's threads across BLOCK_N columns (no
        thread holds another's elements at 64 or 128 columns), four warps down."""
        cols = min(32, block_n // 4)
        return gl.BlockedLayout([1, 4], [32 // cols, cols], [4, 1], [1, 0])

    @aggregate
    class WsArgs:
        """What every partition sees. The constexpr fields stay compile-time inside the partitions
        (a worker's plain arguments would not)."""
        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        c_desc: tma.tensor_descriptor
        peer_desc: tma.tensor_descriptor       # PEER_PUSH: C's twin in a peer GPU's memory
        b1_desc: tma.tensor_descriptor         # N1 > 0: B's boxes of the tile's last N1 columns
        c1_desc: tma.tensor_descriptor         # N1 > 0: C's half-tile boxes of those columns
        a1_desc: tma.tensor_descriptor         # A_LAST > 0: A's boxes of A_LAST rows (the partial last tile row)
        a2_desc: tma.tensor_descriptor         # A_LAST2 > 0: the boxes of its next A_LAST2 rows
        b2_desc: tma.tensor_descriptor         # B_LAST0 > 0: B's first box in the last tile column, B_LAST0 rows
        b3_desc: tma.tensor_descriptor         # B_LAST1 > 0: its second box there, B_LAST1 rows
        bx_desc: tma.tensor_descriptor         # N2 > 0: B's boxes of the tile's third box, N2 columns
        cx_desc: tma.tensor_descriptor         # N2 > 0: C's boxes of those columns
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor   # STAGES slots (GLU: gate rows then up rows in each)
        b1_bufs: gl.shared_memory_descriptor  # N1 > 0: STAGES slots of the second box
        bx_bufs: gl.shared_memory_descriptor  # N2 > 0: STAGES slots of the third box
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        scale: gl.tensor                      # (M,) fp32 row factors (ROW_SCALE), else unread
        M: gl.tensor
        N: gl.tensor                          # output columns (GLU: n; the up rows start at n)
        K: gl.tensor
        GROUP_M: gl.constexpr
        GLU: gl.constexpr
        ROW_SCALE: gl.constexpr
        PEER_PUSH: gl.constexpr
        N1: gl.constexpr          # 0, or a tile of BLOCK_N + N1 columns in two power-of-two boxes
        B_KMAJOR: gl.constexpr    # B's boxes are (columns, K) boxes of an (N, K) weight
        A_LAST: gl.constexpr      # 0, or the rows of a1_desc's boxes (see _stage_a_rows)
        A_LAST2: gl.constexpr     # 0, or the rows of a2_desc's boxes
        DEAD_HALF: gl.constexpr   # a half tile past M frees its slots without a wgmma
        SWAP_C: gl.constexpr      # C is stored transposed: c_desc / c1_desc describe C^T (see gemm_ws_kernel)
        B_LAST0: gl.constexpr     # 0, or the rows of b2_desc's boxes (see _loader)
        B_LAST1: gl.constexpr     # 0 (the second box not loaded there), or the rows of b3_desc's boxes
        N2: gl.constexpr          # 0, or a third power-of-two box of N2 columns (tiles of BLOCK_N + N1 + N2)
        bias: gl.tensor           # BIAS: the output columns' bias (N,) (SWAP_C: the kernel's rows'), else unread
        res: gl.tensor            # RESIDUAL 2: y's residual, (stride_rm, stride_rn) in y's own (rows, columns)
        stride_rm: gl.tensor
        stride_rn: gl.tensor
        BIAS: gl.constexpr
        RESIDUAL: gl.constexpr    # 0; 1: by TMA (r_desc, r1_desc, rx_desc: c_desc's boxes of it) into C's tiles; 2: pointers
        r_desc: tma.tensor_descriptor
        r1_desc: tma.tensor_descriptor
        rx_desc: tma.tensor_descriptor
        resbar: gl.shared_memory_descriptor   # RESIDUAL 1: one barrier per consumer, the residual tile's arrival

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, c_desc, peer_desc, b1_desc, c1_desc, a1_desc, a2_desc, a_bufs, b_bufs,
                     b1_bufs, ready, empty, scale, M, N, K, GROUP_M, GLU, ROW_SCALE, PEER_PUSH, N1, B_KMAJOR, A_LAST,
                     A_LAST2, DEAD_HALF, SWAP_C=False, b2_desc=None, b3_desc=None, B_LAST0=0, B_LAST1=0,
                     bx_desc=None, cx_desc=None, bx_bufs=None, N2=0, bias=None, res=None, stride_rm=None,
                     stride_rn=None, BIAS=False, RESIDUAL=0, r_desc=None, r1_desc=None, rx_desc=None, resbar=None):
            self.a_desc, self.b_desc, self.c_desc, self.peer_desc = a_desc, b_desc, c_desc, peer_desc
            self.b1_desc, self.c1_desc, self.b1_bufs = b1_desc, c1_desc, b1_bufs
            self.a1_desc, self.a2_desc = a1_desc, a2_desc
            self.A_LAST, self.A_LAST2, self.DEAD_HALF = gl.constexpr(A_LAST), gl.constexpr(A_LAST2), gl.constexpr(DEAD_HALF)
            self.PEER_PUSH, self.N1, self.B_KMAJOR = gl.constexpr(PEER_PUSH), gl.constexpr(N1), gl.constexpr(B_KMAJOR)
            self.a_bufs, self.b_bufs, self.ready, self.empty = a_bufs, b_bufs, ready, empty
            self.scale, self.M, self.N, self.K = scale, M, N, K
            self.GROUP_M, self.GLU, self.ROW_SCALE = gl.constexpr(GROUP_M), gl.constexpr(GLU), gl.constexpr(ROW_SCALE)
            self.SWAP_C = gl.constexpr(SWAP_C)
            self.b2_desc, self.b3_desc = b2_desc, b3_desc
            self.B_LAST0, self.B_LAST1 = gl.constexpr(B_LAST0), gl.constexpr(B_LAST1)
            self.bx_desc, self.cx_desc, self.bx_bufs, self.N2 = bx_desc, cx_desc, bx_bufs, gl.constexpr(N2)
            self.bias, self.res, self.stride_rm, self.stride_rn = bias, res, stride_rm, stride_rn
            self.BIAS, self.RESIDUAL = gl.constexpr(BIAS), gl.constexpr(RESIDUAL)
            self.r_desc, self.r1_desc, self.rx_desc, self.resbar = r_desc, r1_desc, rx_desc, resbar

    @gluon.jit
    def _tile_of(t, NM, NN, GROUP_M: gl.constexpr):
        """Tile id -> (tile row, tile column) in grouped order: GROUP_M rows, column by column."""
        per_group = GROUP_M * NN
        group = t // per_group
        first_m = group * GROUP_M
        rows = gl.minimum(NM - first_m, GROUP_M)
        local = t % per_group
        return first_m + local % rows, local // rows

    @gluon.jit
    def _load_box(desc, KMAJOR: gl.constexpr, off_n, k, bar, slot):
        """B's box of ``desc`` at columns off_n and K rows k into ``slot``. B (K, N) stored as
        (N, K), the weight of F.linear (KMAJOR), comes in (columns, BLOCK_K) boxes."""
        if KMAJOR:
            tma.async_copy_global_to_shared(desc, [off_n, k], bar, slot)
        else:
            tma.async_copy_global_to_shared(desc, [k, off_n], bar, slot)

    @gluon.jit
    def _box_operand(slot, KMAJOR: gl.constexpr):
        """A B slot as wgmma's (BLOCK_K, columns) operand (a transposed view for (N, K) boxes)."""
        if KMAJOR:
            return slot.permute((1, 0))
        else:
            return slot

    @gluon.jit
    def _load_b(p, off_n, k, bar, slot):
        """B's box of columns [off_n, off_n + BLOCK_N) and K rows [k, k + BLOCK_K) into ``slot``
        (the orientation read off the box: BLOCK_N != BLOCK_K here)."""
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        _load_box(p.b_desc, p.b_desc.block_type.shape[1] == BLOCK_K, off_n, k, bar, slot)

    @gluon.jit
    def _b_operand(p, slot):
        """A B slot as wgmma's (BLOCK_K, BLOCK_N) operand."""
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        return _box_operand(slot, p.b_desc.block_type.shape[1] == BLOCK_K)

    @gluon.jit
    def _claim_slot(p, it, NBYTES: gl.constexpr):
        """The loader's step ``it``: wait for its slot to be free and arm the slot's ready barrier
        with NBYTES. Returns (the barrier, the slot)."""
        STAGES: gl.constexpr = p.a_bufs.type.shape[0]
        s = it % STAGES
        # slots start free: the first wait on each passes (phase 1 of a fresh barrier)
        mbarrier.wait(p.empty.index(s), ((it // STAGES) & 1) ^ 1)
        bar = p.ready.index(s)
        mbarrier.expect(bar, NBYTES)
        return bar, s

    @gluon.jit
    def _stage_a(p, it, off_m, kk, NBYTES: gl.constexpr):
        """_claim_slot, then A's box. Returns (the barrier, the slot) for B's boxes."""
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        bar, s = _claim_slot(p, it, NBYTES)
        tma.async_copy_global_to_shared(p.a_desc, [off_m, kk * BLOCK_K], bar, p.a_bufs.index(s))
        return bar, s

    @gluon.jit
    def _stage_a_rows(p, it, off_m, kk, NBYTES: gl.constexpr):
        """_stage_a, where A's last tile row is partial and ``p.A_LAST`` > 0: that row's A comes
        in a box of A_LAST rows (``p.a1_desc``), and (A_LAST2 > 0) one of the next A_LAST2 rows
        (``p.a2_desc``), into the top of the slot, the barrier armed with their bytes. A 128-row
        box mostly past A's last row is slow (at 650 rows the 128-row tiles ran longer than at
        768); the slot's rows below the short boxes keep stale data, which feeds only output rows
        past M (never stored)."""
        if p.A_LAST > 0:
            BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
            BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
            A2_BYTES: gl.constexpr = p.a2_desc.block_type.nbytes if p.A_LAST2 > 0 else 0
            LAST_BYTES: gl.constexpr = NBYTES - p.a_desc.block_type.nbytes + p.a1_desc.block_type.nbytes + A2_BYTES
            if off_m + BLOCK_M > p.M:
                bar, s = _claim_slot(p, it, LAST_BYTES)
                slot = p.a_bufs.index(s)
                tma.async_copy_global_to_shared(p.a1_desc, [off_m, kk * BLOCK_K], bar, slot.slice(0, p.A_LAST, dim=0))
                if p.A_LAST2 > 0:
                    tma.async_copy_global_to_shared(p.a2_desc, [off_m + p.A_LAST, kk * BLOCK_K], bar,
                                                    slot.slice(p.A_LAST, p.A_LAST2, dim=0))
            else:
                bar, s = _stage_a(p, it, off_m, kk, NBYTES)
        else:
            bar, s = _stage_a(p, it, off_m, kk, NBYTES)
        return bar, s

    @gluon.jit
    def _wait_slot(p, it, ROLE: gl.constexpr, ROWS: gl.constexpr):
        """Wait for step ``it``'s ring slot: (the slot, this consumer's ROWS rows of A in it)."""
        STAGES: gl.constexpr = p.a_bufs.type.shape[0]
        s = it % STAGES
        mbarrier.wait(p.ready.index(s), (it // STAGES) & 1)
        return s, p.a_bufs.index(s).slice(ROLE * ROWS, ROWS, dim=0)

    @gluon.jit
    def _mma_step(p, acc, it, kk, prev, ROLE: gl.constexpr, ROWS: gl.constexpr):
        """A consumer's step ``it`` (K step ``kk`` of its tile): wait for the slot, one async wgmma
        on its rows, keep one in flight; the previous step's is then done and its slot ``prev``
        is freed. Returns (acc, this slot)."""
        s, a = _wait_slot(p, it, ROLE, ROWS)
        acc = warpgroup_mma(a, _b_operand(p, p.b_bufs.index(s)), acc, use_acc=kk > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(p.empty.index(prev), count=1, pred=kk > 0)
        return acc, s

    @gluon.jit
    def _mma_step2(p, acc, acc1, it, kk, prev, ROLE: gl.constexpr, ROWS: gl.constexpr):
        """_mma_step of a tile in two boxes (N1 > 0): two async wgmmas on the same A rows, one per
        box and accumulator; the previous step's pair is done after ``wait(2)``."""
        s, a = _wait_slot(p, it, ROLE, ROWS)
        acc = warpgroup_mma(a, _box_operand(p.b_bufs.index(s), p.B_KMAJOR), acc, use_acc=kk > 0, is_async=True)
        acc1 = warpgroup_mma(a, _box_operand(p.b1_bufs.index(s), p.B_KMAJOR), acc1, use_acc=kk > 0, is_async=True)
        acc, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc1))
        mbarrier.arrive(p.empty.index(prev), count=1, pred=kk > 0)
        return acc, acc1, s

    @gluon.jit
    def _mma_step3(p, acc, acc1, acc2, it, kk, prev, ROLE: gl.constexpr, ROWS: gl.constexpr):
        """_mma_step2 of a tile in three boxes (N2 > 0): three async wgmmas, one per box."""
        s, a = _wait_slot(p, it, ROLE, ROWS)
        acc = warpgroup_mma(a, _box_operand(p.b_bufs.index(s), p.B_KMAJOR), acc, use_acc=kk > 0, is_async=True)
        acc1 = warpgroup_mma(a, _box_operand(p.b1_bufs.index(s), p.B_KMAJOR), acc1, use_acc=kk > 0, is_async=True)
        acc2 = warpgroup_mma(a, _box_operand(p.bx_bufs.index(s), p.B_KMAJOR), acc2, use_acc=kk > 0, is_async=True)
        acc, acc1, acc2 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, acc1, acc2))
        mbarrier.arrive(p.empty.index(prev), count=1, pred=kk > 0)
        return acc, acc1, acc2, s

    @gluon.jit
    def _load_b_tile(p, s, bar, off_n, kk):
        """The loader's B boxes of one K step of the tile at column ``off_n`` into slot ``s``."""
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[0] if p.SWAP_C else p.c_desc.block_type.shape[1]
        if p.GLU:   # the gate's rows, then the up's (n further on), as one (2 BLOCK_N, BLOCK_K) slot
            slot = p.b_bufs.index(s)
            _load_b(p, off_n, kk * BLOCK_K, bar, slot.slice(0, BLOCK_N, dim=0))
            _load_b(p, p.N + off_n, kk * BLOCK_K, bar, slot.slice(BLOCK_N, BLOCK_N, dim=0))
        elif p.N1 > 0:   # the tile's two boxes: BLOCK_N columns, then N1 (and a third of N2)
            _load_box(p.b_desc, p.B_KMAJOR, off_n, kk * BLOCK_K, bar, p.b_bufs.index(s))
            _load_box(p.b1_desc, p.B_KMAJOR, off_n + BLOCK_N, kk * BLOCK_K, bar, p.b1_bufs.index(s))
            if p.N2 > 0:
                _load_box(p.bx_desc, p.B_KMAJOR, off_n + BLOCK_N + p.N1, kk * BLOCK_K, bar, p.bx_bufs.index(s))
        else:
            _load_b(p, off_n, kk * BLOCK_K, bar, p.b_bufs.index(s))

    @gluon.jit
    def _loader(p):
        """One warp: TMA loads of every (tile, K step) of this program, STAGES ahead of the wgmma."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[0] if p.SWAP_C else p.c_desc.block_type.shape[1]
        NB: gl.constexpr = 2 if p.GLU else 1
        NBYTES: gl.constexpr = (p.a_desc.block_type.nbytes + NB * p.b_desc.block_type.nbytes
                                + (p.b1_desc.block_type.nbytes if p.N1 > 0 else 0)
                                + (p.bx_desc.block_type.nbytes if p.N2 > 0 else 0))
        TILE_N: gl.constexpr = BLOCK_N + p.N1 + p.N2
        NM = gl.cdiv(p.M, BLOCK_M)
        NN = gl.cdiv(p.N, TILE_N)
        k_steps = gl.cdiv(p.K, BLOCK_K)
        it = 0
        for t in range(gl.program_id(0), NM * NN, gl.num_programs(0)):
            tm, tn = _tile_of(t, NM, NN, p.GROUP_M)
            off_m = tm * BLOCK_M
            off_n = tn * TILE_N
            for kk in range(k_steps):
                if p.B_LAST0 > 0:
                    if tn == NN - 1:
                        # the last tile column, mostly past N: B's boxes of its own rows (B_LAST0,
                        # B_LAST1) into the top of the slots; the rows below keep stale data, which
                        # feeds only output columns past N (never stored), as A's last tile row
                        LAST_BYTES: gl.constexpr = (p.a_desc.block_type.nbytes + p.b2_desc.block_type.nbytes
                                                    + (p.b3_desc.block_type.nbytes if p.B_LAST1 > 0 else 0))
                        bar, s = _stage_a_rows(p, it, off_m, kk, LAST_BYTES)
                        _load_box(p.b2_desc, True, off_n, kk * BLOCK_K, bar,
                                  p.b_bufs.index(s).slice(0, p.B_LAST0, dim=0))
                        if p.B_LAST1 > 0:
                            _load_box(p.b3_desc, True, off_n + BLOCK_N, kk * BLOCK_K, bar,
                                      p.b1_bufs.index(s).slice(0, p.B_LAST1, dim=0))
                    else:
                        bar, s = _stage_a_rows(p, it, off_m, kk, NBYTES)
                        _load_b_tile(p, s, bar, off_n, kk)
                else:
                    bar, s = _stage_a_rows(p, it, off_m, kk, NBYTES)
                    _load_b_tile(p, s, bar, off_n, kk)
                it += 1

    @gluon.jit
    def _load_residual(p, c_smem, c1_smem, c2_smem, row0, col0, BLOCK_N: gl.constexpr, ROLE: gl.constexpr):
        """RESIDUAL 1: the TMA loads of the residual's boxes of this consumer's tile (as C's boxes:
        rows row0.., columns col0.., SWAP_C transposed) into C's shared tiles, on its barrier."""
        NBYTES: gl.constexpr = (p.r_desc.block_type.nbytes + (p.r1_desc.block_type.nbytes if p.N1 > 0 else 0)
                                + (p.rx_desc.block_type.nbytes if p.N2 > 0 else 0))
        bar = p.resbar.index(ROLE)
        mbarrier.expect(bar, NBYTES)
        if p.SWAP_C:
            tma.async_copy_global_to_shared(p.r_desc, [col0, row0], bar, c_smem)
            if p.N1 > 0:
                tma.async_copy_global_to_shared(p.r1_desc, [col0 + BLOCK_N, row0], bar, c1_smem)
        else:
            tma.async_copy_global_to_shared(p.r_desc, [row0, col0], bar, c_smem)
            if p.N1 > 0:
                tma.async_copy_global_to_shared(p.r1_desc, [row0, col0 + BLOCK_N], bar, c1_smem)
            if p.N2 > 0:
                tma.async_copy_global_to_shared(p.rx_desc, [row0, col0 + BLOCK_N + p.N1], bar, c2_smem)

    @gluon.jit
    def _shared_tile(p, smem, layout: gl.constexpr):
        """A C-shaped shared tile (the residual's, RESIDUAL 1) as fp32 in the accumulator's layout
        (SWAP_C: read transposed, (columns, rows) -> (rows, columns))."""
        if p.SWAP_C:
            return smem.permute((1, 0)).load(layout).to(gl.float32)
        else:
            return smem.load(layout).to(gl.float32)

    @gluon.jit
    def _bias_of(p, idx):
        """BIAS: the bias at ``idx`` (past N: 0) as fp32; ``p`` either form's arguments."""
        return gl.load(p.bias + idx, mask=idx < p.N, other=0.0).to(gl.float32)

    @gluon.jit
    def _residual_of(p, y_rows, y_cols, inside):
        """The residual by pointers at y's (row, column) indices (broadcast tensors), ``inside`` the
        mask (0 outside), as fp32; ``p`` either form's arguments (res, stride_rm, stride_rn)."""
        offs = y_rows.to(gl.int64) * p.stride_rm + y_cols.to(gl.int64) * p.stride_rn
        return gl.load(p.res + offs, mask=inside, other=0.0).to(gl.float32)

    @gluon.jit
    def _epilogue(p, y, layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, row0, col0):
        """BIAS / RESIDUAL on one fp32 output tile ``y`` (ROWS x COLS in ``layout``, the kernel's rows
        from row0 and columns from col0): y + bias (per column; SWAP_C, where the kernel's rows are
        y's columns, per row) + the residual's elements, loaded in y's own layout (masked at M, N)."""
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        if p.BIAS:
            if p.SWAP_C:   # (y's columns are the kernel's rows, M of them)
                y = y + gl.load(p.bias + rows, mask=rows < p.M, other=0.0).to(gl.float32)[:, None]
            else:
                y = y + _bias_of(p, cols)[None, :]
        if p.RESIDUAL == 2:   # (1: from the shared tile the TMA load filled, see _consumer)
            inside = (rows[:, None] < p.M) & (cols[None, :] < p.N)
            if p.SWAP_C:   # the kernel's (row, column) is y's (column, row)
                y = y + _residual_of(p, cols[None, :], rows[:, None], inside)
            else:
                y = y + _residual_of(p, rows[:, None], cols[None, :], inside)
        return y

    @gluon.jit
    def _consumer(p, ROLE: gl.constexpr):
        """One warpgroup: rows [ROLE * 64, ROLE * 64 + 64) of every tile of this program."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[0] if p.SWAP_C else p.c_desc.block_type.shape[1]
        ROWS: gl.constexpr = p.c_desc.block_type.shape[1] if p.SWAP_C else p.c_desc.block_type.shape[0]
        STAGES: gl.constexpr = p.a_bufs.type.shape[0]
        # GLU: the gate and the up tile side by side, one wgmma of twice the width (columns
        # [0, BLOCK_N) the gate's, [BLOCK_N, 2 BLOCK_N) the up's)
        ACC_N: gl.constexpr = 2 * BLOCK_N if p.GLU else BLOCK_N
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, ACC_N, 16])
        c_smem = gl.allocate_shared_memory(p.c_desc.dtype, p.c_desc.block_type.shape, p.c_desc.layout)
        TILE_N: gl.constexpr = BLOCK_N + p.N1 + p.N2
        NM = gl.cdiv(p.M, BLOCK_M)
        NN = gl.cdiv(p.N, TILE_N)
        k_steps = gl.cdiv(p.K, BLOCK_K)
        acc = gl.zeros((ROWS, ACC_N), gl.float32, acc_layout)
        if p.N1 > 0:   # the second box's accumulator and output tile
            acc1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                  instr_shape=[16, p.N1, 16])
            acc1 = gl.zeros((ROWS, p.N1), gl.float32, acc1_layout)
            c1_smem = gl.allocate_shared_memory(p.c1_desc.dtype, p.c1_desc.block_type.shape, p.c1_desc.layout)
        if p.N2 > 0:   # the third box's
            acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                  instr_shape=[16, p.N2, 16])
            acc2 = gl.zeros((ROWS, p.N2), gl.float32, acc2_layout)
            c2_smem = gl.allocate_shared_memory(p.cx_desc.dtype, p.cx_desc.block_type.shape, p.cx_desc.layout)
        r1_smem = c_smem   # RESIDUAL 1: the shared tiles its boxes land in (C's own)
        r2_smem = c_smem
        if p.N1 > 0:
            r1_smem = c1_smem
        if p.N2 > 0:
            r2_smem = c2_smem
        # PEER_PUSH 2 (paced): the previous tile's copy leaves in column chunks of the peer
        # descriptor's width, spread over this tile's K loop (the rest after it)
        CH: gl.constexpr = p.peer_desc.block_type.shape[1]
        NCH: gl.constexpr = BLOCK_N // CH
        pace = gl.maximum(k_steps // NCH, 1)
        prow = 0
        pcol = 0
        done = 0
        it = 0
        res_phase = 0
        for t in range(gl.program_id(0), NM * NN, gl.num_programs(0)):
            tm, tn = _tile_of(t, NM, NN, p.GROUP_M)
            if p.DEAD_HALF & (tm * BLOCK_M + ROLE * ROWS >= p.M):
                # a half tile wholly past A's last row (M not a multiple of 128): its ring slots
                # are waited for and freed, no wgmma, nothing stored (the other half does the tile)
                for kk in range(k_steps):
                    s = it % STAGES
                    mbarrier.wait(p.ready.index(s), (it // STAGES) & 1)
                    mbarrier.arrive(p.empty.index(s), count=1)
                    it += 1
            else:
                if p.RESIDUAL == 1:
                    # the residual's tile into C's shared tiles while the K loop runs (the previous
                    # tile's store has read them first); summed in the epilogue
                    tma.store_wait(pendings=0)
                    _load_residual(p, c_smem, r1_smem, r2_smem, tm * BLOCK_M + ROLE * ROWS, tn * TILE_N, BLOCK_N, ROLE)
                prev = 0
                for kk in range(k_steps):
                    if p.N2 > 0:
                        acc, acc1, acc2, s = _mma_step3(p, acc, acc1, acc2, it, kk, prev, ROLE, ROWS)
                    elif p.N1 > 0:
                        acc, acc1, s = _mma_step2(p, acc, acc1, it, kk, prev, ROLE, ROWS)
                    else:
                        acc, s = _mma_step(p, acc, it, kk, prev, ROLE, ROWS)
                    if p.PEER_PUSH == 2:
                        for j in gl.static_range(NCH):
                            if (done > 0) & (kk == j * pace):
                                tma.async_copy_shared_to_global(p.peer_desc, [prow, pcol + j * CH],
                                                                c_smem.slice(j * CH, CH, dim=1))
                    prev = s
                    it += 1
                if p.PEER_PUSH == 2:   # chunks the K loop was too short to reach
                    for j in gl.static_range(NCH):
                        if (done > 0) & (j * pace >= k_steps):
                            tma.async_copy_shared_to_global(p.peer_desc, [prow, pcol + j * CH],
                                                            c_smem.slice(j * CH, CH, dim=1))
                if p.N2 > 0:
                    acc, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1, acc2))
                elif p.N1 > 0:
                    acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(p.empty.index(prev), count=1, pred=k_steps > 0)
                row0 = tm * BLOCK_M + ROLE * ROWS
                if p.GLU:
                    y = acc
                    if p.ROW_SCALE:   # (s a) @ b = s (a @ b): the factor on both halves
                        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
                        y = y * gl.load(p.scale + rows, mask=rows < p.M, other=0.0)[:, None]
                    # a thread holds the same columns of both halves: the split moves no data
                    g, u = y.reshape([ROWS, 2, BLOCK_N]).permute(0, 2, 1).split()
                    y = g / (1.0 + gl.exp(-g)) * u
                else:
                    y = acc
                if p.RESIDUAL == 1:   # the residual tile has arrived in C's shared tiles
                    mbarrier.wait(p.resbar.index(ROLE), res_phase)
                    res_phase ^= 1
                    y = y + _shared_tile(p, c_smem, acc_layout)
                    if p.N1 > 0:
                        acc1 = acc1 + _shared_tile(p, r1_smem, acc1_layout)
                    if p.N2 > 0:
                        acc2 = acc2 + _shared_tile(p, r2_smem, acc2_layout)
                if p.BIAS | (p.RESIDUAL == 2):   # (the plain GEMM: not GLU, not PEER_PUSH)
                    y = _epilogue(p, y, acc_layout, ROWS, BLOCK_N, row0, tn * TILE_N)
                    if p.N1 > 0:
                        acc1 = _epilogue(p, acc1, acc1_layout, ROWS, p.N1, row0, tn * TILE_N + BLOCK_N)
                    if p.N2 > 0:
                        acc2 = _epilogue(p, acc2, acc2_layout, ROWS, p.N2, row0, tn * TILE_N + BLOCK_N + p.N1)
                # epilogue: the previous tile's store has had this whole K loop to drain
                tma.store_wait(pendings=0)
                if p.SWAP_C:   # the tile transposed into C's (columns, rows) box, stored at (col, row)
                    c_smem.store(gl.permute(y.to(p.c_desc.dtype), [1, 0]))
                    if p.N1 > 0:
                        c1_smem.store(gl.permute(acc1.to(p.c1_desc.dtype), [1, 0]))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(p.c_desc, [tn * TILE_N, row0], c_smem)
                    if p.N1 > 0:
                        tma.async_copy_shared_to_global(p.c1_desc, [tn * TILE_N + BLOCK_N, row0], c1_smem)
                else:
                    c_smem.store(y.to(p.c_desc.dtype))
                    if p.N1 > 0:
                        c1_smem.store(acc1.to(p.c1_desc.dtype))
                    if p.N2 > 0:
                        c2_smem.store(acc2.to(p.cx_desc.dtype))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(p.c_desc, [row0, tn * TILE_N], c_smem)
                    if p.N1 > 0:   # (TMA clips a box past N, wholly or in part)
                        tma.async_copy_shared_to_global(p.c1_desc, [row0, tn * TILE_N + BLOCK_N], c1_smem)
                    if p.N2 > 0:
                        tma.async_copy_shared_to_global(p.cx_desc, [row0, tn * TILE_N + BLOCK_N + p.N1], c2_smem)
                if p.PEER_PUSH == 1:   # the same tile into the peer's copy, from the same shared tile (asynchronous)
                    tma.async_copy_shared_to_global(p.peer_desc, [row0, tn * BLOCK_N], c_smem)
                prow = row0
                pcol = tn * BLOCK_N
                done += 1
        if p.PEER_PUSH == 2:   # the last tile's copy
            for j in gl.static_range(NCH):
                if done > 0:
                    tma.async_copy_shared_to_global(p.peer_desc, [prow, pcol + j * CH], c_smem.slice(j * CH, CH, dim=1))
        tma.store_wait(pendings=0)

    # The consumers' entry points: a worker's arguments cannot carry a constexpr of their own.
    @gluon.jit
    def _consumer_lo(p):
        _consumer(p, 0)

    @gluon.jit
    def _consumer_hi(p):
        _consumer(p, 1)

    @gluon.jit
    def _consumer_2(p):
        _consumer(p, 2)

    @gluon.jit
    def _consumer_3(p):
        _consumer(p, 3)

    # (M == 1 or a stride of 1 stays a value: WsArgs holds tensors)
    @gluon.jit(do_not_specialize=["M", "N", "K", "stride_rm", "stride_rn"])
    def gemm_ws_kernel(a_desc, b_desc, c_desc, peer_desc, b1_desc, c1_desc, a1_desc, a2_desc, b2_desc, b3_desc,
                       bx_desc, cx_desc, scale, M, N, K, bias, res, stride_rm, stride_rn, r_desc, r1_desc, rx_desc,
                       STAGES: gl.constexpr, GROUP_M: gl.constexpr, GLU: gl.constexpr, ROW_SCALE: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, PEER_PUSH: gl.constexpr = 0,
                       N1: gl.constexpr = 0, B_KMAJOR: gl.constexpr = True, A_LAST: gl.constexpr = 0,
                       A_LAST2: gl.constexpr = 0, DEAD_HALF: gl.constexpr = True, SWAP_C: gl.constexpr = False,
                       B_LAST0: gl.constexpr = 0, B_LAST1: gl.constexpr = 0, N2: gl.constexpr = 0,
                       BIAS: gl.constexpr = False, RESIDUAL: gl.constexpr = 0):
        """C (M, N) = A (M, K) @ B (K, N), or (GLU) silu(A @ B[:, :N]) * (A @ B[:, N:]); launched
        with num_warps=4 (the first consumer warpgroup) and at most one program per SM. PEER_PUSH
        (a probe of the fused GEMM + all-reduce's traffic, scripts/ws_push_probe.py): each tile is
        also TMA-stored into ``peer_desc`` (C's twin in another GPU's memory; otherwise c_desc):
        1 at once after the local store, 2 in column chunks of peer_desc's block width spread
        over the next tile's K loop (paced, so a wave's copies do not all hit the link at once).

        N1 > 0: tiles of BLOCK_N + N1 columns, Triton's blocks being powers of two: B's boxes of
        ``b1_desc`` (N1 columns) beside ``b_desc``'s, a second accumulator and ``c1_desc``'s output
        boxes (otherwise both descriptors are unread); B_KMAJOR says how B's boxes lie (a box of
        64 x 64 could be either). Widths such as 80, 96, 160 or 192 fill the
        SMs where 256 or 128 would leave a wave part-empty (512 x 2560: 40 tiles of 256 columns, 128
        of 80; cuBLAS's own tiles there are 80 or 168 wide). N2 > 0 (untransposed only): a third
        box, ``bx_desc``'s N2 columns and ``cx_desc``'s output boxes, for widths of three powers of
        two (176, 208, 224: 25600 columns in 124 tiles of 208 where 256 leaves 100 and 192 makes 134).

        A_LAST > 0 (the last tile row at most 3/4 full): that row's A boxes are ``a1_desc``'s, of
        A_LAST rows, and (A_LAST2 > 0) ``a2_desc``'s of the next A_LAST2 (otherwise both unread).
        DEAD_HALF: a consumer whose half tile lies wholly past M frees its slots, no wgmma.
        B_LAST0 > 0 (the last tile column at most 3/4 full; B as (N, K) boxes): that column's B
        comes in ``b2_desc``'s boxes of B_LAST0 rows and, where the tile has two boxes and its
        second holds any of its columns, ``b3_desc``'s of B_LAST1 rows (otherwise both unread).

        SWAP_C (F.linear's y = x W^T with the weight as A): the kernel computes C^T = A @ B, its M
        the weight's rows and its N the tokens, and stores each tile transposed through c_desc
        (c1_desc), boxes of (columns, 64 rows) of y itself. The tile's side along the tokens is
        then any width of two power-of-two boxes (80, 96, 112, 144 rows of y: 271 tokens in three
        tiles of 96, not three of 128), and its side along the weight 64 to 256 rows: tiles of
        128 x 256 and 256 x 96 are the same area. cuBLAS's ``..._TNT`` kernels do the same.

        A's boxes of 64 rows (C's are always 64): tiles of 64 rows, one consumer warpgroup and the
        loader; a wave of them reads each W tile once per 64 rows of M instead of once per 128,
        but with half the rows a tile there are twice the tiles to fill the SMs at 65-128 rows.

        BIAS / RESIDUAL (the plain GEMM): y + ``bias`` (one per output column of y; its dtype is
        any float) + the residual (y's shape; it may be y itself, each tile's residual being read
        before its store), added in fp32 before the store. RESIDUAL 1: ``r_desc`` / ``r1_desc`` /
        ``rx_desc`` describe it with c_desc's / c1_desc's / cx_desc's boxes (y's dtype, TMA-able),
        each consumer loads its tile's boxes into its C tiles at the tile's start (after the
        previous store has read them) and adds them after the K loop; RESIDUAL 2: ``res`` with
        strides ``stride_rm`` / ``stride_rn`` along y's rows and columns, loaded in the epilogue
        (any dtype and layout, slower). Unused pointers and descriptors are unread."""
        gl.static_assert(not (BIAS or RESIDUAL) or (not GLU and PEER_PUSH == 0), "BIAS / RESIDUAL: the plain GEMM")
        gl.static_assert(N1 == 0 or (not GLU and PEER_PUSH == 0), "N1 > 0 is for the plain GEMM")
        gl.static_assert(N2 == 0 or (N1 > 0 and not SWAP_C and B_LAST0 == 0 and bx_desc.block_type.shape[0 if B_KMAJOR else 1] == N2),
                         "N2 > 0: a third box of N2 columns beside two (the plain, untransposed GEMM)")
        gl.static_assert(A_LAST == 0 or a1_desc.block_type.shape[0] == A_LAST, "a1_desc's boxes are A_LAST rows")
        gl.static_assert(A_LAST2 == 0 or a2_desc.block_type.shape[0] == A_LAST2, "a2_desc's boxes are A_LAST2 rows")
        gl.static_assert(B_LAST0 == 0 or (b2_desc.block_type.shape[0] == B_LAST0 and B_KMAJOR and not GLU),
                         "b2_desc's boxes are B_LAST0 rows of an (N, K) B (the plain GEMM)")
        gl.static_assert(B_LAST1 == 0 or (N1 > 0 and b3_desc.block_type.shape[0] == B_LAST1),
                         "b3_desc's boxes are B_LAST1 rows of a two-box tile's second box")
        # GLU: a gate box and an up box per stage, stacked along N (B as (N, K) boxes only)
        gl.static_assert(not GLU or b_desc.block_type.shape[1] == a_desc.block_type.shape[1],
                         "the SwiGLU form takes B as the transpose of an (2n, K) weight")
        B_ROWS: gl.constexpr = 2 * b_desc.block_type.shape[0] if GLU else b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, B_ROWS, b_desc.block_type.shape[1]],
                                           b_desc.layout)
        if N1 > 0:
            b1_bufs = gl.allocate_shared_memory(b1_desc.dtype, [STAGES] + b1_desc.block_type.shape, b1_desc.layout)
        else:
            b1_bufs = b_bufs
        if N2 > 0:
            bx_bufs = gl.allocate_shared_memory(bx_desc.dtype, [STAGES] + bx_desc.block_type.shape, bx_desc.layout)
        else:
            bx_bufs = b_bufs
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # one consumer warpgroup per 64 rows of the tile (a box's rows are a power of two: 64, 128, 256)
        CONSUMERS: gl.constexpr = a_desc.block_type.shape[0] // 64
        gl.static_assert(a_desc.block_type.shape[0] % 64 == 0 and (CONSUMERS == 1 or CONSUMERS == 2 or CONSUMERS == 4),
                         "tiles of 64, 128 or 256 rows")
        gl.static_assert(CONSUMERS <= 2 or (not GLU and PEER_PUSH == 0), "256-row tiles: the plain GEMM")
        gl.static_assert(not SWAP_C or (not GLU and PEER_PUSH == 0 and B_KMAJOR),
                         "SWAP_C: the plain GEMM, B as the transpose of an (N, K) operand")
        gl.static_assert(c_desc.block_type.shape[1 if SWAP_C else 0] == 64, "C's boxes hold a consumer's 64 rows")
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)   # one arrive per consumer warpgroup
        resbar = ready   # (unread unless RESIDUAL 1: the plain kernel's shared memory stays as it was)
        if RESIDUAL == 1:
            resbar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(CONSUMERS):
                mbarrier.init(resbar.index(i), count=1)
        p = WsArgs(a_desc, b_desc, c_desc, peer_desc, b1_desc, c1_desc, a1_desc, a2_desc, a_bufs, b_bufs, b1_bufs,
                   ready, empty, scale, M, N, K, GROUP_M, GLU, ROW_SCALE, PEER_PUSH, N1, B_KMAJOR, A_LAST, A_LAST2,
                   DEAD_HALF, SWAP_C, b2_desc, b3_desc, B_LAST0, B_LAST1, bx_desc, cx_desc, bx_bufs, N2, bias, res,
                   gl.to_tensor(stride_rm), gl.to_tensor(stride_rn), BIAS, RESIDUAL, r_desc, r1_desc, rx_desc, resbar)
        if CONSUMERS == 4:
            gl.warp_specialize([
                (_consumer_lo, (p,)),
                (_consumer_hi, (p,)),
                (_consumer_2, (p,)),
                (_consumer_3, (p,)),
                (_loader, (p,)),
            ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
        elif CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer_lo, (p,)),
                (_consumer_hi, (p,)),
                (_loader, (p,)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer_lo, (p,)),
                (_loader, (p,)),
            ], [1], [LOADER_REGS])


# ---------------------------------------------------------------------------------------------
# Stream-K form: where a GEMM has too few 128 x BLOCK_N tiles to fill the GPU (a decode or
# medium-M projection: 40 tiles at 512 x 2560), whole tiles leave SMs idle and split-K by a fixed
# factor rounds badly. Here the T x KS iterations (tiles x K steps, tiles in grouped order) are cut
# into P equal ranges, one per program: program p takes [p TOT / P, (p + 1) TOT / P). A range
# holds whole tiles (stored as above) and at most two pieces of tiles shared with its neighbours.
# A piece's fp32 partial goes to a workspace slot of its program (one for the piece at the range's
# start, one for its end); the program that finishes a tile's last piece (an atomic ticket per
# half tile) sums the tile's partials in the order of their programs, so the sum's bits do not
# depend on which program came last, and resets the ticket for the next call (CUDA graphs).
#
# On an H100 that merge cost 27-70 us (bench/results, twenty-ninth session): one SM reads every
# partial of its tile. Two alternatives (correct on an H100, thirtieth session; their merge's loads
# were then two partials at a time, a chain of L2 round trips: now 64 / MERGE_RB at once):
# * MERGE 1 (banded): after its range, every contributor of a shared tile waits for the tile's
#   partials (a bounded poll; all ranges end together) and sums a band of rows of all of them, in
#   contributor order, so the merge's reads spread over the tile's n SMs;
# * SPLIT (with MERGE 1; S = ``nsplit``, a run-time value): split-K units (tile, K part) instead
#   of ranges, taken p, p + P, ...:
#   every tile's part s at the same K offset at once (K lockstep), where the ranges' scattered
#   offsets read 50 MB of operands through a 50 MB L2 at 512 x 2560 x 8192.
if HAVE_GLUON:

    @aggregate
    class SkArgs:
        """What every partition of the stream-K kernel sees."""
        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        c_desc: tma.tensor_descriptor
        a1_desc: tma.tensor_descriptor   # A_LAST > 0: A's boxes of A_LAST rows (the partial last tile row)
        a2_desc: tma.tensor_descriptor   # A_LAST2 > 0: the boxes of its next A_LAST2 rows
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        work: gl.tensor        # fp32 (P, 2 ends, 2 halves, 64, BLOCK_N) partials (SPLIT: (T x S, 2 halves, ...))
        tickets: gl.tensor     # int32 (2, 2 T): per half tile, arrivals then departures (MERGE 1); zero between calls
        c_ptr: gl.tensor       # C itself (MERGE 1 stores its row bands with plain stores)
        stride_cm: gl.tensor
        status: gl.tensor      # int32: bit 0 set when a MERGE 1 wait ran out of time
        bound: gl.tensor       # ns a MERGE 1 wait may take (%globaltimer)
        M: gl.tensor
        N: gl.tensor
        K: gl.tensor
        GROUP_M: gl.constexpr
        FIXUP: gl.constexpr    # 1; a timing probe's 0 / 2 / 3 / 4 (see _sk_consumer, _split_consumer): wrong sums
        MERGE: gl.constexpr    # 0: the tile's last piece sums it; 1: every contributor sums a band of rows
        MERGE_RB: gl.constexpr  # MERGE 1: rows of a band; 64 / MERGE_RB contributors' bands in flight at once
        SPLIT: gl.constexpr    # False: stream-K ranges; True: split-K units (tile, K part) in K lockstep (MERGE 1)
        S: gl.tensor           # SPLIT: the K parts of a tile (>= 2)
        A_LAST: gl.constexpr   # 0, or the rows of a1_desc's boxes (_stage_a_rows)
        A_LAST2: gl.constexpr  # 0, or the rows of a2_desc's boxes
        bias: gl.tensor        # BIAS: (N,) added by the banded merge (SPLIT), else unread
        res: gl.tensor         # RESIDUAL: C's residual, strides (stride_rm, stride_rn), added by the banded merge
        stride_rm: gl.tensor
        stride_rn: gl.tensor
        BIAS: gl.constexpr
        RESIDUAL: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, c_desc, a1_desc, a2_desc, a_bufs, b_bufs, ready, empty, work, tickets,
                     c_ptr, stride_cm, status, bound, M, N, K, GROUP_M, FIXUP, MERGE, MERGE_RB, SPLIT, S, A_LAST,
                     A_LAST2, bias=None, res=None, stride_rm=None, stride_rn=None, BIAS=False, RESIDUAL=False):
            self.a_desc, self.b_desc, self.c_desc = a_desc, b_desc, c_desc
            self.a1_desc, self.a2_desc = a1_desc, a2_desc
            self.A_LAST, self.A_LAST2 = gl.constexpr(A_LAST), gl.constexpr(A_LAST2)
            self.a_bufs, self.b_bufs, self.ready, self.empty = a_bufs, b_bufs, ready, empty
            self.work, self.tickets, self.M, self.N, self.K = work, tickets, M, N, K
            self.c_ptr, self.stride_cm, self.status, self.bound = c_ptr, stride_cm, status, bound
            self.GROUP_M, self.FIXUP, self.MERGE = gl.constexpr(GROUP_M), gl.constexpr(FIXUP), gl.constexpr(MERGE)
            self.SPLIT = gl.constexpr(SPLIT)
            self.MERGE_RB = gl.constexpr(MERGE_RB)
            self.S = S
            self.bias, self.res, self.stride_rm, self.stride_rn = bias, res, stride_rm, stride_rn
            self.BIAS, self.RESIDUAL = gl.constexpr(BIAS), gl.constexpr(RESIDUAL)

    @gluon.jit
    def _sk_geometry(p):
        """(tiles across, tiles down, K steps, total iterations, this range's start and end)."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        NM = gl.cdiv(p.M, BLOCK_M)
        NN = gl.cdiv(p.N, BLOCK_N)
        ks = gl.cdiv(p.K, BLOCK_K)
        tot = NM * NN * ks
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        return NM, NN, ks, tot, (pid * tot) // P, ((pid + 1) * tot) // P

    @gluon.jit
    def _sk_owner(i, tot, P):
        """The program whose range holds iteration i (the largest q with q tot / P <= i)."""
        return ((i + 1) * P - 1) // tot

    @gluon.jit
    def _sk_piece(p, i, end, ks, NM, NN):
        """The piece that starts at iteration i of a range ending at ``end``: (tile, first and end K
        step, tile row, tile column)."""
        t = i // ks
        tm, tn = _tile_of(t, NM, NN, p.GROUP_M)
        return t, i - t * ks, gl.minimum(ks, end - t * ks), tm, tn

    @gluon.jit
    def _split_piece(p, u, ks, NM, NN):
        """SPLIT: unit u is K part u % S of tile u // S: (tile, first and end K step, tile row, tile
        column). Programs take units u = p, p + P, ...: the parts of a tile run side by side, each
        at its own K offset, and every tile's part s at the same one (K lockstep: a tile row's
        programs read the same K slice of A at once)."""
        t = u // p.S
        part = u - t * p.S
        tm, tn = _tile_of(t, NM, NN, p.GROUP_M)
        return t, part * ks // p.S, (part + 1) * ks // p.S, tm, tn

    @gluon.jit
    def _slot(p, q, t, ks, tot, P, ROLE: gl.constexpr):
        """The workspace slot of contributor q's partial of tile t (this half): SPLIT, q is the unit;
        else q is the program, and its slot 1 holds the piece at its range's end (a range that
        began before the tile)."""
        if p.SPLIT:
            return q * 2 + ROLE
        else:
            return (q * 2 + (q * tot // P < t * ks).to(gl.int32)) * 2 + ROLE

    @gluon.jit
    def _piece_mma(p, it, k0, k1, ROLE: gl.constexpr):
        """A consumer's K steps [k0, k1) of one piece into a fresh accumulator (its first wgmma
        ignores it; made per piece, it is dead during a merge, whose loads then have the
        registers), the ring's slots freed behind it. Returns (the accumulator, the ring step)."""
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        ROWS: gl.constexpr = p.c_desc.block_type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros((ROWS, BLOCK_N), gl.float32, acc_layout)
        prev = 0
        for kk in range(k0, k1):
            acc, s = _mma_step(p, acc, it, kk - k0, prev, ROLE, ROWS)
            prev = s
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p.empty.index(prev), count=1, pred=k1 > k0)
        return acc, it

    @gluon.jit
    def _load_piece(p, it, tm, tn, k0, k1):
        """The loader's TMA loads of K steps [k0, k1) of tile (tm, tn) into the ring from step
        ``it``; returns the ring's next step (the consumers' _piece_mma walks the same steps)."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        NBYTES: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        for kk in range(k0, k1):
            bar, s = _stage_a_rows(p, it, tm * BLOCK_M, kk, NBYTES)
            _load_b(p, tn * BLOCK_N, kk * BLOCK_K, bar, p.b_bufs.index(s))
            it += 1
        return it

    @gluon.jit
    def _sk_loader(p):
        """One warp: the TMA loads of this program's range (or split-K units), piece by piece."""
        NM, NN, ks, tot, start, end = _sk_geometry(p)
        it = 0
        if p.SPLIT:
            for u in range(gl.program_id(0), NM * NN * p.S, gl.num_programs(0)):
                t, k0, k1, tm, tn = _split_piece(p, u, ks, NM, NN)
                it = _load_piece(p, it, tm, tn, k0, k1)
        else:
            i = start
            while i < end:
                t, k0, k1, tm, tn = _sk_piece(p, i, end, ks, NM, NN)
                it = _load_piece(p, it, tm, tn, k0, k1)
                i = t * ks + k1

    @gluon.jit
    def _sk_consumer(p, ROLE: gl.constexpr):
        """One warpgroup: rows [ROLE * 64, ROLE * 64 + 64) of every piece of this program's range."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        ROWS: gl.constexpr = p.c_desc.block_type.shape[0]
        CH: gl.constexpr = BLOCK_N // 2   # the merge's column chunk (64 x 128 fp32: 64 registers a thread)
        ch_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, CH, 16])
        c_smem = gl.allocate_shared_memory(p.c_desc.dtype, p.c_desc.block_type.shape, p.c_desc.layout)
        NM, NN, ks, tot, start, end = _sk_geometry(p)
        P = gl.num_programs(0)
        pid = gl.program_id(0)
        SLOT: gl.constexpr = ROWS * BLOCK_N
        if p.SPLIT:
            _split_consumer(p, ROLE, NM, NN, ks, tot)
            return
        i = start
        it = 0
        while i < end:
            t, k0, k1, tm, tn = _sk_piece(p, i, end, ks, NM, NN)
            acc, it = _piece_mma(p, it, k0, k1, ROLE)
            row0 = tm * BLOCK_M + ROLE * ROWS
            first = _sk_owner(t * ks, tot, P)
            last = _sk_owner(t * ks + ks - 1, tot, P)
            tma.store_wait(pendings=0)   # the previous tile's store has read c_smem
            if first == last:   # the whole tile is this program's: store it
                c_smem.store(acc.to(p.c_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(p.c_desc, [row0, tn * BLOCK_N], c_smem)
            elif p.FIXUP > 0:   # (constexpr: the probe's 0 drops partial pieces, 3 stores them only,
                # 2 stores them and takes tickets: timing only)
                if row0 < p.M:   # (a half tile below M: nothing to store, no ticket)
                    # our piece's partial into our slot (0: the piece at our range's start, 1: its end)
                    _store_partial(p, acc, (pid * 2 + (i != start).to(gl.int32)) * 2 + ROLE)
                    if p.FIXUP != 3:
                        gl.thread_barrier()
                        ticket = gl.atomic_add(p.tickets + t * 2 + ROLE, 1, sem="acq_rel", scope="gpu")
                    else:
                        ticket = 0
                    if p.FIXUP == 2:   # the probe's tickets: reset each call
                        if ticket == last - first:
                            gl.atomic_xchg(p.tickets + t * 2 + ROLE, 0, sem="relaxed", scope="gpu")
                    if (p.FIXUP == 1) & (p.MERGE == 0):
                        if ticket == last - first:   # the tile's last piece: sum every program's, in order
                            gl.atomic_xchg(p.tickets + t * 2 + ROLE, 0, sem="relaxed", scope="gpu")
                            r_c = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ch_layout))
                            c_c = gl.arange(0, CH, layout=gl.SliceLayout(0, ch_layout))
                            offs_c = r_c[:, None] * BLOCK_N + c_c[None, :]
                            for c in gl.static_range(BLOCK_N // CH):
                                # two programs' partials in flight at once (the merge is latency-bound:
                                # one at a time it cost 30-50 us on an H100), added in program order
                                part = gl.zeros((ROWS, CH), gl.float32, ch_layout)
                                for q in range(first, last + 1, 2):
                                    q2 = gl.minimum(q + 1, last)
                                    l1 = gl.load(p.work + _slot(p, q, t, ks, tot, P, ROLE) * SLOT + c * CH + offs_c,
                                                 cache_modifier=".cg")
                                    l2 = gl.load(p.work + _slot(p, q2, t, ks, tot, P, ROLE) * SLOT + c * CH + offs_c,
                                                 cache_modifier=".cg")
                                    part = part + l1
                                    part = part + gl.where(q + 1 <= last, l2, 0.0)
                                c_smem.slice(c * CH, CH, dim=1).store(part.to(p.c_desc.dtype))
                            fence_async_shared()
                            tma.async_copy_shared_to_global(p.c_desc, [row0, tn * BLOCK_N], c_smem)
            i = t * ks + k1
        tma.store_wait(pendings=0)
        if p.MERGE == 1:
            if p.FIXUP == 1:
                _sk_band_merge(p, ROLE, NM, NN, ks, tot, start, end)

    @gluon.jit
    def _store_partial(p, acc, slot):
        """A piece's fp32 accumulator (one half tile) into workspace slot ``slot``."""
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        ROWS: gl.constexpr = p.c_desc.block_type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        gl.store(p.work + slot * (ROWS * BLOCK_N) + r[:, None] * BLOCK_N + c[None, :], acc)

    @gluon.jit
    def _split_consumer(p, ROLE: gl.constexpr, NM, NN, ks, tot):
        """SPLIT: one warpgroup's units (see _split_piece): each unit's partial into its slot and an
        arrival on its tile's counter; after the last unit, its band of each of its units' tiles.
        (A timing probe's FIXUP, wrong sums: 0 the K loops alone, nothing stored; 3 the partials
        stored; 2 stored and arrived on; 4 everything but the wait for the other parts.)"""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        ROWS: gl.constexpr = p.c_desc.block_type.shape[0]
        units = NM * NN * p.S
        it = 0
        for u in range(gl.program_id(0), units, gl.num_programs(0)):
            t, k0, k1, tm, tn = _split_piece(p, u, ks, NM, NN)
            acc, it = _piece_mma(p, it, k0, k1, ROLE)
            # (a half tile below M: no store, no arrival; FIXUP 0: never, by a test the compiler
            # cannot fold, so the accumulator stays live and the K loop compiles as in FIXUP 1)
            if (tm * BLOCK_M + ROLE * ROWS < p.M) & ((p.FIXUP > 0) | (p.M < 0)):
                _store_partial(p, acc, u * 2 + ROLE)
                if p.FIXUP != 3:
                    gl.thread_barrier()
                    gl.atomic_add(p.tickets + t * 2 + ROLE, 1, sem="release", scope="gpu")
        if (p.FIXUP == 1) | (p.FIXUP == 4):
            for u in range(gl.program_id(0), units, gl.num_programs(0)):
                t = u // p.S
                first = t * p.S
                _band_merge_tile(p, ROLE, t, u - first, first, first + p.S - 1, NM, NN, ks, tot)

    @gluon.jit
    def _sk_band_merge(p, ROLE: gl.constexpr, NM, NN, ks, tot, start, end):
        """MERGE 1 (stream-K): after its range, a program takes its share of each tile it shares (its
        range's first and last piece) by _band_merge_tile. Every contributor reads 1 / n of the
        partials, where the tile's last piece read them all (MERGE 0): the merge's bytes spread over
        n SMs instead of one. All ranges end together, so the waits are short."""
        P = gl.num_programs(0)
        t0 = start // ks
        t_last = (end - 1) // ks
        for which in gl.static_range(2):
            t = t0 if which == 0 else t_last
            first = _sk_owner(t * ks, tot, P)
            last = _sk_owner(t * ks + ks - 1, tot, P)
            if (first != last) & ((which == 0) | (t_last != t0)):
                _band_merge_tile(p, ROLE, t, gl.program_id(0) - first, first, last, NM, NN, ks, tot)

    @gluon.jit
    def _band_merge_tile(p, ROLE: gl.constexpr, t, j, first, last, NM, NN, ks, tot):
        """Contributor j of tile t's half ROLE (contributors first ... last: programs, or SPLIT's
        units): once every contributor's partial has arrived (a bounded acquire poll), sum row bands
        j, j + n, ... of the n partials in contributor order and store them into C; the last to
        leave resets the tile's two counters for the next call."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        ROWS: gl.constexpr = p.c_desc.block_type.shape[0]
        RB: gl.constexpr = p.MERGE_RB            # rows of a band
        FLIGHT: gl.constexpr = ROWS // RB        # contributors' bands in flight: 64 x BLOCK_N fp32 (BLOCK_N / 2 a thread)
        SLOT: gl.constexpr = ROWS * BLOCK_N
        band: gl.constexpr = _band_layout(BLOCK_N)
        rr = gl.arange(0, RB, layout=gl.SliceLayout(1, band))
        cc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, band))
        offs = rr[:, None] * BLOCK_N + cc[None, :]
        P = gl.num_programs(0)
        T = NM * NN
        tm, tn = _tile_of(t, NM, NN, p.GROUP_M)
        row0 = tm * BLOCK_M + ROLE * ROWS
        if row0 < p.M:
            n = last - first + 1
            arrived = p.tickets + t * 2 + ROLE
            v = gl.atomic_add(arrived, 0, sem="acquire", scope="gpu")
            if (v < n) & (p.FIXUP != 4):   # (FIXUP 4, a timing probe's: no wait, wrong sums)
                # a wait after one that timed out gives up at once; the clock is read as the
                # warpgroup's maximum, so every warp leaves the loop at the same poll (a warp that
                # left alone would meet the others' poll barrier with its next one: a hang)
                dead = gl.atomic_add(p.status, 0, sem="relaxed", scope="gpu")
                stop = _uniform_clock_ns() + p.bound
                late = (dead != 0).to(gl.int32)
                spins = 0
                while (v < n) & (late == 0):
                    v = gl.atomic_add(arrived, 0, sem="acquire", scope="gpu")
                    spins += 1
                    if spins % 64 == 0:
                        late = (_uniform_clock_ns() > stop).to(gl.int32)
                if v < n:
                    gl.atomic_or(p.status, 1, sem="relaxed", scope="gpu")
            # a part missing after the wait: the band is stored as NaN, never as a partial sum
            missing = (v < n) & (p.FIXUP != 4)
            cols = tn * BLOCK_N + cc
            for b in range(j, ROWS // RB, n):
                part = gl.zeros((RB, BLOCK_N), gl.float32, band)
                for q0 in range(first, last + 1, FLIGHT):
                    # FLIGHT contributors' partials in flight at once (independent loads of one
                    # unrolled block: one L2 round trip, where one or two at a time made the merge a
                    # chain of them), added in contributor order (the same bits whoever came last);
                    # past the last contributor the loads are masked off (no traffic: L2's bandwidth
                    # is what the merge of a whole GPU's partials spends)
                    for g in gl.static_range(FLIGHT):
                        q = gl.minimum(q0 + g, last)
                        part_q = gl.load(p.work + _slot(p, q, t, ks, tot, P, ROLE) * SLOT + b * RB * BLOCK_N + offs,
                                         mask=(offs >= 0) & (q0 + g <= last), other=0.0, cache_modifier=".cg")
                        part = part + part_q
                rows = row0 + b * RB + rr
                if p.BIAS:
                    part = part + _bias_of(p, cols)[None, :]
                if p.RESIDUAL:   # (read before the band's store: the residual may be C itself)
                    part = part + _residual_of(p, rows[:, None], cols[None, :],
                                               (rows[:, None] < p.M) & (cols[None, :] < p.N))
                part = gl.where(missing, float("nan"), part)
                gl.store(p.c_ptr + rows[:, None].to(gl.int64) * p.stride_cm + cols[None, :],
                         part.to(p.c_ptr.dtype.element_ty),
                         mask=(rows[:, None] < p.M) & (cols[None, :] < p.N))
            gl.thread_barrier()
            gone = gl.atomic_add(p.tickets + 2 * T + t * 2 + ROLE, 1, sem="acq_rel", scope="gpu")
            if gone == n - 1:   # everyone has passed the wait: ready for the next call
                gl.atomic_xchg(arrived, 0, sem="relaxed", scope="gpu")
                gl.atomic_xchg(p.tickets + 2 * T + t * 2 + ROLE, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _uniform_clock_ns():
        """The GPU's global nanosecond timer (``%globaltimer``) as one value for the whole warpgroup:
        each thread reads its own (an inline asm runs in every thread), the maximum is shared."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                        pack=1)
        return gl.max(gl.full([128], 0, gl.int64, lay) + now, axis=0)

    @gluon.jit
    def _sk_consumer_lo(p):
        _sk_consumer(p, 0)

    @gluon.jit
    def _sk_consumer_hi(p):
        _sk_consumer(p, 1)

    @gluon.jit(do_not_specialize=["M", "N", "K", "nsplit", "stride_rm", "stride_rn"])
    def gemm_ws_streamk_kernel(a_desc, b_desc, c_desc, a1_desc, a2_desc, work, tickets, c_ptr, stride_cm, status,
                               bound, M, N, K, nsplit, bias, res, stride_rm, stride_rn, STAGES: gl.constexpr,
                               GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                               FIXUP: gl.constexpr = 1, MERGE: gl.constexpr = 0, SPLIT: gl.constexpr = False,
                               MERGE_RB: gl.constexpr = 8, A_LAST: gl.constexpr = 0, A_LAST2: gl.constexpr = 0,
                               BIAS: gl.constexpr = False, RESIDUAL: gl.constexpr = False):
        """C (M, N) = A (M, K) @ B (K, N) in the stream-K order above; P programs (at most one per
        SM, at most T x KS), num_warps=4. ``work``: fp32, P x 2 x 2 x 64 x BLOCK_N (SPLIT: T x S x
        2 x 64 x BLOCK_N, S = ``nsplit``; unused otherwise); ``tickets``:
        int32, 4 T, zero before the first call (each call leaves them zero); ``c_ptr`` / ``stride_cm``
        C for MERGE 1's plain stores, ``status`` / ``bound`` its waits' error bit and bound (ns);
        ``a1_desc`` / ``a2_desc`` / A_LAST / A_LAST2 as in gemm_ws_kernel; BIAS / RESIDUAL (``bias``,
        ``res``, its strides) as there, added by the banded merge (SPLIT only)."""
        gl.static_assert(not (BIAS or RESIDUAL) or (SPLIT and MERGE == 1), "BIAS / RESIDUAL: the split-K form")
        gl.static_assert(A_LAST == 0 or a1_desc.block_type.shape[0] == A_LAST, "a1_desc's boxes are A_LAST rows")
        gl.static_assert(A_LAST2 == 0 or a2_desc.block_type.shape[0] == A_LAST2, "a2_desc's boxes are A_LAST2 rows")
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        p = SkArgs(a_desc, b_desc, c_desc, a1_desc, a2_desc, a_bufs, b_bufs, ready, empty, work, tickets, c_ptr,
                   stride_cm, status, bound, M, N, K, GROUP_M, FIXUP, MERGE, MERGE_RB, SPLIT, gl.to_tensor(nsplit),
                   A_LAST, A_LAST2, bias, res, gl.to_tensor(stride_rm), gl.to_tensor(stride_rn), BIAS, RESIDUAL)
        gl.warp_specialize([
            (_sk_consumer_lo, (p,)),
            (_sk_consumer_hi, (p,)),
            (_sk_loader, (p,)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
