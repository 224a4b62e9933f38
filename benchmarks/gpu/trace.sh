#!/usr/bin/env bash
# Where a seed-lora sync's time goes, across both processes: OUT=<dir> bash benchmarks/gpu/trace.sh [NAME...]
# Runs seed-lora through each path with both the trainer and the engine traced (trace/sitecustomize.py
# on PYTHONPATH wraps the sync's functions) and appends each path's median timeline (trace/timeline.py)
# to $OUT/timelines.txt. NAME is one of cuda_ipc, arena, shm, arena-stream-wait (default: all four).
set -u
OUT=${OUT:?}
PY=${PY:-python3}
HERE=benchmarks/gpu/trace
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-200}
declare -A ARGS=([cuda_ipc]="--transports cuda_ipc" [arena]="--transports cuda_ipc --arena" [shm]="--transports shm"
                 [arena-stream-wait]="--transports cuda_ipc --arena")
for name in ${*:-cuda_ipc arena shm arena-stream-wait}; do
  dir=/tmp/trace-$name
  echo "=== traced seed-lora: $name ($(date -u +%H:%M:%S))"
  rm -rf "$dir"; mkdir -p "$dir"
  wait=host; [ "$name" = arena-stream-wait ] && wait=stream
  COLOSYNC_CUDA_IPC_WAIT=$wait COLOSYNC_TRACE_DIR=$dir PYTHONPATH=$HERE:${PYTHONPATH:-}:$PWD timeout 180 \
    $PY -m colosync.tools.cli bench --workload seed-lora ${ARGS[$name]} --references none --no-floor --repeats 20 \
    --out "$dir/bench.json" 2>&1 | grep -E "^(│ )?(cuda_ipc|shm)"
  { echo "## $name"; $PY $HERE/timeline.py "$dir" --last 20; echo; } >>"$OUT/timelines.txt" 2>&1
done
tail -n 60 "$OUT/timelines.txt"
