#!/usr/bin/env bash
# The split-K merge, store-first against ticket-first (options.gemm_splitk_ticket_first), for
# `scripts/device.sh gemm-merge-probe` on an H100/H200 (issue 13): the model's schedule and a fixed
# 128 x 128 two-part split at decode and medium-M shapes, each kernel timed under torch.profiler
# with the option off and on. Writes bench/results/gemm-merge-probe/probe-DEV.log.
# Usage: gemm_merge_probe.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/gemm-merge-probe; mkdir -p "$res"
P=1x4096x4096,16x28672x4096,128x2560x64,128x2560x1024,128x4096x4096,128x2560x8192,128x4096x14336
P=$P,256x28672x4096,256x25600x5120,512x5120x12800,1024x2560x8192,1024x5120x5120,4096x8192x7168
timeout ${PROBE_TIMEOUT:-300} python3 scripts/gemm_probe.py --shapes $P --schedules "splitk 128x128x64 w8 s6 split2" \
  --ab-option gemm_splitk_ticket_first 2>&1 | tee "$res/probe-$dev.log" | grep -E "^==|per call"
cp "$res/probe-$dev.log" "$out/" 2>/dev/null || true
