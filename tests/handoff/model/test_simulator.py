"""The simulator, including the K3 GB300 verdicts of seeds/003 (``colosync plan`` is in tests/tools)."""

from __future__ import annotations

import json

import msgspec
import pytest

from colosync import workloads
from colosync.errors import ConfigError
from colosync.handoff import (
    HandoffSizes,
    SizesError,
    build_plan,
    compare,
    load_handoff_sizes,
    simulate,
)

GB = 10**9


@pytest.fixture(scope="module")
def k3():
    doc = workloads.load("k3-gb300", kind="handoff")
    return HandoffSizes.from_workload(doc), doc


def test_k3_preset_verdicts(k3):
    sizes, doc = k3
    assert sizes.host_budget_bytes == 898 * 2**30
    result = compare(sizes)
    cpu, gpu = result.simulations["cpu"], result.simulations["gpu"]
    assert not cpu.fits_host and cpu.host_peak > sizes.host_budget_bytes
    assert cpu.both_host_copies
    assert gpu.fits and not gpu.both_host_copies
    assert gpu.host_peak == pytest.approx(770 * GB, rel=0.01)
    assert gpu.device_peak <= sizes.gpu_bytes
    assert result.recommended == "gpu"
    expect = doc["expect"]
    assert cpu.fits == expect["cpu_mode_fits"] and gpu.fits == expect["gpu_mode_fits"]
    assert gpu.host_peak == pytest.approx(expect["gpu_mode_host_peak_bytes_about"], rel=0.01)


def test_k3_from_the_shared_path_matches_the_preset(k3, tmp_path):
    path = tmp_path / "k3.json"
    path.write_text(json.dumps(k3[1]))
    assert load_handoff_sizes(str(path)) == k3[0] == load_handoff_sizes("k3-gb300")


def test_gpu_peak_is_baseline_plus_larger_copy(k3):
    sizes = k3[0]
    gpu = simulate(build_plan(peak_device="gpu"), sizes, cycles=3)
    larger = max(sizes.engine_weight_bytes, sizes.trainer_backup_bytes) * sizes.gpus_per_node
    assert gpu.host_peak == sizes.host_baseline_bytes + larger
    cpu = simulate(build_plan(peak_device="cpu"), sizes, cycles=3)
    both = (sizes.engine_weight_bytes + sizes.trainer_backup_bytes) * sizes.gpus_per_node
    assert cpu.host_peak == sizes.host_baseline_bytes + both


def test_timeline_rows_follow_the_steps():
    sizes = HandoffSizes(
        engine_weight_bytes=10,
        engine_kv_bytes=5,
        trainer_resident_bytes=8,
        trainer_backup_bytes=6,
        trainer_grad_buffer_bytes=2,
        host_baseline_bytes=100,
        gpus_per_node=2,
    )
    sim = simulate(build_plan(peak_device="gpu"), sizes)
    rows = {(r.phase, r.step): r for r in sim.rows}
    wake = rows[("rollout_to_train", "trainer.wake_up")]
    assert wake.host_before == 100 + 2 * 6 and wake.host_after == 100
    assert wake.device_peak == 10 + 8  # engine weights still resident, KV dropped
    grad = rows[("train_to_rollout", "trainer.offload_grad_buffer")]
    assert grad.device_before - grad.device_after == 2


def test_gpu_mode_can_overflow_the_gpu():
    sizes = HandoffSizes(
        engine_weight_bytes=60 * GB,
        engine_kv_bytes=20 * GB,
        trainer_resident_bytes=30 * GB,
        trainer_backup_bytes=20 * GB,
        host_budget_bytes=10**15,
        gpu_bytes=80 * GB,
    )
    result = compare(sizes)
    assert result.simulations["cpu"].fits
    assert not result.simulations["gpu"].fits_device
    assert result.recommended == "cpu"
    assert "GPU peak 90.0 GB" in result.reason or "only 'cpu'" in result.reason


def test_no_mode_fits_says_by_how_much():
    sizes = HandoffSizes(
        engine_weight_bytes=60 * GB,
        engine_kv_bytes=0,
        trainer_resident_bytes=40 * GB,
        trainer_backup_bytes=40 * GB,
        host_budget_bytes=50 * GB,
        gpu_bytes=80 * GB,
    )
    result = compare(sizes)
    assert result.recommended is None
    assert "over the 50.0 GB budget" in result.reason


def test_sizes_are_checked():
    with pytest.raises(SizesError, match="raise trainer_resident_bytes"):
        HandoffSizes(engine_weight_bytes=1, engine_kv_bytes=1, trainer_resident_bytes=1, trainer_backup_bytes=2)
    with pytest.raises(SizesError, match="unknown workload key"):
        HandoffSizes.from_workload({"engine_weights": 1})
    with pytest.raises(SizesError, match=r"workload lacks \['engine_kv_bytes'"):
        HandoffSizes.from_workload({"engine_weight_bytes_per_gpu": 1})
    with pytest.raises(ConfigError, match=r"presets: \['k3-gb300'\]"):
        load_handoff_sizes("no-such-workload")
    with pytest.raises(ConfigError, match="no such file"):
        load_handoff_sizes("/no/such/node.json")


def test_comparison_serialises(k3):
    data = compare(k3[0]).to_dict()
    msgspec.json.encode(data)
    assert set(data["modes"]) == {"cpu", "gpu"}
