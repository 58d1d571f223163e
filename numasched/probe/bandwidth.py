"""Measured streaming-read bandwidth of the GPU at hand (the probe's ``hbm_bytes_per_s`` and the
benchmarks' bandwidth limit: ``numasched.bench.common`` re-exports :func:`stream_read_bw`)."""
from __future__ import annotations

__all__ = ["stream_read_bw", "read_graph_us", "READ_CONFIGS"]

_CACHE: dict = {}


STREAM_READ_BYTES = 1 << 30


def stream_read_bw(device=None) -> float:
    """Measured streaming-read bandwidth (bytes/s): reads of 1 GiB, the fastest of torch's sum and
    kernels/probe.stream_read_kernel in READ_CONFIGS, each the median of back-to-back calls timed
    one by one (cached per process and device).

    Back to back, a call starts with the L2 holding clean lines of the previous read's tail, which
    it evicts before it reaches them: no hits and nothing to write back. (Timed with triton's
    do_bench, whose flush writes 256 MB, a read also wrote back the H200's 60 MiB of dirty L2 lines:
    the rate of the 1st-51st sessions, 4.13-4.15 TB/s, let kernels timed after a read flush reach
    up to 1.09 of it.)"""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    key = ("read", dev)
    if key not in _CACHE:
        n = STREAM_READ_BYTES // 4
        x = torch.ones(n, device=dev, dtype=torch.int32)
        best = float("inf")
        with torch.cuda.device(dev):
            for read in _readers([x], n):
                for _ in range(3):   # compile, warm the clocks
                    read(0)
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(15)]
                for a, b in ev:
                    a.record()
                    read(0)
                    b.record()
                torch.cuda.synchronize()
                ms = sorted(a.elapsed_time(b) for a, b in ev)
                best = min(best, ms[len(ms) // 2])
        _CACHE[key] = STREAM_READ_BYTES / (best * 1e-3)
        del x
    return _CACHE[key]


# (BLOCK words, UNROLL loads in flight per thread, warps) of kernels/probe.stream_read_kernel
READ_CONFIGS = ((2048, 4, 8), (4096, 4, 8), (1024, 8, 4))


def read_graph_us(bufs, calls: int, timer) -> float:
    """Microseconds per read of one of ``bufs`` (same-size tensors, read in turn) in the setting of a
    kernel timed with ``timer(fn_i, copies, calls)`` (numasched.gemm_tune.graph_us: CUDA-graph
    replays, call i reading buffer i mod copies): the fastest of torch's sum and
    kernels/probe.stream_read_kernel in READ_CONFIGS. The limit of a kernel that reads those bytes
    once: fixed costs (launch, ramp-up, drain) included, as they are in the kernel's time, where
    :func:`stream_read_bw` is the rate of a 1 GiB read."""
    import torch

    if not bufs or any(b.shape != bufs[0].shape or b.dtype != bufs[0].dtype or not b.is_contiguous() for b in bufs):
        raise ValueError("bufs: a non-empty list of contiguous tensors of one shape and dtype")
    nbytes = bufs[0].numel() * bufs[0].element_size()
    # read as the widest words the size divides into (the kernel's loads are vectorised either way)
    word = next(w for w in (torch.int32, torch.int16, torch.uint8) if nbytes % w.itemsize == 0)
    words = [b.view(-1).view(torch.uint8).view(word) for b in bufs]
    return min(timer(read, len(bufs), calls) for read in _readers(words, nbytes // word.itemsize))


def _readers(words, n: int) -> list:
    """Readers of ``n`` words of ``words[i]`` (same-size 1-D tensors), each ``read(i)``: torch's
    sum, then kernels/probe.stream_read_kernel in each of READ_CONFIGS."""
    import torch

    from ..kernels.probe import stream_read_kernel

    readers = [lambda i: words[i].sum()]
    for block, unroll, warps in READ_CONFIGS:
        grid = (-(-n // (block * unroll)),)
        sink = torch.empty(grid[0], device=words[0].device, dtype=torch.float32)
        readers.append(lambda i, block=block, unroll=unroll, warps=warps, sink=sink, grid=grid:
                       stream_read_kernel[grid](words[i], sink, n, BLOCK=block, UNROLL=unroll, num_warps=warps))
    return readers
