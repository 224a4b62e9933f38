#!/usr/bin/env bash
# Tuning runs behind the defaults: profiles and a few geometries (see benchmarks/README.md).
set -u
OUT=${OUT:-benchmarks/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-200}
PY=${PY:-python3}
log="$OUT/tune.log"
b() { echo "=== bench $*" >>"$log"; $PY -m colosync.tools.cli bench "$@" 2>&1 | grep -v "^\s*$" | grep -v "━\|──\|┃ path" >>"$log"; }
$PY benchmarks/profile_sync.py --workload seed-lora --transport cuda_ipc >"$OUT/prof-seed-ipc.txt" 2>&1
$PY benchmarks/profile_sync.py --workload seed-lora --transport shm --bucket-mb 64 >"$OUT/prof-seed-shm.txt" 2>&1
b --workload seed-lora --arena --references fresh_ipc --no-floor --repeats 20
COLOSYNC_SHM_CHUNK_MB=32 b --workload seed-lora --transports shm --references none --no-floor --repeats 20
b --workload llama8b-full --transports cuda_ipc --arena --references none --no-floor --repeats 5 --warmup 2 --bucket-mb 1024
b --workload llama8b-full --transports cuda_ipc --references none --no-floor --repeats 5 --warmup 2 --bucket-mb 256 --slots 4
b --workload llama8b-full --transports shm --references none --no-floor --repeats 3 --warmup 1
COLOSYNC_SHM_CHUNK_MB=32 b --workload llama8b-full --transports shm --references none --no-floor --repeats 3 --warmup 1
