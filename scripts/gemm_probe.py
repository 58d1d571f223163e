"""What runs inside one GEMM call: cuBLAS's kernels and numasched's schedules, by name and time.

For each shape (y = x @ W.T, bf16, as F.linear has it) this runs torch.matmul and each named
numasched schedule a few times under torch.profiler and prints every GPU kernel a call launched
with its mean time (cuBLAS's kernel names carry its tile, cluster and split-K / stream-K choice).
Run it under Nsight Compute to see where a schedule's time goes, e.g.

    ncu --kernel-name regex:gemm --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python scripts/gemm_probe.py --shapes 1024x2560x8192 --no-cublas --no-profiler --calls 1

    python scripts/gemm_probe.py --shapes 512x5120x5120,1024x2560x8192 \\
        --schedules "streamk 128x256x64 w8 s4 persistent; tiled 128x256x64 w8 s4 persistent"
"""
from __future__ import annotations

import argparse
import collections
import sys


def main(argv=None) -> int:
    from numasched.argtypes import shape_list
    from numasched.bench.gemm_inference import schedule_list

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", required=True, type=shape_list, help="comma-separated MxNxK, or @FILE of them")
    p.add_argument("--schedules", type=schedule_list, default=[],
                   help="'; '-separated numasched schedules (as the bench names them)")
    p.add_argument("--calls", type=int, default=5, help="calls of each contender (default 5)")
    p.add_argument("--ab-option", default=None,
                   help="a bool numasched option (e.g. gemm_tail_split): each schedule runs with it off and on")
    p.add_argument("--no-cublas", action="store_true", help="only numasched's schedules")
    p.add_argument("--no-profiler", action="store_true",
                   help="run the calls without torch.profiler (under Nsight Compute, which CUPTI cannot share)")
    args = p.parse_args(argv)
    import torch

    import numasched

    if not torch.cuda.is_available():
        print("gemm_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    scheds = args.schedules
    for m, n, k in args.shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(x.double(), w.double().T)
        contenders = [] if args.no_cublas else [("cuBLAS", lambda: torch.matmul(x, w.T))]
        variants = [None] if args.ab_option is None else [{args.ab_option: False}, {args.ab_option: True}]
        for s, opt in [(s, o) for s in [None] + scheds for o in variants]:
            with numasched.options.use(**(opt or {})):
                plan = numasched.plan_matmul(x, w.T, schedule=s)
            name = f"numasched {plan.schedule.describe() if plan.schedule else plan.kernel}" + (" (model)" if s is None else "")
            if opt:
                name += f" [{args.ab_option}={int(opt[args.ab_option])}]"
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            got = plan.run(x, w.T, out).double()
            err = ((got - ref).norm() / ref.norm()).item()
            contenders.append((f"{name} err {err:.1e}", lambda plan=plan: plan.run(x, w.T)))
        print(f"== {m}x{n}x{k}", flush=True)
        for name, fn in contenders:
            for _ in range(3):   # compile, warm up
                fn()
            torch.cuda.synchronize()
            if args.no_profiler:
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
                print(f"  {name}: {args.calls} calls", flush=True)
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
            per = collections.defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
            total = sum(sum(v) for v in per.values()) / args.calls
            print(f"  {name}: {total:.1f} us per call", flush=True)
            for kname, ts in per.items():
                print(f"      {sum(ts) / len(ts):8.1f} us x{len(ts) // args.calls}  {kname[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
