"""Tile rows past M (issue 13): does a split-K tile whose rows run past M lose time to how it
reads A? On the H200 the same 64-row TMA-fed schedule ran 1.3-1.5x longer at M = 32 than at
M = 64 (5120 x 5120: 21.3 against 16.4 us), though it reads fewer bytes there.

Per point (M x N x K, bf16, y = x @ W.T), in CUDA graphs with a copy of W per call (more than
2x the L2, as ``bench gemm_inference``): cuBLAS, then each schedule of the M's list with the
split-K kernel's operands read three ways (options.gemm_splitk_operands): "tma" (both through
descriptors: A's box runs past its last row), "b_tma" (A through masked pointer loads, B through
its descriptor), "pointer" (both through pointers). Every result is checked against float64.
Prints one CSV line per timing: M,N,K,schedule,operands,us,cublas_us.

Run: python3 scripts/gemm_rows_probe.py [--ms 1,16,32,...] [--shapes NxK,...] [--schedules 'S; S'] [--csv FILE]"""
import argparse
import sys

import torch

SHAPES = [(5120, 5120), (4096, 4096), (2560, 8192), (6144, 4096), (8192, 7168)]
MS = [1, 16, 24, 32, 48, 64, 72, 96, 112, 128]
MODES = ("tma", "b_tma", "pointer")


def schedules(m: int) -> list:
    """The schedules timed at M = m: the tiles the chooser weighs there."""
    if m <= 16:
        return ["splitk 16x64x128 w4 s6", "splitk 16x32x256 w4 s6", "splitk 16x128x128 w4 s5"]
    if m <= 64:
        return ["splitk 32x64x256 w4 s4", "splitk 32x32x256 w4 s6", "splitk 64x64x128 w4 s6", "splitk 64x32x256 w4 s4",
                "splitk 64x128x128 w8 s4"]
    return ["splitk 128x64x128 w8 s4", "splitk 128x128x64 w8 s6 split3", "splitk 64x64x128 w4 s6",
            "splitk 64x128x128 w8 s4"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--schedules", default=None, help="'; '-separated schedules timed at every M (default: by M)")
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    import numasched
    from numasched import options
    from numasched.gemm_schedule import Schedule
    from numasched.gemm_tune import checked_us, graph_us, linear_operands

    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    out = open(args.csv, "w") if args.csv else sys.stdout
    print("M,N,K,schedule,operands,us,cublas_us", file=out, flush=True)
    for n, k in shapes:
        for m in ms:
            x, ws, outs, ref, copies = linear_operands(m, n, k)
            cublas = graph_us(lambda i: torch.matmul(x, ws[i].T, out=outs[i]), copies, args.calls)
            names = [t.strip() for t in args.schedules.split(";") if t.strip()] if args.schedules else schedules(m)
            for name in names:
                s = Schedule.parse(name)
                for mode in MODES:
                    try:
                        with options.use(gemm_splitk_operands=mode):
                            plan = numasched.plan_matmul(x, ws[0].T, outs[0], schedule=s)
                        t = checked_us(plan, x, ws, outs, ref, copies, args.calls)
                        got = f"{mode}{'' if plan.path == 'tma' or mode == 'pointer' else '(pointer)'}"
                    except Exception as e:   # reported, not fatal
                        print(f"# {m}x{n}x{k} {name} {mode}: {type(e).__name__}: {str(e)[:200]}", file=out)
                        continue
                    print(f"{m},{n},{k},{name},{got},{t:.2f},{cublas:.2f}", file=out, flush=True)
            del x, ws, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
