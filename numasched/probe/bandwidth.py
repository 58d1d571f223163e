"""Measured streaming-read bandwidth of the GPU at hand (the probe's ``hbm_bytes_per_s`` and the
benchmarks' bandwidth limit: ``numasched.bench.common`` re-exports :func:`stream_read_bw`)."""
from __future__ import annotations

__all__ = ["stream_read_bw"]

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
