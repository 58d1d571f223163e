"""GEMM + all-reduce at large M: the fused kernel against its parts, CUDA-graph replays.

For each (M, N, K_local): torch.matmul and numasched.matmul alone, numasched's all-reduce alone,
bulk (cuBLAS + NCCL), impl="fused" (matmul_all_reduce_kernel: every program pushes each tile to
the peers after its K loop, sums a tile later) and the same kernel with its pushes into its own
heap and no waits (``communicate=False``, timing only: the kernel's time without the exchange),
and (the default tiles) with its pushes to the peer but no waits (``communicate="nowait"``,
timing only: the exchange's traffic without its synchronisation).
Each fused config in TILES (the default's 128 x 256 tiles, 128 x 128 tiles two programs per SM,
128 x 128 with 8 warps) is timed, and checked against bulk's result (eighteenth session, two
H100s: the default fastest at every shape; bench/results/tp2-s18/mar-sweep-tp2-h100.log). The seventeenth session's variants (dedicated
communication programs, pushes spread over the next K loop) ran slower: bench/results/mar-s17/.
Run: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/mar_sweep.py
MAR_SHAPES ("MxNxK_local,...") overrides the grid below; MAR_GROUPS ("0,8") times the WS kernel's
tiles row by row and in groups of tile rows (options.fused_ws_group)."""
import importlib
import os

import torch
import torch.distributed as dist

import numasched
import numasched.distributed as nd
from numasched import options
from numasched.bench.common import init_rank, sweep_timer
from numasched.distributed._common import run

mar = importlib.import_module("numasched.distributed.matmul_all_reduce")
TILE0 = mar.FUSED_BIG_TILE
# (column, the fused kernel's big-tile config): the default, and 128 x 128 tiles two per SM
TILES = [("fused", TILE0),
         ("fused_128x128x2", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, per_sm=2)),
         ("fused_128x128x1", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, per_sm=1)),
         ("fused_nolag", dict(TILE0, LAG=False, PAIRS=False)),   # each tile summed right after its push (two ranks)
         ("fused_lag", dict(TILE0, LAG=True, PAIRS=False)),   # summed a tile later (one-shot, before PAIRS)
         ("fused_s4", dict(TILE0, num_stages=4)),   # four TMA loads in flight (196 KB of shared memory)
         ("fused_noflat", dict(TILE0, FLAT=False)),   # a K loop per tile (before the twenty-sixth session)
         ("fused_tmapush", dict(TILE0, TMA_PUSH=True)),   # FLAT's pushes as TMA stores
         ("fused_ws", dict(TILE0, WS=True))]   # the pairs on the warp-specialised Gluon kernel
if os.environ.get("MAR_TILES"):   # e.g. MAR_TILES=fused,fused_nolag
    TILES = [t for t in TILES if t[0] in os.environ["MAR_TILES"].split(",")]
SHAPES = [(1024, 4096, 2048), (4096, 4096, 2048), (4096, 4096, 7168), (16384, 4096, 2048), (2048, 5120, 12800)]
if os.environ.get("MAR_SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["MAR_SHAPES"].split(",")]


def main():
    R, W = init_rank()
    ctx = nd.init(heap_bytes=40 << 30, timeout_s=30.0)
    for M, N, K in SHAPES:
        torch.manual_seed(R + 7)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        b = w.T   # an F.linear weight's view, as the TP layers pass it
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = nd.matmul_all_reduce(a, b, ctx=ctx, impl="bulk").double()
        line = [f"{M}x{N}x{K}"]
        timed = sweep_timer(ctx, out, ref, line)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        timed("cublas", lambda: torch.matmul(a, b, out=c))
        timed("ns_gemm", lambda: numasched.matmul(a, b, out=c))
        timed("ar", lambda: nd.all_reduce(c, ctx=ctx, out=c, check=False))
        timed("bulk", lambda: nd.matmul_all_reduce(a, b, ctx=ctx, impl="bulk", out=out, check=False))
        for name, tile in TILES:
            mar.FUSED_BIG_TILE = tile   # read when a call is described: each config its own plan
            timed(name, lambda: run(ctx, "matmul_all_reduce", a, b, out=out, check=False),
                  lambda: run(ctx, "matmul_all_reduce", a, b, out=out))
            timed(f"{name}_noremote", lambda: run(ctx, "matmul_all_reduce", a, b, out=out, check=False,
                                                  communicate=False))
            if name == "fused":   # the FLAT pairs pushing to the peer without waiting for its data
                timed(f"{name}_nowait", lambda: run(ctx, "matmul_all_reduce", a, b, out=out, check=False,
                                                    communicate="nowait"))
        # MAR_GROUPS ("0,8"): the WS kernel with its tiles row by row / in groups of tile rows
        # (options.fused_ws_group)
        for g in [int(g) for g in os.environ.get("MAR_GROUPS", "").split(",") if g.strip()]:
            mar.FUSED_BIG_TILE = dict(TILE0, WS=True)
            with options.use(fused_ws_group=g):
                timed(f"fused_ws_g{g}", lambda: run(ctx, "matmul_all_reduce", a, b, out=out, check=False),
                      lambda: run(ctx, "matmul_all_reduce", a, b, out=out))
        mar.FUSED_BIG_TILE = TILE0
        if R == 0:
            print(" | ".join(line), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
