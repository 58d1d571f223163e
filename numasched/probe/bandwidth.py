"""Measured streaming-read bandwidth of the GPU at hand (the probe's ``hbm_bytes_per_s`` and the
benchmarks' bandwidth limit: ``numasched.bench.common`` re-exports :func:`stream_read_bw`)."""
from __future__ import annotations

__all__ = ["stream_read_bw", "read_graph_us", "READ_CONFIGS"]

_CACHE: dict = {}


def stream_read_bw() -> float:
    """Measured streaming-read bandwidth (bytes/s): torch sum over 1 GiB of fp32 (cached per process)."""
    import torch
    import triton.testing

    if "read" not in _CACHE:
        x = torch.rand(256 * 1024 * 1024, device="cuda")
        ms = float(triton.testing.do_bench(lambda: x.sum(), warmup=10, rep=50, return_mode="median"))
        _CACHE["read"] = x.numel() * 4 / (ms * 1e-3)
        del x
    return _CACHE["read"]


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

    from ..kernels.probe import stream_read_kernel

    if not bufs or any(b.shape != bufs[0].shape or b.dtype != bufs[0].dtype or not b.is_contiguous() for b in bufs):
        raise ValueError("bufs: a non-empty list of contiguous tensors of one shape and dtype")
    nbytes = bufs[0].numel() * bufs[0].element_size()
    # read as the widest words the size divides into (the kernel's loads are vectorised either way)
    word = next(w for w in (torch.int32, torch.int16, torch.uint8) if nbytes % w.itemsize == 0)
    words = [b.view(-1).view(torch.uint8).view(word) for b in bufs]
    n = nbytes // word.itemsize
    best = timer(lambda i: words[i].sum(), len(bufs), calls)
    for block, unroll, warps in READ_CONFIGS:
        grid = (-(-n // (block * unroll)),)
        sink = torch.empty(grid[0], device=bufs[0].device, dtype=torch.float32)
        best = min(best, timer(lambda i, block=block, unroll=unroll, warps=warps, sink=sink, grid=grid:
                               stream_read_kernel[grid](words[i], sink, n, BLOCK=block, UNROLL=unroll, num_warps=warps),
                               len(bufs), calls))
    return best
