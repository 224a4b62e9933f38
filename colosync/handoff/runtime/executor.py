"""Run a handoff plan against real participants and check invariants while it runs.

A plan says what should happen; the executor makes it happen and watches. Around every step
(and at the moments inside an operation that a participant marks as its peak, e.g. after a
copy to the host and before the device frees) it samples host memory (anon+shmem of the
process tree) and device memory (``cudaMemGetInfo``), and on CUDA a background thread
catches peaks in between (``runtime.meter``). Each measurement is checked against the
invariants of ``runtime.invariants``; the run's figures are kept as ``runtime.records``.

A broken invariant raises ``HandoffInvariantError`` after the step, naming the phase, the
step, the moment and the figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from colosync.errors import HandoffError, HandoffInvariantError
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.model.ops import HOST_COPIES, Op, Place, Region, device_bytes, effect
from colosync.handoff.model.participants import (
    EngineMemory,
    MemoryParticipant,
    OpReport,
    TrainerMemory,
)
from colosync.handoff.model.plans import Phase, PhaseName, Plan, Step, start_state
from colosync.handoff.runtime.invariants import (
    CheckContext,
    Invariant,
    Measurement,
    MiB,
    Violation,
    broken,
    default_invariants,
    summary,
)
from colosync.handoff.runtime.meter import Meter
from colosync.handoff.runtime.records import ExecutionResult, StepRecord
from colosync.handoff.runtime.sampling import PeakWatcher

log = logging.getLogger(__name__)


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
        self.meter = Meter(self.participants, self.pools, host_scope)
        self.watch_interval_s = watch_interval_s
        self._given_baseline = baseline_host_bytes
        self.result: ExecutionResult | None = None
        self._pending: list[Violation] = []
        self._sim_host_max = 0
        self.lent = False
        """Whether the engine's KV cache block is lent to the trainer (plans with ``lend_kv``, after init)."""

    def measure(self) -> Measurement:
        """Host and device now, against the baseline of the run in progress."""
        if self.result is None:
            raise HandoffError("the executor has no baseline yet: measure() works once run() or run_phase() started")
        return self.meter.measure(self.result.baseline_host)

    def _start(self, plan: Plan) -> ExecutionResult:
        """The result of the run in progress; a new one (and a new baseline) for a new mode."""
        if self.result is not None and self.result.peak_device == plan.peak_device:
            return self.result
        # Host pools reserved before the run hold their chunks from the start: the simulated
        # running peak starts at what is already reserved.
        baseline, dev_base, self._sim_host_max = self.meter.baseline(self._given_baseline)
        self.result = ExecutionResult(peak_device=plan.peak_device, baseline_host=baseline, baseline_device=dev_base)
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
        if plan.config.lend_kv and phase.name is not PhaseName.INIT and not self.lent:
            self._lend()
        expected = start_state(plan.config, phase.name)
        invariants = self.invariants(plan)
        for i, step in enumerate(phase.steps, 1):
            self._run_step(result, plan, phase, i, step, expected, invariants)
            alloc, free = effect(step.op, expected, step.backup)
            expected = (expected | alloc) - free
        return result

    def _lend(self) -> None:
        """Hand the engine's KV cache block to the trainer, once: after init, before the first cycle."""
        if self.trainer is None or self.engine is None:
            raise HandoffError("lend_kv needs both a trainer and an engine participant; give both, or plan without it")
        started = time.perf_counter()
        handle = self.engine.lend()
        self.trainer.borrow(handle)
        self.lent = True
        log.info(
            "handoff executor: the engine lends its KV cache (%.3f GB, %s) to the trainer, %.3f s",
            handle.nbytes / 1e9,
            handle.kind,
            time.perf_counter() - started,
        )

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
        sizes = self.meter.sizes()
        exp_peak = expected | alloc
        exp_host = sum(sizes.get(r, 0) for r in exp_peak if r.place is Place.HOST)
        exp_dev = device_bytes(exp_peak, sizes, lent=self.lent)
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
                sizes=self.meter.sizes(),
                device_baseline=result.baseline_device,
                device_measured=self.meter.device_measured,
                report=report,
                expected_effect=(alloc, free),
            )

        def check(ctx: CheckContext) -> None:
            self._pending.extend(broken(invariants, ctx))

        marks: list[Measurement] = []

        def on_mark(_p: MemoryParticipant, event: str) -> None:
            m = self.meter.measure(result.baseline_host)
            marks.append(m)
            check(context("peak", m))

        before = self.meter.measure(result.baseline_host)
        started = time.perf_counter()
        if participant is None:
            report = OpReport(participant=op.actor, op=op.method, noop=True, note=f"no {op.actor} participant")
        else:
            participant.step_context = (phase.name.value, index)
            participant.add_listener(on_mark)
            if self.meter.device_measured:
                torch.cuda.reset_peak_memory_stats(self.meter.device.device)
                reserved_before = torch.cuda.memory_reserved(self.meter.device.device)
            try:
                if self.watch_interval_s and self.meter.device_measured:
                    with PeakWatcher(self.meter.host, self.meter.device, self.watch_interval_s) as watcher:
                        report = participant.run(op, backup=backup)
                        watched = watcher.take()
                else:
                    report = participant.run(op, backup=backup)
                    watched = (0, 0)
            finally:
                participant.remove_listener(on_mark)
        seconds = time.perf_counter() - started
        after = self.meter.measure(result.baseline_host)
        if participant is not None and participant.remote:
            for m in self.meter.remote_peaks(result.baseline_host, participant, before, after):
                marks.append(m)
                check(context("peak", m))
        host_peak = max([before.host_copies, after.host_copies] + [m.host_copies for m in marks])
        host_abs_peak = max([before.host_abs, after.host_abs] + [m.host_abs for m in marks])
        dev_peak = max([before.device, after.device] + [m.device for m in marks])
        if participant is not None and self.meter.device_measured:
            w_host, w_dev = watched
            if w_host:
                host_abs_peak = max(host_abs_peak, w_host)
                host_peak = max(host_peak, w_host - result.baseline_host)
            dev_peak = max(
                dev_peak,
                w_dev,
                before.device - reserved_before + torch.cuda.max_memory_reserved(self.meter.device.device),
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
                raise HandoffInvariantError(summary(found), violation=found[0])
