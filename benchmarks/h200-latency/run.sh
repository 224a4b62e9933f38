#!/usr/bin/env bash
# Issue 16 on the H200, in one device call: OUT=<dir> bash benchmarks/h200-latency/run.sh STEP...
#   env      the machine
#   kernels  GPU time of the pack and landing kernels alone (kernels.py)
#   trace    seed-lora through cuda_ipc, cuda_ipc + arena and shm with both processes traced (timeline.py)
#   variants seed-lora cuda_ipc, the engine's host poll and stream wait alternated twice, and without graphs
#   seed     colosync bench seed-lora: every path, the seeds' references and the floors
#   big      colosync bench llama8b-full: cuda_ipc in 4 GiB buckets through one slot, and the arena
#   bigvariants  llama8b-full cuda_ipc at other bucket sizes and slot counts (BIG_VARIANTS="MiB:slots ...")
#   shmchunks  seed-lora over shm at other chunk sizes (SHM_CHUNKS="16 8 4 32", MiB)
#   tests    the gpu-marked tests of the transports, the sync, the wire and the faults
set -u
OUT=${OUT:?}
PY=${PY:-python3}
HERE=benchmarks/h200-latency
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-200}
log="$OUT/run.log"
step() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$log"; }
bench() { timeout "${BENCH_TIMEOUT:-240}" $PY -m colosync.tools.cli bench "$@" 2>&1 | grep -v '^\s*$' | tee -a "$log"; }
for what in "$@"; do
  case $what in
  env)
    step machine
    { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; git log --oneline -1
      $PY -c 'import torch, triton, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "python", sys.version.split()[0])'
      nproc; } 2>&1 | tee -a "$log" ;;
  kernels)
    step "kernels alone"
    timeout 300 $PY $HERE/kernels.py --out "$OUT/kernels.json" 2>&1 | tee -a "$log" ;;
  trace)
    for spec in "cuda_ipc:--transports cuda_ipc" "arena:--transports cuda_ipc --arena" "shm:--transports shm" \
                "arena-stream-wait:--transports cuda_ipc --arena"; do
      name=${spec%%:*}; args=${spec#*:}; dir=/tmp/trace-$name
      step "traced seed-lora: $name"
      rm -rf "$dir"; mkdir -p "$dir"
      wait=host; [ "$name" = arena-stream-wait ] && wait=stream
      COLOSYNC_CUDA_IPC_WAIT=$wait COLOSYNC_TRACE_DIR=$dir PYTHONPATH=$HERE/trace:${PYTHONPATH:-} timeout 180 $PY -m colosync.tools.cli bench \
        --workload seed-lora $args --references none --no-floor --repeats 20 --out "$dir/bench.json" 2>&1 \
        | grep -E "^(│ )?(cuda_ipc|shm)" | tee -a "$log"
      { echo "## $name"; $PY $HERE/timeline.py "$dir" --last 20; echo; } >>"$OUT/timelines.txt" 2>&1
    done ;;
  variants)
    for v in "host-poll:COLOSYNC_CUDA_IPC_WAIT=host" "stream-wait:COLOSYNC_CUDA_IPC_WAIT=stream" \
             "host-poll:COLOSYNC_CUDA_IPC_WAIT=host" "stream-wait:COLOSYNC_CUDA_IPC_WAIT=stream" \
             "no-graphs:COLOSYNC_NO_CUDA_GRAPHS=1"; do
      name=${v%%:*}; vars=${v#*:}
      step "variant $name ($vars)"
      env $vars timeout 120 $PY -m colosync.tools.cli bench --workload seed-lora --transports cuda_ipc --arena \
        --references none --no-floor --repeats 20 --out "/tmp/variant-$name.json" 2>&1 \
        | grep -E "^(│ )?cuda_ipc|phases|pack" | tee -a "$log"
    done ;;
  seed)
    step "seed-lora: every path, the seeds' references and the floor"
    bench --workload seed-lora --arena --repeats 20 --out "$OUT/seed-lora.json" ;;
  big)
    step "llama8b-full: cuda_ipc in 4 GiB buckets, one slot (and the arena)"
    bench --workload llama8b-full --transports cuda_ipc --arena --references none --no-floor --bucket-mb cuda_ipc=4096 \
      --slots cuda_ipc=1 --repeats "${BIG_REPEATS:-5}" --warmup 2 --out "$OUT/llama8b-full.json" ;;
  bigvariants)
    for v in ${BIG_VARIANTS:-4096:1 2048:2 1024:2 4096:2}; do
      mb=${v%%:*}; slots=${v#*:}
      step "llama8b-full cuda_ipc: $slots slot(s) of $mb MiB"
      timeout 150 $PY -m colosync.tools.cli bench --workload llama8b-full --transports cuda_ipc --references none \
        --no-floor --bucket-mb cuda_ipc=$mb --slots cuda_ipc=$slots --repeats "${BIG_REPEATS:-5}" --warmup 2 \
        --out "/tmp/llama8b-$mb-$slots.json" 2>&1 | grep -E "^(│ )?cuda_ipc" | tee -a "$log"
    done ;;
  shmchunks)
    for mb in ${SHM_CHUNKS:-16 8 4 32}; do
      step "seed-lora shm: $mb MiB chunks"
      COLOSYNC_SHM_CHUNK_MB=$mb timeout 60 $PY -m colosync.tools.cli bench --workload seed-lora --transports shm \
        --references none --no-floor --repeats 20 --out "/tmp/shm-chunk$mb.json" 2>&1 | grep -E "^(│ )?shm" | tee -a "$log"
    done ;;
  tests)
    step "gpu tests: ${TESTS:-tests/wire tests/transports tests/sync tests/faults}"
    timeout "${TEST_TIMEOUT:-330}" $PY -m pytest -q -m gpu -o addopts="" -p no:cacheprovider --timeout 120 -rfEs \
      ${TESTS:-tests/wire tests/transports tests/sync tests/faults} >"$OUT/${TESTLOG:-gpu-tests.txt}" 2>&1
    echo "pytest exit $?" >>"$OUT/${TESTLOG:-gpu-tests.txt}"
    tail -n 25 "$OUT/${TESTLOG:-gpu-tests.txt}" | tee -a "$log" ;;
  *) echo "unknown step $what" | tee -a "$log" ;;
  esac
done
step done
