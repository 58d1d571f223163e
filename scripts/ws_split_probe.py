"""Split-K in K lockstep on the warp-specialised GEMM (numasched.gemm_ws.split_config: tiles of 128
x 64/128/256, S K parts, the banded merge with MERGE_FLIGHT partials in flight) at M = 64-256
(issue 13's medium-M gap), against cuBLAS and the chooser's pick. Per width, S = SMs // tiles (one
unit per SM) and half of it; the fastest also without its merge (FIXUP 0: wrong sums, the K loops'
time). One GPU, bf16, y = x @ W.T, CUDA graphs of --calls calls, each reading its own copy of W.

Run: python3 scripts/ws_split_probe.py [--m 64,128,256] [--shapes MxNxK,...]"""
import argparse
import math

import torch

from numasched.bench.gemm_inference import NK
from numasched.gemm_tune import baseline_us, checked_us, graph_us, linear_operands
from numasched.gemm_ws import WsGemmPlan, split_config


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="64,128,256")
    ap.add_argument("--shapes", default=None, help="MxNxK,... (replaces the grid)")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    print(f"device {props.name}, {sms} SMs")
    if args.shapes:
        points = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        points = [(m, n, k) for _, _, n, k in NK for m in (int(v) for v in args.m.split(","))]
    wins = []
    for M, N, K in points:
        x, ws, outs, ref, copies = linear_operands(M, N, K, device=dev)
        row, pick = baseline_us(x, ws, outs, copies, args.calls)
        best = (float("inf"), None)
        for bn in (64, 128, 256):
            tiles = -(-M // 128) * -(-N // bn)
            s1 = max(2, sms // tiles)
            for S in sorted({s1, max(2, s1 // 2)}, reverse=True):
                key = f"w{bn}s{S}"
                try:
                    pl = WsGemmPlan(x, ws[0].T, outs[0], config=split_config(bn, S))
                    row[key] = checked_us(pl, x, ws, outs, ref, copies, args.calls)
                    pl.check()
                    if row[key] < best[0]:
                        best = (row[key], (bn, S))
                except Exception as e:  # report, go on
                    print(f"  {M}x{N}x{K} {key}: {type(e).__name__}: {str(e).splitlines()[0][:140]}")
                    row[key] = float("nan")
        if best[1] is not None:
            # the fastest form taken apart (wrong sums): K loops only, + partial stores, + arrivals,
            # + the merge without its wait
            bn, S = best[1]
            for mode, name in ((0, "nofix"), (3, "store"), (2, "arrive"), (4, "nowait")):
                probe = WsGemmPlan(x, ws[0].T, outs[0], config=split_config(bn, S))
                probe.fixup = mode
                row[name] = graph_us(lambda i, probe=probe: probe.run(x, ws[i].T, outs[i]), copies, args.calls)
                probe.tickets.zero_()
        wins.append(row["cublas"] / min(row["pick"], best[0]))
        print(f"{M:>4} x {N:>5} x {K:>5} cublas {row['cublas']:.2f} pick {row['pick']:.2f} "
              f"({pick.schedule.describe() if pick.schedule else pick.kernel}) best split {best[0]:.2f} {best[1]} "
              f"cublas/pick {row['cublas'] / row['pick']:.3f} cublas/split {row['cublas'] / best[0]:.3f} "
              f"merge cost {best[0] - row.get('nofix', float('nan')):.2f} us", flush=True)
        print("    " + "; ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
        del ws, outs
    g = math.exp(sum(math.log(w) for w in wins) / len(wins))
    print(f"cuBLAS / faster of (pick, best split): geomean {g:.3f}, >= 0.95 at {sum(w >= 0.95 for w in wins)}/{len(wins)}")


if __name__ == "__main__":
    main()
