"""The remote handoff on a real CUDA device (skipped without CUDA): the hf engine on the GPU
in its own process, the trainer on the GPU here, one pinned arena registered in both."""

from __future__ import annotations

import pytest
import torch

from colosync.engines.config import Generate
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.handoff import Region, build_plan
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.tools.bench.synthetic import trainer_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHUNK = 64 << 20
GB = 10**9


def test_remote_engine_on_cuda_through_a_pinned_arena(tiny_model_dir):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)
    proc = EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir), device="cuda"))
    plan = build_plan(peak_device="gpu")
    try:
        before = proc.call(Generate([[1, 2, 3]], 6)).tokens
        mirror = proc.memory(chunk_bytes=CHUNK).region_bytes()[Region.ENGINE_MIRROR]
        backup = 3 * GB // 2  # trainer_state(0.5 GB): weights + two Adam moments
        arena = HostArena.for_plan(
            plan, {Region.ENGINE_MIRROR: mirror, Region.TRAINER_BACKUP: backup}, chunk_bytes=CHUNK
        )
        assert arena.pinned
        engine = proc.memory(arena=arena)
        arena.seal()
        trainer = TorchTrainerMemory(loader=lambda: trainer_state(GB // 2, device=device), pool=arena.pool())
        result = HandoffExecutor(trainer, engine, pools=[arena.pool()], watch_interval_s=0.005).run(plan, cycles=2)
        assert not result.violations
        sleep = next(r for r in result.records if r.step == "trainer.sleep")
        assert sleep.report.gbps > 2  # pinned (pageable copies of this size run slower)
        assert proc.call(Generate([[1, 2, 3]], 6)).tokens == before
        arena.close()
    finally:
        proc.close()
