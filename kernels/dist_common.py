"""Device helpers shared by the cross-GPU kernels: heap translation, flags, epochs, bounded waits.

The memory model is Iris's: every rank owns a *symmetric heap*; an allocation sits at the same
offset in every rank's heap, and ``heap_bases[r]`` is the address at which this process sees
rank r's heap (``iris.Iris.get_heap_bases()``; peer heaps are mapped into our address space).
Moving a pointer from our heap to rank r's is base arithmetic, exactly ``iris.load/store``'s
translation. We write it here (three lines) instead of calling ``iris.*`` so the kernels also run
in Triton's interpreter on a CPU-only machine, where the tests fake a heap per rank.

Flags are epoch counters. Every call of an operation has an epoch ``e`` (1, 2, 3, ...) kept on the
device (int64, as the flags: an int32 epoch would wrap after 2^31 calls, about 34 hours of a
decode loop at 17k calls per second, and a negative epoch breaks the buffer parity and the waits): a producer *sets* a flag to ``e`` (release, scope "sys"), a consumer waits until the flag
is ``>= e`` (acquire, scope "sys"). Flags only grow, so nothing clears them between calls, and
because the epoch lives in device memory (not in a kernel argument) a CUDA graph replays correctly.
On NVIDIA a plain cached ``tl.load`` in a spin loop can spin forever on a stale line: always spin
on an acquire atomic.

Every wait is bounded: past the bound the program gives up, sets bit ``src`` in a local status
word and carries on (computing garbage); the host reads the status after the call and raises
TimeoutError naming the ranks that never signalled. After a first timeout later waits give up at
once; a peer missing at such a wait gets bit ``AFTER + src`` instead: with more than two ranks the
live peers are then behind too (each spent the bound waiting on the dead one), and the host names
them apart from the ranks this rank waited the whole bound for. On NVIDIA the bound is wall-clock time
(``CLOCK``: ``bound`` nanoseconds of ``%globaltimer``): a poll-count bound calibrated with one
waiting program was 6x+ too long on four H200s, where every program of the grid polls at once and
each poll is slower. Elsewhere (the interpreter, AMD, where the clock has no path here yet)
``bound`` counts polls.

Epoch bookkeeping without a clearing pass: every program reads ``epoch`` at its start (target
``e = epoch + 1``); at its end it increments an exit counter; the program that sees the counter
reach ``num_programs`` is the last one alive, so it resets the counters and publishes ``epoch = e``
for the next call. All other programs have read ``epoch`` before their exit increment, so none can
observe the new value early.
"""
import triton
import triton.language as tl


@triton.jit
def translate(ptr, from_rank, to_rank, heap_bases):
    """``ptr`` (in ``from_rank``'s heap as we see it) -> the same offset in ``to_rank``'s heap."""
    from_base = tl.load(heap_bases + from_rank)
    to_base = tl.load(heap_bases + to_rank)
    # Moved by a whole number of elements, so the result keeps ptr's alignment and contiguity and
    # remote stores are vectorised (16-byte st.global.v4) rather than one element each. This
    # needs heap bases 16 elements apart at least (256 bytes; checked when a world is set up).
    delta = (to_base - from_base) // (ptr.dtype.element_ty.primitive_bitwidth // 8)
    return ptr + tl.multiple_of(delta, 16)


@triton.jit
def signal(flag_ptr, value, rank, to_rank, heap_bases, BAR_ASM: tl.constexpr = False):
    """Publish ``value`` in ``to_rank``'s copy of ``flag_ptr`` after all of this program's stores.

    The CTA barrier makes every thread's earlier stores precede the single-thread release atomic;
    scope "sys" makes them visible to the peer GPU (scope "gpu" is not enough across NVLink).
    ``BAR_ASM``: the CTA barrier as inline PTX (see ``cta_barrier``).
    """
    cta_barrier(BAR_ASM)
    tl.atomic_xchg(translate(flag_ptr, rank, to_rank, heap_bases), value, sem="release", scope="sys")


@triton.jit
def cta_barrier(ASM: tl.constexpr):
    """Every thread of the program here before any goes on (``__syncthreads``). ``ASM`` (compiled
    NVIDIA kernels): as inline PTX ``bar.sync 0``, the same instruction, which Triton's software
    pipeliner does not see: it leaves a loop holding a ``tl.debug_barrier`` unpipelined (Triton
    3.6), so a persistent loop whose epilogue raises a flag would refill its operand pipeline at
    every tile."""
    if ASM:
        tl.inline_asm_elementwise("bar.sync 0; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def tma_store_drain():
    """Wait until this thread's TMA stores (``cp.async.bulk`` groups) have completed, writes
    included (``cp.async.bulk.wait_group 0``), so that a flag raised next finds them landed; then
    ``fence.proxy.async`` orders them (async proxy) before the flag's generic-proxy release.
    Inline PTX: compiled NVIDIA kernels only."""
    tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_sys():
    """``fence.acq_rel.sys``: this thread's earlier memory operations (and those ordered before
    them, as by a CTA barrier) before its later ones, for every observer on the system. Inline
    PTX: compiled NVIDIA kernels only (callers gate it with a constexpr)."""
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def signal_peers(flag_ptr, value, rank, heap_bases, WORLD: tl.constexpr, ONE_FENCE: tl.constexpr,
                 BAR_ASM: tl.constexpr = False):
    """``signal`` to every peer (every rank but ours), after all of this program's stores.

    Each release atomic of ``signal`` carries its own system-scope fence, and the fences run one
    after another, a round trip over the link each: 1 at two ranks, 3 at four, 7 at eight.
    ``ONE_FENCE`` (compiled NVIDIA kernels) fences once, then writes the flags relaxed: a fence
    followed by a strong write is a release pattern in the PTX memory model, the same ordering.
    ``BAR_ASM``: the CTA barrier as inline PTX (see ``cta_barrier``).
    """
    cta_barrier(BAR_ASM)
    if ONE_FENCE:
        fence_sys()
        for d in tl.static_range(WORLD):
            if d != rank:
                tl.atomic_xchg(translate(flag_ptr, rank, d, heap_bases), value, sem="relaxed", scope="sys")
    else:
        for d in tl.static_range(WORLD):
            if d != rank:
                tl.atomic_xchg(translate(flag_ptr, rank, d, heap_bases), value, sem="release", scope="sys")


@triton.jit
def clock_ns():
    """The GPU's global nanosecond timer (``%globaltimer``). Inline PTX: compiled NVIDIA kernels
    only (callers gate it with a constexpr)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


# status bits: bit r, this rank waited the whole bound for rank r; bit AFTER + r, rank r was
# missing at a wait after that first timeout (numasched.distributed._context.STATUS_AFTER)
AFTER = tl.constexpr(16)


@triton.jit
def _wait_budget(status_ptr, bound, CLOCK: tl.constexpr):
    """(end, late, bit offset) of a bounded wait that found its data missing: ``end`` the deadline
    in ``%globaltimer`` ns (``CLOCK``) or the poll count; ``late`` already (a bound of 0, or an
    earlier wait of this rank timed out: later waits give up at once, so a kernel with many tiles
    per program does not take tiles x timeout to report a dead peer); the offset of the status bit
    a miss sets (AFTER after an earlier timeout, else 0)."""
    dead = tl.atomic_add(status_ptr, 0, sem="relaxed", scope="gpu")
    limit = tl.where(dead != 0, 0, bound).to(tl.int64)
    if CLOCK:
        end = clock_ns() + limit
    else:
        end = limit
    return end, limit <= 0, tl.where(dead != 0, AFTER, 0)


@triton.jit
def _wait_over(spins, end, late, CLOCK: tl.constexpr):
    """Whether a wait that has polled ``spins`` times is past its ``end`` (the clock is read every
    64 polls: a timer read costs about as much as a poll)."""
    if CLOCK:
        if spins % 64 == 0:
            late = clock_ns() > end
    else:
        late = spins >= end
    return late


@triton.jit
def wait_flag(flag_ptr, target, src, status_ptr, bound, CLOCK: tl.constexpr):
    """Spin (acquire, scope "sys") until ``*flag_ptr >= target``; bounded by ``bound``: nanoseconds
    of wall-clock time if ``CLOCK``, else polls.

    On timeout sets bit ``src`` of ``*status_ptr`` (the host names that rank) and returns False.
    """
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if v < target:
        end, late, shift = _wait_budget(status_ptr, bound, CLOCK)
        spins = 0
        while (v < target) & (late == 0):
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            spins += 1
            late = _wait_over(spins, end, late, CLOCK)
        if v < target:
            tl.atomic_or(status_ptr, 1 << (src + shift), sem="relaxed", scope="gpu")
    return v >= target


@triton.jit
def fence_proxy_async():
    """Order the generic-proxy acquire above before later TMA (async-proxy) reads of the same data
    (PTX memory model). Inline PTX: compiled NVIDIA kernels only (the caller gates it)."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def ll_tag(e):
    """The tag an LL word of epoch ``e`` carries in its high half: in [1, 2^31 - 1], never 0 (the
    heap's initial contents) and never the tag of epoch e - 2 (the last use of the same buffer)."""
    return (e % 0x7FFFFFFF) + 1


@triton.jit
def store_words(ptrs, words, mask, NV: tl.constexpr):
    """LL: each int64 of ``words`` to ``ptrs`` (where ``mask``) by one 8-byte relaxed store at
    system scope (``NV``, compiled NVIDIA kernels: inline PTX ``st.relaxed.sys.global.b64``, so
    a reader on another GPU sees each word whole); elsewhere (the interpreter) a plain store."""
    if NV:
        tl.inline_asm_elementwise(
            "{ .reg .pred pw; setp.ne.s32 pw, $3, 0; @pw st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [ptrs, words, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, words, mask=mask)


@triton.jit
def wait_words(ptrs, mask, tag, src, status_ptr, bound, CLOCK: tl.constexpr):
    """LL ("low latency", as NCCL's protocol): spin until every int64 word at ``ptrs`` where
    ``mask`` holds carries ``tag`` in its high 32 bits (each word is written whole by one 8-byte
    store, data in its low half: the tag itself says the data arrived, no flag, no fence).
    Volatile loads (not cached in L1); bounded like :func:`wait_flag` (status bit ``src`` on
    timeout). Returns the words."""
    w = tl.load(ptrs, mask=mask, other=0, volatile=True)
    missing = tl.sum(tl.where(mask & ((w >> 32) != tag), 1, 0), 0)
    if missing != 0:
        end, late, shift = _wait_budget(status_ptr, bound, CLOCK)
        spins = 0
        while (missing != 0) & (late == 0):
            w = tl.load(ptrs, mask=mask, other=0, volatile=True)
            missing = tl.sum(tl.where(mask & ((w >> 32) != tag), 1, 0), 0)
            spins += 1
            late = _wait_over(spins, end, late, CLOCK)
        if missing != 0:
            tl.atomic_or(status_ptr, 1 << (src + shift), sem="relaxed", scope="gpu")
    return w


@triton.jit
def epoch_begin(epoch_ptr):
    """The epoch of this call (previous epoch + 1); read once at the start of every program."""
    return tl.load(epoch_ptr) + 1


@triton.jit
def epoch_end(epoch_ptr, counters_ptr, num_programs, target, BUMP: tl.constexpr, ONE: tl.constexpr = False):
    """Count this program out; the last one resets the ticket/exit counters and (if BUMP) publishes
    ``epoch = target``. ``counters_ptr[0]`` is the tile-ticket counter, ``[1]`` the exit counter.
    ONE (a grid of one program that takes no tickets, e.g. a small all-reduce): that program is
    the last and every read of the epoch was its own, so it only publishes the epoch (one atomic
    on the way out of a latency-bound call instead of four)."""
    if ONE:
        if BUMP:
            tl.atomic_xchg(epoch_ptr, target, sem="release", scope="gpu")
        return
    done = tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == num_programs - 1:
        tl.atomic_xchg(counters_ptr + 0, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + 1, 0, sem="relaxed", scope="gpu")
        if BUMP:
            tl.atomic_xchg(epoch_ptr, target, sem="release", scope="gpu")


@triton.jit
def next_ticket(counters_ptr, LO):
    """Dynamic tile scheduling: the next tile index of this call (``LO`` + a global counter)."""
    return tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu") + LO


@triton.jit
def spin_probe_kernel(flag_ptr, status_ptr, bound, CLOCK: tl.constexpr):
    """A bounded wait on a flag nobody sets: its run time is the bound (``bound`` polls: the time
    of one poll; ``bound`` ns with ``CLOCK``: a check of the clock bound)."""
    wait_flag(flag_ptr, 1, 0, status_ptr, bound, CLOCK)


def spin_ns(device, spins: int = 1 << 15) -> float:
    """Measured nanoseconds per poll of :func:`wait_flag` on this GPU (turns timeouts into poll counts)."""
    import time

    import torch

    flag = torch.zeros(1, dtype=torch.int32, device=device)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    spin_probe_kernel[(1,)](flag, status, spins, CLOCK=False)  # compile + warm
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    spin_probe_kernel[(1,)](flag, status, spins, CLOCK=False)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e9 / spins


@triton.jit
def remote_copy_kernel(src_ptr, dst_ptr, heap_bases, rank, peer, n, BLOCK: tl.constexpr):
    """Copy ``n`` elements from local ``src_ptr`` into ``peer``'s copy of heap tensor ``dst_ptr``
    with remote stores (the benchmark's link-bandwidth probe: the same path the pushes take)."""
    dst = translate(dst_ptr, rank, peer, heap_bases)
    for off in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < n
        tl.store(dst + idx, tl.load(src_ptr + idx, mask=m), mask=m)
