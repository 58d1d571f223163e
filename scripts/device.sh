#!/usr/bin/env bash
# Runs on a lent GPU machine (torch/triton preinstalled there, no network): installs numasched
# without dependencies, the carried wheels (.whl/: flashinfer, tvm-ffi, iris) into /tmp/site,
# then each step given as an argument, logging to $OUT. Steps: env probe tests bench-quick
# bench-decode bench-prefill bench-gemm bench-policies sanitizer l2 gemm-gap gemm-tail gemm-splitk-probe gemm-unit-probe tp2-prefill tp-many[:PARTS] report dist-worker[:ARGS] script-NAME[:ARGS]; "bench-SUITE:ARGS" passes
# ARGS ('+' becomes a space) to the suite, e.g. bench-decode:--heads+gqa
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${OUT:-}" ]; then OUT=/tmp/out; rm -f "$OUT/.run-start"; fi   # a local run: its own results only
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
dev=$(python3 -c "import torch;n=torch.cuda.get_device_name(0).lower();print('h200' if 'h200' in n else 'h100' if 'h100' in n else 'gpu')")
step() { echo "=== $1 ($(date +%T))"; }
# results written by this run come back even if the call runs out of time: copied to $OUT every 20 s
[ -e "$OUT/.run-start" ] || touch "$OUT/.run-start"  # one marker per call: every step's results come back
sync_results() { find bench/results -type f -newer "$OUT/.run-start" | tar czf "$OUT/results.tgz.part" -T - 2>/dev/null && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
( while sleep 20; do sync_results; done ) &
copier=$!
for s in "$@"; do
  step "$s"
  case "$s" in
    env) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
         python3 -c "import torch,triton,numpy;print(torch.__version__,triton.__version__,numpy.__version__,torch.cuda.device_count())"
         python3 -c "import flashinfer;print('flashinfer',flashinfer.__version__)" 2>&1 | tail -1
         python3 -c "import iris;print('iris ok')" 2>&1 | tail -1
         which ncu compute-sanitizer ;;
    probe) numasched probe --out bench/results/probe-$dev.json 2>&1 | tee "$OUT/probe-$dev.log"
           cp bench/results/probe-$dev.* "$OUT/" ;;
    test-*) # one test file, GPU tests only, fixed kernel configs (autotuning is for benches)
            f=tests/test_${s#test-}.py
            NUMASCHED_AUTOTUNE=0 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -v -rfE --timeout 200 $f 2>&1 \
              | tee "$OUT/gpu-${s}-$dev.log" | grep -E "PASS|FAIL|ERROR|Error|passed|failed|assert" | tail -40 ;;
    sanitizer) # compile once outside the sanitizer (Triton's cache), then every kernel family under each tool
               NUMASCHED_AUTOTUNE=0 python3 scripts/sanitize_kernels.py 2>&1 | tail -3
               for tool in memcheck racecheck; do
                 echo "--- compute-sanitizer --tool $tool" | tee -a "$OUT/sanitizer-$dev.log"
                 NUMASCHED_AUTOTUNE=0 timeout ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool $tool \
                   python3 scripts/sanitize_kernels.py 2>&1 | tee -a "$OUT/sanitizer-$dev.log" | tail -8
                 echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/sanitizer-$dev.log"
               done ;;
    dist-worker*) # correctness on every GPU of the machine, or on $NPROC of them (docs/distributed.md); args after ':' as for bench-
             extra=""; [[ $s == *:* ]] && extra=${s#*:}; extra=${extra//+/ }
             timeout -k 10 ${DIST_TIMEOUT:-240} torchrun --nproc-per-node ${NPROC:-$(nvidia-smi -L | wc -l)} tests/dist_worker.py $extra \
               2>&1 | tee -a "$OUT/dist-worker-${NPROC:-$(nvidia-smi -L | wc -l)}x$dev.log" | grep -E "PASS|FAIL|ALL|Error|error|Timeout|hung|stack" | tail -60 ;;
    script-*) # python3 scripts/NAME.py ARGS ('+' becomes a space)
              spec=${s#script-}; name=${spec%%:*}; extra=""; [[ $spec == *:* ]] && extra=${spec#*:}; extra=${extra//+/ }
              timeout ${SCRIPT_TIMEOUT:-300} python3 scripts/$name.py $extra 2>&1 | tee -a "$OUT/$name-$dev.log" | tail -40 ;;
    l2) timeout 300 numasched bench policies --l2 2>&1 | tee "$OUT/l2-$dev.log" | tail -40 ;;
    gemm-gap) bash scripts/gemm_gap.sh "$OUT" "$dev" ;;   # the GEMM's medium-M investigation (issue 13)
    gemm-tail) bash scripts/gemm_tail.sh "$OUT" "$dev" ;;   # split-K tail schedules timed (issue 13)
    gemm-splitk-probe) bash scripts/gemm_splitk_probe.sh "$OUT" "$dev" ;;   # why split-K units run slow (issue 13)
    gemm-unit-probe) bash scripts/gemm_unit_probe.sh "$OUT" "$dev" ;;   # a split-K unit's fixed part (issue 13)
    tp2-prefill) bash scripts/tp2_prefill.sh "$OUT" "$dev" ;;   # the TP 2 prefill modes (issue 14), 2 GPUs
    tp-many*) parts=""; [[ $s == *:* ]] && parts=${s#*:}   # TP on every GPU (issue 15): tp-many:models+worker+llama+qwen+coll
              bash scripts/tp_many.sh "$OUT" "$dev" "${parts:-models+worker+llama+qwen+coll}" ;;
    bench-*) spec=${s#bench-}; name=${spec%%:*}; extra=""; [[ $spec == *:* ]] && extra=${spec#*:}; extra=${extra//+/ }
             [[ $name == *-quick ]] && { name=${name%-quick}; extra="--quick $extra"; }
             timeout ${BENCH_TIMEOUT:-540} numasched bench $name $extra 2>&1 | tee -a "$OUT/bench-$name-$dev.log" | tail -60 ;;
    report) numasched report --skip-sim 2>&1 | tail -40 ;;
    *) echo "unknown step $s" ;;
  esac
done
# everything the run wrote under bench/results comes back
kill $copier 2>/dev/null
sync_results
