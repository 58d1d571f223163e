"""``impl="ce"``: the producer/consumer pair with cuBLAS GEMMs and copy-engine transfers.

The fused kernels (``impl="fused"``) run the GEMM in Triton; this variant keeps cuBLAS for every
GEMM and overlaps the data movement on a second stream, so no SM is spent on communication:

all-gather + GEMM, call e on rank r:
    side stream  for dest = r-1, r-2, ...: wait ack[dest] >= e-1 (dest has finished with the
                 previous call's copy of our shard), copy our shard into dest's buffer[r]
                 (cuMemcpyDtoDAsync over NVLink), set dest's ready[r] = e
    main stream  C[r rows] = A_r @ B (cuBLAS, overlaps the copies); for src = r+1, r+2, ...:
                 wait ready[src] >= e, C[src rows] = buffer[src] @ B, set src's ack[r] = e
GEMM + reduce-scatter, call e on rank r:
    main stream  for dest = r+1, ...: stage[dest] = A[dest rows] @ B (cuBLAS); then own = A[r rows] @ B;
                 wait ready[src] >= e for every peer; sum kernel: out = sum of partials in rank
                 order (fp32); set every src's ack[r] = e. The waits are one-program
                 kernels before the sum: a sum kernel that spun on the flags itself filled
                 every SM and starved the side stream's signal kernels (deadlock, seen on H200)
    side stream  after each stage[dest] is computed: wait ack[dest] >= e-1, copy it into dest's
                 partials[r], set dest's ready[r] = e
Both join the side stream and bump the epoch at the end of the call. One receive buffer per peer
(cuBLAS needs its address on the host), so the ack replaces double buffering.

On CPU (SimWorld) and on GPUs without the CUDA driver API the copy is a Triton remote-store kernel.

First call of a signature: the receive buffers and flags were just zero-filled on each rank's
stream; ``_common.run`` synchronises and barriers before launching, or a fast peer's copy (or ready
flag) could land before our fill and be wiped (seen on H200: zeros for the peer's rows).
Experimental: ``impl="fused"`` is the default.
"""
from __future__ import annotations

import ctypes

import torch

_MEMCPY = None


def _cu_memcpy():
    global _MEMCPY
    if _MEMCPY is None:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuMemcpyDtoDAsync_v2
        f.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        f.restype = ctypes.c_int
        _MEMCPY = f
    return _MEMCPY


def copy_to_peer(ctx, dst: torch.Tensor, src: torch.Tensor, dest: int) -> None:
    """Copy ``src`` (contiguous) into ``dest``'s copy of heap tensor ``dst`` (ours as we see it)."""
    n = src.numel()
    if ctx.device.type == "cuda" and torch.version.hip is None:
        bases = ctx.heap_bases_host
        peer_ptr = dst.data_ptr() - bases[ctx.rank] + bases[dest]
        rc = _cu_memcpy()(peer_ptr, src.data_ptr(), n * src.element_size(), torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"cuMemcpyDtoDAsync to rank {dest} failed with CUresult {rc}")
        return
    from numasched.kernels.dist_common import remote_copy_kernel

    block = 128 if ctx.device.type == "cpu" else 8192
    grid = (max(1, min(2 if ctx.device.type == "cpu" else 64, -(-n // block))),)
    remote_copy_kernel[grid](src.reshape(-1), dst.reshape(-1), ctx.heap_bases, ctx.rank, dest, n, BLOCK=block)


def _signal(ctx, flags, epoch, dest, idx):
    from numasched.kernels.dist_ce import ce_signal_kernel

    ce_signal_kernel[(1,)](flags, epoch, ctx.heap_bases, ctx.rank, dest, idx)


def _wait(ctx, flags, epoch, idx, src, lag):
    from numasched.kernels.dist_ce import ce_wait_kernel

    ce_wait_kernel[(1,)](flags, epoch, ctx.status, idx, src, ctx.wait_bound, LAG=lag, WAIT_CLOCK=ctx.wait_clock)


class _Streams:
    """Fork a side stream off the current one (GPU) or do nothing (simulation: one thing at a time)."""

    def __init__(self, ctx):
        self.gpu = ctx.device.type == "cuda"
        if self.gpu:
            if getattr(ctx, "side_stream", None) is None:
                # high priority: its one-CTA signal/wait kernels must not queue behind a whole cuBLAS GEMM
                ctx.side_stream = torch.cuda.Stream(device=ctx.device, priority=-1)
            self.main, self.side = torch.cuda.current_stream(ctx.device), ctx.side_stream
            self.side.wait_stream(self.main)

    def on_side(self):
        if self.gpu:
            self.side.wait_stream(self.main)   # also orders the side work after what main did so far
            return torch.cuda.stream(self.side)
        import contextlib

        return contextlib.nullcontext()

    def join(self):
        if self.gpu:
            self.main.wait_stream(self.side)


def all_gather_matmul_ce(ctx, plan, call, phase):
    c, t, bf = call.cfg, call.tensors, plan.bufs
    R, W, Ml = ctx.rank, ctx.world, c["Ml"]
    a, b, out = t["a_local"], t["b"], t["out"]
    ready, ack, epoch = bf["flags"][0], bf["flags"][1], bf["epoch"]
    gather = bf.get("gather")
    rows = lambda s: out[s * Ml:(s + 1) * Ml]  # noqa: E731

    def produce():
        for i in range(1, W):
            dest = (R - i) % W             # rank-1 needs our shard first
            _wait(ctx, ack, epoch, dest, dest, 1)
            copy_to_peer(ctx, gather[R], a, dest)
            _signal(ctx, ready, epoch, dest, R)

    def consume(wait=True):
        torch.matmul(a, b, out=rows(R))
        for i in range(1, W):
            src = (R + i) % W
            if wait:
                _wait(ctx, ready, epoch, src, src, 0)
            torch.matmul(gather[src], b, out=rows(src))
            if wait:
                _signal(ctx, ack, epoch, src, R)

    if phase == "nocomm":
        consume(wait=False)
    elif phase == "push":
        produce()
    elif phase == "consume":
        consume()
        epoch.add_(1)
    else:
        st = _Streams(ctx)
        with st.on_side():
            produce()
        consume()
        st.join()
        epoch.add_(1)
    return None if phase == "push" else out


def matmul_reduce_scatter_ce(ctx, plan, call, phase):
    from numasched.kernels.dist_ce import sum_partials_kernel

    c, t, bf = call.cfg, call.tensors, plan.bufs
    R, W, Ms = ctx.rank, ctx.world, c["Ms"]
    a, b, out = t["a"], t["b_local"], t["out"]
    ready, ack, epoch = bf["flags"][0], bf["flags"][1], bf["epoch"]
    partials, stage, own = bf.get("partials"), bf["stage"], bf["own"]
    rows = lambda s: a[s * Ms:(s + 1) * Ms]  # noqa: E731
    st = _Streams(ctx) if phase == "full" else None

    if phase in ("full", "push", "nocomm"):
        for i in range(1, W):
            dest = (R + i) % W
            torch.matmul(rows(dest), b, out=stage[dest])
            if phase == "nocomm":
                continue
            with (st.on_side() if st else _null()):
                _wait(ctx, ack, epoch, dest, dest, 1)
                copy_to_peer(ctx, partials[R], stage[dest], dest)
                _signal(ctx, ready, epoch, dest, R)
    if phase == "push":
        return None
    torch.matmul(rows(R), b, out=own)
    n = own.numel()
    block = 128 if ctx.device.type == "cpu" else 2048
    if W == 1:
        out.copy_(own)
    else:
        if phase != "nocomm":   # one-program waits, never a wide grid of spinners (see sum_partials_kernel)
            for i in range(1, W):
                src = (R - i) % W
                _wait(ctx, ready, epoch, src, src, 0)
        sum_partials_kernel[(-(-n // block),)](own, partials if phase != "nocomm" else stage, out, R, n, WORLD=W,
                                                BLOCK=block)
        if phase != "nocomm":
            for src in range(W):
                if src != R:
                    _signal(ctx, ack, epoch, src, R)
    if st:
        st.join()
    if phase != "nocomm":
        epoch.add_(1)
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def all_reduce_ce(ctx, plan, call, phase):
    """Two-shot all-reduce whose data moves by copy engine (``impl="ce"``): SMs only sum.

    For a caller that overlaps it with compute on another stream (the row-chunked TP prefill):
    the SM-driven kernels (one-shot, two-shot) take SMs from the GEMMs they overlap, the copy
    engine does not. Shard s of the flat tensor (``span`` elements, the last one shorter) is
    reduced by rank s. Call e on rank R, all on the current stream:

    push    for dest = R+1, R+2, ...: wait ack_rs[dest] >= e-1 (dest has summed the previous
            call's partial), copy x[shard dest] into dest's recv[R], set dest's ready_rs[R] = e
    reduce  wait ready_rs[src] >= e for every peer; out[shard R] = sum of the W partials in rank
            order (fp32; every rank gets bit-identical results); set each src's ack_rs[R] = e;
            then for dest = R+1, ...: wait ack_ag[dest] >= e-1, copy out[shard R] into dest's
            gath[R], set dest's ready_ag[R] = e
    gather  for src = R+1, ...: wait ready_ag[src] >= e, out[shard src] = gath[src] (a local
            copy), set src's ack_ag[R] = e; then the epoch moves on

    ``out`` may be ``x`` (in place): every read of x[shard s] is stream-ordered before the write
    of out[shard s]. The waits are one-program kernels (see sum_partials_kernel)."""
    from numasched.kernels.dist_ce import sum_partials_kernel

    c, t, bf = call.cfg, call.tensors, plan.bufs
    R, W, n, span = ctx.rank, ctx.world, c["n"], c["span"]
    xf, of = t["x"].reshape(-1), t["out"].reshape(-1)
    flags, epoch, recv, gath = bf["flags"], bf["epoch"], bf["recv"], bf["gath"]
    ready_rs, ack_rs, ready_ag, ack_ag = flags[0], flags[1], flags[2], flags[3]
    lo = lambda s: min(n, s * span)  # noqa: E731
    shard = lambda v, s: v[lo(s):lo(s + 1)]  # noqa: E731
    size = lambda s: lo(s + 1) - lo(s)  # noqa: E731
    peers = [(R + i) % W for i in range(1, W)]

    def push(src_view, dst_view, dest, ready, ack):
        _wait(ctx, ack, epoch, dest, dest, 1)
        if src_view.numel():
            copy_to_peer(ctx, dst_view, src_view, dest)
        _signal(ctx, ready, epoch, dest, R)

    if phase in ("full", "push"):
        for dest in peers:   # into dest's recv at our slot, sized by dest's shard
            push(shard(xf, dest), recv[R * size(dest):(R + 1) * size(dest)], dest, ready_rs, ack_rs)
    if phase in ("full", "reduce"):
        for src in peers:
            _wait(ctx, ready_rs, epoch, src, src, 0)
        m = size(R)
        block = 128 if ctx.device.type == "cpu" else 2048
        sum_partials_kernel[(max(1, -(-m // block)),)](shard(xf, R), recv[:W * m], shard(of, R), R, m, WORLD=W,
                                                       BLOCK=block)
        for src in peers:
            _signal(ctx, ack_rs, epoch, src, R)
        for dest in peers:
            push(shard(of, R), gath[lo(R):lo(R + 1)], dest, ready_ag, ack_ag)
    if phase in ("full", "gather"):
        for src in peers:
            _wait(ctx, ready_ag, epoch, src, src, 0)
            if size(src):
                shard(of, src).copy_(gath[lo(src):lo(src + 1)])
            _signal(ctx, ack_ag, epoch, src, R)
        epoch.add_(1)
    return None if phase == "push" else t["out"]
