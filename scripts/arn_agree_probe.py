"""Why the decode all-reduce + add + RMSNorm's flag and LL exchanges can differ (issue 14): many
calls without a host sync, one rank made late now and then, each call's output kept; afterwards
every output is compared with a host reference built from the gathered inputs
(tests/dist_worker.py's _arn_compare): the residual r = h + (x0 + x1) involves no reduction
order, so any r that differs from the reference is wrong data (a race), not rounding; y differing
alone by one bf16 step is the norm's sum order. Varies what the worker's check keeps fixed: the
late rank on and off, PDL on and off.

    torchrun --nproc-per-node 2 scripts/arn_agree_probe.py [--calls 200] [--rows 1,4,16]
"""
import argparse
import itertools
import os
import sys

import torch
import torch.distributed as dist

import numasched
import numasched.distributed as nd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from dist_worker import _arn_compare  # noqa: E402  (the worker check's comparison, reused)

BF = torch.bfloat16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--n", type=int, default=4096)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    ctx = nd.init(heap_bytes=1 << 30, timeout_s=20.0)
    R, W = ctx.rank, ctx.world
    eps = 1e-5
    for late, pdl, M in itertools.product((True, False), (True, False), [int(v) for v in args.rows.split(",")]):
        gen = torch.Generator(device="cuda").manual_seed(7)
        h = torch.randn(M, args.n, device="cuda", generator=gen).to(BF)
        w = torch.randn(args.n, device="cuda", generator=gen).to(BF)
        g = torch.Generator(device="cuda").manual_seed(63 + R)
        xs, outs = [], {"flag": [], "ll": []}
        for i in range(args.calls):
            x = torch.randn(M, args.n, device="cuda", generator=g).to(BF)
            xs.append(x)
            for exchange in ("flag", "ll"):
                if late and R == W - 1 and i % 5 == (0 if exchange == "flag" else 2):
                    torch.cuda._sleep(20000 * (1 + i % 3))
                with numasched.options.use(arn_exchange=exchange, arn_one_row=True, pdl=pdl):
                    outs[exchange].append(nd.all_reduce_add_rmsnorm(x, h, w, eps, ctx=ctx,
                                                                   residual_out=torch.empty_like(h), check=False))
        torch.cuda.synchronize()
        ctx.check("probe")
        allx = torch.empty((W, args.calls, M, args.n), dtype=BF, device="cuda")
        dist.all_gather_into_tensor(allx, torch.stack(xs).contiguous())
        differ, y_rows, notes = _arn_compare(allx, outs, h, w, eps)
        print(f"[rank {R}] late={late} pdl={pdl} M={M}: {differ} elements differ beyond a rounding, y a rounding "
              f"apart in {y_rows} of {args.calls * M} rows; {len(notes)} notes", flush=True)
        for note in notes[:12]:
            print(f"[rank {R}]   {note}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
