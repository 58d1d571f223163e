#!/usr/bin/env bash
# Decode graph vs eager (issue 12): decode_graph_probe.py at 128 x 32k, pages of 16, 64/8 and 32/8 heads,
# then Nsight Compute on the one kernel in both modes. Run on the device: bash scripts/decode_graph_probe.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/device.sh env >/dev/null 2>&1
for h in 64/8 32/8; do python3 scripts/decode_graph_probe.py --heads $h 2>&1 | tail -5; done | tee $OUT/decode-graph.log
timeout 240 ncu --graph-profiling node --clock-control none --kernel-name regex:decode --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,launch__block_size,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active --csv python3 scripts/decode_graph_probe.py --heads 64/8 --profile > $OUT/decode-graph-ncu.csv 2>&1; tail -30 $OUT/decode-graph-ncu.csv | cut -c1-250
