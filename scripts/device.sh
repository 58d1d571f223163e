#!/usr/bin/env bash
# Runs on a lent GPU machine (torch/triton preinstalled there, no network): installs numasched
# without dependencies, the carried wheels (.whl/: flashinfer, tvm-ffi, iris) into /tmp/site,
# then each step given as an argument, logging to $OUT. Steps: env probe tests bench-quick
# bench-decode bench-prefill bench-gemm bench-policies sanitizer report dist-tests dist-bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
dev=$(python3 -c "import torch;n=torch.cuda.get_device_name(0).lower();print('h200' if 'h200' in n else 'h100' if 'h100' in n else 'gpu')")
step() { echo "=== $1 ($(date +%T))"; }
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
    sanitizer) for tool in memcheck racecheck; do
                 timeout 240 compute-sanitizer --tool $tool --target-processes all python3 -m pytest -q -m gpu -k "sanitizer or small" tests 2>&1 | tail -15 | tee -a "$OUT/sanitizer-$dev.log"
               done ;;
    bench-*) name=${s#bench-}; extra=""; [[ $name == *-quick ]] && { name=${name%-quick}; extra=--quick; }
             timeout 540 numasched bench $name $extra 2>&1 | tee "$OUT/bench-$name-$dev.log" | tail -60
             cp bench/results/$name-* "$OUT/" 2>/dev/null ;;
    report) numasched report --skip-sim 2>&1 | tail -40 ;;
    *) echo "unknown step $s" ;;
  esac
done
# everything the run wrote under bench/results comes back
tar czf "$OUT/results.tgz" bench/results 2>/dev/null
