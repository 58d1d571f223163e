"""Split-K merge probe (GPU, issue 13): the in-kernel ticket merge against a merge kernel of its
own under PDL (``gemm_splitk_kernel`` with MERGE=1, then ``gemm_splitk_reduce_kernel``), and
cuBLAS, at the medium-M shapes where the model picks split-K. Each timing is a CUDA graph of
``--calls`` calls back to back (the decode step's pattern), per call; the two merges must give
the same bits (both sum the parts in split order).

    python scripts/splitk_merge_probe.py
    python scripts/splitk_merge_probe.py --shapes 128x4096x4096 256x4096x14336 --splits 2 3 4
"""
import argparse
import sys

import torch

import numasched
from numasched.kernels import gemm_splitk as KS

SHAPES = ["128x4096x4096", "128x2560x8192", "128x5120x5120", "128x4096x14336", "128x6144x4096",
          "256x4096x14336", "256x5120x12800", "64x4096x14336", "32x5120x12800", "97x3001x1537"]
REDUCE_BLOCK = (32, 128)


def graph_us(fn, calls: int, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def kernel_merge(plan, a, b, out):
    """The plan's split kernel with MERGE=1, then the reduce kernel (both PDL where the plan's
    launch uses it)."""
    launch = plan._launch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from numasched._launch import HostDesc

    args = [TensorDescriptor(x.base, x.shape, x.strides, x.block_shape) if isinstance(x, HostDesc) else x
            for x in plan._args_for(a, b, out, None, None, False)]
    ws = args[5]
    kw = dict(launch.kwargs, MERGE=1)
    pdl = kw.get("launch_pdl", False)
    bm, bn = kw["BLOCK_M"], kw["BLOCK_N"]
    nm, nn = -(-plan.M // bm), -(-plan.N // bn)
    grid = launch.grid[:1]
    rm, rn = REDUCE_BLOCK
    rgrid = (-(-plan.M // rm), -(-plan.N // rn))
    extra = dict(launch_pdl=True) if pdl else {}

    def run():
        KS.gemm_splitk_kernel[grid](*args, **kw)
        KS.gemm_splitk_reduce_kernel[rgrid](ws, out, out, out, plan.M, plan.N, nn * bn, nm * bm * nn * bn,
                                            out.stride(0), out.stride(1), 0, 0, SPLIT_K=plan.split_k,
                                            BLOCK_M=rm, BLOCK_N=rn, HAS_BIAS=False, HAS_RES=False,
                                            PDL=1 if pdl else 0, num_warps=4, **extra)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="MxNxK (B = W.T as F.linear has it)")
    p.add_argument("--splits", type=int, nargs="*", default=[], help="also these split counts (the model's tile)")
    p.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print("shape | schedule | ticket us | merge kernel us | cuBLAS us | kernel/ticket speedup | cuBLAS/best")
    for text in args.shapes:
        M, N, K = (int(x) for x in text.split("x"))
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        b = w.T
        t_cublas = graph_us(lambda: torch.matmul(a, b), args.calls)
        base = numasched.plan_matmul(a, b)
        plans = [(None, base)]
        if base.kernel == "splitk" and base.schedule is not None and not base.tail_whole_tiles:
            plans += [(s, numasched.plan_matmul(a, b, schedule=base.schedule, split_k=s)) for s in args.splits
                      if s != base.split_k]
        for s, plan in plans:
            name = f"{plan.kernel} {plan.schedule}" + (f" split {s}" if s else "")
            if plan.kernel != "splitk" or plan.split_k < 2 or plan.tail_whole_tiles:
                t = graph_us(lambda: plan.run(a, b), args.calls)
                print(f"{text} | {name} | {t:.2f} | - | {t_cublas:.2f} | - | {t_cublas / t:.3f}", flush=True)
                continue
            out_t = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            out_k = torch.empty_like(out_t)
            t_ticket = graph_us(lambda: plan.run(a, b, out=out_t), args.calls)
            run_k = kernel_merge(plan, a, b, out_k)
            t_kernel = graph_us(run_k, args.calls)
            out_k.fill_(float("nan"))
            run_k()
            torch.cuda.synchronize()
            same = torch.equal(out_k, out_t)
            print(f"{text} | {name} | {t_ticket:.2f} | {t_kernel:.2f} | {t_cublas:.2f} | {t_ticket / t_kernel:.3f} | "
                  f"{t_cublas / min(t_ticket, t_kernel):.3f}{'' if same else ' | RESULTS DIFFER'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
