#!/usr/bin/env bash
# The fixed part of a split-K unit (issue 13), for `scripts/device.sh gemm-unit-probe` on an
# H100/H200. The fifteenth session's fit over 1 / 2 / 4 / 6 K parts of 128 x 2560 x 8192 gave about
# 14 us per unit besides its K loop (bench/results/gemm-s15-splitk-probe/). Units of 1-128 K blocks
# (K = 64-8192, one and two parts) timed side by side; the intercept of time against K blocks is
# the start-up + descriptors + epilogue (+ merge for two parts). Then Nsight Compute's warp state
# and source counters for the shortest units. Writes under bench/results/gemm-unit-probe/.
# Usage: gemm_unit_probe.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/gemm-unit-probe; mkdir -p "$res"
S="splitk 128x128x64 w8 s6; splitk 128x128x64 w8 s6 split2; splitk 128x64x64 w8 s6"
P=128x2560x64,128x2560x256,128x2560x1024,128x2560x2048,128x2560x4096,128x2560x8192
timeout 150 python3 scripts/gemm_probe.py --shapes $P --schedules "$S" 2>&1 | tee "$res/probe-$dev.log" | grep -v "^ " | tail -30
grep -E "^==|per call" "$res/probe-$dev.log" | tail -40
timeout 200 ncu --clock-control none --kernel-name regex:gemm --section WarpStateStats --section SourceCounters \
  --section SpeedOfLight --csv --page details \
  python3 scripts/gemm_probe.py --shapes 128x2560x64,128x2560x2048 --no-cublas --no-profiler --calls 1 \
  --schedules "splitk 128x128x64 w8 s6; splitk 128x128x64 w8 s6 split2" > "$res/ncu-$dev.csv" 2>&1
tail -4 "$res/ncu-$dev.csv"
