#!/usr/bin/env bash
# Why a split-K unit runs at about half the rate of a whole tile (issue 13), for
# `scripts/device.sh gemm-splitk-probe` on an H100/H200. On the H200, 128 x 2560 x 8192 in four K
# parts of 128 x 128 tiles (80 units, one wave) took 24.4 us, while 512 x 2560 x 8192's 80 whole
# tiles (four times the work each) took 45.4: the K loop compiles the same (TMA, wgmma, one group
# in flight, 95 / 128 registers), so the time is in the fill, the fp32 partial stores, the merge or
# the memory system. Times (torch.profiler) and Nsight Compute sections of split 1 / 2 / 4 / 4-tail
# at three shapes. Writes under bench/results/gemm-splitk-probe/. Usage: gemm_splitk_probe.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/gemm-splitk-probe; mkdir -p "$res"
S="splitk 128x128x64 w8 s6; splitk 128x128x64 w8 s6 split2; splitk 128x128x64 w8 s6 split4; splitk 128x128x64 w8 s6 split4 tail; splitk 128x64x64 w8 s6 split3"
P=128x2560x8192,512x2560x8192,512x5120x5120
timeout 150 python3 scripts/gemm_probe.py --shapes $P --schedules "$S" 2>&1 | tee "$res/probe-$dev.log" | tail -40
timeout 240 ncu --clock-control none --kernel-name regex:gemm --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section LaunchStats --section Occupancy --csv --page details \
  python3 scripts/gemm_probe.py --shapes 128x2560x8192,512x2560x8192 --no-cublas --no-profiler --calls 1 \
  --schedules "$S" > "$res/ncu-$dev.csv" 2>&1
tail -12 "$res/ncu-$dev.csv"
cp -r "$res" "$out/" 2>/dev/null || true
