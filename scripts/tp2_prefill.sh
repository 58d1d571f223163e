#!/usr/bin/env bash
# The TP 2 prefill investigation (issue 14), for `scripts/device.sh tp2-prefill` on 2 GPUs:
# correctness of the overlapped and sequence-parallel prefills against transformers (eager and in
# a CUDA graph), then the Llama-3-8B prefill of 4096 tokens with one decode point, numasched in
# one bulk step and sequence-parallel, each beside the bulk-synchronous torch baseline (the step
# and component graphs of both backends timed in turns). (Two overlapped row chunks were timed in
# the tenth session: no gain.) Writes under bench/results/tp2-prefill/. Usage: tp2_prefill.sh OUT_DIR DEV
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}
res=bench/results/tp2-prefill; mkdir -p "$res"
timeout -k 10 ${TP2_TEST_TIMEOUT:-170} torchrun --nproc-per-node=2 tests/test_models.py 2>&1 | tee "$res/models-tp2-$dev.log" \
  | grep -E "PASS|FAIL|ALL|Error" | tail -20
common=(--tp 2 --batch 1 --context 2048 --prompt 4096 --no-generate --iters 10)
for mode in seqpar bulk; do
  case $mode in
    bulk) extra=() ;;
    seqpar) extra=(--prefill-seq-parallel) ;;
  esac
  timeout -k 10 ${TP2_E2E_TIMEOUT:-190} numasched bench e2e "${common[@]}" "${extra[@]}" --out-dir "$res/$mode" 2>&1 \
    | tee "$res/e2e-$mode-$dev.log" | grep -vE "^\s*$" | grep -E "Error|error|prefill|Traceback|File .*numasched|speedup|ms" | tail -25
  cp -r "$res" "$out/" 2>/dev/null || true
done
cp -r "$res" "$out/" 2>/dev/null || true
