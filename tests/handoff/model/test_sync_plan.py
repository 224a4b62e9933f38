"""The weight sync as a step of train_to_rollout: where plans put it, what the simulator
charges for it, and what a custom plan may not do with it."""

from __future__ import annotations

import pytest

from colosync.handoff import HandoffSizes, Op, Plan, PlanError, Region, SizesError, build_plan, compare, simulate

GB = 10**9
MiB = 1 << 20
BASE = dict(
    engine_weight_bytes=16 * GB, engine_kv_bytes=60 * GB, trainer_resident_bytes=48 * GB, trainer_backup_bytes=40 * GB
)


def t2r(mode: str) -> list[str]:
    return [s.label for s in build_plan(peak_device=mode, sync=True).phase("train_to_rollout").steps]


def test_plans_put_the_sync_where_both_weights_are_on_the_device():
    assert t2r("gpu")[2:5] == ["engine.onload_weights", "sync.weights", "trainer.sleep"]
    assert t2r("cpu") == ["engine.onload_weights", "sync.weights", "trainer.sleep", "engine.onload_kv"]
    assert "sync.weights" not in [s.label for s in build_plan(peak_device="gpu").phase("train_to_rollout").steps]
    step = build_plan(peak_device="gpu", sync=True).phase("train_to_rollout").steps[3]
    assert (
        set(step.allocates)
        == set(step.frees)
        == {
            Region.SYNC_TRANSPORT,
            Region.SYNC_STAGING,
            Region.SYNC_PREPARED,
            Region.SYNC_HOST_STAGING,
        }
    )


def test_a_sync_while_the_trainer_sleeps_is_rejected():
    config = build_plan(peak_device="cpu").config
    with pytest.raises(PlanError, match=r"train_to_rollout step 2 sync.weights does nothing"):
        Plan.from_ops(
            config,
            {
                "init": [s.op for s in build_plan(config).phase("init").steps],
                "rollout_to_train": [s.op for s in build_plan(config).phase("rollout_to_train").steps],
                "train_to_rollout": [Op.TRAINER_SLEEP, Op.SYNC_WEIGHTS, Op.ENGINE_ONLOAD_WEIGHTS, Op.ENGINE_ONLOAD_KV],
            },
        )


def test_simulator_charges_a_full_sync_twice_its_bytes_plus_slots():
    sizes = HandoffSizes(**BASE, sync_kind="full", sync_bytes=16 * GB)
    sim = simulate(build_plan(peak_device="gpu", sync=True), sizes)
    row = next(r for r in sim.rows if r.step == "sync.weights")
    slots = 2 * (64 * MiB)
    assert row.device_peak - row.device_before == 2 * 16 * GB  # staging + prepared copy
    assert row.host_peak - row.host_before == slots  # shm slots on the host
    assert row.device_after == row.device_before and row.host_after == row.host_before  # transient
    via_ipc = HandoffSizes(**BASE, sync_kind="full", sync_bytes=16 * GB, sync_transport="cuda_ipc")
    row = next(r for r in simulate(build_plan(peak_device="gpu", sync=True), via_ipc).rows if r.step == "sync.weights")
    assert row.device_peak - row.device_before == 2 * 16 * GB + slots and row.host_peak == row.host_before


def test_a_host_staged_full_sync_holds_one_bucket_on_the_device_and_takes_its_turn_in_the_arena():
    from colosync.handoff.model.simulator import arena_bytes

    bucket, chunk = 64 * MiB, 1 << 30
    host = HandoffSizes(**BASE, sync_kind="full", sync_bytes=16 * GB, sync_transport="cuda_ipc", sync_staging="host")
    for mode in ("gpu", "cpu"):
        plan = build_plan(peak_device=mode, sync=True)
        row = next(r for r in simulate(plan, host).rows if r.step == "sync.weights")
        assert row.device_peak - row.device_before == bucket + 2 * bucket  # one bucket beside the two slots
        assert row.host_peak - row.host_before == 16 * GB  # the staging, while neither copy exists
        # the arena the copies need already holds the staging: it takes the engine mirror's turn
        sizes = host.region_bytes()
        assert arena_bytes(plan, sizes, chunk_bytes=chunk) == arena_bytes(
            plan, {**sizes, Region.SYNC_HOST_STAGING: 0}, chunk_bytes=chunk
        )
    big = {**host.region_bytes(), Region.SYNC_HOST_STAGING: 200 * GB}  # larger than both copies
    assert arena_bytes(build_plan(peak_device="gpu", sync=True), big, chunk_bytes=chunk) >= 200 * GB
    with pytest.raises(SizesError, match="host only for a full sync"):
        HandoffSizes(**BASE, sync_kind="lora", sync_bytes=GB, sync_staging="host")


def test_simulator_lora_sync_and_compare_plans_it():
    lora = 169_417_728
    sizes = HandoffSizes(**BASE, sync_kind="lora", sync_bytes=lora, gpu_bytes=141 * GB)
    result = compare(sizes)  # sizes with a sync make compare plan it
    for sim in result.simulations.values():
        row = next(r for r in sim.rows if r.step == "sync.weights")
        assert row.device_peak - row.device_before == 2 * lora
        assert row.host_peak - row.host_before == 2 * 64 * MiB  # a bucket each of the two slots
    assert sizes.sync_region_bytes()[Region.SYNC_TRANSPORT] == 2 * 64 * MiB
    small = HandoffSizes(**BASE, sync_kind="lora", sync_bytes=8 * MiB)
    assert small.sync_region_bytes()[Region.SYNC_TRANSPORT] == 2 * 8 * MiB  # a bucket no larger than the update


def test_sync_sizes_are_checked():
    with pytest.raises(SizesError, match="sync_kind must be one of"):
        HandoffSizes(**BASE, sync_kind="delta", sync_bytes=1)
    with pytest.raises(SizesError, match="together"):
        HandoffSizes(**BASE, sync_bytes=1)
