"""A linear layer with its bias and residual add, y = x @ W.T + b + h, side by side in CUDA graphs:
torch (cuBLAS's addmm, then the residual add: two kernels), numasched.matmul with the epilogue in
the warp-specialised kernel (the chooser's pick, options.gemm_ws on), the same with the Triton
kernels only (gemm_ws off: where biased linears went before the WS epilogue), and numasched
without bias or residual (the epilogue's own cost). Each call reads its own copy of W (more than
twice the L2), as a model's layers do. With --parts, the WS kernel also runs with the bias only
and the residual only (which of the two costs the time). bf16, one GPU.

Run: python3 scripts/ws_epilogue_bench.py [--shapes MxNxK,...] [--calls 20]"""
from __future__ import annotations

import argparse
import math

# the inference grid's WS rows (from 129 rows) and a few off it
SHAPES = ("512x6144x4096,512x4096x14336,1024x4096x4096,1024x14336x8192,4096x4096x4096,2048x5120x5120,"
          "300x5120x12800,777x3001x2056,256x25600x5120,140x10240x6896")


def main(argv=None) -> int:
    import torch

    import numasched
    from numasched import options
    from numasched.argtypes import shape_list
    from numasched.gemm_tune import graph_us, linear_operands

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=shape_list, default=shape_list(SHAPES))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--parts", action="store_true", help="also time the WS kernel with the bias only and the residual only")
    args = p.parse_args(argv)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'M x N x K':>20} {'torch':>8} {'ws+epi':>8} {'triton+epi':>10} {'ws plain':>8} "
          f"{'torch/ws':>8} {'triton/ws':>9}" + (f" {'ws+bias':>8} {'ws+res':>8}" if args.parts else "")
          + "  pick with the epilogue")
    ratios = []
    for M, N, K in args.shapes:
        x, ws, outs, _, copies = linear_operands(M, N, K)
        bias = torch.randn(N, device="cuda", dtype=x.dtype)
        res = torch.randn(M, N, device="cuda", dtype=x.dtype)
        both = dict(bias=bias, residual=res)
        row = {}
        row["torch"] = graph_us(lambda i: torch.add(torch.nn.functional.linear(x, ws[i], bias), res, out=outs[i]),
                                copies, args.calls)
        picks = {}
        runs = [("ws+epi", True, both), ("triton+epi", False, both)]
        if args.parts:
            runs += [("ws+bias", True, dict(bias=bias)), ("ws+res", True, dict(residual=res))]
        for name, gemm_ws, kw in runs:
            with options.use(gemm_ws=gemm_ws):
                plan = numasched.plan_matmul(x, ws[0].T, outs[0], **kw)
                outs[0].fill_(float("nan"))
                plan.run(x, ws[0].T, outs[0], **kw)
                want = x.double() @ ws[0].double().T + sum(t.double() for t in kw.values())
                err = ((outs[0].double() - want).abs().max() / want.abs().max()).item()
                if not err < 1e-2:
                    raise AssertionError(f"{M}x{N}x{K} {name}: relative error {err:.2e}")
                row[name] = graph_us(lambda i, plan=plan, kw=kw: plan.run(x, ws[i].T, outs[i], **kw),
                                     copies, args.calls)
                picks[name] = plan.schedule.describe() if plan.schedule is not None else plan.kernel
        plain = numasched.plan_matmul(x, ws[0].T, outs[0])
        row["ws plain"] = graph_us(lambda i: plain.run(x, ws[i].T, outs[i]), copies, args.calls)
        ratios.append(row["torch"] / row["ws+epi"])
        print(f"{f'{M} x {N} x {K}':>20} {row['torch']:8.1f} {row['ws+epi']:8.1f} {row['triton+epi']:10.1f} "
              f"{row['ws plain']:8.1f} {row['torch'] / row['ws+epi']:8.3f} {row['triton+epi'] / row['ws+epi']:9.3f}"
              + (f" {row['ws+bias']:8.1f} {row['ws+res']:8.1f}" if args.parts else "") +
              f"  {picks['ws+epi']} (gemm_ws off: {picks['triton+epi']})", flush=True)
        del ws, outs
    g = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"torch (addmm + add) / numasched with the epilogue: geomean {g:.3f} over {len(ratios)} shapes, "
          f">= 1.00 at {sum(r >= 1.0 for r in ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
