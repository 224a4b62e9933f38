"""The invariants a handoff must keep, judged one measurement at a time.

Why this is not part of the executor: an invariant is a pure judgement of one measurement
against the plan -- no sampling, no participants, no torch -- so it can be tested (and
mutation-tested) on a measurement made by hand, and a caller can write one more without
reading the loop that runs steps and samples around them. The executor only builds the
``CheckContext`` and collects what ``broken`` returns.

* ``MatchesPlan`` -- after each step the participants hold exactly the regions the plan says,
  and a step the plan expects to act did act;
* ``NoCoexistingHostCopies`` (``gpu`` mode) -- the engine mirror and the trainer backup are
  never both on the host, neither as the participants account it nor as measured (host
  copies above baseline stay within 5% of the larger single copy);
* ``WithinSimulation`` -- measured host copies never exceed what the simulator predicts for
  the step with the participants' real sizes, by more than the tolerance;
* ``HostBudget`` / ``DeviceBudget`` -- absolute limits, when given.

"Host copies" are measured as the process tree's anon+shmem minus the baseline (what was
there before, not counting participants' own copies) -- and, when a participant's "device"
is the CPU (tests, CPU-only runs), minus the bytes it holds on that device, which are host
memory too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from colosync.handoff.model.ops import HOST_COPIES, Op, Region
from colosync.handoff.model.participants import OpReport
from colosync.handoff.model.plans import Plan, _names

MiB = 1 << 20


@dataclass(frozen=True)
class Measurement:
    host_copies: int
    """Host bytes above the baseline (see module docstring)."""
    host_abs: int
    """anon+shmem of the process tree."""
    device: int
    """Device bytes in use (all processes on CUDA; participants' accounted bytes on CPU)."""
    logical_host: int
    """Host copy bytes the participants account for."""
    held: frozenset[Region]
    """Regions the participants say they hold."""
    by_pid: dict[int, int] = field(default_factory=dict)
    """anon+shmem of each sampled process (what ``host_abs`` sums)."""


@dataclass
class CheckContext:
    plan: Plan
    phase: str
    index: int
    step: str
    moment: str
    """``peak`` (inside or across the step) or ``after``."""
    measurement: Measurement
    expected_held: frozenset[Region]
    expected_host_copies: int
    """Simulated host copies at this step's peak."""
    expected_host_copies_max: int
    """Simulated host-copy peak of the run so far (host pools keep their chunks, so measured
    host memory follows the running peak, not each step's figure), plus the host memory
    outside the copies that this step holds (a sync's transport slots, a load's staging)."""
    expected_device: int
    sizes: dict[Region, int]
    device_baseline: int
    device_measured: bool
    report: OpReport | None = None
    expected_effect: tuple[frozenset[Region], frozenset[Region]] | None = None


class Invariant:
    name = "invariant"

    def check(self, ctx: CheckContext) -> str | None:
        """A message when the invariant is broken at this moment, else None."""
        raise NotImplementedError


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


class NoCoexistingHostCopies(Invariant):
    """The engine mirror and the trainer backup are never on the host together."""

    name = "no-coexisting-host-copies"

    def __init__(self, tolerance: float = 0.05, slack_bytes: int = 32 * MiB) -> None:
        self.tolerance = tolerance
        self.slack_bytes = slack_bytes

    def check(self, ctx: CheckContext) -> str | None:
        m = ctx.measurement
        mirror, backup = ctx.sizes.get(Region.ENGINE_MIRROR, 0), ctx.sizes.get(Region.TRAINER_BACKUP, 0)
        if m.held >= HOST_COPIES:
            return (
                f"the engine mirror ({_gb(mirror)}) and the trainer backup ({_gb(backup)}) are both on the host "
                f"(participants account {_gb(m.logical_host)} of host copies)"
            )
        # A pool reserved up front for the larger copy holds it from the start, before that
        # copy's size is known (expected_host_copies_max starts at the reserved bytes).
        larger = max(mirror, backup, ctx.expected_host_copies_max)
        limit = int(larger * (1 + self.tolerance)) + self.slack_bytes
        if m.host_copies > limit:
            return (
                f"measured host copies {_gb(m.host_copies)} exceed the larger single copy "
                f"max(mirror {_gb(mirror)}, backup {_gb(backup)}) by more than {self.tolerance:.0%} "
                f"+ {self.slack_bytes // MiB} MiB (limit {_gb(limit)}): two copies coexist on the host — e.g. "
                f"separate host pools that keep their chunks; share one HostPool between trainer and engine"
            )
        return None


class WithinSimulation(Invariant):
    """Measured host copies (and device bytes, on CUDA) stay near what the simulator predicts."""

    name = "within-simulation"

    def __init__(
        self, tolerance: float = 0.05, host_slack_bytes: int = 32 * MiB, device_slack_bytes: int = 512 * MiB
    ) -> None:
        self.tolerance = tolerance
        self.host_slack_bytes = host_slack_bytes
        self.device_slack_bytes = device_slack_bytes

    def check(self, ctx: CheckContext) -> str | None:
        m = ctx.measurement
        if ctx.sizes.get(Region.TRAINER_LOAD, 0) == 0 and ctx.step == Op.TRAINER_LOAD.value:
            return None  # the load's host staging is not declared: nothing to compare with
        limit = int(ctx.expected_host_copies_max * (1 + self.tolerance)) + self.host_slack_bytes
        if m.host_copies > limit:
            return (
                f"measured host copies {_gb(m.host_copies)} exceed the simulated peak so far "
                f"{_gb(ctx.expected_host_copies_max)} (+{self.tolerance:.0%} + {self.host_slack_bytes // MiB} MiB "
                f"= {_gb(limit)})"
            )
        if ctx.device_measured:
            dev_limit = ctx.device_baseline + int(ctx.expected_device * (1 + self.tolerance)) + self.device_slack_bytes
            if m.device > dev_limit:
                return (
                    f"measured device {_gb(m.device)} exceeds baseline {_gb(ctx.device_baseline)} + simulated "
                    f"{_gb(ctx.expected_device)} (+{self.tolerance:.0%} + {self.device_slack_bytes // MiB} MiB)"
                )
        return None


class MatchesPlan(Invariant):
    """After each step the participants hold what the plan says, and expected work was done."""

    name = "matches-plan"
    _UNOBSERVED = frozenset({Region.TRAINER_CACHE, Region.TRAINER_LOAD})

    def check(self, ctx: CheckContext) -> str | None:
        if ctx.moment != "after":
            return None
        observable = {r for r in Region if ctx.sizes.get(r, 0) > 0 and r not in self._UNOBSERVED}
        want = ctx.expected_held & observable
        have = ctx.measurement.held & observable
        if want != have:
            return (
                f"the plan expects {_names(want)} to be held after this step but the participants hold "
                f"{_names(have)} (missing {_names(want - have)}, unexpected {_names(have - want)})"
            )
        if ctx.report is not None and ctx.expected_effect is not None:
            alloc, free = ctx.expected_effect
            observable_effect = (alloc | free) & observable
            if observable_effect and ctx.report.noop:
                return (
                    f"the plan expects this step to allocate {_names(alloc)} and free {_names(free)}, but the "
                    f"participant reported nothing to do ({ctx.report.note})"
                )
        return None


class _Limit(Invariant):
    """One measured figure stays at or below an absolute limit."""

    what = "bytes"
    limit = "limit"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes

    def measured(self, m: Measurement) -> int:
        raise NotImplementedError

    def check(self, ctx: CheckContext) -> str | None:
        value = self.measured(ctx.measurement)
        if value > self.limit_bytes:
            return f"{self.what} {_gb(value)} exceeds the {self.limit} {_gb(self.limit_bytes)}"
        return None


class HostBudget(_Limit):
    name = "host-budget"
    what = "host anon+shmem"
    limit = "budget"

    def measured(self, m: Measurement) -> int:
        return m.host_abs


class DeviceBudget(_Limit):
    name = "device-budget"
    what = "device memory"

    def measured(self, m: Measurement) -> int:
        return m.device


def default_invariants(plan: Plan, *, tolerance: float = 0.05, host_slack_bytes: int = 32 * MiB) -> list[Invariant]:
    out: list[Invariant] = [MatchesPlan(), WithinSimulation(tolerance, host_slack_bytes)]
    if plan.peak_device == "gpu":
        out.append(NoCoexistingHostCopies(tolerance, host_slack_bytes))
    return out


@dataclass(frozen=True)
class Violation:
    invariant: str
    phase: str
    index: int
    step: str
    moment: str
    message: str
    figures: dict[str, int]

    def __str__(self) -> str:
        return (
            f"invariant {self.invariant} broke at {self.phase} step {self.index} {self.step} ({self.moment}): "
            f"{self.message}"
        )


def broken(invariants: Sequence[Invariant], ctx: CheckContext) -> list[Violation]:
    """The invariants broken at the moment ``ctx`` describes, each with the figures it was judged on."""
    found = []
    for inv in invariants:
        message = inv.check(ctx)
        if message:
            m = ctx.measurement
            found.append(
                Violation(
                    invariant=inv.name,
                    phase=ctx.phase,
                    index=ctx.index,
                    step=ctx.step,
                    moment=ctx.moment,
                    message=message,
                    figures={
                        "host_copies_bytes": m.host_copies,
                        "host_abs_bytes": m.host_abs,
                        "device_bytes": m.device,
                        "logical_host_bytes": m.logical_host,
                        "expected_host_copies_bytes": ctx.expected_host_copies,
                        "expected_device_bytes": ctx.expected_device,
                    },
                )
            )
    return found


def summary(found: Sequence[Violation]) -> str:
    """The first violation, how many more there are, and its figures: the message a failed step raises."""
    first = found[0]
    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
    return f"{first}{more}; figures: " + ", ".join(f"{k}={_gb(v)}" for k, v in first.figures.items())
