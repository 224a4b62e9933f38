"""Both handoff orders on a real CUDA device with pinned host memory (skipped without CUDA).

Sizes are moderate (engine 4 GB + 8 GB KV, trainer 2 GB of parameters = 8 GB resident) so the
test fits any recent GPU; ``benchmarks/handoff/gpu_handoff.py`` records the full-size run.
"""

from __future__ import annotations

import gc

import pytest
import torch

from colosync.handoff import Region, build_plan
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.handoff.runtime.sampling import HostSampler
from colosync.tools.bench.synthetic import engine_state, trainer_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GB = 10**9
CHUNK = 256 << 20


def run_mode(mode: str) -> tuple[object, dict[Region, int], list[float]]:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # CUDA context before the baseline
    gc.collect()
    torch.cuda.empty_cache()
    baseline = HostSampler().sample().value
    pool = HostPool(chunk_bytes=CHUNK)
    model, kv = engine_state(4 * GB, 8 * GB, device=device)
    engine = TorchEngineMemory(model, kv, pool=pool)
    trainer = TorchTrainerMemory(loader=lambda: trainer_state(2 * GB, device=device), pool=pool, device=device)
    # allocate the pinned pool once, up front, as a deployment would: the larger copy in gpu
    # mode, both in cpu mode (it counts as host copies: the baseline was taken before)
    mirror, backup = engine.region_bytes()[Region.ENGINE_MIRROR], 3 * 2 * GB
    pool.reserve(max(mirror, backup) if mode == "gpu" else mirror + backup)
    weights = [p.detach().float().sum().item() for p in list(model.parameters())[:3]]
    executor = HandoffExecutor(trainer, engine, baseline_host_bytes=baseline, watch_interval_s=0.002, pools=[pool])
    try:
        result = executor.run(build_plan(peak_device=mode), cycles=2)
        assert [p.detach().float().sum().item() for p in list(model.parameters())[:3]] == weights
        sizes = {**engine.region_bytes(), **trainer.region_bytes()}
        rates = [
            r.report.gbps
            for r in result.records
            if r.step in ("trainer.sleep", "trainer.wake_up") and r.phase != "init"
        ]
    finally:  # leave the device and the pinned pages clean for the next test, pass or fail
        trainer.wake_up()  # gives its lease back, so trim() can unregister every chunk
        engine.onload_weights()
        del engine, trainer, model, kv, executor
        gc.collect()
        pool.trim()
        torch.cuda.empty_cache()
    return result, sizes, rates


def test_gpu_mode_keeps_one_host_copy_on_a_real_device():
    result, sizes, rates = run_mode("gpu")
    assert not result.violations
    larger = max(sizes[Region.ENGINE_MIRROR], sizes[Region.TRAINER_BACKUP])
    assert result.host_peak <= 1.05 * larger + CHUNK
    assert result.host_peak >= 0.9 * larger  # the pinned copy is really counted
    assert result.device_peak <= torch.cuda.get_device_properties(0).total_memory
    assert min(rates) > 10, rates  # pinned chunked copies, far above pageable rates


def test_cpu_mode_holds_both_copies_on_a_real_device():
    result, sizes, _ = run_mode("cpu")
    assert not result.violations
    both = sizes[Region.ENGINE_MIRROR] + sizes[Region.TRAINER_BACKUP]
    assert result.host_peak >= 0.95 * both
