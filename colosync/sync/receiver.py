"""The engine-side transaction: begin -> stage... -> prepare -> commit, or abort.

The engine serves exactly one committed version at any time: nothing it serves is touched
before ``commit``, and a failed, aborted, superseded or timed-out update frees everything it
staged. The Receiver is transport- and engine-agnostic: the engine plugs in through
``EngineTarget``, bytes come through whatever ``ReceiverTransport`` the sender attached.
This module decides only whether a step may happen now (ids only grow, a newer Begin
supersedes, a silent sender times out, an ended id stays ended); where a Stage's bytes land
and how they are checked is ``sync.landing``'s business.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from colosync import transports
from colosync.errors import (
    ColosyncError,
    ConfigError,
    EngineBusyError,
    ManifestError,
    StaleUpdateError,
    TransactionStateError,
    TransportError,
    UpdateTimeoutError,
)
from colosync.sync.delivery import delivery_error
from colosync.sync.landing import Lander, Landing
from colosync.sync.target import EngineTarget, ReceiverPolicy, untie, validate_manifest
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import (
    Abort,
    Ack,
    Attach,
    Begin,
    Commit,
    Delivery,
    Detach,
    Prepare,
    Revert,
    Stage,
    Status,
    TransactionRequest,
)

if TYPE_CHECKING:
    from colosync.sync.transaction import EngineTransaction

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    manifest: UpdateManifest
    landing: Landing
    prepared: Any = None
    is_prepared: bool = False
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def update_id(self) -> int:
        return self.manifest.update_id


class Receiver:
    def __init__(
        self, target: EngineTarget, device: torch.device | str = "cpu", policy: ReceiverPolicy | None = None
    ) -> None:
        self.target = target
        self.device = _usable(torch.device(device))
        self.policy = policy or ReceiverPolicy()
        self.transaction: EngineTransaction | None = None  # the owner in front of it (``sync.transaction``)
        self.committed_update_id = 0
        self.serving = True  # False after a full update failed verification (fail closed)
        self._previous: tuple[int, bool] | None = None  # (id, serving) a revert of the last commit goes back to
        self._delivery: Delivery | None = None  # what the last commit changed, for its Ack
        self._highest_update_id = 0
        self._spec = target.model_spec()
        self._transport: transports.ReceiverTransport | None = None
        self._inflight: _InFlight | None = None
        self._ended: OrderedDict[int, str] = OrderedDict()  # recent aborted ids -> why
        self._lander = Lander(self.device)  # plans, bounce buffer and fence, kept between updates
        self._drain = self._lander.fence.drain

    # -- dispatch ---------------------------------------------------------------------------
    def handle(self, request: TransactionRequest) -> Ack:
        """Apply one control message; raises a ``ColosyncError`` subclass on rejection."""
        if type(request) is not Stage:
            self._drain()  # every reply but a Stage's promises that all slots are free
        self.check_timeout()
        match request:
            case Attach():
                self.attach(request.transport, request.handle, request.takeover)
            case Detach():
                self.detach()
            case Begin():
                self.begin(request.manifest)
            case Stage():
                self.stage(request)
            case Prepare():
                self.prepare(request.update_id)
            case Commit():
                self.commit(request.update_id)
                return self.status(self._delivery)
            case Abort():
                self.abort(request.update_id, request.reason or "aborted by sender")
            case Revert():
                self.revert(request.update_id, request.reason or "reverted by sender")
            case Status():
                pass
            case _:
                raise ManifestError(f"unexpected control message {type(request).__name__}")
        return self.status()

    def status(self, delivery: Delivery | None = None) -> Ack:
        return Ack(
            committed_update_id=self.committed_update_id,
            in_flight_update_id=self.in_flight,
            highest_update_id=self._highest_update_id,
            serving=self.serving,
            delivery=delivery,
            adapter=self.target.served_adapter(),
        )

    # -- transaction steps ------------------------------------------------------------------
    def attach(self, transport: str, handle: bytes, takeover: bool = False) -> None:
        """Open a sender's transport. One sender at a time: another is refused unless it takes over."""
        self._drain()
        if self._transport is not None and not takeover:
            raise EngineBusyError(
                "another sender is attached to this engine; one sender updates an engine at a time: close it "
                "(Sender.close() detaches) or take over with Sender(..., takeover=True)"
            )
        try:
            opened = transports.receiver_class(transport).open(handle, self.device)
        except ColosyncError:
            raise
        except Exception as exc:  # a failed open is the transport's failure, so auto can fall back
            raise TransportError(f"cannot open the {transport} handle: {type(exc).__name__}: {exc}") from exc
        if self._inflight is not None and takeover:
            self._end("another sender took over the engine")
        self.detach()
        self._transport = opened
        self._lander.attached(opened.num_slots)
        log.info("receiver: attached %s transport", transport)

    def detach(self) -> None:
        """Drop the attached transport (its sender is done or gone) and its in-flight update."""
        self._drain()
        if self._inflight is not None:
            self._end("the sender detached")
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def begin(self, manifest: UpdateManifest) -> None:
        uid = manifest.update_id
        _check_fresh(uid, self.committed_update_id, self.in_flight, self._highest_update_id)
        plan = self._lander.plans.get(manifest.layout)
        checked = (manifest.kind, manifest.lora)
        if checked not in plan.validated:  # an invalid update must not end the one in flight
            validate_manifest(manifest, self._spec)
            self.target.check(manifest)
            plan.validated.add(checked)
        if self._inflight is not None:
            log.warning("receiver: update %d supersedes unfinished update %d", uid, self._inflight.update_id)
            self._end(f"superseded by update {uid}")
        self._highest_update_id = uid
        staging = self.target.staging(manifest)
        try:
            landing = self._lander.open(manifest, plan, staging, self.policy)
        except BaseException:
            self.target.unstage(manifest)  # the engine's area (an arena lease) goes back with the refusal
            raise
        self._inflight = _InFlight(manifest, landing)
        log.debug("receiver: begin update %d (%s, %d tensors)", uid, manifest.kind, len(manifest.tensors))

    def stage(self, msg: Stage) -> None:
        tx = self._current(msg.update_id, "stage")
        if tx.is_prepared:
            raise TransactionStateError(f"update {msg.update_id} is already prepared; stage before prepare")
        if self._transport is None:
            raise TransportError("no transport attached; the sender must send Attach before staging")
        src = tx.landing.admit(msg, self._transport)  # a chunk out of place is refused, the update stays
        try:
            tx.landing.land(msg, src)
            tx.last_activity = time.monotonic()
            self._lander.fence.staged()
        except Exception as exc:
            self._end(f"rejected: {exc}" if isinstance(exc, ColosyncError) else f"failed: {type(exc).__name__}: {exc}")
            raise

    def prepare(self, update_id: int) -> None:
        tx = self._current(update_id, "prepare")
        if tx.is_prepared:
            return
        missing = tx.landing.missing_buckets()
        if missing:
            self._end("prepare before all buckets arrived")
            raise TransactionStateError(
                f"update {update_id}: prepare before buckets {missing[:10]} arrived; stage every bucket first"
            )
        try:
            tx.landing.verify()
            tensors = untie(tx.manifest, tx.landing.engine_tensors(), self._spec)
            tx.prepared = self.target.prepare(tx.manifest, tensors)
        except BaseException as exc:
            self._end(f"prepare failed: {exc}")
            raise
        tx.is_prepared = True
        tx.last_activity = time.monotonic()

    def commit(self, update_id: int) -> None:
        tx = self._current(update_id, "commit")
        if not tx.is_prepared:
            raise TransactionStateError(f"update {update_id}: commit before prepare; call prepare first")
        try:
            changes = self.target.commit(tx.prepared, update_id)
        except BaseException as exc:
            self._end(f"commit failed: {exc}")
            raise
        self._previous = (self.committed_update_id, self.serving)
        self.committed_update_id = update_id
        if tx.manifest.kind == "full" and tx.manifest.tensors:
            self.serving = True  # new base weights: what failed closed is replaced (a LoRA or a bare drop cannot)
        tx.prepared = None  # committed: now owned by the engine, not to be discarded
        self._inflight = None
        self._unstage(tx)
        self._delivery = Delivery(changes.changed, changes.expected) if changes is not None else None
        log.info("receiver: committed update %d", update_id)
        if changes is not None and changes.changed != changes.expected:
            unit = "modules" if tx.manifest.kind == "lora" else "parameters or layers"
            why = f"the engine changed {changes.changed} {unit} where the manifest names {changes.expected}"
            raise delivery_error(update_id, why, self.revert(update_id, why))

    def revert(self, update_id: int, reason: str) -> Ack:
        """Undo the last commit (it failed verification): the engine's previous version, or fail closed."""
        if update_id != self.committed_update_id or self._previous is None:
            raise TransactionStateError(
                f"revert of update {update_id}, but the last commit is {self.committed_update_id}"
                f"{' and it was already reverted' if self._previous is None else ''}; only the last commit can be "
                "reverted, once"
            )
        previous, self._previous = self._previous, None
        if self.target.revert(update_id):
            self.committed_update_id, self.serving = previous
            log.warning("receiver: update %d reverted to %d: %s", update_id, self.committed_update_id, reason)
        else:
            self.serving = False
            log.error("receiver: update %d cannot be reverted; failing closed: %s", update_id, reason)
        return self.status()

    def abort(self, update_id: int, reason: str) -> None:
        """Drop the in-flight update if it is ``update_id``; idempotent otherwise."""
        if self._inflight is not None and self._inflight.update_id == update_id:
            self._end(reason)

    def check_timeout(self, now: float | None = None) -> None:
        tx = self._inflight
        if tx is None:
            return
        idle = (time.monotonic() if now is None else now) - tx.last_activity
        if idle > self.policy.timeout_s:
            log.warning("receiver: update %d idle for %.1fs, aborting", tx.update_id, idle)
            self._end(f"timed out: the sender was silent for {idle:.1f}s (timeout {self.policy.timeout_s}s)")

    def close(self) -> None:
        self.detach()
        self._lander.close()

    @property
    def buffer_bytes(self) -> int:  # device memory the Receiver keeps between updates (at most one bucket)
        return self._lander.bounce.nbytes

    @property
    def in_flight(self) -> int | None:
        return self._inflight.update_id if self._inflight else None

    # -- internals --------------------------------------------------------------------------
    def _current(self, update_id: int, step: str) -> _InFlight:
        tx = self._inflight
        if tx is not None and tx.update_id == update_id:
            return tx
        why = self._ended.get(update_id)
        if why is not None:
            cls = UpdateTimeoutError if why.startswith("timed out") else TransactionStateError
            raise cls(f"update {update_id} was aborted ({why}); start a new update")
        raise TransactionStateError(
            f"{step} for update {update_id}, but the update in flight is "
            f"{tx.update_id if tx else 'none'}; send Begin first"
        )

    def _end(self, reason: str) -> None:
        self._drain()
        tx, self._inflight = self._inflight, None
        if tx is None:
            return
        if tx.is_prepared and tx.prepared is not None:
            try:
                self.target.discard(tx.prepared)
            except Exception:  # freeing must not mask the original error
                log.exception("receiver: discard of update %d failed", tx.update_id)
        tx.landing.release()
        self._unstage(tx)
        self._ended[tx.update_id] = reason
        while len(self._ended) > 64:
            self._ended.popitem(last=False)
        log.info("receiver: update %d ended without commit: %s", tx.update_id, reason)

    def _unstage(self, tx: _InFlight) -> None:
        try:
            self.target.unstage(tx.manifest)
        except Exception:  # freeing must not mask the original error or undo a commit
            log.exception("receiver: unstage of update %d failed", tx.update_id)


def _check_fresh(uid: int, committed: int, in_flight: int | None, highest: int) -> None:
    """Refuse an update id that is not newer than every id this engine has seen."""
    if uid <= committed:
        raise StaleUpdateError(
            f"update {uid} is not newer than the committed update {committed}; "
            "use a fresh, increasing update_id (Sender does this for you)"
        )
    if in_flight is not None and uid <= in_flight:
        raise StaleUpdateError(
            f"update {uid} repeats or precedes the in-flight update {in_flight}; "
            "abort it first or use a larger update_id"
        )
    if uid <= highest:
        raise StaleUpdateError(
            f"update {uid} is not newer than update {highest}, which began and ended "
            "without commit; ids are never reused: use a larger update_id (Sender does this for you)"
        )


def _usable(device: torch.device) -> torch.device:
    """``device`` with its index resolved, or a ``ConfigError`` now rather than at the first push."""
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f"Receiver(device={str(device)!r}) on a host where CUDA is not available; "
            "use device='cpu' or run the engine where its GPU is visible"
        )
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
