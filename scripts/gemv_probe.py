"""Weight streaming at M <= 16 (issue 13): cuBLAS, the chooser's pick and the stream-K kernel
(kernels/gemm_streamk.py: every K iteration of every tile shared equally by the programs, so all
SMs stream the weight whatever the tile count) with 16-row tiles, one and two programs per SM,
TMA and pointer loads; beside them the same-size streaming read (the limit for reading W once in
this setting: numasched.probe.bandwidth.read_graph_us) and the 1 GiB streaming rate. With --mid,
also stream-K at M = 128 and 256 (128-row tiles). One GPU, bf16, y = x @ W.T, CUDA graphs of
--calls calls, each reading its own copy of W (copies exceed twice the L2), us per call.

Run: python3 scripts/gemv_probe.py [--m 1,16] [--mid] [--calls 20]"""
import argparse

import torch

from numasched import gemm_schedule as GS
from numasched.bench.gemm_inference import NK, OFF_GRID
from numasched.gemm import plan_matmul
from numasched.gemm_tune import baseline_us, checked_us, graph_us, linear_operands
from numasched.probe.bandwidth import read_graph_us, stream_read_bw

SMALL = ("16x32x256 w4 s6", "16x64x128 w4 s6", "16x64x256 w4 s5", "16x128x64 w4 s6")
MID = ("128x128x64 w8 s4", "128x256x64 w8 s4", "128x64x128 w8 s4")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--mid", action="store_true")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    stream = stream_read_bw()
    print(f"device {props.name}, {sms} SMs, L2 {l2 >> 20} MB, 1 GiB streaming read {stream / 1e12:.2f} TB/s")
    points = [(m, n, k) for _, _, n, k in NK for m in (int(v) for v in args.m.split(","))]
    points += [(m, n, k) for _, m, n, k in OFF_GRID if m <= 16]
    if args.mid:
        points += [(m, n, k) for _, _, n, k in NK for m in (128, 256)]
    reads = {}
    for M, N, K in points:
        x, ws, outs, ref, copies = linear_operands(M, N, K, device=dev)
        row, pick = baseline_us(x, ws, outs, copies, args.calls)
        names = [pick.schedule.describe() if pick.schedule else pick.kernel]
        tiles = SMALL if M <= 16 else MID
        for t in tiles:
            for mult in (1, 2):
                for path in ("tma", "pointer"):
                    key = f"sk {t.split()[0]} P{mult} {path[0]}"
                    try:
                        s = GS.Schedule.parse(f"streamk {t} persistent")
                        pl = plan_matmul(x, ws[0].T, outs[0], schedule=s, num_programs=mult * sms, path=path)
                        row[key] = checked_us(pl, x, ws, outs, ref, copies, args.calls)
                    except Exception as e:  # report, go on
                        print(f"  {M}x{N}x{K} {key}: {type(e).__name__}: {str(e).splitlines()[0][:140]}")
                        row[key] = float("nan")
        if M <= 16:
            if (N, K) not in reads:
                reads[(N, K)] = read_graph_us(ws, args.calls, graph_us)
            row["read"] = reads[(N, K)]
        best_sk = min((v for k, v in row.items() if k.startswith("sk ") and v == v), default=float("nan"))
        best_key = min((k for k in row if k.startswith("sk ") and row[k] == row[k]), key=row.get, default="-")
        wbytes = N * K * 2
        extra = ""
        if M <= 16:
            extra = (f" | stream1G pick {wbytes / (row['pick'] * 1e-6) / stream:.3f} sk {wbytes / (best_sk * 1e-6) / stream:.3f}"
                     f" | same-size read {wbytes / (row['read'] * 1e-6) / stream:.3f} of 1G; pick {row['read'] / row['pick']:.3f}"
                     f" sk {row['read'] / best_sk:.3f} cublas {row['read'] / row['cublas']:.3f}")
        print(f"{M:>4} x {N:>5} x {K:>5} cublas {row['cublas']:.2f} pick {row['pick']:.2f} ({names[0]}) "
              f"best sk {best_sk:.2f} ({best_key}) cublas/sk {row['cublas'] / best_sk:.3f} cublas/pick "
              f"{row['cublas'] / row['pick']:.3f}{extra}", flush=True)
        print("    " + "; ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
        del ws, outs


if __name__ == "__main__":
    main()
