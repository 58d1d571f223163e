"""GEMM + reduce-scatter of two ranks at large M: the fused kernels against their parts, CUDA-graph
replays (issue 14: >= 1.2x bulk-synchronous where overlap pays).

For each (M, N, K_local) (M: both slices' rows): torch.matmul and numasched.matmul alone on the
whole (M, K_local) A (the work of one rank), the WS GEMM alone in the fused kernel's tiles
(128 x 256, three stages), bulk (cuBLAS + NCCL), torch symm_mem, and the fused reduce-scatter on
the warp-specialised kernel (kernels/dist_gemm_ar_ws.py, RS) in both tile orders (pairs; one list,
the peer's tiles first), with and without ``options.fused_rs_early`` (the flag raised and the peer's
partial fetched inside the K loop), a slice's tiles row by row or in groups of 8 tile rows
(RS_TRITON=1: the Triton kernel too), and auto. Every fused form is checked against bulk's result
(out poisoned before); the last column is bulk's time over each form's, the WS GEMM's and auto's.
Run: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/rs_ws_sweep.py
RS_SHAPES ("MxNxK_local,...") overrides the grid; RS_REPEAT repeats it (the order of the fused
forms alternates)."""
import os

import torch
import torch.distributed as dist

import numasched
import numasched.distributed as nd
from numasched import options
from numasched.bench.common import init_rank, sweep_timer
from numasched.gemm import plan_matmul
from numasched.gemm_schedule import Schedule

# Llama-3-8B down (K 14336 / 2, N 4096), Qwen3-32B o (8192 / 2, 5120) and down (25600 / 2, 5120)
SHAPES = [(2048, 4096, 7168), (4096, 4096, 7168), (16384, 4096, 7168), (4096, 5120, 4096), (16384, 5120, 4096),
          (16384, 5120, 12800)]
if os.environ.get("RS_SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["RS_SHAPES"].split(",")]
# (name, options): the tile order (fused_rs_pairs; None: the default's rule), the tiles row by row or
# in groups of 8 tile rows (fused_ws_group), the early flag
FORMS = [("ws_rows", dict(fused_ws=True, fused_rs_early=False, fused_ws_group=0)),
         ("ws", dict(fused_ws=True, fused_rs_early=False, fused_ws_group=8)),
         ("ws_early", dict(fused_ws=True, fused_rs_early=True, fused_ws_group=8)),
         ("ws_list_early", dict(fused_ws=True, fused_rs_early=True, fused_ws_group=8, fused_rs_pairs=False))]
if os.environ.get("RS_TRITON"):
    FORMS.insert(0, ("fused_triton", dict(fused_ws=False)))
WS_GEMM = Schedule.parse("ws 128x256x64 w4 s3 persistent")


def main():
    R, W = init_rank()
    ctx = nd.init(heap_bytes=40 << 30, timeout_s=30.0)
    for rep in range(int(os.environ.get("RS_REPEAT", "1"))):
        for M, N, K in SHAPES:
            torch.manual_seed(R + 11)
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            b = w.T   # an F.linear weight's view, as the TP layers pass it
            out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
            ref = nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="bulk").double()
            line = [f"{M}x{N}x{K}"]
            res = {}
            timed = sweep_timer(ctx, out, ref, line, res)
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            timed("cublas", lambda: torch.matmul(a, b, out=c))
            timed("ns_gemm", lambda: numasched.matmul(a, b, out=c))
            ws_plan = plan_matmul(a, b, c, schedule=WS_GEMM)
            timed("ws_gemm", lambda: ws_plan.run(a, b, c))
            timed("bulk", lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="bulk", out=out, check=False))
            timed("symm", lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="symm_mem", out=out, check=False))
            forms = FORMS if rep % 2 == 0 else FORMS[::-1]
            for name, opts in forms:
                with options.use(**opts):
                    timed(name, lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="fused", out=out, check=False),
                          lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="fused", out=out))
            timed("auto", lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, out=out, check=False))
            if "bulk" in res:
                named = ["ws_gemm"] + [name for name, _ in forms] + ["auto"]
                line.append("bulk/x: " + " ".join(f"{k} {res['bulk'] / res[k]:.3f}" for k in named if k in res))
            if R == 0:
                print(" | ".join(line), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
