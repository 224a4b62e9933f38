"""The colocated step as one call: rollout, handoff, train, handoff with the sync, verify.

Trainer and engine share the GPU, so every step of an RL job is the same five moves, and
their order is the point: the engine rolls out; the handoff gives the device to the trainer
(``rollout_to_train``); the trainer steps; the handoff gives it back (``train_to_rollout``),
and inside it, once the engine's weights are in place, the trainer's weights go over as one
transaction (``VerifiedSync``: a probe of the trainer's logprobs rides along when asked);
then the loop may check what the engine now serves (``check``). ``Colocated.step`` runs them in that
order against a ``Cluster`` and returns a ``StepRecord`` of each part's seconds, the two
phases as measured against the plan (``PhaseStats``) and the ``SyncReport``. What the rollout
and the training are is the caller's (two callables); with ``peak_device=None`` there is no
handoff (an engine without a sleep mode) and the sync runs between train and check.

A sync that fails inside the handoff (a ``DeliveryError`` from a verified push, an engine
that refuses the update) does not stop the phase: the rest of ``train_to_rollout`` runs (the
trainer asleep, the engine's KV back, memory where the plan says) and then the sync's error
raises from ``step``, so the next ``step`` starts where a step starts. A step whose memory
cannot be put back where the plan says (a handoff phase, or ``train`` between the two phases,
raised) leaves the instance broken: every later ``step`` raises a ``ColosyncError`` saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from colosync.colocated.cluster import Cluster
from colosync.colocated.handoff import PEAK_DEVICES, Handoff, PhaseStats
from colosync.colocated.sync import VerifiedSync
from colosync.errors import ColosyncError, ConfigError
from colosync.sync.pipeline import SyncReport
from colosync.sync.sender import DEFAULT_BUCKET_BYTES
from colosync.wire.protocol import Probe

log = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")


@dataclass
class StepRecord(Generic[R, T]):
    """One colocated step as it ran: what the callables returned, each part's seconds, both
    handoff phases (``None`` without the handoff) and the sync's report."""

    rollout: R
    trained: T
    sync: SyncReport
    checked: Any = None  # what ``check(trained, sync)`` returned
    verified: bool = False  # a probe rode the push (the engine checked it before serving)
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0  # the push (inside train_to_rollout with the handoff)
    check_s: float = 0.0
    seconds: float = 0.0  # the whole step
    rollout_to_train: PhaseStats | None = None
    train_to_rollout: PhaseStats | None = None
    violations: list[str] = field(default_factory=list)  # both phases' broken invariants

    @property
    def phases(self) -> list[PhaseStats]:
        return [p for p in (self.rollout_to_train, self.train_to_rollout) if p is not None]


class Colocated:
    """``cluster``'s trainer and engine, stepped together (see module docstring).

    ``peak_device``: the handoff's order (``cpu`` or ``gpu``), or ``None`` for no handoff;
    ``verify_every``: which pushes carry the step's probe (``VerifiedSync``); ``lend_kv``: the
    trainer wakes up in the engine's KV cache block (``HandoffConfig.lend_kv``). Call ``init()``
    once (the plan's init phase: the trainer loaded and asleep, the engine back), then
    ``step(...)`` per step, then ``close()`` (the arena; the cluster is the caller's).
    ``broken`` says why later steps are refused (``None`` while the step can run)."""

    def __init__(
        self,
        cluster: Cluster,
        peak_device: str | None = "cpu",
        *,
        pin: Any = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        host_scope: str = "processes",
        verify_every: int = 1,
        lend_kv: bool = False,
    ) -> None:
        if peak_device is not None and peak_device not in PEAK_DEVICES:
            raise ConfigError(
                f"peak_device must be one of {list(PEAK_DEVICES)} or None (no handoff), got {peak_device!r}"
            )
        self.cluster = cluster
        self.sync = VerifiedSync(verify_every=verify_every)
        self._probe: Probe | None = None  # the pending step's, for the push inside train_to_rollout
        self._sync_error: Exception | None = None  # what the push inside train_to_rollout raised
        self._initialized = peak_device is None
        self.broken: str | None = None
        self.handoff: Handoff | None = None
        if peak_device is not None:
            self.handoff = Handoff(
                cluster,
                peak_device,
                self._push_pending,
                pin=pin,
                bucket_bytes=bucket_bytes,
                host_scope=host_scope,
                lend_kv=lend_kv,
            )

    def _remote_push(self, probe: Probe | None) -> SyncReport:
        reply = self.cluster.trainer.call("push") if probe is None else self.cluster.trainer.call("push", probe)
        return msgspec.msgpack.decode(reply, type=SyncReport)

    def _push_pending(self) -> SyncReport | None:
        """The plan's sync.weights step: the push, its error kept (not raised) so that the
        rest of the phase runs; ``step`` raises it once the phase is done."""
        probe, self._probe = self._probe, None
        try:
            return self.sync.push(self._remote_push, probe)
        except Exception as exc:
            log.warning("sync failed inside train_to_rollout (%s: %s); finishing the phase", type(exc).__name__, exc)
            self._sync_error = exc
            return None

    def _phase(self, name: str) -> PhaseStats:
        """One handoff phase; one that raises leaves memory where no plan says: broken."""
        assert self.handoff is not None
        try:
            return self.handoff.phase(name)
        except BaseException as exc:
            self.broken = f"the handoff's {name} phase raised {type(exc).__name__}: {exc}"
            raise

    def push(self, probe: Probe | None = None) -> SyncReport:
        """One sync outside a step (the engine awake), e.g. the first adapter without the handoff."""
        return self.sync.push(self._remote_push, probe)

    def init(self) -> PhaseStats | None:
        """The plan's init phase (``None`` without the handoff)."""
        if self.handoff is None:
            return None
        self._refuse_if_broken()
        stats = self._phase("init")
        self._initialized = True
        return stats

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise ColosyncError(
                f"this Colocated cannot step: {self.broken}; the trainer's and the engine's memory is not where the "
                "plan says, so start a new Cluster and Colocated"
            )

    def step(
        self,
        rollout: Callable[[], R],
        train: Callable[[R], T],
        *,
        probe: Callable[[T], Probe] | None = None,
        check: Callable[[T, SyncReport], Any] | None = None,
    ) -> StepRecord[R, T]:
        """rollout() -> handoff -> train(rollout) -> handoff with the sync -> check(trained, sync).

        ``probe(trained)``: the trainer's probe, made after its step on the steps that verify
        (it rides the push; a deviation raises from the sync); ``check(trained, sync)``: what
        the loop verifies once the engine serves the update (raise to stop), kept in ``checked``.

        A sync that fails inside the handoff raises its error after ``train_to_rollout`` has
        finished (the next step can run); a failure that leaves the memory off the plan marks
        the instance ``broken`` (see module docstring)."""
        self._refuse_if_broken()
        if not self._initialized:
            raise ConfigError("Colocated.step before init(): the plan's init phase loads the trainer")
        started = time.perf_counter()
        out = rollout()
        rollout_s = time.perf_counter() - started
        r2t = self._phase("rollout_to_train") if self.handoff is not None else None
        t = time.perf_counter()
        try:
            trained = train(out)
            train_s = time.perf_counter() - t
            pending = self.sync.probe(None if probe is None else lambda: probe(trained))
        except BaseException as exc:
            if self.handoff is not None:  # the trainer holds the device, the engine's KV is offloaded
                self.broken = f"train raised {type(exc).__name__} between the handoff's phases: {exc}"
            raise
        t2r = None
        if self.handoff is not None:
            before = self.sync.last
            self._probe, self._sync_error = pending, None
            try:
                t2r = self._phase("train_to_rollout")  # runs the push at its sync.weights step
            finally:
                self._probe = None
                error, self._sync_error = self._sync_error, None
            if error is not None:
                raise error  # after the phase finished: memory is where the plan says, the next step can run
            if self.sync.last is None or self.sync.last is before:
                raise ConfigError("the plan's train_to_rollout ran no sync (it has no sync.weights step)")
            report, sync_s = self.sync.last, t2r.sync_seconds
        else:
            t = time.perf_counter()
            report = self.sync.push(self._remote_push, pending)
            sync_s = time.perf_counter() - t
        t = time.perf_counter()
        checked = check(trained, report) if check is not None else None
        check_s = time.perf_counter() - t
        phases = [p for p in (r2t, t2r) if p is not None]
        return StepRecord(
            rollout=out,
            trained=trained,
            sync=report,
            checked=checked,
            verified=pending is not None,
            rollout_s=rollout_s,
            train_s=train_s,
            sync_s=sync_s,
            check_s=check_s,
            seconds=time.perf_counter() - started,
            rollout_to_train=r2t,
            train_to_rollout=t2r,
            violations=[v for p in phases for v in p.violations],
        )

    @property
    def arena_bytes(self) -> int:
        return self.handoff.arena.nbytes if self.handoff is not None else 0

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()

    def __enter__(self) -> Colocated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Colocated", "StepRecord"]
