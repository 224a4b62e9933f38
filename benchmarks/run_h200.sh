#!/usr/bin/env bash
# Reproduce the sync benchmarks quoted in benchmarks/README.md on one CUDA GPU (an H200 there):
#   OUT=benchmarks/h200 bash benchmarks/run_h200.sh
# Writes run.log (all text output), probe.json, seed-lora*.json, llama8b-full*.json, gpu-tests.txt.
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-200}
PY=${PY:-python3}
log="$OUT/run.log"
step() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$log"; }
bench() { $PY -m colosync.tools.cli bench "$@" 2>&1 | grep -v '^\s*$' >>"$log"; }

step machine
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; nproc; } >>"$log" 2>&1

step probe
$PY -m colosync.tools.cli probe --json >"$OUT/probe.json" 2>>"$log"
$PY -m colosync.tools.cli probe >>"$log" 2>&1

step "seed-lora: every path, the seeds' references and the floor"
bench --workload seed-lora --arena --repeats ${SEED_REPEATS:-20} --out "$OUT/seed-lora.json"
step "seed-lora: shm with 8 MiB chunks"
COLOSYNC_SHM_CHUNK_MB=8 bench --workload seed-lora --transports shm --references none --no-floor --repeats ${SEED_REPEATS:-20} --out "$OUT/seed-lora-shm8.json"

step "llama8b-full: cuda_ipc in 4 GiB buckets, one slot; shm in 32 MiB chunks"
COLOSYNC_SHM_CHUNK_MB=32 bench --workload llama8b-full --arena --references fresh_ipc --bucket-mb cuda_ipc=4096,shm=64 \
  --slots cuda_ipc=1,shm=2 --repeats ${BIG_REPEATS:-5} --warmup 2 --out "$OUT/llama8b-full.json"
step "llama8b-full: cuda_ipc in 1 GiB buckets, two slots"
bench --workload llama8b-full --transports cuda_ipc --references none --no-floor --bucket-mb 1024 --slots 2 \
  --repeats ${BIG_REPEATS:-5} --warmup 2 --out "$OUT/llama8b-full-ipc1g.json"

if [ -z "${SKIP_TESTS:-}" ]; then
  step "gpu tests"
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -m gpu tests/gpu tests/test_transport_contract.py -p no:cacheprovider -o addopts="" -rs >"$OUT/gpu-tests.txt" 2>&1
  tail -3 "$OUT/gpu-tests.txt" >>"$log"
fi
step done
