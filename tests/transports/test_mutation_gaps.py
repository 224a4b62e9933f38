"""Transport promises that the mutation run (benchmarks/mutation/) found no test holding."""

from __future__ import annotations

import torch

from colosync.transports.shm import CHUNK_BYTES, ShmSender


def test_shm_slots_on_the_cpu_are_whole_buckets_however_large():
    """Cutting a segment into chunk-sized slots pays only where a host->device copy can pipeline (CUDA);
    a CPU sender keeps one slot per bucket in flight, at the bucket's size."""
    cpu = torch.device("cpu")
    for bucket in (CHUNK_BYTES // 2, CHUNK_BYTES, 4 * CHUNK_BYTES):
        assert ShmSender.geometry(bucket, 2, cpu) == (bucket, 2)
    assert ShmSender.geometry(4 * CHUNK_BYTES, 3, cpu) == (4 * CHUNK_BYTES, 3)
