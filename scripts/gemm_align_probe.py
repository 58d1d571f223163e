"""Rows that are not whole 128-byte lines (issue 13, off the grid): how much of numasched's loss
to cuBLAS at such K comes from A's rows, how much from W's. Per shape, in CUDA graphs with a
copy of W per call (more than 2x the L2, as ``bench gemm_inference``), bf16, y = x @ W.T:
cuBLAS and numasched.matmul on (a) the plain operands, (b) x with its rows padded to a multiple
of 64 elements (a view of a wider buffer), (c) W padded the same way, (d) both. Same values in
every layout; each result checked against float64.
Run: python3 scripts/gemm_align_probe.py [MxNxK ...]"""
import math
import sys

import torch

SHAPES = ["128x7000x5000", "100x6000x4000", "200x8000x6000", "24x9000x3000", "16x6144x4104",
          "520x3072x4096", "600x5000x3000", "1000x3000x5000", "128x6144x4096", "128x7000x5056"]


def padded(t: torch.Tensor, mult: int = 64) -> torch.Tensor:
    """``t`` (rows, K) as a view of a (rows, K rounded up to ``mult``) buffer: the same values,
    every row starting on a 128-byte line (bf16)."""
    k = t.shape[1]
    buf = torch.zeros(t.shape[0], -(-k // mult) * mult, dtype=t.dtype, device=t.device)
    buf[:, :k] = t
    return buf[:, :k]


def main():
    import numasched
    from numasched.gemm_tune import graph_us

    shapes = sys.argv[1:] or SHAPES
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print("shape, layout: cuBLAS us, numasched us (schedule), cuBLAS / numasched", flush=True)
    for s in shapes:
        m, n, k = (int(v) for v in s.split("x"))
        copies = max(2, min(64, math.ceil(2 * l2 / (n * k * 2))))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        ref = x.double() @ ws[0].double().T
        xp, wsp = padded(x), [padded(w) for w in ws]
        for name, xa, wa in (("plain", x, ws), ("x padded", xp, ws), ("W padded", x, wsp), ("both", xp, wsp)):
            plan = numasched.plan_matmul(xa, wa[0].T, out=outs[0])
            outs[0].fill_(float("nan"))
            plan.run(xa, wa[0].T, outs[0])
            err = ((outs[0].double() - ref).norm() / ref.norm()).item()
            cub = graph_us(lambda i: torch.matmul(xa, wa[i].T, out=outs[i]), copies, 20)
            ours = graph_us(lambda i: plan.run(xa, wa[i].T, outs[i]), copies, 20)
            desc = plan.schedule.describe() if plan.schedule is not None else plan.kernel
            print(f"{s}, {name}: {cub:.1f}, {ours:.1f} ({desc}), {cub / ours:.3f}; err {err:.1e}", flush=True)
        del ws, wsp, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
