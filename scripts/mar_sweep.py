"""GEMM + all-reduce at large M: the fused kernels against their parts, CUDA-graph replays.

For each (M, N, K_local): torch.matmul and numasched.matmul alone, numasched's all-reduce alone,
bulk (cuBLAS + NCCL), impl="fused" with the GEMM programs pushing their own tiles
(matmul_all_reduce_kernel: at once after each K loop, and DEFER: a few rows per K step of the
next tile; each also with its pushes into its own heap, ``_noremote``: the time without the
remote stores) and with COMM dedicated communication programs
(matmul_all_reduce_cs_kernel, one column per count, and the same kernel with its communication
off: the GEMM programs' time alone). Every fused result is checked against bulk's.
Run: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/mar_sweep.py
MAR_SHAPES ("MxNxK_local,...") and MAR_COMM ("programs/group,...") override the grids below."""
import importlib
import os

import torch
import torch.distributed as dist

import numasched
import numasched.distributed as nd
from numasched.bench.common import bench_fixed_ms, init_rank, warm_up_for_capture
from numasched.distributed._common import run

mar = importlib.import_module("numasched.distributed.matmul_all_reduce")
DEFER0, REL0 = mar.FUSED_DEFER_PUSH, mar.FUSED_REL32
# (column, DEFER, REL32) of the self-pushing kernel
VARIANTS = [("fused_push64", False, False), ("fused_push", False, True), ("fused_defer", True, True)]

SHAPES = [(1024, 4096, 2048), (4096, 4096, 2048), (4096, 4096, 7168), (16384, 4096, 2048), (2048, 5120, 12800)]
COMM = [(32, 1)]   # (communication programs, tiles between fences)
if os.environ.get("MAR_SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["MAR_SHAPES"].split(",")]
if os.environ.get("MAR_COMM"):
    COMM = [] if os.environ["MAR_COMM"] == "none" else [tuple(int(f) for f in v.split("/"))
                                                        for v in os.environ["MAR_COMM"].split(",")]


def main():
    R, W = init_rank()
    ctx = nd.init(heap_bytes=40 << 30, timeout_s=30.0)

    def graph_us(fn, calls=3):
        warm_up_for_capture(fn, 2)
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
        dist.barrier()
        us = bench_fixed_ms(g.replay, warmup=3, iters=10) * 1e3 / calls
        x = torch.tensor([us], device="cuda")
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x)

    for M, N, K in SHAPES:
        torch.manual_seed(R + 7)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        b = w.T   # an F.linear weight's view, as the TP layers pass it
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = nd.matmul_all_reduce(a, b, ctx=ctx, impl="bulk").double()
        line = [f"{M}x{N}x{K}"]

        def timed(name, fn, check=None):
            try:
                t = graph_us(fn)
                ctx.check("sweep")
                err = ""
                if check is not None:
                    out.fill_(float("nan"))
                    got = check()
                    torch.cuda.synchronize()
                    err = f" err {((got.double() - ref).norm() / ref.norm()).item():.1e}"
                line.append(f"{name} {t:.1f}{err}")
            except Exception as e:  # noqa: BLE001
                line.append(f"{name} ERR {type(e).__name__}: {str(e)[:80]}")

        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        timed("cublas", lambda: torch.matmul(a, b, out=c))
        timed("ns_gemm", lambda: numasched.matmul(a, b, out=c))
        timed("ar", lambda: nd.all_reduce(c, ctx=ctx, out=c, check=False))
        timed("bulk", lambda: nd.matmul_all_reduce(a, b, ctx=ctx, impl="bulk", out=out, check=False))
        for name, defer, rel32 in VARIANTS:
            # read when a call is described: each setting its own plan
            mar.FUSED_DEFER_PUSH, mar.FUSED_REL32 = defer, rel32
            timed(name, lambda: run(ctx, "matmul_all_reduce", a, b, out=out, check=False),
                  lambda: run(ctx, "matmul_all_reduce", a, b, out=out))
            # the same kernel with its pushes into our own heap: its time without remote stores
            timed(f"{name}_noremote", lambda: run(ctx, "matmul_all_reduce", a, b, out=out, check=False,
                                                  communicate=False))
        mar.FUSED_DEFER_PUSH, mar.FUSED_REL32 = DEFER0, REL0
        for cp, gr in COMM:
            kw = dict(comm=cp, group=gr)
            timed(f"cs{cp}/g{gr}", lambda kw=kw: run(ctx, "matmul_all_reduce_cs", a, b, out=out, check=False, **kw),
                  lambda kw=kw: run(ctx, "matmul_all_reduce_cs", a, b, out=out, **kw))
        if R == 0:
            print(" | ".join(line), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
