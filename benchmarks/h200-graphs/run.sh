#!/usr/bin/env bash
# One device run for issue 16: the GPU tests of the transports, landing and faults, then the benches.
#   OUT=benchmarks/h200-graphs bash benchmarks/h200-graphs/run.sh [tests|seed|big|all]
set -u
OUT=${OUT:-benchmarks/h200-graphs}
WHAT=${1:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-200}
PY=${PY:-python3}
log="$OUT/run.log"
step() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$log"; }
bench() { timeout "${BENCH_TIMEOUT:-240}" $PY -m colosync.tools.cli bench "$@" 2>&1 | grep -v '^\s*$' | tee -a "$log"; }

step machine
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'; nproc; } >>"$log" 2>&1
if [ "$WHAT" = variants ]; then
  # cuda_ipc on seed-lora with each part switched off in turn (same process tree, same GPU, back to back)
  for v in "default:" "host-wait:COLOSYNC_CUDA_IPC_WAIT=host" "no-events:COLOSYNC_CUDA_IPC_EVENTS=0" \
           "no-graphs:COLOSYNC_NO_CUDA_GRAPHS=1" "neither:COLOSYNC_CUDA_IPC_EVENTS=0 COLOSYNC_NO_CUDA_GRAPHS=1"; do
    name=${v%%:*}; vars=${v#*:}
    step "variant $name ($vars)"
    env $vars timeout 120 $PY -m colosync.tools.cli bench --workload seed-lora --transports cuda_ipc --arena \
      --references none --no-floor --repeats ${SEED_REPEATS:-20} --out "$OUT/variant-$name.json" 2>&1 \
      | grep -E "^(cuda_ipc|│ cuda_ipc)" | tee -a "$log"
  done
fi
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  step "gpu tests"
  timeout "${TEST_TIMEOUT:-330}" $PY -m pytest -q -m gpu -o addopts="" -p no:cacheprovider --timeout 120 -rs \
    ${TESTS:-tests/transports tests/sync tests/faults} >"$OUT/${TESTLOG:-gpu-tests.txt}" 2>&1
  echo "pytest exit $?" >>"$OUT/${TESTLOG:-gpu-tests.txt}"
  grep -E "passed|failed|error|FAILED|ERROR" "$OUT/${TESTLOG:-gpu-tests.txt}" | tail -25 | tee -a "$log"
fi
if [ "$WHAT" = seed ] || [ "$WHAT" = all ]; then
  step "seed-lora: every path, the seeds' references and the floor"
  bench --workload seed-lora --arena --repeats ${SEED_REPEATS:-20} --out "$OUT/seed-lora.json"
fi
if [ "$WHAT" = big ] || [ "$WHAT" = all ]; then
  step "llama8b-full: cuda_ipc in 4 GiB buckets, one slot (and the arena)"
  bench --workload llama8b-full --transports cuda_ipc --arena --references none --no-floor --bucket-mb cuda_ipc=4096 \
    --slots cuda_ipc=1 --repeats ${BIG_REPEATS:-5} --warmup 2 --out "$OUT/llama8b-full.json"
fi
step done
