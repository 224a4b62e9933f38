"""The handoff's invariants, each judged on one measurement made by hand (no participants, no sampling).

Budgets admit memory filled to the byte; one host copy passes where two do not, and a host pool
reserved up front is not taken for a second copy; measured memory may exceed the simulation by
the tolerance and no more; ``MatchesPlan`` compares only regions that have a size, and a step
the plan expects to act must not report that it had nothing to do.
"""

from __future__ import annotations

from dataclasses import replace

from colosync.handoff import build_plan
from colosync.handoff.model.ops import Op, Region
from colosync.handoff.model.participants import OpReport
from colosync.handoff.runtime.invariants import (
    CheckContext,
    DeviceBudget,
    HostBudget,
    MatchesPlan,
    Measurement,
    NoCoexistingHostCopies,
    WithinSimulation,
    default_invariants,
)
from tests.helpers import GB


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
) -> CheckContext:
    """One moment of an ``init`` step of the gpu plan, as measured (``reserved``: the simulated host-copy peak)."""
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
    limit = 3 * GB
    assert HostBudget(limit).check(_context(limit, 10 * limit)) is None
    assert DeviceBudget(limit).check(_context(10 * limit, limit)) is None
    over_host = HostBudget(limit).check(_context(limit + 1, 0))
    over_device = DeviceBudget(limit).check(_context(0, limit + 1))
    assert over_host and "host anon+shmem" in over_host and "budget" in over_host
    assert over_device and "device memory" in over_device


def test_one_host_copy_passes_the_measured_check_whichever_copy_is_the_larger():
    """The measured half of no-coexisting-host-copies: one copy (mirror *or* backup) fits, both do not."""
    check = NoCoexistingHostCopies(tolerance=0.05, slack_bytes=0)
    sizes = {Region.ENGINE_MIRROR: 1 * GB, Region.TRAINER_BACKUP: 2 * GB}
    assert check.check(_context(host_copies=2 * GB, sizes=sizes)) is None  # the backup alone
    broken = check.check(_context(host_copies=3 * GB, sizes=sizes))  # both
    assert broken and "two copies coexist on the host" in broken
    both_held = check.check(_context(sizes=sizes, held=(Region.ENGINE_MIRROR, Region.TRAINER_BACKUP)))
    assert both_held and "are both on the host" in both_held


def test_a_host_pool_reserved_up_front_is_not_mistaken_for_two_copies():
    check = NoCoexistingHostCopies(tolerance=0.05, slack_bytes=0)
    sizes = {Region.ENGINE_MIRROR: 1 * GB, Region.TRAINER_BACKUP: 1 * GB}
    assert check.check(_context(host_copies=2 * GB, sizes=sizes, reserved=2 * GB)) is None
    assert check.check(_context(host_copies=2 * GB, sizes=sizes, reserved=0)) is not None


def test_a_plan_without_a_trainer_backup_checks_the_mirror_alone():
    check = NoCoexistingHostCopies(tolerance=0.05, slack_bytes=0)
    assert check.check(_context(host_copies=1 * GB, sizes={Region.ENGINE_MIRROR: 1 * GB})) is None
    assert check.check(_context(host_copies=2 * GB, sizes={Region.ENGINE_MIRROR: 1 * GB})) is not None


def test_measured_host_copies_may_exceed_the_simulated_peak_by_the_tolerance_and_no_more():
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


def test_measured_device_memory_may_reach_the_baseline_plus_the_simulated_bytes_and_the_tolerance():
    check = WithinSimulation(tolerance=0.05, host_slack_bytes=0, device_slack_bytes=0)

    def at(device: int):
        m = Measurement(host_copies=0, host_abs=0, device=device, logical_host=0, held=frozenset())
        return replace(_context(), measurement=m, expected_device=10 * GB, device_baseline=2 * GB)

    assert check.check(at(2 * GB + int(10.4 * GB))) is None
    over = check.check(at(2 * GB + int(10.6 * GB)))
    assert over and "exceeds baseline" in over
    assert check.check(replace(at(2 * GB + int(10.6 * GB)), device_measured=False)) is None


def test_an_undeclared_checkpoint_load_is_not_compared_but_a_declared_one_is():
    check = WithinSimulation(tolerance=0.05, host_slack_bytes=0, device_slack_bytes=0)
    load = Op.TRAINER_LOAD.value
    assert check.check(_context(host_copies=5 * GB, reserved=1 * GB, step=load)) is None
    declared = {Region.TRAINER_LOAD: 2 * GB}
    assert check.check(_context(host_copies=5 * GB, reserved=1 * GB, step=load, sizes=declared)) is not None


def test_matches_plan_compares_only_regions_that_have_a_size():
    """A region of size zero or unknown cannot be seen by measuring, so it is neither required nor refused."""
    w, kv, mirror = Region.ENGINE_WEIGHTS, Region.ENGINE_KV, Region.ENGINE_MIRROR
    sizes = {w: 1 * GB, kv: 0}
    ok = _context(moment="after", sizes=sizes, expected_held=(w, kv, mirror), held=(w,))
    assert MatchesPlan().check(ok) is None
    missing = MatchesPlan().check(_context(moment="after", sizes=sizes, expected_held=(w,), held=()))
    assert missing and "missing" in missing
    assert MatchesPlan().check(_context(moment="peak", sizes=sizes, expected_held=(w,), held=())) is None


def test_a_step_the_plan_expects_to_allocate_must_not_report_nothing_to_do():
    w = Region.ENGINE_WEIGHTS
    noop = OpReport(participant="engine", op="engine.onload_weights", noop=True)
    did = OpReport(participant="engine", op="engine.onload_weights")
    ctx = dict(moment="after", sizes={w: 1 * GB}, expected_held=(w,), held=(w,), effect=(frozenset({w}), frozenset()))
    broken = MatchesPlan().check(_context(**ctx, report=noop))
    assert broken and "reported nothing to do" in broken
    assert MatchesPlan().check(_context(**ctx, report=did)) is None
