#!/bin/bash
# The gpu-marked tests, in streams that run side by side on the one H200, each stream in its own
# mount namespace with a private /dev/shm, so that the run-wide shared-memory leak check of one
# pytest never counts the live segments of another.  Usage (on the device, after the wheels are
# installed and PYTHONPATH set): bash benchmarks/gpu/test-streams.sh NAME "PYTEST ARGS" [NAME "ARGS"]...
set -u
OUT=${OUT:?}
LIMIT=${LIMIT:-280}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "python", sys.version.split()[0], "gpus", torch.cuda.device_count())'
  uname -r; nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if unshare -m --propagation private true 2>/dev/null; then NS="unshare -m --propagation private"; else NS=""; echo "no unshare: streams share /dev/shm"; fi
pids=()
while [ $# -ge 2 ]; do
  name=$1 args=$2; shift 2
  (
    start=$(date +%s)
    $NS bash -c \
      "[ -n \"$NS\" ] && { mount -t tmpfs -o size=64g tmpfs /dev/shm || echo 'no private /dev/shm'; }; \
       PYTHONUNBUFFERED=1 timeout $LIMIT python3 -m pytest -v -m gpu -o addopts='' -p no:cacheprovider \
       --timeout 100 -rfE --durations=15 $args" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "pytest rc=$rc wall_s=$(( $(date +%s) - start ))" >>"$OUT/$name.txt"
  ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/*.txt; do echo "== $f"; tail -n 4 "$f"; done
