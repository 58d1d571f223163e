#!/usr/bin/env bash
# The GEMM's medium-M investigation (issue 13), for `scripts/device.sh gemm-gap` on an H100/H200:
# cuBLAS's kernels beside ours (scripts/gemm_probe.py), the M = 128-1024 points of the grid where
# the best timed schedule trailed cuBLAS with stream-K in both piece orders and split-K with 128 x
# 256 tiles beside the model's picks, and Nsight Compute metrics of stream-K in both orders.
# Writes under bench/results/gemm-gap/ (device.sh brings it back). Usage: gemm_gap.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/gemm-gap; mkdir -p "$res"
X="streamk 128x256x64 w8 s4 persistent; streamk 128x128x64 w8 s4 persistent; splitk 128x256x64 w8 s4 split2; splitk 128x256x64 w8 s4 split3"
S=1024x2560x8192,512x2560x8192,512x5120x5120,1024x5120x5120,512x5120x12800,1024x5120x12800,320x8192x7168,512x6144x4096,1024x6144x4096,256x6144x4096,128x5120x5120,256x25600x5120,512x25600x5120,512x14336x8192,192x6144x4096,384x4096x14336
P=1024x2560x8192,512x5120x5120,512x5120x12800,320x8192x7168,256x6144x4096,128x5120x5120
timeout 120 python3 scripts/gemm_probe.py --shapes $P \
  --schedules "streamk 128x256x64 w8 s4 persistent; tiled 128x256x64 w8 s4 persistent; splitk 128x256x64 w8 s4 split3" \
  2>&1 | tee "$res/probe-$dev.log" | tail -40
for ka in 0 1; do
  NUMASCHED_GEMM_STREAMK_K_ALIGNED=$ka timeout 240 numasched bench gemm_inference --shapes $S --top 3 --extra "$X" \
    --precompile 12 --out-dir "$res/k_aligned$ka" 2>&1 | tail -3
done
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum
for ka in 0 1; do
  NUMASCHED_GEMM_STREAMK_K_ALIGNED=$ka timeout 90 ncu --kernel-name regex:gemm --metrics $M --csv \
    python3 scripts/gemm_probe.py --shapes 1024x2560x8192,512x5120x12800 --no-cublas --no-profiler --calls 1 \
    --schedules "streamk 128x256x64 w8 s4 persistent; tiled 128x256x64 w8 s4 persistent" \
    > "$res/ncu-k_aligned$ka-$dev.csv" 2>&1
  tail -3 "$res/ncu-k_aligned$ka-$dev.csv"
done
cp -r "$res" "$out/" 2>/dev/null || true
