"""All-reduce config sweep (chunk size, warps, programs per SM) against NCCL and torch symm_mem,
CUDA-graph replays, to set numasched.distributed.all_reduce's config and the cost model's
constants. Run: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/ar_sweep.py
AR_SIZES (bytes) and AR_CONFIGS ("chunk_bytes/warps/per_sm[/bulk],...") override the grids below;
bulk 1 runs each stage over all of a program's chunks before one signal (the kernel's BULK).
The copy-engine two-shot (impl="ce") is timed once per size."""
import os

import torch
import torch.distributed as dist

import numasched.distributed as nd
from numasched.bench.common import dist_graph_us, init_rank

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CONFIGS = [(16384, 8, 1), (32768, 8, 1), (16384, 8, 2), (8192, 4, 2), (65536, 16, 1), (32768, 8, 2)]
if os.environ.get("AR_SIZES"):
    SIZES = [int(v) for v in os.environ["AR_SIZES"].split(",")]
if os.environ.get("AR_CONFIGS"):
    CONFIGS = [tuple(int(f) for f in c.split("/")) for c in os.environ["AR_CONFIGS"].split(",")]


def main():
    R, W = init_rank()
    ctx = nd.init(heap_bytes=48 << 30, timeout_s=30.0)
    group = dist.group.WORLD.group_name
    from torch.distributed import _symmetric_memory as symm_mem

    graph_us = dist_graph_us

    for nbytes in SIZES:
        n = nbytes // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        line = [f"{nbytes >> 10} KiB"]
        nb = x.clone()
        line.append(f"nccl {graph_us(lambda: dist.all_reduce(nb)):.1f}")
        sb = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(sb, group)
        sb.copy_(x)
        line.append(f"symm2 {graph_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(sb, 'sum', group)):.1f}")
        ob = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        line.append(f"symm1 {graph_us(lambda: torch.ops.symm_mem.one_shot_all_reduce_out(sb, 'sum', group, ob)):.1f}")
        try:
            line.append(f"ce {graph_us(lambda: nd.all_reduce(x, ctx=ctx, impl='ce', out=out, check=False)):.1f}")
            ctx.check("sweep")
        except Exception as e:  # noqa: BLE001
            line.append(f"ce ERR {type(e).__name__}")
        for block_bytes, warps, per_sm, *rest in CONFIGS:
            bulk = bool(rest and rest[0])
            config = dict(BLOCK=block_bytes // 2, num_warps=warps, programs_per_sm=per_sm, BULK=bulk)
            name = f"{block_bytes >> 10}k/w{warps}/x{per_sm}{'/bulk' if bulk else ''}"
            for impl in ("oneshot", "twoshot"):
                try:
                    t = graph_us(lambda: nd.all_reduce(x, ctx=ctx, impl=impl, out=out, check=False, config=config))
                    ctx.check("sweep")
                    line.append(f"{impl[:3]}{name} {t:.1f}")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{impl[:3]}{name} ERR {type(e).__name__}")
        if R == 0:
            print(" | ".join(line), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
