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


# -- the runtime's budget invariants (colosync.handoff.runtime.executor), checked on one measurement ---------
def _context(
    host_abs: int = 0,
    device: int = 0,
    *,
    host_copies: int = 0,
    sizes=None,
    reserved: int = 0,
    held=(),
    step: str = "step",
    moment: str = "peak",
    expected_held=(),
    report=None,
    effect=None,
):
    from colosync.handoff.runtime.executor import CheckContext, Measurement

    m = Measurement(host_copies=host_copies, host_abs=host_abs, device=device, logical_host=0, held=frozenset(held))
    return CheckContext(
        plan=build_plan(peak_device="gpu"),
        phase="init",
        index=1,
        step=step,
        moment=moment,
        measurement=m,
        expected_held=frozenset(expected_held),
        expected_host_copies=0,
        expected_host_copies_max=reserved,
        expected_device=0,
        sizes=dict(sizes or {}),
        device_baseline=0,
        device_measured=True,
        report=report,
        expected_effect=effect,
    )


def test_host_and_device_budgets_allow_memory_filled_to_the_byte_and_not_one_more():
    from colosync.handoff.runtime.executor import DeviceBudget, HostBudget

    limit = 3 * GB
    assert HostBudget(limit).check(_context(limit, 10 * limit)) is None
    assert DeviceBudget(limit).check(_context(10 * limit, limit)) is None
    over_host = HostBudget(limit).check(_context(limit + 1, 0))
    over_device = DeviceBudget(limit).check(_context(0, limit + 1))
    assert over_host and "host anon+shmem" in over_host and "budget" in over_host
    assert over_device and "device memory" in over_device


def test_one_host_copy_passes_the_measured_check_whichever_copy_is_the_larger():
    """The measured half of no-coexisting-host-copies: one copy (mirror *or* backup) fits, both do not."""
    from colosync.handoff.model.ops import Region
    from colosync.handoff.runtime.executor import NoCoexistingHostCopies

    check = NoCoexistingHostCopies(tolerance=0.05, slack_bytes=0)
    sizes = {Region.ENGINE_MIRROR: 1 * GB, Region.TRAINER_BACKUP: 2 * GB}
    assert check.check(_context(host_copies=2 * GB, sizes=sizes)) is None  # the backup alone
    broken = check.check(_context(host_copies=3 * GB, sizes=sizes))  # both
    assert broken and "two copies coexist on the host" in broken
    both_held = check.check(_context(sizes=sizes, held=(Region.ENGINE_MIRROR, Region.TRAINER_BACKUP)))
    assert both_held and "are both on the host" in both_held


def test_a_host_pool_reserved_up_front_is_not_mistaken_for_two_copies():
    from colosync.handoff.model.ops import Region
    from colosync.handoff.runtime.executor import NoCoexistingHostCopies

    check = NoCoexistingHostCopies(tolerance=0.05, slack_bytes=0)
    sizes = {Region.ENGINE_MIRROR: 1 * GB, Region.TRAINER_BACKUP: 1 * GB}
    assert check.check(_context(host_copies=2 * GB, sizes=sizes, reserved=2 * GB)) is None
    assert check.check(_context(host_copies=2 * GB, sizes=sizes, reserved=0)) is not None


def test_a_plan_without_a_trainer_backup_checks_the_mirror_alone():
    from colosync.handoff.model.ops import Region
    from colosync.handoff.runtime.executor import NoCoexistingHostCopies

    check = NoCoexistingHostCopies(tolerance=0.05, slack_bytes=0)
    assert check.check(_context(host_copies=1 * GB, sizes={Region.ENGINE_MIRROR: 1 * GB})) is None
    assert check.check(_context(host_copies=2 * GB, sizes={Region.ENGINE_MIRROR: 1 * GB})) is not None


def test_measured_host_copies_may_exceed_the_simulated_peak_by_the_tolerance_and_no_more():
    from colosync.handoff.runtime.executor import WithinSimulation, default_invariants

    check = WithinSimulation(tolerance=0.05, host_slack_bytes=0, device_slack_bytes=0)
    assert check.check(_context(host_copies=int(10.4 * GB), reserved=10 * GB)) is None
    over = check.check(_context(host_copies=int(10.6 * GB), reserved=10 * GB))
    assert over and "exceed the simulated peak" in over
    # the executor's default set applies the tolerance and slack it is given
    (within,) = [
        i
        for i in default_invariants(build_plan(peak_device="gpu"), tolerance=0.05, host_slack_bytes=0)
        if i.name == "within-simulation"
    ]
    assert within.check(_context(host_copies=int(10.4 * GB), reserved=10 * GB)) is None
    assert within.check(_context(host_copies=int(10.6 * GB), reserved=10 * GB)) is not None


def test_an_undeclared_checkpoint_load_is_not_compared_but_a_declared_one_is():
    from colosync.handoff.model.ops import Op, Region
    from colosync.handoff.runtime.executor import WithinSimulation

    check = WithinSimulation(tolerance=0.05, host_slack_bytes=0, device_slack_bytes=0)
    load = Op.TRAINER_LOAD.value
    assert check.check(_context(host_copies=5 * GB, reserved=1 * GB, step=load)) is None
    declared = {Region.TRAINER_LOAD: 2 * GB}
    assert check.check(_context(host_copies=5 * GB, reserved=1 * GB, step=load, sizes=declared)) is not None


def test_matches_plan_compares_only_regions_that_have_a_size():
    """A region of size zero or unknown cannot be seen by measuring, so it is neither required nor refused."""
    from colosync.handoff.model.ops import Region
    from colosync.handoff.runtime.executor import MatchesPlan

    w, kv, mirror = Region.ENGINE_WEIGHTS, Region.ENGINE_KV, Region.ENGINE_MIRROR
    sizes = {w: 1 * GB, kv: 0}
    ok = _context(moment="after", sizes=sizes, expected_held=(w, kv, mirror), held=(w,))
    assert MatchesPlan().check(ok) is None
    missing = MatchesPlan().check(_context(moment="after", sizes=sizes, expected_held=(w,), held=()))
    assert missing and "missing" in missing
    assert MatchesPlan().check(_context(moment="peak", sizes=sizes, expected_held=(w,), held=())) is None


def test_a_step_the_plan_expects_to_allocate_must_not_report_nothing_to_do():
    from colosync.handoff.model.ops import Region
    from colosync.handoff.runtime.executor import MatchesPlan
    from colosync.handoff.runtime.participants import OpReport

    w = Region.ENGINE_WEIGHTS
    noop = OpReport(participant="engine", op="engine.onload_weights", noop=True)
    did = OpReport(participant="engine", op="engine.onload_weights")
    ctx = dict(moment="after", sizes={w: 1 * GB}, expected_held=(w,), held=(w,), effect=(frozenset({w}), frozenset()))
    broken = MatchesPlan().check(_context(**ctx, report=noop))
    assert broken and "reported nothing to do" in broken
    assert MatchesPlan().check(_context(**ctx, report=did)) is None


@pytest.mark.parametrize("options", [{"peak_device": "cpu"}, {"peak_device": "gpu"}, {"engine_weight_backup": False}])
def test_a_built_plan_round_trips_through_json_as_data(options):
    """A handoff is a plan, not a code path: it can be written out and read back, typed, unchanged."""
    import msgspec

    from colosync.handoff.model.plans import Plan

    plan = build_plan(**options)
    again = msgspec.json.decode(msgspec.json.encode(plan), type=Plan)
    assert again == plan
    assert all(isinstance(step.why, str) for phase in plan.phases for step in phase.steps)


def test_measured_device_memory_may_reach_the_baseline_plus_the_simulated_bytes_and_the_tolerance():
    from dataclasses import replace

    from colosync.handoff.runtime.executor import Measurement, WithinSimulation

    check = WithinSimulation(tolerance=0.05, host_slack_bytes=0, device_slack_bytes=0)

    def at(device: int):
        m = Measurement(host_copies=0, host_abs=0, device=device, logical_host=0, held=frozenset())
        return replace(_context(), measurement=m, expected_device=10 * GB, device_baseline=2 * GB)

    assert check.check(at(2 * GB + int(10.4 * GB))) is None
    over = check.check(at(2 * GB + int(10.6 * GB)))
    assert over and "exceeds baseline" in over
    assert check.check(replace(at(2 * GB + int(10.6 * GB)), device_measured=False)) is None


def test_an_arena_holds_whole_chunks_for_copies_that_are_not_a_multiple_of_a_chunk():
    from colosync.handoff.model.ops import Region
    from colosync.handoff.model.simulator import arena_bytes

    plan = build_plan(peak_device="gpu")
    chunk = 1 << 20
    sizes = {Region.ENGINE_MIRROR: 3 * chunk + 1, Region.TRAINER_BACKUP: 2 * chunk + 5}
    need = arena_bytes(plan, sizes, chunk_bytes=chunk)
    assert isinstance(need, int) and need % chunk == 0
    assert need == 4 * chunk  # gpu mode holds one copy at a time: the larger, in 4 whole chunks


def test_when_modes_tie_on_the_gpu_peak_the_cpu_mode_is_recommended():
    from colosync.handoff.model.simulator import _recommend

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
