#!/usr/bin/env bash
# Session 11 on the H200, one device call: OUT=<dir> bash benchmarks/h200-s11/run.sh [STEP...]
#   tests    the gpu-marked tests of sync, faults, wire, transports, engines, handoff (../h200-s9/run.sh tests)
#   mutants  the GPU tests of the seals and of a source's temporaries against the library with that feature taken
#            out: each test must fail (call 1 also took the chunk ramp out: `no-ramp`, gone with the ramp)
#   edges    seed-lora over shm, the chunk ramp off (0) and on (8 MiB) alternated (EDGES, MiB; ../h200-s9/run.sh edges);
#            it needs COLOSYNC_SHM_EDGE_MB, which only a6a6d18 has: the ramp measured even and is out again
#   targets  issue 16's table, without and under MPS (../h200-s10/run.sh targets)
set -u
OUT=${OUT:?}
export PYTHONUNBUFFERED=1 PYTHONPATH=${SITE:-/tmp/site}:$PWD
for what in ${*:-tests mutants}; do
  case $what in
  tests | edges) EDGES=${EDGES:-0 8 0 8 0 8} OUT=$OUT bash benchmarks/h200-s9/run.sh "$what" ;;
  targets) OUT=$OUT bash benchmarks/h200-s10/run.sh targets ;;
  mutants)
    . benchmarks/h200-s9/mutant.sh
    sealed=tests/transports/test_cuda_ipc.py::test_shm_on_gpu_sends_each_stage_sealed_and_the_engine_waits_for_the_seal
    {
      mutant unsealed colosync/sync/pipeline.py 's/seal = transport.written(slot, on, on_device)/seal = 0/' "$sealed"
      mutant seal-not-awaited colosync/transports/shm.py 's/while words\[word\] != seal:/while False:/' "$sealed"
      mutant seal-on-the-host colosync/transports/shm.py \
        's/seal\[1:\].copy_(numbers.row(self._sealed), non_blocking=True)/seal[1] = self._sealed/' "$sealed"
      mutant temporaries-unordered colosync/sync/pipeline.py \
        's/packed.record_stream(copier)/pass/; s/torch.cuda.current_stream(device).wait_stream(copier)/pass/' \
        tests/transports/test_cuda_ipc.py::test_shm_on_gpu_copies_out_of_a_sources_temporaries_before_their_memory_is_reused
    } 2>&1 | tee "$OUT/mutants.log" ;;
  *) echo "unknown step $what" ;;
  esac
done
