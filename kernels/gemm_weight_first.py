"""Weight-first decode GEMM for Hopper (sm_90), written in Gluon: ``y = x @ W.T`` for a few rows.

Why: in a decode step the GEMM after the all-reduce + norm waits about 7 us for that kernel, a
latency-bound NVLink round trip during which HBM is idle (bench/results, fifty-fourth session:
the TP 2 step's GEMMs read their weights at 0.78 of the streaming read). A program launched early
by programmatic dependent launch (PDL) may read the weights before it waits, as long as no kernel
that may still be running writes them: with numasched's kernels, which let their successor launch
before their own wait, that is any kernel of the chain before, not only the one just before (a
dequantisation or an all-gather of W right before the GEMM rules this kernel out). Triton's software pipeliner issues a K step's A and B loads together,
so they cannot straddle the wait; here the loads are explicit:

1. a program is one unit: a 64-row band of W (64 output columns; GLU: the gate's band and the
   up's) and a K range (split-K: ``SPLITS`` units a band);
2. it arms its first STAGES ring slots and issues their **weight** boxes (TMA) at once;
3. then it waits for the previous kernel (``griddepcontrol.wait``: PDL 1 and 3; 0 waits for
   nothing) and only then issues the same slots' **activation** boxes (x: BLOCK_T rows, the rows
   past M zero-filled by TMA);
4. the K loop: wait for a slot, one wgmma (the weight box as wgmma's A, 64 rows; x's box
   transposed as its B, BLOCK_T columns), then the slot's next boxes, STAGES steps ahead;
5. the epilogue writes y's columns [n0, n0 + 64) of every row (transposed, masked pointer
   stores; GLU: ``silu(gate) * up``). With SPLITS > 1 each unit's fp32 partial goes to the
   workspace and takes a ticket on its band's counter; the unit that takes the last ticket sums
   the band's partials in split order (the same bits whichever finishes last), stores, and resets
   the counter for the next launch and for CUDA-graph replays. Nothing waits on another program.

One warpgroup (4 warps) a program; shared memory holds STAGES x (64 or 128 rows + BLOCK_T) x
BLOCK_K. ``WEIGHTS_FIRST=False`` issues the weight boxes after the wait too (an A/B of step 2).
Gluon has no interpreter: the CPU suite compiles this kernel for sm_90 offline
(tests/test_gemm_weight_first.py); correctness and speed come from its GPU tests and
``scripts/weight_first_probe.py``. Host side: numasched/gemm_weight_first.py.
"""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - triton without Gluon
    HAVE_GLUON = False

BAND = 64   # rows of W a unit computes: one warpgroup's wgmma M

if HAVE_GLUON:
    @gluon.jit
    def _pdl(TRIGGER: gl.constexpr, WAIT: gl.constexpr):
        """PDL's two instructions (kernels/pdl.py's, as inline PTX: Gluon has no builtin for them)."""
        if TRIGGER:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _load_w(w_desc, n0, N, k, bar, slot, GLU: gl.constexpr):
        """The weight boxes of one K step: the band's 64 rows at K offset ``k`` (GLU: the gate's,
        then the up's ``N`` rows further on, stacked in the slot)."""
        BAND: gl.constexpr = w_desc.block_type.shape[0]
        if GLU:
            tma.async_copy_global_to_shared(w_desc, [n0, k], bar, slot.slice(0, BAND, dim=0))
            tma.async_copy_global_to_shared(w_desc, [N + n0, k], bar, slot.slice(BAND, BAND, dim=0))
        else:
            tma.async_copy_global_to_shared(w_desc, [n0, k], bar, slot)

    @gluon.jit
    def _band_store(y, vals, n0, M, N, stride_ym, stride_yn, layout: gl.constexpr, BAND: gl.constexpr,
                    BLOCK_T: gl.constexpr):
        """vals (BAND columns of y, BLOCK_T rows) into y[:M, n0:n0 + BAND], transposed."""
        r = gl.arange(0, BAND, layout=gl.SliceLayout(1, layout))
        m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        cols = n0 + r
        ptrs = y + m[None, :].to(gl.int64) * stride_ym + cols[:, None].to(gl.int64) * stride_yn
        gl.store(ptrs, vals.to(y.dtype.element_ty), mask=(cols[:, None] < N) & (m[None, :] < M))

    @gluon.jit
    def _glu(g, u):
        return g / (1.0 + gl.exp(-g)) * u

    @gluon.jit
    def weight_first_kernel(w_desc, x_desc, y, ws, counters, M, N, K, stride_ym, stride_yn, k_per_split,
                            SPLITS: gl.constexpr, STAGES: gl.constexpr, GLU: gl.constexpr = False,
                            PDL: gl.constexpr = 0, WEIGHTS_FIRST: gl.constexpr = True):
        """y[:M, :N] = x[:M] @ W[:N].T (GLU: silu(x @ W[:N].T) * (x @ W[N:2N].T)). w_desc: W (N or
        2N, K) in (64, BLOCK_K) boxes; x_desc: x (M, K) in (BLOCK_T, BLOCK_K) boxes; y: (M, N) any
        strides; ws: fp32, SPLITS > 1: (units, GLU + 1, 64, BLOCK_T); counters: int32, one per band
        (zero before the first launch; each launch leaves them zero). Grid: bands x SPLITS units;
        k_per_split: a multiple of BLOCK_K. PDL: 0 none, 1 let the next kernel launch, then wait,
        3 wait, and let it launch after the K loop."""
        BAND: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        gl.static_assert(BAND == 64, "the weight's boxes are 64 rows (one warpgroup's wgmma)")
        gl.static_assert(x_desc.block_type.shape[1] == BLOCK_K, "x's boxes are BLOCK_K wide")
        NW: gl.constexpr = 2 if GLU else 1
        NBYTES: gl.constexpr = NW * w_desc.block_type.nbytes + x_desc.block_type.nbytes
        pid = gl.program_id(0)
        band = pid // SPLITS
        n0 = band * BAND
        k0 = (pid % SPLITS) * k_per_split
        n_iter = gl.cdiv(gl.minimum(K - k0, k_per_split), BLOCK_K)

        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, NW * BAND, BLOCK_K], w_desc.layout)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_T, BLOCK_K], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        # 2. the first stages' weight boxes before the wait (no earlier kernel writes W)
        if WEIGHTS_FIRST:
            for i in gl.static_range(STAGES):
                if i < n_iter:
                    mbarrier.expect(bars.index(i), NBYTES)
                    _load_w(w_desc, n0, N, k0 + i * BLOCK_K, bars.index(i), w_bufs.index(i), GLU)
        # 3. the previous kernel wrote x: wait for it, then x's boxes of the same stages
        _pdl(PDL == 1, PDL != 0)
        for i in gl.static_range(STAGES):
            if i < n_iter:
                if not WEIGHTS_FIRST:
                    mbarrier.expect(bars.index(i), NBYTES)
                    _load_w(w_desc, n0, N, k0 + i * BLOCK_K, bars.index(i), w_bufs.index(i), GLU)
                tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BLOCK_K], bars.index(i), x_bufs.index(i))

        # 4. the K loop
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_T, 16])
        acc = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
        acc_u = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
        for i in range(n_iter):
            s = i % STAGES
            mbarrier.wait(bars.index(s), (i // STAGES) & 1)
            xs = x_bufs.index(s).permute((1, 0))   # (BLOCK_K, BLOCK_T): x's box as wgmma's B
            wb = w_bufs.index(s)
            if GLU:
                acc = warpgroup_mma(wb.slice(0, BAND, dim=0), xs, acc, is_async=True)
                acc_u = warpgroup_mma(wb.slice(BAND, BAND, dim=0), xs, acc_u, is_async=True)
                acc, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_u))
            else:
                acc = warpgroup_mma(wb, xs, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            nxt = i + STAGES
            if nxt < n_iter:   # the slot is read: its next boxes, STAGES steps ahead
                gl.thread_barrier()   # every warp's wgmma on the slot is done before TMA overwrites it
                mbarrier.expect(bars.index(s), NBYTES)
                _load_w(w_desc, n0, N, k0 + nxt * BLOCK_K, bars.index(s), wb, GLU)
                tma.async_copy_global_to_shared(x_desc, [0, k0 + nxt * BLOCK_K], bars.index(s), x_bufs.index(s))
        if PDL == 3:
            _pdl(True, False)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        # 5. the epilogue
        if SPLITS == 1:
            if GLU:
                _band_store(y, _glu(acc, acc_u), n0, M, N, stride_ym, stride_yn, acc_layout, BAND, BLOCK_T)
            else:
                _band_store(y, acc, n0, M, N, stride_ym, stride_yn, acc_layout, BAND, BLOCK_T)
        else:
            SLOT: gl.constexpr = BAND * BLOCK_T
            r = gl.arange(0, BAND, layout=gl.SliceLayout(1, acc_layout))
            m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, acc_layout))
            offs = r[:, None] * BLOCK_T + m[None, :]
            base = ws + pid.to(gl.int64) * (NW * SLOT)
            gl.store(base + offs, acc)
            if GLU:
                gl.store(base + SLOT + offs, acc_u)
            # every thread's partial before the ticket; the last arrival reads the others' through
            # L2 (.cg), never a stale L1 line
            gl.thread_barrier()
            ticket = gl.atomic_add(counters + band, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:
                gl.atomic_xchg(counters + band, 0, sem="relaxed", scope="gpu")   # ready for the next launch
                tot = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
                tot_u = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
                first = ws + (band * SPLITS).to(gl.int64) * (NW * SLOT)
                for q in range(SPLITS):   # split order: the same sum every time
                    tot = tot + gl.load(first + q * (NW * SLOT) + offs, cache_modifier=".cg")
                    if GLU:
                        tot_u = tot_u + gl.load(first + q * (NW * SLOT) + SLOT + offs, cache_modifier=".cg")
                if GLU:
                    _band_store(y, _glu(tot, tot_u), n0, M, N, stride_ym, stride_yn, acc_layout, BAND, BLOCK_T)
                else:
                    _band_store(y, tot, n0, M, N, stride_ym, stride_yn, acc_layout, BAND, BLOCK_T)

    @gluon.jit
    def _load_x_w(w_desc, x_desc, g, iters, N, bar, w_slot, x_slot, NBYTES: gl.constexpr, GLU: gl.constexpr,
                  W: gl.constexpr, X: gl.constexpr):
        """Global K step ``g`` (band g // iters, K step g % iters): arm ``bar`` when the weight goes
        (W), then the weight's boxes (W) and x's (X)."""
        BAND: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        k = (g % iters) * BLOCK_K
        if W:
            mbarrier.expect(bar, NBYTES)
            _load_w(w_desc, (g // iters) * BAND, N, k, bar, w_slot, GLU)
        if X:
            tma.async_copy_global_to_shared(x_desc, [0, k], bar, x_slot)

    # iters = 1 specialised to a constant breaks Triton 3.6's lowering of the loop (an LLVM
    # assertion in ConvertTritonGPUToLLVM): the step count stays a runtime value
    @gluon.jit(do_not_specialize=["iters", "total"])
    def weight_first_streamk_kernel(w_desc, x_desc, y, ws, counters, M, N, K, stride_ym, stride_yn, iters, total,
                                    STAGES: gl.constexpr, EARLY: gl.constexpr, GLU: gl.constexpr = False,
                                    PDL: gl.constexpr = 0, WEIGHTS_FIRST: gl.constexpr = True):
        """The persistent form: the bands' K steps in one row (``total`` = bands x ``iters``), program
        p streams steps [p * total // P, (p + 1) * total // P) through one ring carried across the
        bands it crosses, so every program reads the same bytes (no partly empty last wave, one
        pipeline fill a program). At the end of each band it touched: the band's whole K range
        (no other program in it) stores y; a part writes its fp32 partial to slot 0 (its first
        band) or 1 (its last) of the program's workspace. After the loop the program takes a
        ticket on each shared band's counter; the last arrival sums the band's parts in program
        order (the same bits whichever finishes last), stores and resets the counter. ``EARLY`` ring stages' weight boxes go before the
        PDL wait (WEIGHTS_FIRST), the others' after it. ws: fp32 (P, 2, GLU + 1, 64, BLOCK_T)."""
        BAND: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        gl.static_assert(BAND == 64, "the weight's boxes are 64 rows (one warpgroup's wgmma)")
        gl.static_assert(x_desc.block_type.shape[1] == BLOCK_K, "x's boxes are BLOCK_K wide")
        gl.static_assert(EARLY <= STAGES, "EARLY counts ring stages")
        NW: gl.constexpr = 2 if GLU else 1
        NBYTES: gl.constexpr = NW * w_desc.block_type.nbytes + x_desc.block_type.nbytes
        SLOT: gl.constexpr = BAND * BLOCK_T
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        g0 = (pid * total) // P
        n = (pid + 1) * total // P - g0

        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, NW * BAND, BLOCK_K], w_desc.layout)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_T, BLOCK_K], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        # the first EARLY stages' weight boxes before the wait (no earlier kernel writes W), the
        # rest after it, and x's (written by the kernel before) after it
        if WEIGHTS_FIRST:
            for i in gl.static_range(EARLY):
                if i < n:
                    _load_x_w(w_desc, x_desc, g0 + i, iters, N, bars.index(i), w_bufs.index(i), x_bufs.index(i),
                              NBYTES, GLU, True, False)
        _pdl(PDL == 1, PDL != 0)
        for i in gl.static_range(STAGES):
            if i < n:
                late_w: gl.constexpr = (not WEIGHTS_FIRST) or i >= EARLY
                _load_x_w(w_desc, x_desc, g0 + i, iters, N, bars.index(i), w_bufs.index(i), x_bufs.index(i),
                          NBYTES, GLU, late_w, True)

        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_T, 16])
        r = gl.arange(0, BAND, layout=gl.SliceLayout(1, acc_layout))
        m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, acc_layout))
        offs = r[:, None] * BLOCK_T + m[None, :]
        acc = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
        acc_u = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
        for i in range(n):
            g = g0 + i
            s = i % STAGES
            mbarrier.wait(bars.index(s), (i // STAGES) & 1)
            xs = x_bufs.index(s).permute((1, 0))   # (BLOCK_K, BLOCK_T): x's box as wgmma's B
            wb = w_bufs.index(s)
            if GLU:
                acc = warpgroup_mma(wb.slice(0, BAND, dim=0), xs, acc, is_async=True)
                acc_u = warpgroup_mma(wb.slice(BAND, BAND, dim=0), xs, acc_u, is_async=True)
                acc, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_u))
            else:
                acc = warpgroup_mma(wb, xs, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if i + STAGES < n:   # the slot is read: its next boxes, STAGES steps ahead (maybe the next band's)
                gl.thread_barrier()   # every warp's wgmma on the slot is done before TMA overwrites it
                _load_x_w(w_desc, x_desc, g + STAGES, iters, N, bars.index(s), wb, x_bufs.index(s), NBYTES, GLU,
                          True, True)
            if (g % iters == iters - 1) | (i == n - 1):   # the end of this program's part of a band
                band = g // iters
                b0 = band * iters
                if ((b0 + 1) * P - 1) // total == ((b0 + iters) * P - 1) // total:   # the band's one program
                    if GLU:
                        _band_store(y, _glu(acc, acc_u), band * BAND, M, N, stride_ym, stride_yn, acc_layout,
                                    BAND, BLOCK_T)
                    else:
                        _band_store(y, acc, band * BAND, M, N, stride_ym, stride_yn, acc_layout, BAND, BLOCK_T)
                else:   # a part: its partial now, its ticket after the loop (a ticket's release
                    # fence here would stall the ring for the stores in flight)
                    base = ws + (pid * 2 + (g0 < b0).to(gl.int32)).to(gl.int64) * (NW * SLOT)
                    gl.store(base + offs, acc)
                    if GLU:
                        gl.store(base + SLOT + offs, acc_u)
                acc = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
                acc_u = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
        if PDL == 3:
            _pdl(True, False)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        # the tickets of the (at most two) bands this program holds a part of: its first band and
        # its last; every thread's partials before them
        gl.thread_barrier()
        b_first = g0 // iters
        b_last = (g0 + n - 1) // iters
        _stream_fixup(y, ws, counters, b_first, pid, P, total, iters, g0, M, N, stride_ym, stride_yn, offs,
                      acc_layout, BAND, BLOCK_T, GLU)
        if b_last != b_first:
            _stream_fixup(y, ws, counters, b_last, pid, P, total, iters, g0, M, N, stride_ym, stride_yn, offs,
                          acc_layout, BAND, BLOCK_T, GLU)

    @gluon.jit
    def _stream_fixup(y, ws, counters, band, pid, P, total, iters, g0, M, N, stride_ym, stride_yn, offs,
                      layout: gl.constexpr, BAND: gl.constexpr, BLOCK_T: gl.constexpr, GLU: gl.constexpr):
        """Where ``band`` is shared (programs first..last meet it), this program's ticket on it; the
        last arrival sums the parts in program order (the same bits whichever finishes last) through
        L2 (.cg, never a stale L1 line), stores y's band and resets the counter for the next launch."""
        NW: gl.constexpr = 2 if GLU else 1
        SLOT: gl.constexpr = BAND * BLOCK_T
        b0 = band * iters
        first = ((b0 + 1) * P - 1) // total
        last = ((b0 + iters) * P - 1) // total
        if first != last:
            ticket = gl.atomic_add(counters + band, 1, sem="acq_rel", scope="gpu")
            if ticket == last - first:
                gl.atomic_xchg(counters + band, 0, sem="relaxed", scope="gpu")
                tot = gl.zeros((BAND, BLOCK_T), gl.float32, layout)
                tot_u = gl.zeros((BAND, BLOCK_T), gl.float32, layout)
                for q in range(first, last + 1):
                    q_slot = (q * total // P < b0).to(gl.int32)   # the band is q's last part (1) or its first (0)
                    src = ws + (q * 2 + q_slot).to(gl.int64) * (NW * SLOT)
                    tot = tot + gl.load(src + offs, cache_modifier=".cg")
                    if GLU:
                        tot_u = tot_u + gl.load(src + SLOT + offs, cache_modifier=".cg")
                if GLU:
                    _band_store(y, _glu(tot, tot_u), band * BAND, M, N, stride_ym, stride_yn, layout, BAND, BLOCK_T)
                else:
                    _band_store(y, tot, band * BAND, M, N, stride_ym, stride_yn, layout, BAND, BLOCK_T)
