"""Does asking a decode GEMM's weights into L2 during a latency-bound kernel before it pay?
(GPU, sm_90+; a probe for issue 14's decode step, not a test.)

In a TP decode step the GEMM after each all-reduce waits ~5-7 us for an NVLink round trip during
which HBM is idle. The probe stands in a "spin" kernel for that all-reduce: one program waits
``--spin-us`` on the global timer; with ``PF`` programs it also issues
``cp.async.bulk.prefetch.L2`` for the first ``budget`` bytes of the next GEMM's weight (before its
wait, as the real kernel would). Then the GEMM (numasched.matmul, PDL-launched as in the model).
A chain of ``--layers`` (spin, GEMM) pairs with a distinct weight each (so no weight is left in L2
from the layer before), in one CUDA graph; us per pair, and the spin kernel and GEMM alone.

    python scripts/l2_prefetch_probe.py [--layers 16] [--spin-us 6]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import numasched
from numasched.bench.common import bench_fixed_ms, capture, warm_up_for_capture
from numasched.kernels.pdl import prefetch_l2


@triton.jit
def _spin_prefetch(flag_ptr, pf_ptr, pf_bytes, spin_ns, CHUNK: tl.constexpr, LANES: tl.constexpr,
                   PF: tl.constexpr):
    p = tl.program_id(0)
    gdc_launch_dependents()
    if PF:
        # program p asks for chunks p, p + P, ... of the first pf_bytes (CHUNK bytes each)
        P = tl.num_programs(0)
        nchunks = tl.cdiv(pf_bytes, CHUNK)
        for c0 in range(p * LANES, nchunks, P * LANES):
            c = c0 + tl.arange(0, LANES)
            off = c.to(tl.int64) * CHUNK
            nb = tl.minimum(pf_bytes - off, CHUNK).to(tl.int32)
            prefetch_l2(pf_ptr + off, nb, c < nchunks)
    gdc_wait()
    if p == 0:
        t0 = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - t0 < spin_ns:
            pass
        tl.store(flag_ptr, 1)


def run(M, N, K, layers, spin_us, budgets, pf_progs, chunk):
    dev = "cuda"
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    res = {}

    def chain(budget, progs, spin=True, gemm=True):
        def f():
            for i in range(layers):
                if spin:
                    _spin_prefetch[(progs if budget else 1,)](flag, ws[i], budget, int(spin_us * 1000),
                                                              CHUNK=chunk, LANES=16, PF=bool(budget), num_warps=1)
                if gemm:
                    numasched.matmul(x, ws[i].t(), out=outs[i])
        return f

    def t(f):
        warm_up_for_capture(f, 2)
        return bench_fixed_ms(capture(f).replay, warmup=3, iters=20) * 1e3 / layers

    res["spin alone"] = t(chain(0, 1, gemm=False))
    res["gemm alone"] = t(chain(0, 1, spin=False))
    res["spin + gemm"] = t(chain(0, 1))
    for b in budgets:
        bb = min(int(b * 2**20), N * K * 2) // 16 * 16
        for progs in pf_progs:
            res[f"spin(pf {bb / 2**20:.0f} MB, {progs} progs) + gemm"] = t(chain(bb, progs))
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--spin-us", type=float, default=6.0)
    ap.add_argument("--chunk", type=int, default=32768, help="bytes per prefetch instruction")
    ap.add_argument("--budgets", default="8,16,24", help="MB of the weight asked into L2, comma-separated")
    ap.add_argument("--progs", default="16,66,132", help="programs that issue the prefetches")
    ap.add_argument("--shapes", default="4x3072x4096,16x3072x4096,4x4096x2048,4x14336x4096,16x14336x4096,4x4096x7168")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    print(f"{torch.cuda.get_device_name(0)}; spin {args.spin_us} us, chunk {args.chunk} B, {args.layers} layers; "
          "us per (spin, gemm) pair")
    for M, N, K in shapes:
        wmb = N * K * 2 / 2**20
        r = run(M, N, K, args.layers, args.spin_us, budgets=[float(b) for b in args.budgets.split(",")],
                pf_progs=[int(p) for p in args.progs.split(",")], chunk=args.chunk)
        base = r["spin + gemm"]
        print(f"--- M {M} N {N} K {K} (weight {wmb:.1f} MB)")
        for k, v in r.items():
            print(f"  {k:42s} {v:8.2f} us  ({base - v:+.2f} vs spin + gemm)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
