"""Simulator promises that the mutation run (benchmarks/mutation/) found no test holding.

The timeline's first row, its step numbers and over-budget flags, the JSON that ``colosync plan
--json`` prints, and the recommendation when every mode fits.
"""

from __future__ import annotations

import itertools
import json

import pytest

from colosync.handoff import HandoffSizes, build_plan, compare, simulate

GB = 10**9
SIZES = dict(
    engine_weight_bytes=10 * GB,
    engine_kv_bytes=5 * GB,
    trainer_resident_bytes=8 * GB,
    trainer_backup_bytes=6 * GB,
    host_baseline_bytes=3 * GB,
    device_baseline_bytes=1 * GB,
    gpus_per_node=2,
)


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


def test_a_mode_whose_configuration_is_invalid_is_listed_as_rejected_with_its_reason():
    from colosync.handoff import HandoffConfig

    result = compare(HandoffSizes(**SIZES), config=HandoffConfig(engine_offload=False))
    assert result.rejected, "some mode must refuse a configuration that keeps the engine on the GPU"
    for mode, why in result.rejected.items():
        assert mode not in result.simulations and why
    assert json.loads(json.dumps(result.to_dict()))["rejected"] == result.rejected
