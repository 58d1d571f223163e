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
6. PUSH (a row-parallel projection at TP > 1): the band also goes to every peer's receive buffer
   of the all-reduce + add + norm that follows, with one count a band, so that kernel sends
   nothing and only waits for the counts (``_band_push``; the exchange starts band by band while
   the GEMM's other bands still stream, instead of after the GEMM's last one).

7. REDUCE (a row-parallel projection whose all-reduce ends in the next projection): instead of
   counting, each band's last program waits for the peers' copies of the same band (a flag a
   band and source, holding the epoch of the last call that arrived; bounded, naming the rank in
   the status word), sums the parts in rank order, rounds, adds the residual stream in place
   (the same bits as the all-reduce + add kernel's r) and stores the band's sum of squares a row
   (``_band_reduce``). No kernel sits between this GEMM and the next projection's: that one
   (NSS > 0) reads the residual stream as its x and scales row m of its result by
   1 / sqrt(sum of those sums / K + eps), RMSNorm's factor (the norm's weight is folded into
   its W: TPDecoder.fold_norms).

One warpgroup (4 warps) a program; shared memory holds STAGES x (64 or 128 rows + BLOCK_T) x
BLOCK_K. ``EARLY`` counts the ring stages whose weight boxes go before the wait (step 2): the host
plan's default is all of them (the kernel's own, 0, is the A/B of the order); fewer leave more of
the memory bus to the kernel before.
Gluon has no interpreter: the CPU suite compiles this kernel for sm_90 offline
(tests/test_gemm_weight_first.py); correctness and speed come from its GPU tests and
``scripts/weight_first_probe.py``. Host side: numasched/gemm_weight_first.py.
"""
from numasched.kernels import gluon_wait

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    HAVE_GLUON = gluon_wait.HAVE_GLUON
except ImportError:  # pragma: no cover - triton without Gluon
    HAVE_GLUON = False

BAND = 64   # rows of W a unit computes: one warpgroup's wgmma M

if HAVE_GLUON:
    wait_flag = gluon_wait.wait_flag

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
    def _row_runs(vals, BAND: gl.constexpr):
        """vals (BAND columns of y, BLOCK_T rows) in a layout of 8 consecutive columns a thread: one
        16-byte store a row run in y's row-major memory. wgmma's accumulator gives a thread two
        neighbouring rows of a column, so stored as it is every element is its own 2-byte store
        (four 16-byte pieces of rows a warp instruction); the conversion goes through shared memory
        once."""
        gl.static_assert(BAND == 64, "8 threads of 8 columns span the band")
        runs: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                              warps_per_cta=[1, 4], order=[0, 1])
        return gl.convert_layout(vals, runs)

    @gluon.jit
    def _band_store(y, vals, n0, M, N, stride_ym, stride_yn, BAND: gl.constexpr, BLOCK_T: gl.constexpr):
        """vals (BAND columns of y, BLOCK_T rows, as :func:`_row_runs` lays them out) into
        y[:M, n0:n0 + BAND], transposed."""
        layout: gl.constexpr = vals.type.layout
        r = gl.arange(0, BAND, layout=gl.SliceLayout(1, layout))
        m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        cols = n0 + r
        ptrs = y + m[None, :].to(gl.int64) * stride_ym + cols[:, None].to(gl.int64) * stride_yn
        gl.store(ptrs, vals.to(y.dtype.element_ty), mask=(cols[:, None] < N) & (m[None, :] < M))

    @gluon.jit
    def _band_push(recv, pcount, epoch, heap_bases, rank, vals, n0, M, N, BAND: gl.constexpr,
                   BLOCK_T: gl.constexpr, WORLD: gl.constexpr):
        """PUSH: the band (as :func:`_band_store` writes it) into every peer's copy of ``recv``, slot
        ``epoch + 1 & 1``, part ``rank`` (heap (2, WORLD, M, N)), then one add to every peer's
        ``pcount[rank]`` after those stores (CTA barrier, then a release at system scope): the
        producer's side of the pushed all-reduce + add + norm (kernels/dist_allreduce.py,
        ``arn_push_kernel`` is the same in Triton). ``epoch`` is that kernel's own word: read
        after this kernel's PDL wait, so the call before it has published it."""
        layout: gl.constexpr = vals.type.layout
        e = gl.load(epoch, cache_modifier=".cg") + 1
        slot = (e % 2).to(gl.int32)
        r = gl.arange(0, BAND, layout=gl.SliceLayout(1, layout))
        m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        cols = n0 + r
        # (M and rank may be the constant 1, which Triton specialises: no .to on them)
        offs = (slot * WORLD + rank).to(gl.int64) * M * N + m[None, :].to(gl.int64) * N + cols[:, None].to(gl.int64)
        mask = (cols[:, None] < N) & (m[None, :] < M)
        v = vals.to(recv.dtype.element_ty)
        ELT: gl.constexpr = recv.dtype.element_ty.primitive_bitwidth // 8
        own = gl.load(heap_bases + rank)
        for d in gl.static_range(WORLD):
            if d != rank:   # the same offset in the peer's heap: heap bases are 256-byte aligned,
                # which the hint tells the compiler (16-byte stores need it)
                delta = gl.multiple_of((gl.load(heap_bases + d) - own) // ELT, 256 // ELT)
                gl.store(recv + delta + offs, v, mask=mask)
        gl.thread_barrier()
        for d in gl.static_range(WORLD):
            if d != rank:
                gl.atomic_add(pcount + (gl.load(heap_bases + d) - own) // 8 + rank, 1, sem="release", scope="sys")

    @gluon.jit
    def _band_reduce(recv, flags, epoch, heap_bases, rank, status, bound, res, ss, xcount, vals, band, nbands,
                     n0, M, N, BAND: gl.constexpr, BLOCK_T: gl.constexpr, WORLD: gl.constexpr):
        """REDUCE: the band (as :func:`_band_store` writes it) into every peer's ``recv[slot, rank]``
        (heap (2, WORLD, M, N), slot = e % 2, e = this call's epoch), then the peer's
        ``flags[rank, band]`` set to e (release, system scope, after the stores); then, for each
        peer, a bounded wait for our ``flags[src, band]`` >= e and its part; the sum in rank order
        (fp32, rounded to the residual's dtype, as an all-reduce returns it) is added to
        ``res[:M, band]`` in place (rounded: the new residual stream) and the band's sum of
        squares of each row goes to ``ss[band, :]``. The last band to finish publishes e
        (``xcount``: its exit count, left zero). Two slots suffice: a band of call e + 2 is pushed
        only after its rank's call e + 1 saw every peer's band of e + 1, which each peer sends
        after its call e ended."""
        layout: gl.constexpr = vals.type.layout
        e = gl.load(epoch, cache_modifier=".cg") + 1
        slot = (e % 2).to(gl.int32)
        r = gl.arange(0, BAND, layout=gl.SliceLayout(1, layout))
        m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        cols = n0 + r
        offs = m[None, :].to(gl.int64) * N + cols[:, None].to(gl.int64)
        mask = (cols[:, None] < N) & (m[None, :] < M)
        v = vals.to(recv.dtype.element_ty)
        ELT: gl.constexpr = recv.dtype.element_ty.primitive_bitwidth // 8
        own = gl.load(heap_bases + rank)
        # (M and rank may be the constant 1, which Triton specialises: no .to on them)
        mine = recv + (slot * WORLD + rank).to(gl.int64) * M * N + offs
        for d in gl.static_range(WORLD):
            if d != rank:
                delta = gl.multiple_of((gl.load(heap_bases + d) - own) // ELT, 256 // ELT)
                gl.store(mine + delta, v, mask=mask)
        gl.thread_barrier()
        for d in gl.static_range(WORLD):
            if d != rank:
                gl.atomic_xchg(flags + (gl.load(heap_bases + d) - own) // 8 + rank * nbands + band, e,
                               sem="release", scope="sys")
        total = gl.zeros((BAND, BLOCK_T), gl.float32, layout)
        for src in gl.static_range(WORLD):
            if src == rank:
                total += v.to(gl.float32)
            else:
                wait_flag(flags + src * nbands + band, e, src, status, bound)   # kernels/gluon_wait.py
                theirs = recv + (slot * WORLD + src).to(gl.int64) * M * N + offs
                total += gl.load(theirs, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        s = total.to(res.dtype.element_ty)
        h = (gl.load(res + offs, mask=mask, other=0.0).to(gl.float32) + s.to(gl.float32)).to(res.dtype.element_ty)
        gl.store(res + offs, h, mask=mask)
        hf = h.to(gl.float32)
        gl.store(ss + band * BLOCK_T + m, gl.sum(hf * hf, axis=0))
        gl.thread_barrier()   # every thread's stores before the exit count
        done = gl.atomic_add(xcount, 1, sem="acq_rel", scope="gpu")
        if done == nbands - 1:
            gl.atomic_xchg(xcount, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(epoch, e, sem="release", scope="gpu")

    @gluon.jit
    def _row_inv(xsq, nss, eps, K, like, NSS: gl.constexpr, BLOCK_T: gl.constexpr):
        """RMSNorm's factor of each of x's BLOCK_T rows, 1 / sqrt(sum_q xsq[q, m] / K + eps), as a
        row vector of ``like``'s layout (xsq: fp32 (nss, BLOCK_T), the producer's sums of squares
        of x's bands, nss <= NSS, a power of two). The parts are read and summed CH at a time (a
        fixed order; at most CH x BLOCK_T values in registers)."""
        lay: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[4, 1],
                                             order=[1, 0])
        CH: gl.constexpr = 32 if NSS > 32 else NSS
        q = gl.arange(0, CH, layout=gl.SliceLayout(1, lay))
        m = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, lay))
        tot = gl.zeros([BLOCK_T], gl.float32, gl.SliceLayout(0, lay))
        for c in gl.static_range(NSS // CH):
            rows = c * CH + q
            parts = gl.load(xsq + rows[:, None] * BLOCK_T + m[None, :],
                            mask=(rows[:, None] < nss) & (m[None, :] < BLOCK_T), other=0.0)
            tot += gl.sum(parts, axis=0)
        inv = 1.0 / gl.sqrt(tot / K + eps)
        return gl.convert_layout(inv, gl.SliceLayout(0, like.type.layout))[None, :]

    @gluon.jit
    def _glu(g, u):
        return g / (1.0 + gl.exp(-g)) * u

    @gluon.jit
    def _epilogue(acc, acc_u, inv, y, n0, M, N, stride_ym, stride_yn, recv, pcount, epoch, heap_bases, rank, res,
                  ss, xcount, status, bound, band, BAND: gl.constexpr, BLOCK_T: gl.constexpr, GLU: gl.constexpr,
                  PUSH: gl.constexpr, WORLD: gl.constexpr, REDUCE: gl.constexpr, NSS: gl.constexpr):
        """A band's whole result (acc; GLU: and the up's, acc_u): NSS's row scale (``inv``, a row
        vector of acc's layout), then y's store, the push or the reduce (the module doc's steps 5-7)."""
        if NSS > 0:
            acc = acc * inv
            if GLU:
                acc_u = acc_u * inv
        if GLU:
            _band_store(y, _row_runs(_glu(acc, acc_u), BAND), n0, M, N, stride_ym, stride_yn, BAND, BLOCK_T)
        else:
            out = _row_runs(acc, BAND)
            if REDUCE:
                _band_reduce(recv, pcount, epoch, heap_bases, rank, status, bound, res, ss, xcount, out, band,
                             gl.cdiv(N, BAND), n0, M, N, BAND, BLOCK_T, WORLD)
            else:
                _band_store(y, out, n0, M, N, stride_ym, stride_yn, BAND, BLOCK_T)
                if PUSH:
                    _band_push(recv, pcount, epoch, heap_bases, rank, out, n0, M, N, BAND, BLOCK_T, WORLD)

    @gluon.jit
    def weight_first_kernel(w_desc, x_desc, y, ws, counters, M, N, K, stride_ym, stride_yn, k_per_split,
                            recv, pcount, epoch, heap_bases, rank, res, ss, xcount, status, bound, xsq, nss, eps,
                            SPLITS: gl.constexpr, STAGES: gl.constexpr, GLU: gl.constexpr = False,
                            PDL: gl.constexpr = 0, EARLY: gl.constexpr = 0, PUSH: gl.constexpr = False,
                            WORLD: gl.constexpr = 1, REDUCE: gl.constexpr = False, NSS: gl.constexpr = 0):
        """y[:M, :N] = x[:M] @ W[:N].T (GLU: silu(x @ W[:N].T) * (x @ W[N:2N].T)). w_desc: W (N or
        2N, K) in (64, BLOCK_K) boxes; x_desc: x (M, K) in (BLOCK_T, BLOCK_K) boxes; y: (M, N) any
        strides; ws: fp32, SPLITS > 1: (units, GLU + 1, 64, BLOCK_T); counters: int32, one per band
        (zero before the first launch; each launch leaves them zero). Grid: bands x SPLITS units;
        k_per_split: a multiple of BLOCK_K. PDL: 0 none, 1 let the next kernel launch, then wait,
        3 wait, and let it launch after the K loop. EARLY: at most STAGES. PUSH (not GLU): each
        band of y also goes to the WORLD - 1 peers of ``rank`` for a pushed all-reduce + add +
        norm (``_band_push``: recv, pcount, epoch, heap_bases; unused otherwise). REDUCE (with
        PUSH): ``_band_reduce`` instead, pcount being the flags (WORLD, bands) int64, res the
        residual stream (M, N) contiguous, updated in place, ss fp32 (bands, BLOCK_T) the sums of
        squares, xcount an int32 exit count, status / bound the waits' (y is not written). NSS > 0
        (a power of two >= nss): row m of the result is scaled by RMSNorm's factor from xsq (fp32
        (nss, BLOCK_T)) and eps over K columns, before the GLU."""
        BAND: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
        gl.static_assert(BAND == 64, "the weight's boxes are 64 rows (one warpgroup's wgmma)")
        gl.static_assert(x_desc.block_type.shape[1] == BLOCK_K, "x's boxes are BLOCK_K wide")
        gl.static_assert(EARLY <= STAGES, "EARLY counts ring stages")
        gl.static_assert(not (PUSH and GLU), "PUSH: a row-parallel projection's GEMM (no GLU)")
        gl.static_assert(PUSH or not REDUCE, "REDUCE: a pushing form")
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

        # 2. the first EARLY stages' weight boxes before the wait (no earlier kernel writes W)
        for i in gl.static_range(EARLY):
            if i < n_iter:
                mbarrier.expect(bars.index(i), NBYTES)
                _load_w(w_desc, n0, N, k0 + i * BLOCK_K, bars.index(i), w_bufs.index(i), GLU)
        # 3. the previous kernel wrote x: wait for it, then x's boxes of the ring's stages (and
        # the weight boxes of the stages past EARLY)
        _pdl(PDL == 1, PDL != 0)
        for i in gl.static_range(STAGES):
            if i < n_iter:
                if i >= EARLY:
                    mbarrier.expect(bars.index(i), NBYTES)
                    _load_w(w_desc, n0, N, k0 + i * BLOCK_K, bars.index(i), w_bufs.index(i), GLU)
                tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BLOCK_K], bars.index(i), x_bufs.index(i))

        # 4. the K loop (NSS: the row factors first, from the sums the previous kernel wrote: their
        # load's latency passes while the ring's boxes land, not in the epilogue)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_T, 16])
        acc = gl.zeros((BAND, BLOCK_T), gl.float32, acc_layout)
        if NSS > 0:
            inv = _row_inv(xsq, nss, eps, K, acc, NSS, BLOCK_T)
        else:
            inv = 1.0
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
            _epilogue(acc, acc_u, inv, y, n0, M, N, stride_ym, stride_yn, recv, pcount, epoch, heap_bases, rank, res, ss,
                      xcount, status, bound, band, BAND, BLOCK_T, GLU, PUSH, WORLD, REDUCE, NSS)
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
                _epilogue(tot, tot_u, inv, y, n0, M, N, stride_ym, stride_yn, recv, pcount, epoch, heap_bases, rank, res,
                          ss, xcount, status, bound, band, BAND, BLOCK_T, GLU, PUSH, WORLD, REDUCE, NSS)
