#!/usr/bin/env bash
# Tensor parallelism on every GPU of the machine (issue 15: 4 and 8 GPUs), for
# `scripts/device.sh tp-many:PARTS`. PARTS, '+'-separated, in the order given:
#   models   the TP decoder against transformers (tests/test_models.py under torchrun, eager + graph,
#            overlapped and sequence-parallel prefill)
#   worker   every collective against a single-GPU reference (tests/dist_worker.py --quick)
#   llama    bench e2e, Llama-3-8B at TP N: batch 1, 4, 16 x context 2k, 8k, 32k, prefill of 4096 tokens
#   qwen     bench e2e, Qwen3-32B at TP N: batch 1, 4, 16 x context 2k, 32k, prefill of 4096 tokens
#   prefill  bench e2e, Llama-3-8B at TP N: the prefill of 4096 tokens (and one decode point, batch 1
#            x 2k), each backend in its own launch, with components
#   prefillab the prefill of 4096 tokens with the defaults, then with each of $TP_PREFILL_VARIANTS (default
#            "no-fuse-swiglu no-heap-residual no-fuse-residual": bench e2e switches) in turn, each backend in
#            its own launch (one call: the A/B of this session's prefill fusions)
#   flatab   the prefill of 4096 tokens (no components): both backends with the defaults, then numasched with
#            NUMASCHED_FUSED_FLAT=0 (the fused GEMM + all-reduce's K loop per tile) and =1, each in its own launch
#   envab    the prefill of 4096 tokens (no components): torch, then numasched once per assignment in $TP_ENVAB
#            (e.g. "NUMASCHED_GLU_PERSISTENT=1 NUMASCHED_GLU_PERSISTENT=0 NUMASCHED_GLU_PERSISTENT=1"), each in
#            its own launch with that variable set
#   rsab     bench collectives --only rs at $TP_RS_ROWS (default 256,1024,2048,4096,16384) rows, the fused
#            reduce-scatter with its defaults, then with NUMASCHED_FUSED_FLAT=0 (ticketed tiles, a K loop each)
#   rswsab   bench collectives --only rs,mar at $TP_RS_ROWS rows with NUMASCHED_FUSED_WS=1 (the tile pairs on
#            the warp-specialised Gluon kernel), then =0 ($TP_WS_VALUES, default "1 0"; "def": unset)
#   coll     bench collectives --quick (auto vs NCCL, bulk, torch symm_mem)
#   ar       bench collectives --only ar (the all-reduce alone, every size)
#   decode   both models' (or $TP_MODELS') decode grids alone (no components, no eager step, no prefill): a re-check
#   rope     Llama-3-8B's decode grid with and without --fuse-rope-cache, one after the other (components kept)
#   prefetch Llama-3-8B's decode grid: torch, then numasched with options.pdl_prefetch off, on, and on with
#            --fuse-swiglu (the decode GEMMs' weights into L2 before their PDL wait), each in its own launch
#   swiglu   Llama-3-8B's decode grid: torch, numasched, numasched --pdl-swiglu (the activation by
#            numasched.swiglu, a PDL-launched kernel, not the compiled one), each in its own launch;
#            TP_SWIGLU_VARIANTS="pdl-swiglu fuse-swiglu" for the activation fused into the gate/up GEMM
#   timeline Llama-3-8B's decode grid with --timeline: each step's kernels by kind and the idle time
#            between them, both backends (bench/timeline.py)
#   arn      the fused all-reduce + add + norm alone at 1-64 rows (bench collectives --only arn: NCCL + torch,
#            flag and LL exchanges), then Llama-3-8B's decode grid: torch, then numasched with its
#            exchange by flag (NUMASCHED_ARN_LL=0) and by LL words (=1), each in its own launch, twice
#            in alternating order (run "NUMASCHED_ARN_LL=1 tp-many:models+worker" first: correctness)
#   arnk     the first half of arn alone (the kernel, no decode grid)
#   final    Llama-3-8B's decode grid with the defaults: torch, numasched, torch, numasched, each in its own
#            launch (the spread between launches of one backend is the noise of the ratio)
#   kvpf     Llama-3-8B's decode grid: torch, then numasched with options.decode_prefetch (the decode's first
#            K/V tokens into L2 before its PDL wait) at each of $TP_KVPF_VALUES (default "0 128 0 128"),
#            each in its own launch
#   mar      scripts/mar_sweep.py (the fused GEMM + all-reduce's tile configs at large M)
# Writes under bench/results/tp<N>-DATE/ (or tp<N>-$TP_TAG/). Usage: tp_many.sh OUT_DIR DEV PARTS
set -uo pipefail
out=${1:?OUT_DIR}; dev=${2:-gpu}; parts=${3:-models+worker+llama+qwen+coll}
n=${NPROC:-$(nvidia-smi -L | wc -l)}
res=bench/results/tp$n-${TP_TAG:-$(date +%Y-%m-%d)}; mkdir -p "$res"   # TP_TAG: the folder's suffix
keep() { cp -r "$res" "$out/" 2>/dev/null || true; }
# e2e NAME MODEL CONTEXTS TIMEOUT ARGS...: bench e2e at TP n, batch 1, 4, 16 (or $TP_BATCHES), into $res/NAME, each
# backend in its own launch (--isolate: the one run second in a shared process ran 2-4 % slower)
e2e() {
  local name=$1 model=$2 ctx=$3 limit=$4; shift 4
  timeout -k 10 $limit numasched bench e2e --isolate --model $model --tp $n --batch ${TP_BATCHES:-1,4,16} --context $ctx "$@" \
    --out-dir "$res/$name" 2>&1 | tee "$res/e2e-$name-tp$n-$dev.log" \
    | grep -E "Error|error|Traceback|^decode|^prefill|speedup" | tail -30
}
for part in ${parts//+/ }; do
  echo "--- tp $n: $part ($(date +%T))"
  case $part in
    models) timeout -k 10 ${TP_TEST_TIMEOUT:-200} torchrun --nproc-per-node=$n tests/test_models.py 2>&1 \
              | tee "$res/models-tp$n-$dev.log" | grep -E "PASS|FAIL|ALL|Error" | tail -20 ;;
    worker) timeout -k 10 ${DIST_TIMEOUT:-240} torchrun --nproc-per-node=$n tests/dist_worker.py --quick 2>&1 \
              | tee "$res/dist-worker-tp$n-$dev.log" | grep -E "PASS|FAIL|ALL|Error|error|Timeout|hung" | tail -40 ;;
    llama) e2e llama3-8b llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-420} --prompt 4096 --no-generate ;;
    qwen) e2e qwen3-32b qwen3-32b 2048,32768 ${TP_E2E_TIMEOUT:-420} --prompt 4096 --no-generate ;;
    prefill) TP_BATCHES=1 e2e llama3-8b-prefill llama3-8b 2048 ${TP_E2E_TIMEOUT:-300} --prompt 4096 --no-generate ;;
    prefillab) TP_BATCHES=1 e2e prefill-default llama3-8b 2048 ${TP_E2E_TIMEOUT:-150} --prompt 4096 --no-generate
               for v in ${TP_PREFILL_VARIANTS:-no-fuse-swiglu no-heap-residual no-fuse-residual}; do
                 TP_BATCHES=1 e2e prefill-$v llama3-8b 2048 ${TP_E2E_TIMEOUT:-150} --prompt 4096 --no-generate --$v
               done ;;
    flatab) TP_BATCHES=1 e2e prefill-flat llama3-8b 2048 ${TP_E2E_TIMEOUT:-150} --prompt 4096 --no-generate --no-taxes
            for v in 0 1; do
              NUMASCHED_FUSED_FLAT=$v TP_BATCHES=1 e2e prefill-flat$v llama3-8b 2048 ${TP_E2E_TIMEOUT:-150} --prompt 4096 \
                --no-generate --no-taxes --backends numasched
            done ;;
    envab) TP_BATCHES=1 e2e prefill-torch llama3-8b 2048 ${TP_E2E_TIMEOUT:-150} --prompt 4096 --no-generate --no-taxes \
             --backends torch
           k=0
           for v in ${TP_ENVAB:?TP_ENVAB: assignments to compare}; do
             k=$((k + 1))
             ( export "$v"; TP_BATCHES=1 e2e prefill-$k-${v//=/-} llama3-8b 2048 ${TP_E2E_TIMEOUT:-150} --prompt 4096 \
                 --no-generate --no-taxes --backends numasched )
           done ;;
    rswsab) for v in ${TP_WS_VALUES:-1 0}; do   # "def": the variable unset (the defaults)
            ( [ "$v" = def ] && unset NUMASCHED_FUSED_WS || export NUMASCHED_FUSED_WS=$v
            timeout -k 10 ${TP_COLL_TIMEOUT:-240} numasched bench collectives --only rs,mar \
              --rows ${TP_RS_ROWS:-256,1024,2048,4096,16384} --nproc $n --out-dir "$res/rsws$v" 2>&1 \
              | tee "$res/rsws$v-tp$n-$dev.log" | grep -E "matmul_reduce_scatter|matmul_all_reduce|Error|error" | tail -24 )
          done ;;
    rsab) for v in 1 0; do
            NUMASCHED_FUSED_FLAT=$v timeout -k 10 ${TP_COLL_TIMEOUT:-240} numasched bench collectives --only rs \
              --rows ${TP_RS_ROWS:-256,1024,2048,4096,16384} --nproc $n --out-dir "$res/rs-flat$v" 2>&1 \
              | tee "$res/rs-flat$v-tp$n-$dev.log" | grep -E "matmul_reduce_scatter|Error|error" | tail -14
          done ;;
    coll) timeout -k 10 ${TP_COLL_TIMEOUT:-240} numasched bench collectives --quick --nproc $n --out-dir "$res/collectives" 2>&1 \
            | tee "$res/collectives-tp$n-$dev.log" | tail -40 ;;
    ar) timeout -k 10 ${TP_COLL_TIMEOUT:-240} numasched bench collectives --only ar --nproc $n --out-dir "$res/ar" 2>&1 \
          | tee "$res/ar-tp$n-$dev.log" | grep -E "all_r|auto vs" | tail -30 ;;
    decode) for model in ${TP_MODELS:-llama3-8b qwen3-32b}; do
              e2e decode-$model $model 2048,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager
            done ;;
    rope) for fuse in no-fuse-rope-cache fuse-rope-cache; do
            e2e $fuse-llama3-8b llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-240} --prompt 0 --no-eager --$fuse
          done ;;
    prefetch) e2e prefetch-torch llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager --iters ${TP_ITERS:-10} \
                --backends torch
              for v in off on swiglu; do
                NUMASCHED_PDL_PREFETCH=$([[ $v == off ]] && echo 0 || echo 1) e2e prefetch-$v llama3-8b 2048,8192,32768 \
                  ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager --iters ${TP_ITERS:-10} --backends numasched \
                  $([[ $v == swiglu ]] && echo --fuse-swiglu)
              done ;;
    swiglu) e2e swiglu-torch llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager \
              --iters ${TP_ITERS:-10} --backends torch
            for v in ${TP_SWIGLU_VARIANTS:-no-pdl-swiglu pdl-swiglu}; do
              e2e swiglu-$v llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager \
                --iters ${TP_ITERS:-10} --backends numasched --$v
            done ;;
    timeline) e2e timeline-llama3-8b llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-300} --prompt 0 --no-taxes --no-eager \
                --iters ${TP_ITERS:-10} --timeline ;;
    arn|arnk) timeout -k 10 ${TP_COLL_TIMEOUT:-240} numasched bench collectives --only arn --nproc $n --out-dir "$res/arn" 2>&1 \
           | tee "$res/arn-collectives-tp$n-$dev.log" | grep -E "ROW|Error|error" | tail -20
         [[ $part == arnk ]] && { keep; continue; }
         e2e arn-torch llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager \
           --iters ${TP_ITERS:-10} --backends torch
         k=0
         for v in 0 1 1 0; do
           k=$((k + 1))
           NUMASCHED_ARN_LL=$v e2e arn-ll$v-$k llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes \
             --no-eager --iters ${TP_ITERS:-10} --backends numasched
         done ;;
    final) for k in 1 2; do
             for b in torch numasched; do
               e2e final-$b-$k llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager \
                 --iters ${TP_ITERS:-10} --backends $b
             done
           done ;;
    kvpf) e2e kvpf-torch llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 --no-taxes --no-eager \
            --iters ${TP_ITERS:-10} --backends torch
          k=0
          for v in ${TP_KVPF_VALUES:-0 128 0 128}; do
            k=$((k + 1))
            NUMASCHED_DECODE_PREFETCH=$v e2e kvpf-$v-$k llama3-8b 2048,8192,32768 ${TP_E2E_TIMEOUT:-200} --prompt 0 \
              --no-taxes --no-eager --iters ${TP_ITERS:-10} --backends numasched
          done ;;
    mar) NCCL_NVLS_ENABLE=0 timeout -k 10 ${TP_MAR_TIMEOUT:-240} torchrun --nproc-per-node=$n scripts/mar_sweep.py 2>&1 \
           | tee "$res/mar-sweep-tp$n-$dev.log" | tail -40 ;;
    *) echo "unknown part $part" ;;
  esac
  keep
done
