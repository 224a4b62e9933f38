"""Run a handoff plan against real participants and check invariants while it runs.

A plan says what should happen; the executor makes it happen and watches. Around every step
(and at the moments inside an operation that a participant marks as its peak, e.g. after a
copy to the host and before the device frees) it samples host memory (anon+shmem of the
process tree) and device memory (``cudaMemGetInfo``), and on CUDA a background thread
catches peaks in between. Each measurement is checked against invariants:

* ``MatchesPlan`` — after each step the participants hold exactly the regions the plan says,
  and a step the plan expects to act did act;
* ``NoCoexistingHostCopies`` (``gpu`` mode) — the engine mirror and the trainer backup are
  never both on the host, neither as the participants account it nor as measured (host
  copies above baseline stay within 5% of the larger single copy);
* ``WithinSimulation`` — measured host copies never exceed what the simulator predicts for
  the step with the participants' real sizes, by more than the tolerance;
* ``HostBudget`` / ``DeviceBudget`` — absolute limits, when given.

A broken invariant raises ``HandoffInvariantError`` after the step, naming the phase, the
step, the moment and the figures. "Host copies" are measured as the process tree's
anon+shmem minus the baseline (what was there before, not counting participants' own
copies) — and, when a participant's "device" is the CPU (tests, CPU-only runs), minus the
bytes it holds on that device, which are host memory too.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import torch

from colosync.errors import HandoffError, HandoffInvariantError
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.model.ops import HOST_COPIES, Op, Place, Region, effect
from colosync.handoff.model.plans import Phase, PhaseName, Plan, Step, _names, start_state
from colosync.handoff.runtime.participants import (
    EngineMemory,
    Footprint,
    MemoryParticipant,
    OpReport,
    TrainerMemory,
)
from colosync.handoff.runtime.sampling import DeviceSampler, HostSampler, PeakWatcher, trim_host_allocator

log = logging.getLogger(__name__)

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


@dataclass
class StepRecord:
    phase: str
    index: int
    step: str
    why: str
    report: OpReport
    held_after: list[str]
    host_before: int
    host_peak: int
    host_after: int
    host_abs_peak: int
    device_before: int
    device_peak: int
    device_after: int
    expected_host_peak: int
    expected_device_peak: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["report"] = msgspec.to_builtins(self.report)
        return d


@dataclass
class ExecutionResult:
    peak_device: str
    baseline_host: int
    baseline_device: int
    records: list[StepRecord] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    @property
    def host_peak(self) -> int:
        """Peak host copies above baseline."""
        return max((r.host_peak for r in self.records), default=0)

    @property
    def host_abs_peak(self) -> int:
        return max((r.host_abs_peak for r in self.records), default=0)

    @property
    def device_peak(self) -> int:
        return max((r.device_peak for r in self.records), default=0)

    def peak_step(self, what: str = "host") -> str:
        key = (lambda r: r.host_peak) if what == "host" else (lambda r: r.device_peak)
        if not self.records:
            return ""
        r = max(self.records, key=key)
        return f"{r.phase}:{r.step}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_device": self.peak_device,
            "baseline_host_bytes": self.baseline_host,
            "baseline_device_bytes": self.baseline_device,
            "host_copies_peak_bytes": self.host_peak,
            "host_copies_peak_step": self.peak_step("host"),
            "host_abs_peak_bytes": self.host_abs_peak,
            "device_peak_bytes": self.device_peak,
            "device_peak_step": self.peak_step("device"),
            "violations": [asdict(v) for v in self.violations],
            "steps": [r.to_dict() for r in self.records],
        }


def _remote_device(p: MemoryParticipant) -> int:
    sample = getattr(getattr(p, "state", None), "sample", None)
    used = getattr(sample, "device_used", None)
    return int(used) if used is not None else 0


class HandoffExecutor:
    """Runs plans against a trainer and an engine (either may be None if it does not offload),
    and the weight sync (``sync``: a ``WeightSync``) where the plan has a ``sync.weights`` step.

    ``baseline_host_bytes``: host memory before any participant or host pool existed (else
    the executor takes it at the first phase, less what participants account for).
    ``pools``: host pools reserved before the run (their chunks count as host copies from the
    start; a shared ``HostArena``'s pool is one). ``watch_interval_s``: poll host and device
    on a thread this often (CUDA only).

    Participants may live in other processes (``runtime.remote``): the executor then samples
    every participant's process tree, counting pages they share (the arena) once, and takes
    the moments inside a remote operation from the samples its process sends back.
    ``host_scope="node"`` measures the node's anon+shmem instead (see ``sampling``).
    """

    def __init__(
        self,
        trainer: TrainerMemory | None,
        engine: EngineMemory | None,
        *,
        invariants: Sequence[Invariant] | None = None,
        extra_invariants: Sequence[Invariant] = (),
        fail_fast: bool = True,
        baseline_host_bytes: int | None = None,
        watch_interval_s: float | None = None,
        tolerance: float = 0.05,
        host_slack_bytes: int = 32 * MiB,
        pools: Sequence[HostPool] = (),
        host_scope: str = "processes",
        sync: MemoryParticipant | None = None,
    ) -> None:
        self.trainer = trainer
        self.pools = list(pools)
        self.engine = engine
        self.sync = sync
        self.participants: list[MemoryParticipant] = [p for p in (trainer, engine, sync) if p is not None]
        self._invariants = list(invariants) if invariants is not None else None
        self.extra_invariants = list(extra_invariants)
        self.fail_fast = fail_fast
        self.tolerance = tolerance
        self.host_slack_bytes = host_slack_bytes
        self._remote = [p for p in self.participants if p.remote]
        shared = bool(self._remote) or any(getattr(pool, "arena", None) is not None for pool in self.pools)
        # every arena in play, once: the pools' and the ones remote participants map (their
        # self-samples leave an arena to this process's sampler, which counts it once)
        found = [getattr(x, "arena", None) for x in [*self.pools, *self._remote]]
        arenas = list({a.name: a for a in found if a is not None}.values())
        self.host = HostSampler(roots=[p.pid for p in self._remote], shared=shared, scope=host_scope, arenas=arenas)
        self.device = DeviceSampler()
        on_cuda = any(p.footprint().device_type == "cuda" for p in self.participants)
        self._device_measured = self.device.enabled and on_cuda
        self._device_remote = not self.device.enabled and on_cuda
        """No CUDA here (a controller): device figures come from the remote participants' samples."""
        self.watch_interval_s = watch_interval_s
        self._given_baseline = baseline_host_bytes
        self.result: ExecutionResult | None = None
        self._pending: list[Violation] = []
        self._sim_host_max = 0

    # -- measurement ------------------------------------------------------------------------
    def _footprints(self) -> list[Footprint]:
        return [p.footprint() for p in self.participants]

    def _held_now(self) -> frozenset[Region]:
        out: frozenset[Region] = frozenset()
        for p in self.participants:
            out |= p.regions()
        return out

    def _sizes(self) -> dict[Region, int]:
        sizes: dict[Region, int] = {}
        for p in self.participants:
            sizes.update(p.region_bytes())
        return sizes

    def measure(self) -> Measurement:
        """Host and device now, against the baseline of the run in progress."""
        if self.result is None:
            raise HandoffError("the executor has no baseline yet: measure() works once run() or run_phase() started")
        return self._measure(self.result)

    def _measure(self, result: ExecutionResult) -> Measurement:
        for p in self._remote:
            p.refresh()  # one round trip: what it holds and its footprint now
        if self._remote:
            self.host.refresh()  # a remote engine's workers may have started since
        fps = self._footprints()
        cpu_device = sum(fp.device_bytes for fp in fps if fp.device_type == "cpu")
        if any(fp.device_type == "cpu" for fp in fps):
            trim_host_allocator()  # freed CPU tensors must show up as freed
        h = self.host.sample()
        logical_host = sum(fp.host_bytes for fp in fps)
        if self._device_measured:
            d = self.device.sample()
            device = d.used if d is not None else 0
        elif self._device_remote:
            device = max((_remote_device(p) for p in self._remote), default=0)
        else:
            device = sum(fp.device_bytes for fp in fps)
        return Measurement(
            host_copies=h.value - result.baseline_host - cpu_device,
            host_abs=h.value,
            device=device,
            logical_host=logical_host,
            held=self._held_now(),
            by_pid=h.by_pid,
        )

    def _remote_peaks(
        self, result: ExecutionResult, participant: MemoryParticipant, before: Measurement, after: Measurement
    ) -> list[Measurement]:
        """The moments a remote operation marked, as measurements of every process: the remote
        process tree as it sampled itself then, every other process as it is now (idle while
        the remote one worked)."""
        out = []
        others = [p for p in self.participants if p is not participant]
        other_fps = [p.footprint() for p in others]
        for peak in getattr(participant, "peaks", []):
            tree = set(peak.host_pids)
            host = sum(v for pid, v in after.by_pid.items() if pid not in tree) + sum(peak.host_pids.values())
            fps = [*other_fps, Footprint(peak.host_bytes, peak.device_bytes, peak.device_type)]
            cpu_device = sum(fp.device_bytes for fp in fps if fp.device_type == "cpu")
            if self._device_measured or self._device_remote:
                device = peak.device_used if peak.device_used is not None else after.device
            else:
                device = sum(fp.device_bytes for fp in fps)
            out.append(
                Measurement(
                    host_copies=host - result.baseline_host - cpu_device,
                    host_abs=host,
                    device=device,
                    logical_host=sum(fp.host_bytes for fp in fps),
                    held=before.held,
                )
            )
        return out

    def _start(self, plan: Plan) -> ExecutionResult:
        """The result of the run in progress; a new one (and a new baseline) for a new mode."""
        if self.result is not None and self.result.peak_device == plan.peak_device:
            return self.result
        gc.collect()  # garbage collected later would otherwise make host copies look smaller
        for p in self._remote:
            p.refresh()
        self.host.refresh()
        fps = self._footprints()
        cpu_device = sum(fp.device_bytes for fp in fps if fp.device_type == "cpu")
        if any(fp.device_type == "cpu" for fp in fps):
            trim_host_allocator()
        h = self.host.sample()
        baseline = self._given_baseline
        reserved = sum(p.capacity_bytes for p in self.pools)
        if baseline is None:
            # Reserved pools (the arena) hold their pages from the start: they are host copies'
            # memory, not baseline. Participants' copies live inside them.
            baseline = h.value - max(sum(fp.host_bytes for fp in fps), reserved) - cpu_device
        dev_base = 0
        if self._device_measured or self._device_remote:
            if self._device_measured:
                d = self.device.sample()
                used = d.used if d is not None else 0
            else:
                used = max((_remote_device(p) for p in self._remote), default=0)
            dev_base = used - sum(fp.device_bytes for fp in fps if fp.device_type == "cuda")
        self.result = ExecutionResult(peak_device=plan.peak_device, baseline_host=baseline, baseline_device=dev_base)
        # Host pools reserved before the run hold their chunks from the start: the simulated
        # running peak starts at what is already reserved.
        self._sim_host_max = max(sum(fp.host_bytes for fp in fps), reserved)
        log.info("handoff executor: host baseline %.3f GB, device baseline %.3f GB", baseline / 1e9, dev_base / 1e9)
        return self.result

    def invariants(self, plan: Plan) -> list[Invariant]:
        base = (
            self._invariants
            if self._invariants is not None
            else default_invariants(plan, tolerance=self.tolerance, host_slack_bytes=self.host_slack_bytes)
        )
        return [*base, *self.extra_invariants]

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        plan: Plan,
        *,
        cycles: int = 1,
        include_init: bool = True,
        between: Callable[[PhaseName], None] | None = None,
    ) -> ExecutionResult:
        """Run init (optionally) and ``cycles`` rollout->train->rollout rounds of ``plan``.
        ``between(phase)`` runs after each phase (training or generation work goes there)."""
        result = self._start(plan)
        for phase in plan.schedule(cycles, include_init=include_init):
            self.run_phase(plan, phase)
            if between is not None:
                between(phase.name)
        return result

    def run_phase(self, plan: Plan, phase: Phase | PhaseName | str) -> ExecutionResult:
        """Run one phase of ``plan`` (call it from a training loop at each handoff)."""
        if not isinstance(phase, Phase):
            phase = plan.phase(phase)
        result = self._start(plan)
        expected = start_state(plan.config, phase.name)
        invariants = self.invariants(plan)
        for i, step in enumerate(phase.steps, 1):
            self._run_step(result, plan, phase, i, step, expected, invariants)
            alloc, free = effect(step.op, expected, step.backup)
            expected = (expected | alloc) - free
        return result

    def _participant(self, op: Op) -> MemoryParticipant | None:
        return {"trainer": self.trainer, "engine": self.engine, "sync": self.sync}.get(op.actor)

    def _run_step(
        self,
        result: ExecutionResult,
        plan: Plan,
        phase: Phase,
        index: int,
        step: Step,
        expected: frozenset[Region],
        invariants: list[Invariant],
    ) -> None:
        op, backup, label = step.op, step.backup, step.label
        participant = self._participant(op)
        alloc, free = effect(op, expected, backup)
        sizes = self._sizes()
        exp_peak = expected | alloc
        exp_host = sum(sizes.get(r, 0) for r in exp_peak if r.place is Place.HOST)
        exp_dev = sum(sizes.get(r, 0) for r in exp_peak if r.place is Place.DEVICE)
        # Pools keep the chunks of the largest copies so far; host memory outside the copies
        # (a sync's transport slots, a load's staging) comes on top of them while it is held.
        exp_copies = sum(sizes.get(r, 0) for r in exp_peak if r in HOST_COPIES)
        self._sim_host_max = max(self._sim_host_max, exp_copies)
        exp_host_max = self._sim_host_max + exp_host - exp_copies

        def context(
            moment: str, m: Measurement, report: OpReport | None = None, held: frozenset[Region] = exp_peak
        ) -> CheckContext:
            return CheckContext(
                plan=plan,
                phase=phase.name.value,
                index=index,
                step=label,
                moment=moment,
                measurement=m,
                expected_held=held,
                expected_host_copies=exp_host,
                expected_host_copies_max=exp_host_max,
                expected_device=exp_dev,
                sizes=self._sizes(),
                device_baseline=result.baseline_device,
                device_measured=self._device_measured,
                report=report,
                expected_effect=(alloc, free),
            )

        def check(ctx: CheckContext) -> None:
            for inv in invariants:
                message = inv.check(ctx)
                if message:
                    m = ctx.measurement
                    self._pending.append(
                        Violation(
                            invariant=inv.name,
                            phase=ctx.phase,
                            index=index,
                            step=label,
                            moment=ctx.moment,
                            message=message,
                            figures={
                                "host_copies_bytes": m.host_copies,
                                "host_abs_bytes": m.host_abs,
                                "device_bytes": m.device,
                                "logical_host_bytes": m.logical_host,
                                "expected_host_copies_bytes": exp_host,
                                "expected_device_bytes": exp_dev,
                            },
                        )
                    )

        marks: list[Measurement] = []

        def on_mark(_p: MemoryParticipant, event: str) -> None:
            m = self._measure(result)
            marks.append(m)
            check(context("peak", m))

        before = self._measure(result)
        started = time.perf_counter()
        if participant is None:
            report = OpReport(participant=op.actor, op=op.method, noop=True, note=f"no {op.actor} participant")
        else:
            participant.step_context = (phase.name.value, index)
            participant.add_listener(on_mark)
            if self._device_measured:
                torch.cuda.reset_peak_memory_stats(self.device.device)
                reserved_before = torch.cuda.memory_reserved(self.device.device)
            try:
                if self.watch_interval_s and self._device_measured:
                    with PeakWatcher(self.host, self.device, self.watch_interval_s) as watcher:
                        report = participant.run(op, backup=backup)
                        watched = watcher.take()
                else:
                    report = participant.run(op, backup=backup)
                    watched = (0, 0)
            finally:
                participant.remove_listener(on_mark)
        seconds = time.perf_counter() - started
        after = self._measure(result)
        if participant is not None and participant.remote:
            for m in self._remote_peaks(result, participant, before, after):
                marks.append(m)
                check(context("peak", m))
        host_peak = max([before.host_copies, after.host_copies] + [m.host_copies for m in marks])
        host_abs_peak = max([before.host_abs, after.host_abs] + [m.host_abs for m in marks])
        dev_peak = max([before.device, after.device] + [m.device for m in marks])
        if participant is not None and self._device_measured:
            w_host, w_dev = watched
            if w_host:
                host_abs_peak = max(host_abs_peak, w_host)
                host_peak = max(host_peak, w_host - result.baseline_host)
            dev_peak = max(
                dev_peak, w_dev, before.device - reserved_before + torch.cuda.max_memory_reserved(self.device.device)
            )
            sampled_peak = Measurement(
                host_copies=host_peak,
                host_abs=host_abs_peak,
                device=dev_peak,
                logical_host=after.logical_host,
                held=after.held & before.held,
            )
            check(context("peak", sampled_peak))
        expected_after = (expected | alloc) - free
        check(context("after", after, report, expected_after))
        result.records.append(
            StepRecord(
                phase=phase.name.value,
                index=index,
                step=label,
                why=step.why,
                report=report,
                held_after=[r.value for r in Region if r in after.held],
                host_before=before.host_copies,
                host_peak=host_peak,
                host_after=after.host_copies,
                host_abs_peak=host_abs_peak,
                device_before=before.device,
                device_peak=dev_peak,
                device_after=after.device,
                expected_host_peak=exp_host,
                expected_device_peak=exp_dev,
                seconds=seconds,
            )
        )
        log.info(
            "%s step %d %s: host copies %.3f GB peak, device %.3f GB peak, %.3f s",
            phase.name.value,
            index,
            label,
            host_peak / 1e9,
            dev_peak / 1e9,
            seconds,
        )
        if self._pending:
            found, self._pending = self._pending, []
            result.violations.extend(found)
            if self.fail_fast:
                first = found[0]
                more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
                raise HandoffInvariantError(
                    f"{first}{more}; figures: " + ", ".join(f"{k}={_gb(v)}" for k, v in first.figures.items()),
                    violation=first,
                )
