"""Where a misaligned weight's time goes (issue 13, off the grid), for Nsight Compute: y = x @ W.T
(bf16, as F.linear has it) through numasched.matmul, each call on its own copy of W (more than
twice the L2 in all, so every profiled call reads W from HBM), W's rows either as given (K * 2
bytes apart) or padded to whole 128-byte lines (a view of a wider buffer, the same values).
No CUDA graph (ncu profiles launches); the schedule is the chooser's for the plain layout, so
both layouts run the same kernel. Checked against float64 once per layout.

Run (on the GPU machine, numasched installed), once per layout:
  ncu --clock-control none -k regex:gemm --launch-skip 3 --launch-count 1 --csv --page raw \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \
      python3 scripts/gemm_align_ncu.py --shape 16x6000x5000 --layout padded
"""
import argparse

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="MxNxK")
    p.add_argument("--layout", choices=("plain", "padded"), default="plain")
    p.add_argument("--calls", type=int, default=6)
    a = p.parse_args()
    import numasched
    from gemm_align_probe import padded   # (scripts/ is this script's path)

    m, n, k = (int(v) for v in a.shape.split("x"))
    dev, dt = torch.device("cuda"), torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, -(-3 * l2 // (n * k * 2)))
    x = torch.randn(m, k, device=dev, dtype=dt)
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
    if a.layout == "padded":
        ws = [padded(w) for w in ws]
    plain = torch.empty_strided((n, k), (k, 1), device=dev, dtype=dt)
    sched = numasched.plan_matmul(x, plain.T).schedule   # the plain layout's schedule for both
    plan = numasched.plan_matmul(x, ws[0].T, schedule=sched)
    y = plan.run(x, ws[0].T)
    ref = x.double() @ ws[0].double().T
    err = ((y.double() - ref).norm() / ref.norm()).item()
    print(f"{a.shape} {a.layout}: {plan.kernel} {sched.describe() if sched else ''}, rel err {err:.1e}", flush=True)
    assert err < 1e-2, err
    torch.cuda.synchronize()
    for i in range(a.calls):
        plan.run(x, ws[i % copies].T)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
