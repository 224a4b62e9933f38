#!/usr/bin/env bash
# Each GPU test against the library with the feature it guards taken out: every test must fail.
#   OUT=<dir> bash benchmarks/gpu/gpu-mutants.sh        (on the GPU host, from the repository root)
# A mutant edits one file with sed, runs one test, and puts the file back (mutant.sh); a pass means the
# test misses the feature, and "the edit changed nothing" means the sed line no longer matches the code.
set -u
OUT=${OUT:?}
export PYTHONUNBUFFERED=1 PYTHONPATH=${SITE:-/tmp/site}:$PWD
. benchmarks/gpu/mutant.sh
cuda_ipc=tests/transports/test_cuda_ipc.py
sealed=$cuda_ipc::test_shm_on_gpu_sends_each_stage_sealed_and_the_engine_waits_for_the_seal
{
  # shm seals: the trainer's copy stream writes a seal behind each chunk, the engine waits for it
  mutant unsealed colosync/sync/pipeline.py 's/seal = transport.written(slot, on, on_device)/seal = 0/' "$sealed"
  mutant seal-not-awaited colosync/transports/shm.py 's/while words\[word\] != seal:/while False:/' "$sealed"
  mutant seal-on-the-host colosync/transports/shm.py \
    's/seal\[1:\].copy_(numbers.row(self._sealed), non_blocking=True)/seal[1] = self._sealed/' "$sealed"
  # a source's temporaries are read by the copy stream before their memory is reused
  mutant temporaries-unordered colosync/sync/pipeline.py \
    's/packed.record_stream(copier)/pass/; s/torch.cuda.current_stream(device).wait_stream(copier)/pass/' \
    $cuda_ipc::test_shm_on_gpu_copies_out_of_a_sources_temporaries_before_their_memory_is_reused
  # verdict rows, the staging pair and its copy stream
  mutant no-mirror-wait colosync/sync/landing.py 's/self._lander.mirror.wait()  # the rows/pass  # the rows/' \
    tests/sync/test_landing.py::test_gpu_verdicts_are_read_only_once_their_copy_to_the_host_is_done
  mutant staging-unkeyed colosync/sync/pipeline.py 's/(bucket, STAGING, packed.data_ptr(), /(bucket, STAGING, /' \
    tests/transports/test_cuda_graphs.py::test_the_gather_into_the_staging_buffer_replays_and_follows_a_new_staging_buffer
  mutant copier-unordered colosync/sync/pipeline.py '/stream.wait_stream(torch.cuda.current_stream(device))/d' \
    $cuda_ipc::test_shm_on_gpu_copies_a_bucket_out_only_once_it_is_packed
  mutant no-record-stream colosync/sync/pipeline.py 's/checked.record_stream(copier)/pass/' \
    $cuda_ipc::test_shm_on_gpu_fingerprints_of_single_tensor_buckets_in_a_row_stay_their_own
  mutant views-unkeyed colosync/sync/pipeline.py 's/ViewKey(bucket, STAGING - staged)/ViewKey(bucket, STAGING)/' \
    $cuda_ipc::test_shm_staging_views_follow_their_buffer_when_a_bucket_moves_between_devices
} 2>&1 | tee "$OUT/gpu-mutants.log"
