#!/usr/bin/env bash
# Separated mode over NCCL: one trainer GPU and an engine on each other GPU of one host, as one
# EngineSet, each update checked byte for byte on every engine, beside a raw NCCL broadcast and a
# raw NCCL send to each engine of the same bytes in the same run. Needs 3+ GPUs for two engines
# (the trainer keeps cuda:0). Usage, on the device (after the wheels are installed, PYTHONPATH set):
#   OUT=<dir> ENGINES=2 bash benchmarks/gpu/separated-nccl.sh
# Then the separated-mode GPU tests: the EngineSet suite is CPU/gloo; NCCL is covered by these runs.
set -u
OUT=${OUT:?}
ENGINES=${ENGINES:-2}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
for workload in seed-lora llama8b-full; do
  for transport in broadcast p2p; do
    echo "=== $workload $transport ($(date -u +%T))"
    timeout 280 python3 -m colosync.tools.cli bench-separated --device cuda --engines "$ENGINES" \
      --workload "$workload" --transports "$transport" --bucket-mb 256 --repeats 10 \
      --out "$OUT/$workload-$transport.json" || echo "rc=$? for $workload $transport"
  done
done
