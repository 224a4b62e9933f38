"""The executor against participants that really allocate and free memory (CPU tensors of
~100 MB per host copy), with host memory measured by the process's anon+shmem."""

from __future__ import annotations

import pytest
import torch

from colosync.errors import ConfigError
from colosync.handoff import HandoffError, HandoffInvariantError, Op, OpReport, Region, build_plan
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.handoff.runtime.invariants import DeviceBudget, HostBudget, NoCoexistingHostCopies
from tests.helpers import CHUNK, make_engine_state, make_trainer_state


def participants(shared_pool: bool = True) -> tuple[TorchTrainerMemory, TorchEngineMemory, list[HostPool]]:
    pools = [HostPool(chunk_bytes=CHUNK, pin="none")]
    if not shared_pool:
        pools.append(HostPool(chunk_bytes=CHUNK, pin="none"))
    model, kv = make_engine_state()  # 48 MiB weights, 32 MiB KV
    engine = TorchEngineMemory(model, kv, pool=pools[-1], device="cpu")
    trainer = TorchTrainerMemory(loader=make_trainer_state, pool=pools[0], device="cpu")  # ~48 MiB backup
    return trainer, engine, pools


def test_gpu_mode_keeps_one_host_copy():
    trainer, engine, (pool,) = participants()
    result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="gpu"), cycles=1)
    assert not result.violations
    larger = max(engine.region_bytes()[Region.ENGINE_MIRROR], trainer.region_bytes()[Region.TRAINER_BACKUP])
    # measured host copies stay within 5% of the larger single copy (+ one pool chunk of rounding)
    assert result.host_peak <= larger * 1.05 + CHUNK
    assert result.host_peak >= larger * 0.75  # and the copy was really measured
    assert pool.capacity_bytes <= larger + CHUNK
    steps = [r.step for r in result.records]
    assert steps[4:7] == ["engine.offload_kv", "trainer.wake_up", "engine.offload_weights(backup=True)"]
    wake = result.records[5]
    assert wake.report.bytes_to_device > 0 and wake.held_after == [
        "engine.weights",
        "trainer.state",
        "trainer.grad_buffer",
        "trainer.cache",
    ]


def test_cpu_mode_measures_both_copies():
    trainer, engine, (pool,) = participants()
    result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="cpu"), cycles=1)
    assert not result.violations
    mirror, backup = engine.region_bytes()[Region.ENGINE_MIRROR], trainer.region_bytes()[Region.TRAINER_BACKUP]
    both = mirror + backup
    # measured: clearly more than one copy at the peak (allowing for allocator noise)
    assert result.host_peak >= 0.8 * both and result.host_peak > 1.4 * max(mirror, backup), (result.host_peak, both)
    assert pool.capacity_bytes >= both
    first_sleep = next(r for r in result.records if (r.phase, r.step) == ("init", "trainer.sleep"))
    assert first_sleep.host_peak >= 0.8 * both  # the backup joins the mirror already at init


def test_cpu_order_breaks_the_gpu_invariant_loudly():
    trainer, engine, _ = participants()
    executor = HandoffExecutor(trainer, engine, extra_invariants=[NoCoexistingHostCopies()])
    with pytest.raises(HandoffInvariantError) as info:
        executor.run(build_plan(peak_device="cpu"))
    message = str(info.value)
    assert "no-coexisting-host-copies" in message
    assert "init step 4 trainer.sleep" in message  # the first step where the backup joins the mirror
    assert "GB" in message and "host_copies_bytes=" in message
    assert info.value.violation.phase == "init"


def test_separate_pools_break_gpu_mode_as_measured():
    # The order is right, but each participant keeps its own pool's chunks: both copies'
    # memory stays on the host. Only measurement can see this.
    trainer, engine, pools = participants(shared_pool=False)
    executor = HandoffExecutor(trainer, engine, invariants=[NoCoexistingHostCopies()])  # this invariant alone
    with pytest.raises(HandoffInvariantError) as info:
        executor.run(build_plan(peak_device="gpu"))
    message = str(info.value)
    assert message.startswith("invariant no-coexisting-host-copies broke"), message
    assert "measured host copies" in message and "exceed the larger single copy" in message
    assert "share one HostPool between trainer and engine" in message
    assert sum(p.capacity_bytes for p in pools) > 90 << 20


def test_participant_that_does_not_do_its_job_is_caught():
    class StuckEngine(TorchEngineMemory):
        def offload_weights(self, backup: bool) -> OpReport:
            return self._noop("offload_weights", "pretends the weights are already gone")

    trainer, _, (pool,) = participants()
    model, kv = make_engine_state(layers=2, kv_tensors=1)
    engine = StuckEngine(model, kv, pool=pool, device="cpu")
    with pytest.raises(HandoffInvariantError, match=r"matches-plan.*rollout_to_train step 3 .*engine.weights"):
        HandoffExecutor(trainer, engine).run(build_plan(peak_device="gpu"))


def test_host_budget_invariant():
    trainer, engine, _ = participants()
    executor = HandoffExecutor(trainer, engine, extra_invariants=[HostBudget(1)], fail_fast=False)
    result = executor.run(build_plan(peak_device="gpu"), cycles=0)
    assert result.violations and all(v.invariant == "host-budget" for v in result.violations)
    assert result.to_dict()["violations"][0]["figures"]["host_abs_bytes"] > 1


def test_run_phase_by_phase_and_report_json():
    trainer, engine, _ = participants()
    plan = build_plan(peak_device="gpu")
    executor = HandoffExecutor(trainer, engine)
    executor.run_phase(plan, "init")
    executor.run_phase(plan, "rollout_to_train")
    trainer.model(torch.randn(2, 1024)).sum().backward()  # a training step's backward
    result = executor.run_phase(plan, "train_to_rollout")
    data = result.to_dict()
    assert [s["step"] for s in data["steps"]][-1] == Op.ENGINE_ONLOAD_KV.value
    assert data["steps"][0]["report"]["participant"] == "engine"
    assert not data["violations"]


def test_device_budget_invariant():
    trainer, engine, _ = participants()
    executor = HandoffExecutor(trainer, engine, extra_invariants=[DeviceBudget(1)], fail_fast=False)
    result = executor.run(build_plan(peak_device="gpu"), cycles=0)
    assert result.violations and {v.invariant for v in result.violations} == {"device-budget"}
    assert "device memory" in result.violations[0].message and "exceeds the limit" in result.violations[0].message


def test_measure_needs_a_started_run():
    trainer, engine, _ = participants()
    executor = HandoffExecutor(trainer, engine)
    with pytest.raises(HandoffError, match=r"measure\(\) works once run\(\) or run_phase\(\) started"):
        executor.measure()
    executor.run_phase(build_plan(peak_device="gpu"), "init")
    assert executor.measure().held == frozenset({Region.ENGINE_WEIGHTS, Region.ENGINE_KV, Region.TRAINER_BACKUP})


def test_run_with_no_phases_still_returns_a_result():
    trainer, engine, _ = participants()
    result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="gpu"), cycles=0, include_init=False)
    assert result.records == [] and result.peak_device == "gpu"


def test_a_declared_trainer_cache_is_expected_on_the_device_until_clear_memory():
    # What a step leaves in the allocator's cache (optimizer temporaries, activations) is the
    # trainer's until clear_memory: the device the executor allows includes it exactly then.
    # On CUDA, a trainer that declared none broke within-simulation at clear_memory.
    cache = 8 << 20
    pool = HostPool(chunk_bytes=CHUNK, pin="none")
    model, kv = make_engine_state()
    engine = TorchEngineMemory(model, kv, pool=pool, device="cpu")
    trainer = TorchTrainerMemory(loader=make_trainer_state, pool=pool, device="cpu", cache_bytes=cache)
    result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="gpu"), cycles=1)
    assert not result.violations
    by_step = {(r.phase, r.step): r for r in result.records}
    clear = by_step[("train_to_rollout", "trainer.clear_memory")]
    after_clear = by_step[("train_to_rollout", "trainer.offload_grad_buffer")]
    assert clear.expected_device_peak - after_clear.expected_device_peak == cache
    assert "trainer.cache" not in clear.held_after


def test_a_negative_trainer_cache_is_refused():
    with pytest.raises(ConfigError, match="cache_bytes must be >= 0"):
        TorchTrainerMemory(loader=make_trainer_state, device="cpu", cache_bytes=-1)
