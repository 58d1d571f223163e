"""Warp-specialised persistent GEMM for Hopper (sm_90), written in Gluon.

Why: the Triton kernels of kernels/gemm.py are software-pipelined. Every K step of their loop
holds CTA-wide barriers (four ``bar.sync`` in the sm_90 PTX), and Nsight Compute put 35-61 % of
their issue gaps at those barriers (bench/results, twenty-sixth session). Triton 3.6 does not
warp-specialise a ``tl.range`` on sm_90, but Gluon (its explicit-layout dialect) does. Here the
warps of a program split the work three ways, and they talk through mbarriers only:

* a **loader** warp walks the program's tiles and K steps and issues the TMA loads of A and B
  into a ring of STAGES shared-memory slots. It waits for a slot to be freed (``empty``), then
  arms its ``ready`` barrier with the bytes to expect;
* two **consumer** warpgroups each own half of the tile's rows (64 x BLOCK_N). They wait for
  ``ready``, issue an asynchronous wgmma and keep one in flight. After ``wait(1)`` the previous
  slot's wgmma is done, and each warpgroup releases that slot with one arrive (``empty`` counts two);
* the epilogue runs in each consumer: fp32 -> output dtype, into its own shared tile, then a TMA
  store. The store drains while the next tile's K loop runs, and the loader has already fetched
  that tile's first stages.

No barrier spans the whole CTA inside the K loop. A, B and C go through host TMA descriptors, so
edges need no masks: TMA zero-fills the loads outside the tensor and clips the stores.

Tiles are walked persistently (one program per SM) in grouped order: GROUP_M tile rows share the
B columns of a tile column while they are in L2.

Gluon has no interpreter: the CPU suite compiles this kernel for sm_90 offline and checks its
structure (tests/test_gemm_ws.py); correctness and speed come from the GPU tests and
``scripts/gemm_ws_probe.py``.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - triton without Gluon
    HAVE_GLUON = False

CONSUMER_ROWS = 64  # rows of the tile one consumer warpgroup owns (wgmma's M per warpgroup)

if HAVE_GLUON:

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
    def _loader(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
        """One warp: TMA loads of every (tile, K step) of this program, STAGES ahead of the wgmma."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        # B (K, N) stored as (N, K), the weight of F.linear, comes in (BLOCK_N, BLOCK_K) boxes
        B_KMAJOR: gl.constexpr = b_desc.block_type.shape[1] == BLOCK_K
        NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        NM = gl.cdiv(M, BLOCK_M)
        NN = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        it = 0
        for t in range(gl.program_id(0), NM * NN, gl.num_programs(0)):
            tm, tn = _tile_of(t, NM, NN, GROUP_M)
            off_m = tm * BLOCK_M
            off_n = tn * BLOCK_N
            for kk in range(k_steps):
                s = it % STAGES
                # slots start free: the first wait on each passes (phase 1 of a fresh barrier)
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, NBYTES)
                tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(s))
                if B_KMAJOR:
                    tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar, b_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], bar, b_bufs.index(s))
                it += 1

    @gluon.jit
    def _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                  GROUP_M: gl.constexpr, ROLE: gl.constexpr):
        """One warpgroup: rows [ROLE * 64, ROLE * 64 + 64) of every tile of this program."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        ROWS: gl.constexpr = c_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        # B (K, N) stored as (N, K), the weight of F.linear, comes in (BLOCK_N, BLOCK_K) boxes
        B_KMAJOR: gl.constexpr = b_desc.block_type.shape[1] == BLOCK_K
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        NM = gl.cdiv(M, BLOCK_M)
        NN = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        acc = gl.zeros((ROWS, BLOCK_N), gl.float32, acc_layout)
        it = 0
        for t in range(gl.program_id(0), NM * NN, gl.num_programs(0)):
            tm, tn = _tile_of(t, NM, NN, GROUP_M)
            prev = 0
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                a = a_bufs.index(s).slice(ROLE * ROWS, ROWS, dim=0)
                if B_KMAJOR:
                    b = b_bufs.index(s).permute((1, 0))
                else:
                    b = b_bufs.index(s)
                acc = warpgroup_mma(a, b, acc, use_acc=kk > 0, is_async=True)
                # one wgmma in flight: the previous step's is done, so its slot is free
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)
                prev = s
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1, pred=k_steps > 0)
            # epilogue: the previous tile's store has had this whole K loop to drain
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [tm * BLOCK_M + ROLE * ROWS, tn * BLOCK_N], c_smem)
        tma.store_wait(pendings=0)

    # The partitions' entry points: a worker's arguments cannot carry a constexpr of their own.
    @gluon.jit
    def _consumer_lo(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
        _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, 0)

    @gluon.jit
    def _consumer_hi(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
        _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, 1)

    @gluon.jit
    def gemm_ws_kernel(a_desc, b_desc, c_desc, M, N, K,
                       STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """C (M, N) = A (M, K) @ B (K, N); launched with num_warps=4 (the first consumer warpgroup)
        and one program per SM at most."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)   # one arrive per consumer warpgroup
        args = (a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)
        gl.warp_specialize([
            (_consumer_lo, args),
            (_consumer_hi, args),
            (_loader, args),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
