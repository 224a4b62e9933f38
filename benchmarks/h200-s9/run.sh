#!/usr/bin/env bash
# Session 9 on the H200, one device call: OUT=<dir> bash benchmarks/h200-s9/run.sh [STEP...]
#   ab       seed-lora over shm, .ab/old and this tree alternated PAIRS times, then this tree traced (../h200-shm/run.sh)
#   tests    the gpu-marked tests of sync, faults, wire, transports, engines, handoff (../h200-session4/run.sh)
#   edges    seed-lora over shm with the chunk ramp at the update's ends, alternated (EDGES="0 8 4 ...", MiB);
#            the ramp (COLOSYNC_SHM_EDGE_MB) was in the library for call 8 only (d7e6a8e) and is gone again
#   timeline the trainer's GPU timeline of seed-lora pushes over shm (gpu_timeline.py)
#   mutants  each new GPU test against the library with its feature taken out: the test must fail
# .ab/old is made before the call: rm -rf .ab && mkdir -p .ab/old && git archive <commit> colosync | tar -x -C .ab/old
set -u
OUT=${OUT:?}
export PYTHONUNBUFFERED=1 PYTHONPATH=${SITE:-/tmp/site}:$PWD
. benchmarks/h200-s9/mutant.sh
for what in ${*:-ab tests mutants}; do
  case $what in
  ab) PAIRS=${PAIRS:-3} OUT=$OUT bash benchmarks/h200-shm/run.sh ab trace ;;
  tests)
    mkdir -p "$OUT/tests"
    LIMIT=${LIMIT:-330} OUT=$OUT/tests bash benchmarks/h200-session4/run.sh sync-faults "tests/sync tests/faults" \
      wire-transports "tests/wire tests/transports"
    # alone: the handoff's device invariant reads cudaMemGetInfo, which counts every process on the GPU
    LIMIT=120 OUT=$OUT/tests bash benchmarks/h200-session4/run.sh engines-handoff "tests/engines tests/handoff" ;;
  mutants)
    {
      mutant no-mirror-wait colosync/sync/landing.py 's/self._lander.mirror.wait()  # the rows/pass  # the rows/' \
        tests/sync/test_landing.py::test_gpu_verdicts_are_read_only_once_their_copy_to_the_host_is_done
      mutant staging-unkeyed colosync/sync/pipeline.py 's/(bucket, STAGING, packed.data_ptr(), /(bucket, STAGING, /' \
        tests/transports/test_cuda_graphs.py::test_the_gather_into_the_staging_buffer_replays_and_follows_a_new_staging_buffer
      mutant copier-unordered colosync/sync/pipeline.py '/stream.wait_stream(torch.cuda.current_stream(device))/d' \
        tests/transports/test_cuda_ipc.py::test_shm_on_gpu_copies_a_bucket_out_only_once_it_is_packed
      mutant no-record-stream colosync/sync/pipeline.py 's/checked.record_stream(copier)/pass/' \
        tests/transports/test_cuda_ipc.py::test_shm_on_gpu_fingerprints_of_single_tensor_buckets_in_a_row_stay_their_own
      mutant views-unkeyed colosync/sync/pipeline.py 's/ViewKey(bucket, STAGING - staged)/ViewKey(bucket, STAGING)/' \
        tests/transports/test_cuda_ipc.py::test_shm_staging_views_follow_their_buffer_when_a_bucket_moves_between_devices
    } 2>&1 | tee "$OUT/mutants.log" ;;
  edges)  # the chunk ramp at an update's ends (COLOSYNC_SHM_EDGE_MB; 0: none), alternated
    for e in ${EDGES:-0 8 4 0 8 4 0 8 4}; do
      echo "=== shm, edge $e MiB ($(date -u +%T))"
      COLOSYNC_SHM_EDGE_MB=$e timeout 60 python3 -m colosync.tools.cli bench --workload seed-lora --transports shm \
        --references none --no-floor --repeats 20 --out /tmp/shm.json 2>&1 | grep -E "^(│ )?shm"
    done 2>&1 | tee -a "$OUT/edges.log" ;;
  timeline)
    timeout 120 python3 benchmarks/h200-s9/gpu_timeline.py --workload seed-lora --transport shm >"$OUT/gpu-timeline.txt" 2>&1
    tail -n 40 "$OUT/gpu-timeline.txt" ;;
  *) echo "unknown step $what" ;;
  esac
done
