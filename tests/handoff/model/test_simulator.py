"""The simulator, including the K3 GB300 verdicts of radixark/miles #2781 (``colosync plan`` is in tests/tools)."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest

from colosync import workloads
from colosync.errors import ConfigError
from colosync.handoff import (
    HandoffConfig,
    HandoffSizes,
    SizesError,
    build_plan,
    compare,
    load_handoff_sizes,
    simulate,
)
from colosync.handoff.model.ops import Region
from colosync.handoff.model.simulator import _recommend, arena_bytes
from tests.helpers import GB

SIZES = dict(
    engine_weight_bytes=10 * GB,
    engine_kv_bytes=5 * GB,
    trainer_resident_bytes=8 * GB,
    trainer_backup_bytes=6 * GB,
    host_baseline_bytes=3 * GB,
    device_baseline_bytes=1 * GB,
    gpus_per_node=2,
)


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


# -- the timeline, budgets, the JSON a script reads, and the recommendation, on one set of sizes ------


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_the_timeline_starts_with_only_the_engine_up_and_numbers_each_phase_from_one(mode):
    sim = simulate(build_plan(peak_device=mode), HandoffSizes(**SIZES), cycles=2)
    start = sim.rows[0]
    assert (start.phase, start.index, start.step) == ("start", 0, "start")
    engine = 1 * GB + 10 * GB + 5 * GB  # device baseline + engine weights + KV; the trainer is not loaded
    assert start.device_before == start.device_peak == start.device_after == engine
    assert start.host_before == start.host_peak == start.host_after == 3 * GB and start.host_copies == ()
    phases = [list(g) for _, g in itertools.groupby(sim.rows[1:], key=lambda r: r.phase)]
    assert len(phases) == 1 + 2 * 2  # init, then two cycles of two phases
    for rows in phases:
        assert [r.index for r in rows] == list(range(1, len(rows) + 1))


def test_a_row_is_over_budget_exactly_when_its_peak_exceeds_it():
    """Memory filled to the byte still fits; one byte more does not -- on every row, the first included."""
    free = simulate(build_plan(peak_device="gpu"), HandoffSizes(**SIZES))
    start = free.rows[0]
    for gpu, host in [(start.device_peak, start.host_peak), (free.device_peak, free.host_peak)]:
        sim = simulate(build_plan(peak_device="gpu"), HandoffSizes(**SIZES, gpu_bytes=gpu, host_budget_bytes=host))
        for row in sim.rows:
            assert row.over_device == (row.device_peak > gpu), row
            assert row.over_host == (row.host_peak > host), row
    exact = simulate(
        build_plan(peak_device="gpu"),
        HandoffSizes(**SIZES, gpu_bytes=free.device_peak, host_budget_bytes=free.host_peak),
    )
    assert exact.fits and not any(r.over_device or r.over_host for r in exact.rows)


def test_the_plan_json_names_every_field_a_reader_uses():
    """``colosync plan --json`` is read by scripts: its keys are an interface."""
    result = compare(HandoffSizes(**SIZES, gpu_bytes=80 * GB, host_budget_bytes=500 * GB))
    doc = json.loads(json.dumps(result.to_dict()))
    assert set(doc) == {"sizes", "modes", "rejected", "recommended", "reason"}
    assert doc["sizes"]["engine_weight_bytes"] == 10 * GB
    assert set(doc["modes"]) == {"cpu", "gpu"}
    for mode, sim in doc["modes"].items():
        assert set(sim) == {
            "peak_device",
            "host_peak_bytes",
            "host_peak_step",
            "device_peak_bytes",
            "device_peak_step",
            "both_host_copies",
            "fits_host",
            "fits_device",
            "fits",
            "timeline",
        }
        real = result.simulations[mode]
        assert (sim["host_peak_bytes"], sim["device_peak_bytes"], sim["fits"]) == (
            real.host_peak,
            real.device_peak,
            real.fits,
        )
        assert sim["timeline"][0]["phase"] == "start" and len(sim["timeline"]) == len(real.rows)
        assert set(sim["timeline"][0]) >= {"phase", "index", "step", "host_peak", "device_peak", "host_copies"}


def test_when_every_mode_fits_the_one_with_the_lower_gpu_peak_is_recommended():
    result = compare(HandoffSizes(**SIZES))  # no budgets: everything fits
    assert all(s.fits for s in result.simulations.values()) and result.rejected == {}
    best = min(result.simulations, key=lambda m: result.simulations[m].device_peak)
    assert result.recommended == best
    assert result.reason.startswith("every mode fits") and f"'{best}'" in result.reason


def test_when_modes_tie_on_the_gpu_peak_the_cpu_mode_is_recommended():
    sim = simulate(build_plan(peak_device="gpu"), HandoffSizes(**SIZES))
    for order in (("gpu", "cpu"), ("cpu", "gpu")):
        best, why = _recommend(dict.fromkeys(order, sim), HandoffSizes(**SIZES))
        assert best == "cpu" and why.startswith("every mode fits")


def test_when_no_mode_fits_the_reason_names_each_mode_and_its_shortfall():
    budget = {**SIZES, "host_budget_bytes": 1, "gpu_bytes": 1}
    result = compare(HandoffSizes(**budget))
    assert result.recommended is None and result.reason.startswith("no mode fits: ")
    for mode in result.simulations:
        assert f"'{mode}': " in result.reason and "over the" in result.reason
    assert "'None'" not in result.reason


def test_a_mode_whose_configuration_is_invalid_is_listed_as_rejected_with_its_reason():
    result = compare(HandoffSizes(**SIZES), config=HandoffConfig(engine_offload=False))
    assert result.rejected, "some mode must refuse a configuration that keeps the engine on the GPU"
    for mode, why in result.rejected.items():
        assert mode not in result.simulations and why
    assert json.loads(json.dumps(result.to_dict()))["rejected"] == result.rejected


def test_an_arena_holds_whole_chunks_for_copies_that_are_not_a_multiple_of_a_chunk():
    plan = build_plan(peak_device="gpu")
    chunk = 1 << 20
    sizes = {Region.ENGINE_MIRROR: 3 * chunk + 1, Region.TRAINER_BACKUP: 2 * chunk + 5}
    need = arena_bytes(plan, sizes, chunk_bytes=chunk)
    assert isinstance(need, int) and need % chunk == 0
    assert need == 4 * chunk  # gpu mode holds one copy at a time: the larger, in 4 whole chunks
