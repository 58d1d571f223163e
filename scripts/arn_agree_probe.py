"""Why the decode all-reduce + add + RMSNorm's flag and LL exchanges can differ (issue 14): many
calls without a host sync, one rank made late now and then, each call's output kept; afterwards
every output is compared with a host reference built from the gathered inputs. The residual
r = h + (x0 + x1) involves no reduction order, so any r that differs from the reference is wrong
data (a race), not rounding; y differing alone by one bf16 step is the norm's sum order.

    torchrun --nproc-per-node 2 scripts/arn_agree_probe.py [--calls 200] [--rows 1,4,16]
"""
import argparse
import itertools
import os

import torch
import torch.distributed as dist

import numasched
import numasched.distributed as nd

BF = torch.bfloat16


def reference(xs, h, w, eps):
    s = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:                       # rank order, fp32
        s += x.float()
    r = (h.float() + s.to(BF).float()).to(BF)
    rf = r.double()
    inv = 1.0 / torch.sqrt((rf * rf).mean(-1, keepdim=True) + eps)
    return r, (w.double() * (rf * inv).to(BF).double()).to(BF)


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
        allx = torch.stack(xs)
        gathered = [torch.empty_like(allx) for _ in range(W)]
        dist.all_gather(gathered, allx)
        lines = []
        bad = {k: [0, 0] for k in outs}
        for i in range(args.calls):
            r_ref, y_ref = reference([gathered[s][i] for s in range(W)], h, w, eps)
            differ = [(outs["flag"][i][k] != outs["ll"][i][k]).sum().item() for k in (0, 1)]
            for ex in outs:
                r, y = outs[ex][i]
                r_bad = (r != r_ref).sum().item()
                y_far = ((y.float() - y_ref.float()).abs() > 0.02 * y_ref.float().abs() + 1e-2).sum().item()
                bad[ex][0] += r_bad
                bad[ex][1] += y_far
                if r_bad or y_far:
                    rows = sorted(set((r != r_ref).nonzero()[:, 0].tolist()))
                    lines.append(f"  call {i} {ex}: r wrong in {r_bad} elements (rows {rows}), y far in {y_far}")
            if differ[0] or differ[1]:
                rows = sorted(set((outs["flag"][i][1] != outs["ll"][i][1]).nonzero()[:, 0].tolist()))
                dy = (outs["flag"][i][1].float() - outs["ll"][i][1].float()).abs().max().item()
                lines.append(f"  call {i}: flag vs ll differ r {differ[0]} y {differ[1]} (rows {rows}, max |dy| {dy:.3g})"
                             f"{' late' if late and i % 5 in (0, 2) else ''}")
        print(f"[rank {R}] late={late} pdl={pdl} M={M}: r wrong flag {bad['flag'][0]} ll {bad['ll'][0]}; "
              f"y far flag {bad['flag'][1]} ll {bad['ll'][1]}; {len(lines)} notes", flush=True)
        for ln in lines[:12]:
            print(f"[rank {R}]{ln}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
