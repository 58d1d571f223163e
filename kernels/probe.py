"""Device code of ``numasched probe``: SM/CU ids, cycle and wall-clock counters, L2-only loads, and
the two probe kernels. Host side (launches, analysis, CLI): :mod:`numasched.probe`.

Every helper takes ``AMD: tl.constexpr`` and emits the ISA of one vendor (Triton cannot tell the
compile target inside a kernel when compiling offline, so the caller says which):

============  ==============================  ====================================================
helper        NVIDIA (PTX)                    AMD CDNA3/CDNA4 (gfx942, gfx950)
============  ==============================  ====================================================
``_smid``     ``%smid``                       ``(XCC_ID << 8) | HW_ID[15:8]`` (CU, SH, SE of the
                                              wave) read with ``s_getreg_b32``
``_clock``    ``%clock64`` (SM cycles)        ``s_memtime`` (64-bit shader clock)
``_globaltimer`` ``%globaltimer`` (ns)        ``s_memrealtime`` (constant 100 MHz: ticks x 10 = ns)
``_load_cg``  ``ld.global.cg.u64`` (L2 only)  ``global_load_dwordx2 ... sc1`` (device scope: misses
                                              the CU's L1/TCP, hits L2) + ``s_waitcnt vmcnt(0)``
============  ==============================  ====================================================

The AMD column assembles for gfx942 and gfx950 with Triton 3.6's toolchain (checked offline by
:mod:`numasched.portability`) but has NEVER RUN ON AMD HARDWARE: this project had no AMD GPU.
None of these has an interpreter path (inline assembly): the probe needs a compiled GPU kernel.
"""
import triton
import triton.language as tl


@triton.jit
def _smid(AMD: tl.constexpr = False):
    # Hardware id of the SM (NVIDIA) or CU (AMD: XCC id * 256 + HW_ID bits 15:8) this program runs on.
    if AMD:
        cu = tl.inline_asm_elementwise("s_getreg_b32 $0, hwreg(HW_REG_HW_ID, 8, 8)", "=s", [], dtype=tl.int32,
                                       is_pure=False, pack=1)
        xcc = tl.inline_asm_elementwise("s_getreg_b32 $0, hwreg(HW_REG_XCC_ID, 0, 4)", "=s", [], dtype=tl.int32,
                                        is_pure=False, pack=1)
        return xcc * 256 + cu
    else:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _clock(after, AMD: tl.constexpr = False):
    # Cycle counter. `after` is an unused operand: it orders this read after the value that
    # `after` depends on (in the SASS a consumer of the last load precedes the clock read; on AMD
    # the compiler waits for the register's load before the asm reads it).
    if AMD:
        return tl.inline_asm_elementwise("s_memtime $0\ns_waitcnt lgkmcnt(0)", "=s,v", [after], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [after], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def _globaltimer(after, AMD: tl.constexpr = False):
    # Wall-clock timer, to convert cycles to time: ns on NVIDIA; 100 MHz ticks on AMD (s_memrealtime).
    if AMD:
        return tl.inline_asm_elementwise("s_memrealtime $0\ns_waitcnt lgkmcnt(0)", "=s,v", [after],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [after], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def _load_cg(ptr, AMD: tl.constexpr = False):
    # 8-byte load cached at L2 only (bypasses L1), so every load of the chain is an L2 access.
    if AMD:
        # sc1 = device scope: the load must miss the CU's vector L1 (TCP) and is served by L2.
        return tl.inline_asm_elementwise("global_load_dwordx2 $0, $1, off sc1\ns_waitcnt vmcnt(0)", "=v,v",
                                         [ptr], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global.cg.u64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def _l2_latency_kernel(buf_ptr, offs_ptr, lat_ptr, sm_ptr, clk_ptr, n_lines, iters, AMD: tl.constexpr = False):
    # One program = one warp (wavefront); all values are scalars, so the lanes do the same loads
    # (one request). lat: cycles per dependent load per (program, line); clk: [cycles, timer] per program.
    pid = tl.program_id(0)
    sm = _smid(AMD)
    c_start = _clock(pid.to(tl.int64), AMD)
    g_start = _globaltimer(c_start, AMD)
    sink = tl.zeros((), tl.int64)
    for j in range(n_lines):
        p = buf_ptr + tl.load(offs_ptr + j)      # first 8 bytes of line j
        v = _load_cg(p, AMD)                     # warm-up: line now in L2
        q = p + v                                # buf is zero: q == p, but the compiler cannot know
        t0 = _clock(q, AMD)
        for i in range(iters):
            v = _load_cg(q, AMD)                 # waits for the previous load: latency, not throughput
            q = p + v
        t1 = _clock(q, AMD)
        tl.store(lat_ptr + pid * n_lines + j, (t1 - t0).to(tl.float32) / iters)
        sink += v
    c_end = _clock(sink, AMD)
    g_end = _globaltimer(c_end, AMD)
    tl.store(clk_ptr + 2 * pid, c_end - c_start)
    tl.store(clk_ptr + 2 * pid + 1, g_end - g_start)
    # sink is 0 (zeroed buffer); adding it keeps the loads alive and checks the buffer was zero.
    tl.store(sm_ptr + pid, sm + sink.to(tl.int32))


@triton.jit
def _xcc_id_kernel(out_ptr):
    # AMD gfx942/gfx950 only (UNTESTED ON HARDWARE): XCC (die) that runs this workgroup;
    # HW_REG_XCC_ID = 20, bits 3:0. NVIDIA has no counterpart (see _smid for the SM id).
    pid = tl.program_id(0)
    xcc = tl.inline_asm_elementwise("s_getreg_b32 $0, hwreg(HW_REG_XCC_ID, 0, 4)", "=s", [], dtype=tl.int32,
                                    is_pure=False, pack=1)
    tl.store(out_ptr + pid, xcc)


@triton.jit
def stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    # A streaming read of n words: each program sums BLOCK * UNROLL of them (UNROLL independent
    # loads in flight per thread) and stores one float, so the loads cannot be dropped. The
    # benchmarks' limit for reading a buffer of a given size in the same setting as a kernel
    # (numasched.probe.bandwidth.read_graph_us); plain loads, so it runs in the interpreter too.
    base = tl.program_id(0).to(tl.int64) * BLOCK * UNROLL
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for u in tl.static_range(UNROLL):
        offs = base + u * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))
