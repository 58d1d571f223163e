"""Bounded waits of the Gluon kernels (NVIDIA sm_90: kernels/dist_gemm_ar_ws.py, gemm_weight_first.py).

A wait spins on a flag with acquire loads at system scope (a peer GPU writes it) until it reaches
the call's epoch, for at most ``bound`` microseconds of the GPU's global timer. On a timeout it sets
the peer's bit in the context's status word, which the host turns into a TimeoutError naming the
rank (numasched.distributed's ``ctx.check``). A wait after an earlier timeout gives up at once and
sets bit 16 + src instead (the status word's second field: kernels/dist_common.py). A poll count
was no bound: on two H100s 10 s of the Triton kernels' polls took the WS consumers 112 s (tp2-s29b).
"""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - triton without Gluon
    HAVE_GLUON = False

if HAVE_GLUON:
    @gluon.jit
    def clock_ns():
        """The GPU's global nanosecond timer (``%globaltimer``), as this thread reads it. (Warps read
        it nanoseconds apart, so at a timeout one warp could leave the poll loop a poll before the
        others, whose polls' broadcasts share a barrier: a window of nanoseconds in a 10 s wait.
        Taking the warpgroup's maximum instead (gemm_ws._uniform_clock_ns) added 8-12 bytes of
        spills to the WS reduce-scatter forms; kernels/dist_common.py's wait_flag reads it the same way.)"""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def wait_flag(ptr, target, src, status, bound):
        """Spin (acquire, system scope) until *ptr >= target, for at most ``bound`` us of
        ``%globaltimer`` (read every 64 polls); on a timeout set bit ``src`` of the status word
        (bit 16 + src for a wait that gave up at once after an earlier timeout)."""
        v = gl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        if v < target:
            dead = gl.atomic_add(status, 0, sem="relaxed", scope="gpu")
            end = clock_ns() + gl.where(dead != 0, 0, bound).to(gl.int64) * 1000
            late = (dead != 0).to(gl.int32)
            spins = 0
            while (v < target) & (late == 0):
                v = gl.atomic_add(ptr, 0, sem="acquire", scope="sys")
                spins += 1
                if spins % 64 == 0:
                    late = (clock_ns() > end).to(gl.int32)
            if v < target:
                gl.atomic_or(status, 1 << (src + gl.where(dead != 0, 16, 0)), sem="relaxed", scope="gpu")
