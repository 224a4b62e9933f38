#!/usr/bin/env bash
# The sync figures with and without CUDA MPS, in one device call (from the repository root):
#   OUT=<dir> bash benchmarks/gpu/bench-mps.sh
# seed-lora (every path, the reference paths, the copy floors) without MPS, twice under MPS, llama8b-full
# (cuda_ipc with two 4 GiB slots, and with the trainer's arena) under MPS, then seed-lora without MPS again; each JSON in $OUT/NAME.json.
# benchmarks/seed-lora/mps.json and benchmarks/full-sync/h100-mps-arena.json are two of these files.
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
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  bench seed-lora-1 --workload seed-lora --arena --repeats 20
  mps on
  bench mps-seed-lora-1 --workload seed-lora --arena --repeats 20
  bench mps-seed-lora-2 --workload seed-lora --arena --repeats 20
  bench mps-llama8b-full --workload llama8b-full --transports cuda_ipc --arena --references none --no-floor \
    --bucket-mb cuda_ipc=4096 --slots cuda_ipc=2 --repeats 5 --warmup 2
  mps off
  bench seed-lora-2 --workload seed-lora --arena --repeats 20
} 2>&1 | tee -a "$OUT/bench-mps.log"
