"""``python -m numasched.bench.host_overhead``: Python host time per eager call, without a GPU.

Times ``attention_forward``, ``scaled_dot_product_attention`` and ``matmul`` on CPU tensors with
the Triton launch replaced by a no-op, so what is left is numasched's own host work: checks,
policy resolution, dispatch, allocation of outputs. The kernel-device check is forced true so
that the kernel path runs (with TRITON_INTERPRET unset the kernels are real JITFunctions: the
stub stands in for them). Triton's own launch cost (argument binding, the driver call) is NOT
included: measure it on a GPU with ``--gpu``, which times real eager calls back to back.

    python -m numasched.bench.host_overhead            # CPU, no-op launches, 1000 calls each
    python -m numasched.bench.host_overhead --gpu      # GPU: eager wall time per call (launches included),
                                                       # the GPU time of one call, and torch's calls beside
"""
from __future__ import annotations

import argparse
import os
import sys
import time


class _NoLaunch:
    """Stands in for a JITFunction/Autotuner: ``kernel[grid](...)`` does nothing."""

    best_config = None

    def __getitem__(self, grid):
        return self._run

    def _run(self, *args, **kwargs):
        return None


def _per_call_us(fn, n: int) -> float:
    fn()  # first call: caches, lazy imports
    best = float("inf")
    for _ in range(3):  # best of three rounds: the machine is shared
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def _stub_launches() -> None:
    import numasched.attention as A
    import numasched.gemm as G
    from numasched.kernels import attention_fwd as KA
    from numasched.kernels import gemm as KG

    always = lambda t: True  # noqa: E731
    A.kernel_device_ok = always
    G.kernel_device_ok = always
    KA.attn_fwd_kernel = _NoLaunch()
    KA.attn_fwd_autotuned = _NoLaunch()
    KG.gemm_kernel = _NoLaunch()
    cfg = KG.cpu_config(False)

    class _Tuned(_NoLaunch):
        best_config = cfg

    KG.tuned_kernel = lambda *a, **k: _Tuned()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m numasched.bench.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=1000, help="calls per round (best of 3 rounds)")
    p.add_argument("--gpu", action="store_true", help="real launches on the GPU (synchronised once per round)")
    p.add_argument("--quick", action="store_true", help="fewer calls")
    args = p.parse_args(argv)
    n = 200 if args.quick else args.n

    import torch

    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu needs a CUDA GPU", file=sys.stderr)
            return 2
        dev, dt = "cuda", torch.bfloat16
    else:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("unset TRITON_INTERPRET: the stubs stand in for compiled kernels", file=sys.stderr)
            return 2
        _stub_launches()
        dev, dt = "cpu", torch.float16

    import numasched
    import torch.nn.functional as F
    from numasched.attention import attention_forward

    torch.manual_seed(0)
    # Small shapes on both CPU and GPU: the kernels take a few microseconds, so the wall time per
    # call is the host's (checks, planning, Triton's launch), which is what this bench is about.
    q, k, v = (torch.randn(2, 4, 128, 64, device=dev, dtype=dt) for _ in range(3))
    a, b = torch.randn(256, 256, device=dev, dtype=dt), torch.randn(256, 256, device=dev, dtype=dt)
    cases = {}
    if args.gpu:   # decode: batch 1, 32/8 heads, 1k tokens (its kernels are not stubbed on CPU)
        qd = torch.randn(1, 32, 128, device=dev, dtype=dt)
        kd, vd = (torch.randn(1, 1024, 8, 128, device=dev, dtype=dt) for _ in range(2))
        cases["flash_decode"] = lambda: numasched.flash_decode(qd, kd, vd)
    cases.update({
        "attention_forward": lambda: attention_forward(q, k, v),
        "attention_forward causal": lambda: attention_forward(q, k, v, causal=True),
        "scaled_dot_product_attention": lambda: numasched.scaled_dot_product_attention(q, k, v),
        "matmul": lambda: numasched.matmul(a, b),
    })
    if args.gpu:   # the same calls through torch: the host cost a user compares against
        cases["torch sdpa (peer)"] = lambda: F.scaled_dot_product_attention(q, k, v)
        cases["torch.matmul (peer)"] = lambda: torch.matmul(a, b)
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)
    for name, fn in cases.items():
        us = _per_call_us(fn, n)
        sync()
        line = f"{name:34s} {us:8.1f} us/call ({'GPU, launches included' if args.gpu else 'CPU, no-op launch'})"
        if args.gpu:   # GPU time of one call (a CUDA-graph replay): wall time above it is host time
            from .common import graph_replay_ms

            line += f"; GPU time {graph_replay_ms(fn) * 1e3:.1f} us"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
