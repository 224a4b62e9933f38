"""The sync as a step the executor runs and measures against the plan (CPU: a real push
through a host staging buffer from the trainer's weights into the engine's)."""

from __future__ import annotations

import pytest
import torch

from colosync.handoff import HandoffInvariantError, Region, build_plan
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.model.participants import WeightSync
from colosync.handoff.runtime.executor import HandoffExecutor
from tests.helpers import CHUNK, make_trainer_state

MiB = 1 << 20


def run(staging_bytes: int, declared_bytes: int):
    pool = HostPool(chunk_bytes=CHUNK, pin="none")
    engine_model, _ = make_trainer_state()  # the engine serves the same architecture
    for p in engine_model.parameters():
        p.requires_grad_(False)
    engine = TorchEngineMemory(engine_model, [], pool=pool, device="cpu")
    trainer = TorchTrainerMemory(loader=make_trainer_state, pool=pool, device="cpu")

    def push(mark):
        """Each weight crosses a host staging buffer into the engine, as a shm transport would."""
        staging = torch.empty(staging_bytes, dtype=torch.uint8)
        staging.fill_(0)
        mark()  # the sync's peak: the staging is held
        with torch.no_grad():
            for src, dst in zip(trainer.model.parameters(), engine_model.parameters(), strict=True):
                dst.copy_(src)
        return "pushed"

    sync = WeightSync(push, {Region.SYNC_TRANSPORT: declared_bytes})
    executor = HandoffExecutor(trainer, engine, sync=sync)
    plan = build_plan(peak_device="gpu", sync=True)
    executor.run_phase(plan, "init")
    executor.run_phase(plan, "rollout_to_train")
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)  # "training"
    result = executor.run_phase(plan, "train_to_rollout")
    return result, trainer, engine_model


def test_the_sync_step_runs_and_is_measured_within_its_plan():
    result, trainer, engine_model = run(staging_bytes=64 * MiB, declared_bytes=64 * MiB)
    assert not result.violations
    record = next(r for r in result.records if r.step == "sync.weights")
    assert record.phase == "train_to_rollout" and record.report.note == "pushed: 'pushed'"
    assert record.host_peak - record.host_before >= 48 * MiB  # the staging was really measured
    assert record.expected_host_peak >= 64 * MiB  # and planned
    trainer.wake_up()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), engine_model.parameters(), strict=True))


def test_a_sync_that_holds_more_than_its_plan_breaks_within_simulation():
    with pytest.raises(
        HandoffInvariantError, match=r"within-simulation broke at train_to_rollout step 4 sync.weights \(peak\)"
    ):
        run(staging_bytes=256 * MiB, declared_bytes=4 * MiB)
