"""Does a decode GEMM that streams its weights before its PDL wait gain behind a latency-bound
kernel? (GPU, sm_90; a probe for issue 14's decode step, not a test.)

In a TP decode step the QKV and gate/up GEMMs follow the all-reduce + add + norm, about 7 us of
NVLink round trip during which HBM is idle. A "spin" kernel stands in for it: ``--spin-programs``
programs of 4 warps (16: the all-reduce + norm's one row a program at batch 16) let the next kernel
launch at once, wait for the kernel before them, then wait ``--spin-us`` on the global timer. They
take no shared memory, so the GEMM's early programs (about 200 KB of it each) find room on every
SM; a real kernel that holds shared memory on many SMs would leave fewer of them room. After it
the GEMM, PDL-launched:

* ``numasched``: numasched.matmul / matmul_swiglu (the Triton split-K kernel: its loads after the wait);
* ``weight-first``: kernels/gemm_weight_first.py, its first ring stages' weight boxes before the
  wait (``pdl=1``);
* ``weight-first, after``: the same kernel with every box after the wait (the A/B of the order);
* ``weight-first, early 2``: two ring stages' weight boxes before the wait, the rest after (less
  of the memory bus taken while the kernel before runs; the spin does not feel it, an all-reduce
  + norm may).

A chain of ``--layers`` (spin, GEMM) pairs with a distinct weight each (none left in L2 by the
pair before), in one CUDA graph: us per pair, and each GEMM alone (a chain of GEMMs) and the spin
alone. Each form's output is checked against torch on the first layer first.

    python scripts/weight_first_probe.py [--layers 16] [--spin-us 7]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import numasched
from numasched.bench.common import bench_fixed_ms, capture, warm_up_for_capture
from numasched.gemm_weight_first import WeightFirstPlan


@triton.jit
def _spin(flag_ptr, spin_ns):
    gdc_launch_dependents()
    gdc_wait()
    t0 = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - t0 < spin_ns:
        pass
    tl.store(flag_ptr + tl.program_id(0), 1)


def run(M, N, K, glu, layers, spin_us, spin_programs=16):
    dev, dt = "cuda", torch.bfloat16
    rows = 2 * N if glu else N
    ws = [torch.randn(rows, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(layers)]
    x = torch.randn(M, K, device=dev, dtype=dt)
    outs = [torch.empty(M, N, device=dev, dtype=dt) for _ in range(layers)]
    flag = torch.zeros(spin_programs, device=dev, dtype=torch.int32)
    plans = {"weight-first": [WeightFirstPlan(x, w, glu=glu, pdl=1) for w in ws],
             "weight-first, after": [WeightFirstPlan(x, w, glu=glu, pdl=1, early=0) for w in ws],
             "weight-first, early 2": [WeightFirstPlan(x, w, glu=glu, pdl=1, early=2) for w in ws]}

    def gemm(form, i):
        if form == "numasched":
            if glu:
                numasched.matmul_swiglu(x, ws[i].t(), out=outs[i])
            else:
                numasched.matmul(x, ws[i].t(), out=outs[i])
        else:
            plans[form][i].run(x, ws[i], outs[i])

    ref = x.double() @ ws[0].double().t()
    if glu:
        ref = ref[:, :N] * torch.sigmoid(ref[:, :N]) * ref[:, N:]
    errs = {}
    for form in ("numasched", *plans):
        outs[0].fill_(float("nan"))
        gemm(form, 0)
        torch.cuda.synchronize()
        errs[form] = ((outs[0].double() - ref).abs().max() / ref.abs().max()).item()

    def chain(form, spin=True):
        def f():
            for i in range(layers):
                if spin:
                    _spin[(spin_programs,)](flag, int(spin_us * 1000), num_warps=4)
                if form:
                    gemm(form, i)
        return f

    def t(f):
        warm_up_for_capture(f, 2)
        return bench_fixed_ms(capture(f).replay, warmup=3, iters=20) * 1e3 / layers

    res = {"spin alone": t(chain(None))}
    for form in ("numasched", *plans):
        res[f"{form} alone"] = t(chain(form, spin=False))
        res[f"spin + {form}"] = t(chain(form))
    return res, errs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--spin-us", type=float, default=7.0)
    ap.add_argument("--spin-programs", type=int, default=16)
    ap.add_argument("--shapes", default="16x3072x4096,16x7168x4096glu,16x4096x2048,16x4096x7168,"
                                        "1x3072x4096,1x7168x4096glu,4x3072x4096",
                    help="MxNxK[glu] (glu: the gate/up form, N output columns from a 2N-row weight)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}; spin {args.spin_us} us on {args.spin_programs} programs, "
          f"{args.layers} layers; us per pair "
          "(the GEMM's weights all different)")
    for spec in args.shapes.split(","):
        glu = spec.endswith("glu")
        M, N, K = (int(v) for v in spec.removesuffix("glu").split("x"))
        r, errs = run(M, N, K, glu, args.layers, args.spin_us, args.spin_programs)
        mb = (2 if glu else 1) * N * K * 2 / 2**20
        print(f"--- M {M} N {N} K {K}{' (SwiGLU)' if glu else ''}: weight {mb:.1f} MB; rel. error "
              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        base = r["spin + numasched"]
        for k, v in r.items():
            print(f"  {k:32s} {v:8.2f} us  ({base - v:+.2f} vs spin + numasched)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
