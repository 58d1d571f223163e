#!/usr/bin/env bash
# Split-K tail schedules (issue 13), for `scripts/device.sh gemm-tail` on an H100/H200: the
# GPU tests of split-K (the tail one in a CUDA graph), then the grid's M = 128-1024 points with
# the tail schedules among the chooser's candidates (options.gemm_tail_split) and three of them
# timed at every point beside the model's pick, its next three and cuBLAS. Writes under
# bench/results/gemm-tail/. Usage: gemm_tail.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/gemm-tail; mkdir -p "$res"
NUMASCHED_AUTOTUNE=0 timeout 120 python3 -m pytest -m gpu -q -rfE tests/test_gemm.py -k "cuda_graph_replays" 2>&1 \
  | tee "$res/test-$dev.log" | tail -3
X="splitk 128x128x64 w8 s6 split2 tail; splitk 128x128x64 w8 s6 split3 tail; splitk 128x128x64 w8 s6 split4 tail"
NUMASCHED_GEMM_TAIL_SPLIT=1 timeout ${GEMM_TAIL_TIMEOUT:-400} numasched bench gemm_inference --m 128,256,512,1024 \
  --top 3 --extra "$X" --precompile 12 --out-dir "$res" 2>&1 | tail -4
cp -r "$res" "$out/" 2>/dev/null || true
