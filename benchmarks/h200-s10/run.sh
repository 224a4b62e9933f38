#!/usr/bin/env bash
# Session 10 on the H200, one device call: OUT=<dir> bash benchmarks/h200-s10/run.sh [STEP...]
#   targets  issue 16's table in one call: seed-lora (every path, the seeds' references, the floors) without MPS,
#            twice under MPS, llama8b-full (cuda_ipc, two 4 GiB slots) under MPS, then seed-lora without MPS again
#   shmab    seed-lora over shm, .ab/old and this tree alternated PAIRS times (../h200-shm/run.sh ab), and traced
#   tests    the gpu-marked tests (../h200-s9/run.sh tests)
#   mutants  each new GPU test against the library with its feature taken out: the test must fail
# The MPS daemon is a user process with private directories, stopped at the end; no GPU setting is changed.
set -u
OUT=${OUT:?}
export PYTHONUNBUFFERED=1 COLUMNS=200 PYTHONPATH=${SITE:-/tmp/site}:$PWD
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
bench() {  # NAME ARGS...: colosync bench, its table in the log and its JSON in $OUT/NAME.json
  local name=$1; shift
  echo "=== $name: colosync bench $* ($(date -u +%T))"
  timeout 240 python3 -m colosync.tools.cli bench "$@" --out "$OUT/$name.json" 2>&1 | grep -v '^\s*$'
}
mps() {  # on | off
  if [ "$1" = on ]; then mkdir -p /tmp/mps-pipe /tmp/mps-log && nvidia-cuda-mps-control -d && sleep 1
  else echo quit | nvidia-cuda-mps-control; sleep 1; fi
  echo "mps $1: $(ls /tmp/mps-pipe 2>/dev/null | tr '\n' ' ')"
}
for what in ${*:-targets}; do
  case $what in
  targets)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      bench seed-lora-1 --workload seed-lora --arena --repeats 20
      mps on
      bench mps-seed-lora-1 --workload seed-lora --arena --repeats 20
      bench mps-seed-lora-2 --workload seed-lora --arena --repeats 20
      bench mps-llama8b-full --workload llama8b-full --transports cuda_ipc --references none --no-floor \
        --bucket-mb cuda_ipc=4096 --slots cuda_ipc=2 --repeats 5 --warmup 2
      mps off
      bench seed-lora-2 --workload seed-lora --arena --repeats 20
    } 2>&1 | tee -a "$OUT/targets.log" ;;
  shmab) PAIRS=${PAIRS:-3} OUT=$OUT bash benchmarks/h200-shm/run.sh ab trace ;;
  tests) OUT=$OUT bash benchmarks/h200-s9/run.sh tests ;;
  mutants)  # the list lives in ../h200-s11/run.sh; session 10's seal-not-awaited edit was
    # 's/if words\[word\] == seal:/if True:/', which since f38e364 matches only the liveness probe
    OUT=$OUT bash benchmarks/h200-s11/run.sh mutants ;;
  *) echo "unknown step $what" ;;
  esac
done
