"""The stream-K piece orders in the L2 simulator, at the GEMM grid's medium-M points (CPU only).

For each shape (y = x @ W.T, bf16) and tile: the data-parallel kernel, stream-K with the pieces'
parts tail first (the kernel's default) and K-aligned (``options.gemm_streamk_k_aligned``):
HBM bytes, L2 hit rate and the simulator's rough time, on a topology preset (default h200; a
model of the GPU, not a measurement). Writes a CSV and prints a markdown table.

    python scripts/sim_streamk_orders.py [--topology h200] [--out bench/results/sim-streamk-orders-h200.csv]
"""
from __future__ import annotations

import argparse
import csv

M_VALUES = (128, 256, 512, 1024)
NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2560, 8192), (8192, 2048), (14336, 8192),
      (8192, 7168), (5120, 5120), (25600, 5120), (5120, 12800)]
OFF = [(192, 6144, 4096), (320, 8192, 7168), (384, 4096, 14336)]  # the simulator needs line-aligned rows
TILES = ((128, 256), (128, 128))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="h200")
    p.add_argument("--out", default=None, help="CSV path (default: none)")
    args = p.parse_args(argv)
    from numasched import sim
    from numasched.topology import Topology

    topo = Topology.preset(args.topology)
    sms = topo.num_cus
    shapes = [(m, n, k) for m in M_VALUES for n, k in NK] + OFF
    rows = []
    for m, n, k in shapes:
        for bm, bn in TILES:
            tiles = -(-m // bm) * -(-n // bn)
            if tiles % sms == 0 or tiles > 4 * sms:
                continue   # no stream-K remainder, or the chooser would not weigh stream-K
            row = dict(M=m, N=n, K=k, tile=f"{bm}x{bn}", tiles=tiles, floor_MB=round((m * k + n * k) * 2 / 1e6, 1))
            dp = sim.simulate(topo, sim.GemmModel(m, n, k, bm, bn, 64), "auto")
            row.update(dp_hbm_MB=round(dp.hbm_bytes / 1e6, 1), dp_us=round(dp.time_s * 1e6, 1))
            for name, aligned in (("tail", False), ("aligned", True)):
                r = sim.simulate(topo, sim.StreamKGemmModel(m, n, k, bm, bn, 64, k_aligned=aligned), "auto")
                row.update({f"{name}_hbm_MB": round(r.hbm_bytes / 1e6, 1), f"{name}_l2_hit": round(r.l2_hit_rate, 3),
                            f"{name}_us": round(r.time_s * 1e6, 1)})
            rows.append(row)
            print(" | ".join(str(v) for v in row.values()), flush=True)
    if args.out and rows:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
