#!/usr/bin/env bash
# Wide tiles (issue 13), for `scripts/device.sh gemm-wide` on an H100/H200: the GPU tests of the
# tiled kernel with 128 x 160 / 128 x 192 tiles, then the medium-M grid (M = 64-4096 on the 11
# projections) and shapes off it with the wide schedules timed beside the model's top picks.
# Writes under bench/results/gemm-wide/ (device.sh brings it back). Usage: gemm_wide.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/gemm-wide; mkdir -p "$res"
NUMASCHED_AUTOTUNE=0 timeout 200 python3 -m pytest -m gpu -q -rfE --timeout 150 tests/test_gemm.py -k "wide" 2>&1 \
  | tee "$res/test-wide-$dev.log" | tail -5
X="tiled 128x160x64 w8 s4 persistent; tiled 128x160x64 w8 s5 persistent; tiled 128x192x64 w8 s4 persistent; tiled 64x160x64 w4 s5 persistent; tiled 64x192x64 w4 s5 persistent; tiled 128x256x64 w8 s4 persistent; tiled 128x128x64 w8 s4 persistent"
timeout 300 numasched bench gemm_inference --m 64,128,256,512,1024,4096 --top 2 --extra "$X" --precompile 14 \
  --out-dir "$res/grid" 2>&1 | tail -3
S=1024x1024x1024,2048x2048x2048,97x3001x1537,301x7001x3011,192x6144x4096,384x4096x14336,768x2560x8192,640x5120x5120,1536x4096x4096,320x8192x7168,96x25600x5120,448x14336x8192,896x8192x2048,777x3001x1999,600x5000x7000,3000x5000x7000,1500x2500x4104
timeout 200 numasched bench gemm_inference --shapes $S --top 2 --extra "$X" --precompile 14 --out-dir "$res/off" 2>&1 | tail -3
cp -r "$res" "$out/" 2>/dev/null || true
