"""All-reduce config sweep (chunk size, warps, programs per SM) against NCCL and torch symm_mem,
CUDA-graph replays, to set numasched.distributed.all_reduce's config and the cost model's
constants. Run: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/ar_sweep.py
AR_SIZES (bytes) and AR_CONFIGS ("chunk_bytes/warps/per_sm[/bulk],...") override the grids below;
bulk 1 runs each stage over all of a program's chunks before one signal (the kernel's BULK).
AR_REPEATS (default 1): rounds over every contender of a size, interleaved, each a fresh graph;
a contender's figure is then its median, with the range (one timing moved by 1 us between
configs at 256 KB - 1 MB on two H200s). The copy-engine two-shot (impl="ce") is timed once per size."""
import os
import statistics

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
REPEATS = int(os.environ.get("AR_REPEATS", "1"))
if REPEATS < 1:
    raise SystemExit(f"AR_REPEATS must be >= 1, got {REPEATS}")


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
        sb = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(sb, group)
        sb.copy_(x)
        ob = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        contenders = [("nccl", lambda: dist.all_reduce(nb)),
                      ("symm2", lambda: torch.ops.symm_mem.two_shot_all_reduce_(sb, "sum", group)),
                      ("symm1", lambda: torch.ops.symm_mem.one_shot_all_reduce_out(sb, "sum", group, ob))]
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
                contenders.append((f"{impl[:3]}{name}", lambda impl=impl, config=config: nd.all_reduce(
                    x, ctx=ctx, impl=impl, out=out, check=False, config=config)))
        times = {label: [] for label, _ in contenders}
        for _ in range(REPEATS):   # interleaved: a drift in the machine moves every contender alike
            for label, fn in contenders:
                if times[label] is None:
                    continue
                try:
                    times[label].append(graph_us(fn))
                    ctx.check("sweep")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{label} ERR {type(e).__name__}")
                    times[label] = None
        for label, ts in times.items():
            if ts:
                rng = f" ({min(ts):.1f}-{max(ts):.1f})" if len(ts) > 1 else ""
                line.append(f"{label} {statistics.median(ts):.1f}{rng}")
        if R == 0:
            print(" | ".join(line), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
