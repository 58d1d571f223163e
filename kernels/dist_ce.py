"""Small kernels of the producer/consumer implementation (``impl="ce"``): the data moves with the
copy engine (or :func:`.dist_common.remote_copy_kernel` where there is none) and the GEMMs are
cuBLAS calls; these kernels only signal, wait and sum, all stream-ordered with those calls.

Flags are epoch counters as in :mod:`.dist_common`; the epoch ``e`` is ``*epoch_ptr + 1`` during a
call and the host bumps ``*epoch_ptr`` at its end (an ``add_`` on the main stream, after the
producer stream has joined). With one receive buffer per peer (no double buffering: cuBLAS needs
the buffer's address on the host, which a CUDA graph would freeze), a producer first waits for the
consumer's *ack* of the previous call (``ack >= e - 1``) before overwriting its buffer.
"""
import triton
import triton.language as tl

from .dist_common import translate, wait_flag


@triton.jit
def ce_signal_kernel(flags_ptr, epoch_ptr, heap_bases, rank, dest, idx):
    """``dest``'s ``flags[idx] = e`` (release, sys), after everything earlier on this stream."""
    e = tl.load(epoch_ptr) + 1
    tl.atomic_xchg(translate(flags_ptr + idx, rank, dest, heap_bases), e, sem="release", scope="sys")


@triton.jit
def ce_wait_kernel(flags_ptr, epoch_ptr, status_ptr, idx, src, wait_bound, LAG: tl.constexpr,
                   WAIT_CLOCK: tl.constexpr):
    """Stall this stream until ``flags[idx] >= e - LAG`` (bounded; a timeout names ``src``)."""
    e = tl.load(epoch_ptr) + 1 - LAG
    wait_flag(flags_ptr + idx, e, src, status_ptr, wait_bound, WAIT_CLOCK)


@triton.jit
def sum_partials_kernel(own_ptr, p_ptr, out_ptr, rank, n, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over ranks of the partial slices (ours in ``own_ptr``, rank s's in ``p_ptr[s]``),
    in rank order 0..WORLD-1 with fp32 accumulation. It never waits: the one-program
    ``ce_wait_kernel`` launches before it on the same stream wait for the peers' ready flags.
    (A wide grid of spinning programs fills every SM and starves the side stream's one-program
    signal kernels, on this GPU and, symmetrically, on the peer: that deadlock was seen on two
    H200s at 16384 x 14336 x 8192.)"""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    total = tl.zeros((BLOCK,), tl.float32)
    for src in tl.static_range(WORLD):
        if src == rank:
            total += tl.load(own_ptr + idx, mask=m, other=0.0).to(tl.float32)
        else:
            total += tl.load(p_ptr + src * (tl.zeros([], tl.int64) + n) + idx, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, total.to(out_ptr.dtype.element_ty), mask=m)
