"""The TP prefill's elementwise kernels against the streaming read (one GPU, CUDA-graph replays).

bench e2e's elementwise component (Llama-3-8B, TP 2, 4096 tokens: 7.6 ms of a 57-61 ms step on
two H100s) is the model's torch.compile'd kernels. This times each alone at a prefill size, with
the bytes it must move (read + write) and the fraction of the measured streaming read that makes:
where a kernel is far from it, a fused hand-written one could pay; where it is close, not.

    add_rms_norm   h + y, then RMSNorm (the residual add + next norm, twice a layer)
    rms_norm       RMSNorm alone
    qkv_rope       split the QKV projection, rotate q and k
    cache_write    k, v into a paged cache (numasched's qkv_rope_cache does both in one launch)
    silu_mul       silu(gate) * up (fused into the gate/up GEMM at prefill sizes since this session)

Run: python3 scripts/prefill_elementwise_probe.py [--rows 4096] [--tp 2]
"""
import argparse

import torch

from numasched.bench.common import graph_replay_ms, stream_read_bw
from numasched.models.llama import CompiledElementwise, add_rms_norm, qkv_rope, rms_norm, silu_mul


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1024,4096")
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    E, D, HQ, HK, I = 4096, 128, 32 // args.tp, 8 // args.tp, 14336 // args.tp   # Llama-3-8B
    bw = stream_read_bw()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} streaming read {bw / 1e12:.2f} TB/s",
          flush=True)
    ops = {n: CompiledElementwise(f) for n, f in (("add_rms_norm", add_rms_norm), ("rms_norm", rms_norm),
                                                  ("qkv_rope", qkv_rope), ("silu_mul", silu_mul))}
    for T in [int(v) for v in args.rows.split(",")]:
        h, y = (torch.randn(T, E, device=dev, dtype=dt) for _ in range(2))
        w = torch.randn(E, device=dev, dtype=dt)
        qkv = torch.randn(T, (HQ + 2 * HK) * D, device=dev, dtype=dt)
        pos = torch.arange(T, device=dev, dtype=torch.float32)[:, None] / 10000 ** (
            torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D)
        emb = torch.cat((pos, pos), -1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        gu = torch.randn(T, 2 * I, device=dev, dtype=dt)
        kc = torch.empty(T // 16 + 1, 16, HK, D, device=dev, dtype=dt)
        vc = torch.empty_like(kc)
        k, v = torch.randn(T, HK, D, device=dev, dtype=dt), torch.randn(T, HK, D, device=dev, dtype=dt)
        slots = torch.arange(T, device=dev)
        e = 2   # bytes per element
        cases = {
            "add_rms_norm": (lambda: ops["add_rms_norm"](y, h, w, 1e-5), 4 * T * E * e),
            "rms_norm": (lambda: ops["rms_norm"](h, w, 1e-5), 2 * T * E * e),
            "qkv_rope": (lambda: ops["qkv_rope"](qkv, cos, sin, HQ, HK, D, None, None, 1e-5), 2 * qkv.numel() * e),
            "cache_write": (lambda: (kc.view(-1, HK, D).index_copy_(0, slots, k),
                                     vc.view(-1, HK, D).index_copy_(0, slots, v)), 4 * k.numel() * e),
            "silu_mul": (lambda: ops["silu_mul"](gu, I), 3 * T * I * e),
        }
        for name, (fn, nbytes) in cases.items():
            us = graph_replay_ms(fn) * 1e3
            print(f"T {T} {name:13s} {us:8.1f} us  {nbytes / 1e6:7.1f} MB  {nbytes / us / 1e3:6.0f} GB/s  "
                  f"{nbytes / us / 1e-6 / bw:.2f} of the streaming read", flush=True)


if __name__ == "__main__":
    main()
