"""The engine-side transaction: begin -> stage... -> prepare -> commit, or abort.

The engine serves exactly one committed version at any time. Bytes arrive into buffers the
Receiver owns; nothing the engine serves is touched before ``commit``, and a failed, aborted,
superseded or timed-out update frees everything it staged. The Receiver is transport- and
engine-agnostic: the engine plugs in through ``EngineTarget``, bytes come through whatever
``ReceiverTransport`` the sender attached.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from . import transports
from .bucket import fingerprint, tensor_views
from .errors import (
    ColosyncError,
    FingerprintMismatchError,
    ManifestError,
    NonFiniteError,
    StaleUpdateError,
    TransactionStateError,
    TransportError,
    UpdateTimeoutError,
)
from .manifest import UpdateManifest
from .protocol import Abort, Ack, Attach, Begin, Commit, Prepare, Stage, Status, TransactionRequest
from .target import EngineTarget, validate_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverPolicy:
    """What the engine accepts. Defaults are the safe ones."""

    reject_nonfinite: bool = True
    verify_fingerprints: bool = True
    timeout_s: float = 60.0


@dataclass
class _InFlight:
    manifest: UpdateManifest
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    prepared: Any = None
    is_prepared: bool = False
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def update_id(self) -> int:
        return self.manifest.update_id

    def missing_buckets(self) -> list[int]:
        sizes = self.manifest.bucket_sizes
        return [b for b, size in enumerate(sizes) if self.received.get(b, 0) != size]


class Receiver:
    def __init__(self, target: EngineTarget, device: torch.device | str = "cpu", policy: ReceiverPolicy | None = None) -> None:
        self.target = target
        self.device = torch.device(device)
        self.policy = policy or ReceiverPolicy()
        self.committed_update_id = 0
        self._spec = target.model_spec()
        self._transport: transports.ReceiverTransport | None = None
        self._inflight: _InFlight | None = None
        self._ended: OrderedDict[int, str] = OrderedDict()  # recent aborted ids -> why

    # -- dispatch ---------------------------------------------------------------------------
    def handle(self, request: TransactionRequest) -> Ack:
        """Apply one control message; raises a ``ColosyncError`` subclass on rejection."""
        self.check_timeout()
        match request:
            case Attach():
                self.attach(request.transport, request.handle)
            case Begin():
                self.begin(request.manifest)
            case Stage():
                self.stage(request)
            case Prepare():
                self.prepare(request.update_id)
            case Commit():
                self.commit(request.update_id)
            case Abort():
                self.abort(request.update_id, request.reason or "aborted by sender")
            case Status():
                pass
            case _:
                raise ManifestError(f"unexpected control message {type(request).__name__}")
        return self.status()

    def status(self) -> Ack:
        inflight = self._inflight.update_id if self._inflight else None
        return Ack(committed_update_id=self.committed_update_id, in_flight_update_id=inflight)

    # -- transaction steps ------------------------------------------------------------------
    def attach(self, transport: str, handle: bytes) -> None:
        opened = transports.receiver_class(transport).open(handle, self.device)
        if self._transport is not None:
            self._transport.close()
        self._transport = opened
        log.info("receiver: attached %s transport", transport)

    def begin(self, manifest: UpdateManifest) -> None:
        uid = manifest.update_id
        if uid <= self.committed_update_id:
            raise StaleUpdateError(
                f"update {uid} is not newer than the committed update {self.committed_update_id}; "
                "use a fresh, increasing update_id (Sender does this for you)"
            )
        if self._inflight is not None:
            if uid <= self._inflight.update_id:
                raise StaleUpdateError(
                    f"update {uid} repeats or precedes the in-flight update {self._inflight.update_id}; "
                    "abort it first or use a larger update_id"
                )
            log.warning("receiver: update %d supersedes unfinished update %d", uid, self._inflight.update_id)
            self._end("superseded by update %d" % uid)
        validate_manifest(manifest, self._spec)
        self._inflight = _InFlight(manifest)
        log.debug("receiver: begin update %d (%s, %d tensors, %d bytes)", uid, manifest.kind,
                  len(manifest.tensors), manifest.total_bytes)

    def stage(self, msg: Stage) -> None:
        tx = self._current(msg.update_id, "stage")
        if tx.is_prepared:
            raise TransactionStateError(f"update {msg.update_id} is already prepared; stage before prepare")
        if self._transport is None:
            raise TransportError("no transport attached; the sender must send Attach before staging")
        sizes = tx.manifest.bucket_sizes
        if msg.bucket >= len(sizes):
            raise ManifestError(f"stage names bucket {msg.bucket} but update {msg.update_id} has {len(sizes)}")
        size, done = sizes[msg.bucket], tx.received.get(msg.bucket, 0)
        if msg.offset != done or msg.offset + msg.nbytes > size:
            raise ManifestError(
                f"bucket {msg.bucket}: chunk [{msg.offset}, {msg.offset + msg.nbytes}) does not continue "
                f"the {done} bytes received of {size}; chunks must arrive in order"
            )
        try:
            buffer = tx.buffers.get(msg.bucket)
            if buffer is None:
                buffer = tx.buffers[msg.bucket] = torch.empty(size, dtype=torch.uint8, device=self.device)
            if msg.nbytes:
                src = self._transport.slot(msg.slot)[: msg.nbytes]
                buffer[msg.offset : msg.offset + msg.nbytes].copy_(src)
            tx.received[msg.bucket] = done + msg.nbytes
            tx.last_activity = time.monotonic()
            if tx.received[msg.bucket] == size:
                self._complete_bucket(tx, msg.bucket, msg.fingerprint)
        except ColosyncError as exc:
            self._end(f"rejected: {exc}")
            raise

    def _complete_bucket(self, tx: _InFlight, bucket: int, sent_fp: int | None) -> None:
        buffer = tx.buffers[bucket]
        if self.policy.verify_fingerprints:
            got = fingerprint(buffer)
            if sent_fp is None or got != sent_fp:
                raise FingerprintMismatchError(
                    f"update {tx.update_id} bucket {bucket}: fingerprint {got} != sent {sent_fp}; the "
                    "bytes changed in transit (was the slot overwritten before it was acknowledged?)"
                )
        views = tensor_views(buffer, tx.manifest.bucket_tensors(bucket))
        if self.policy.reject_nonfinite:
            _check_finite(views, tx.update_id)
        tx.tensors.update(views)

    def prepare(self, update_id: int) -> None:
        tx = self._current(update_id, "prepare")
        if tx.is_prepared:
            return
        missing = tx.missing_buckets()
        if missing:
            self._end("prepare before all buckets arrived")
            raise TransactionStateError(
                f"update {update_id}: prepare before buckets {missing[:10]} arrived; stage every bucket first"
            )
        try:
            tx.prepared = self.target.prepare(tx.manifest, tx.tensors)
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
            self.target.commit(tx.prepared, update_id)
        except BaseException as exc:
            self._end(f"commit failed: {exc}")
            raise
        self.committed_update_id = update_id
        tx.prepared = None  # committed: now owned by the engine, not to be discarded
        self._inflight = None
        log.info("receiver: committed update %d", update_id)

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
        if self._inflight is not None:
            self._end("receiver closed")
        if self._transport is not None:
            self._transport.close()
            self._transport = None

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
        tx, self._inflight = self._inflight, None
        if tx is None:
            return
        if tx.is_prepared and tx.prepared is not None:
            try:
                self.target.discard(tx.prepared)
            except Exception:  # freeing must not mask the original error
                log.exception("receiver: discard of update %d failed", tx.update_id)
        tx.buffers.clear()
        tx.tensors.clear()
        self._ended[tx.update_id] = reason
        while len(self._ended) > 64:
            self._ended.popitem(last=False)
        log.info("receiver: update %d ended without commit: %s", tx.update_id, reason)


def _check_finite(views: dict[str, torch.Tensor], update_id: int) -> None:
    floats = [(n, t if t.dtype.itemsize > 1 else t.float()) for n, t in views.items() if t.is_floating_point() and t.numel()]
    if not floats:
        return
    maxes = torch._foreach_norm([t for _, t in floats], float("inf"))
    bad = ~torch.stack([m.float() for m in maxes]).isfinite()
    if bool(bad.any()):
        names = [floats[i][0] for i in bad.nonzero().flatten().tolist()]
        raise NonFiniteError(
            f"update {update_id}: tensors {names[:5]} hold NaN or Inf; fix the training step, or start "
            "the engine with ReceiverPolicy(reject_nonfinite=False) to accept them"
        )
