"""The engine-side transaction: begin -> stage... -> prepare -> commit, or abort.

The engine serves exactly one committed version at any time. Bytes arrive into buffers the
Receiver owns; nothing the engine serves is touched before ``commit``, and a failed, aborted,
superseded or timed-out update frees everything it staged. The Receiver is transport- and
engine-agnostic: the engine plugs in through ``EngineTarget``, bytes come through whatever
``ReceiverTransport`` the sender attached.

Receive paths. An engine that lends its own tensors (``EngineTarget.staging``) gets each
bucket copied straight from the transport into them: one flat copy per bucket when it lends
per-bucket buffers too, else one fused copy (through one bucket-sized device buffer when the
bytes arrive in host memory or in pieces); otherwise the Receiver allocates one buffer per
bucket and hands out views of it. On a GPU nothing waits
on the host mid-update except the flow control below: fingerprints and the non-finite check
run on the device as the bytes land and are read back once, at ``prepare``; a Stage is
acknowledged as soon as the previous Stage's copy has finished, so with two or more slots
the copy of one chunk overlaps the arrival of the next (``transports.base`` says what an
acknowledgement promises).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from colosync import transports
from colosync.wire import fused
from colosync.wire.bucket import tensor_views, typed_views
from colosync.errors import (
    ColosyncError,
    FingerprintMismatchError,
    ManifestError,
    NonFiniteError,
    StaleUpdateError,
    TransactionStateError,
    TransportError,
    UpdateTimeoutError,
)
from colosync.wire.manifest import Layout, TensorMeta, UpdateManifest
from colosync.wire.protocol import Abort, Ack, Attach, Begin, Commit, Prepare, Stage, Status, TransactionRequest
from colosync.sync.target import EngineTarget, Staging, validate_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverPolicy:
    """What the engine accepts. Defaults are the safe ones."""

    reject_nonfinite: bool = True
    verify_fingerprints: bool = True
    timeout_s: float = 60.0


class _Bucket:
    """What the Receiver needs to know about one bucket of a layout, computed once."""

    def __init__(self, size: int, indices: list[int], metas: list[TensorMeta]) -> None:
        self.size, self.indices, self.metas = size, indices, metas
        self.names = [m.name for m in metas]
        self.single = len(metas) == 1 and metas[0].offset == 0 and metas[0].nbytes == size
        self.segments = fused.segments(metas, size)  # None: check finiteness tensor by tensor (fp8)
        self.views: dict[tuple, list[torch.Tensor]] = {}  # typed views of a slot / the bounce buffer


class _Layout:
    """Per-layout receive plan, shared by every update with the same tensors and buckets."""

    def __init__(self, manifest: UpdateManifest) -> None:
        self.names = tuple(t.name for t in manifest.tensors)
        members: list[list[int]] = [[] for _ in manifest.bucket_sizes]
        for i, t in enumerate(manifest.tensors):
            members[t.bucket].append(i)
        self.buckets = [
            _Bucket(size, idx, [manifest.tensors[i] for i in idx]) for size, idx in zip(manifest.bucket_sizes, members)
        ]
        self.validated: set[tuple] = set()


@dataclass
class _InFlight:
    manifest: UpdateManifest
    layout: _Layout | None = None
    staging: list[torch.Tensor] | None = None  # engine-owned destination tensors (manifest order)
    flats: Any = None  # engine-owned bucket buffers matching ``staging`` (optional)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: list[tuple[int, Any, int | None]] = field(default_factory=list)  # (bucket, [fp, bad] on device, sent)
    results: Any = None  # one zeroed [fingerprint, non-finite] row per bucket, on the device
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
        self._highest_update_id = 0
        self._spec = target.model_spec()
        self._transport: transports.ReceiverTransport | None = None
        self._inflight: _InFlight | None = None
        self._ended: OrderedDict[int, str] = OrderedDict()  # recent aborted ids -> why
        self._layouts: OrderedDict[Layout, _Layout] = OrderedDict()
        self._generation = 0  # bumps on every attach: cached slot views name it
        self._lag = False  # acknowledge a Stage before its copy is done (2+ slots)
        self._pending: Any = None  # CUDA event after the last Stage's copies
        self._bounce: torch.Tensor | None = None  # one bucket of device memory, kept between updates

    # -- dispatch ---------------------------------------------------------------------------
    def handle(self, request: TransactionRequest) -> Ack:
        """Apply one control message; raises a ``ColosyncError`` subclass on rejection."""
        if type(request) is not Stage:
            self._drain()  # every reply but a Stage's promises that all slots are free
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
        return Ack(committed_update_id=self.committed_update_id, in_flight_update_id=inflight,
                   highest_update_id=self._highest_update_id)

    # -- transaction steps ------------------------------------------------------------------
    def attach(self, transport: str, handle: bytes) -> None:
        self._drain()
        try:
            opened = transports.receiver_class(transport).open(handle, self.device)
        except ColosyncError:
            raise
        except Exception as exc:  # a failed open is the transport's failure, so auto can fall back
            raise TransportError(f"cannot open the {transport} handle: {type(exc).__name__}: {exc}") from exc
        if self._transport is not None:
            self._transport.close()
        self._transport = opened
        self._generation += 1
        self._lag = opened.num_slots >= 2
        for layout in self._layouts.values():
            for bucket in layout.buckets:
                bucket.views.clear()
        log.info("receiver: attached %s transport", transport)

    def begin(self, manifest: UpdateManifest) -> None:
        uid = manifest.update_id
        if uid <= self.committed_update_id:
            raise StaleUpdateError(
                f"update {uid} is not newer than the committed update {self.committed_update_id}; "
                "use a fresh, increasing update_id (Sender does this for you)"
            )
        if self._inflight is not None and uid <= self._inflight.update_id:
            raise StaleUpdateError(
                f"update {uid} repeats or precedes the in-flight update {self._inflight.update_id}; "
                "abort it first or use a larger update_id"
            )
        if uid <= self._highest_update_id:
            raise StaleUpdateError(
                f"update {uid} is not newer than update {self._highest_update_id}, which began and ended "
                "without commit; ids are never reused: use a larger update_id (Sender does this for you)"
            )
        layout = self._layout(manifest)
        checked = (manifest.kind, manifest.lora)
        if checked not in layout.validated:  # an invalid update must not end the one in flight
            validate_manifest(manifest, self._spec)
            self.target.check(manifest)
            layout.validated.add(checked)
        if self._inflight is not None:
            log.warning("receiver: update %d supersedes unfinished update %d", uid, self._inflight.update_id)
            self._end("superseded by update %d" % uid)
        self._highest_update_id = uid
        staging, flats = self._staging(manifest)
        self._inflight = _InFlight(manifest, layout, staging, flats)
        if log.isEnabledFor(logging.DEBUG):
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
        if size and done == size:
            raise ManifestError(f"bucket {msg.bucket} of update {msg.update_id} is already complete; stage it once")
        if msg.nbytes > self._transport.slot(msg.slot).numel():
            raise ManifestError(
                f"stage of {msg.nbytes} bytes exceeds transport slot {msg.slot}; chunk buckets by the slot size"
            )
        if msg.offset != done or msg.offset + msg.nbytes > size:
            raise ManifestError(
                f"bucket {msg.bucket}: chunk [{msg.offset}, {msg.offset + msg.nbytes}) does not continue "
                f"the {done} bytes received of {size}; chunks must arrive in order"
            )
        try:
            if msg.nbytes:
                src = self._transport.slot(msg.slot)
                if msg.nbytes < src.numel():
                    src = src[: msg.nbytes]
            else:
                src = None
            self._receive(tx, msg, src, size)
            tx.received[msg.bucket] = done + msg.nbytes
            tx.last_activity = time.monotonic()
            self._fence()
        except ColosyncError as exc:
            self._end(f"rejected: {exc}")
            raise
        except Exception as exc:
            self._end(f"failed: {type(exc).__name__}: {exc}")
            raise

    # -- receive path -----------------------------------------------------------------------
    def _receive(self, tx: _InFlight, msg: Stage, src: torch.Tensor | None, size: int) -> None:
        """Land one chunk; at a bucket's last chunk, fingerprint and check it (one pass on a GPU).

        The destination is one flat run of bytes per bucket when there is one: the engine's own
        bucket buffer (``Staging.buckets``), the engine's tensor if it is the whole bucket, or,
        without staging, a buffer the Receiver allocates and hands out views of. Otherwise the
        bucket is copied straight from the slot into the engine's tensors (fused), or assembled in
        one bucket of device memory first when it arrives in host memory or in pieces.
        """
        b = tx.layout.buckets[msg.bucket]
        last = msg.offset + msg.nbytes == size
        flat = self._flat_destination(tx, msg.bucket, b, size)
        whole = msg.offset == 0 and last and src is not None
        check = self.policy.verify_fingerprints or self.policy.reject_nonfinite
        segs = b.segments if self.policy.reject_nonfinite else None
        result = None
        row = None
        if check and last and self.device.type == "cuda":
            if tx.results is None:
                tx.results = torch.zeros(len(tx.manifest.bucket_sizes), 2, dtype=torch.int64, device=self.device)
            row = tx.results[msg.bucket]
        if flat is not None:
            if whole and check and src.device == flat.device:
                result = fused.copy_check(src, flat, segs, out=row)  # copy + fingerprint + check, one pass
            else:
                if src is not None:
                    flat[msg.offset : msg.offset + msg.nbytes].copy_(src, non_blocking=flat.is_cuda)
                if last and check and size:
                    result = fused.copy_check(flat, None, segs, out=row)
            checked = flat
        elif whole and src.device == self.device:
            views = b.views.get(("slot", self._generation, msg.slot))
            if views is None:
                views = b.views[("slot", self._generation, msg.slot)] = typed_views(src, b.metas)
            if check:
                result = fused.copy_check(src, None, segs, out=row)  # on the slot, before the copy out
            with torch.no_grad():
                torch._foreach_copy_([tx.staging[i] for i in b.indices], views, non_blocking=True)
            checked = src
        else:
            bounce = self._bounce_buffer(size)
            if src is not None:
                bounce[msg.offset : msg.offset + msg.nbytes].copy_(src, non_blocking=bounce.is_cuda)
            checked = bounce[:size]
            if last and size:
                if check:
                    result = fused.copy_check(checked, None, segs, out=row)
                views = b.views.get(("bounce", id(bounce)))
                if views is None:
                    views = b.views[("bounce", id(bounce))] = typed_views(checked, b.metas)
                with torch.no_grad():
                    torch._foreach_copy_([tx.staging[i] for i in b.indices], views, non_blocking=True)
        if not last:
            return
        if tx.staging is None:
            tx.tensors.update(tensor_views(checked, b.metas))
        if self.policy.reject_nonfinite and b.segments is None:  # fp8 has no device check: tensor by tensor
            _check_finite(self._bucket_tensors(tx, b), tx.update_id)
        if not check:
            return
        if result is None:  # an empty bucket: its fingerprint is 0
            result = fused.copy_check(checked[:0], None, None, out=row)
        item = (msg.bucket, result, msg.fingerprint)
        if result.is_cuda:
            tx.deferred.append(item)  # read at prepare, all buckets at once
        else:
            self._verify(tx, [item])

    def _flat_destination(self, tx: _InFlight, bucket: int, b: _Bucket, size: int) -> torch.Tensor | None:
        if tx.staging is None:
            buffer = tx.buffers.get(bucket)
            if buffer is None:
                buffer = tx.buffers[bucket] = torch.empty(size, dtype=torch.uint8, device=self.device)
            return buffer
        if tx.flats is not None:
            return tx.flats[bucket]
        if b.single and tx.staging[b.indices[0]].is_contiguous():
            return tx.staging[b.indices[0]].reshape(-1).view(torch.uint8)
        return None

    def _bucket_tensors(self, tx: _InFlight, b: _Bucket) -> dict[str, torch.Tensor]:
        if tx.staging is None:
            return {name: tx.tensors[name] for name in b.names}
        return dict(zip(b.names, (tx.staging[i] for i in b.indices)))

    def _verify(self, tx: _InFlight, items: list[tuple[int, torch.Tensor, int | None]]) -> None:
        """Read the verdicts ([fingerprint, non-finite] per bucket) in one transfer; raise the first."""
        if not items:
            return
        if tx.results is not None and all(r.data_ptr() == tx.results[b].data_ptr() for b, r, _ in items):
            rows = tx.results.tolist()  # one transfer for the whole update
            values = [rows[b] for b, _, _ in items]
        else:
            values = torch.stack([result for _, result, _ in items]).tolist()
        for (bucket, _, sent), (got, bad) in zip(items, values):
            if self.policy.verify_fingerprints and (sent is None or got != sent):
                raise _fingerprint_error(tx.update_id, bucket, got, sent)
            if bad and self.policy.reject_nonfinite:
                # Name the tensors; a bucket flagged only for its padding passes.
                _check_finite(self._bucket_tensors(tx, tx.layout.buckets[bucket]), tx.update_id)

    def _bounce_buffer(self, size: int) -> torch.Tensor:
        if self._bounce is None or self._bounce.numel() < size:
            self._drain()
            self._bounce = None
            for layout in self._layouts.values():
                for bucket in layout.buckets:
                    for key in [k for k in bucket.views if k[0] == "bounce"]:
                        del bucket.views[key]
            self._bounce = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._bounce

    def _staging(self, manifest: UpdateManifest) -> tuple[Any, Any]:
        lent = self.target.staging(manifest)
        if lent is None:
            return None, None
        tensors, flats = (lent.tensors, lent.buckets) if isinstance(lent, Staging) else (lent, None)
        if not isinstance(tensors, list):
            tensors = list(tensors)
        if len(tensors) != len(manifest.tensors) or (flats is not None and len(flats) != len(manifest.bucket_sizes)):
            raise TransactionStateError(
                f"the engine lent {len(tensors)} staging tensors for an update of {len(manifest.tensors)}; "
                "staging() must return one per manifest tensor, in order (and one buffer per bucket)"
            )
        return tensors, flats

    def _layout(self, manifest: UpdateManifest) -> _Layout:
        key = manifest.layout
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout(manifest)
            while len(self._layouts) > 8:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout

    def _fence(self) -> None:
        """After a Stage's copies: wait for the previous Stage's (or this one's, with one slot)."""
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        previous, self._pending = self._pending, event
        if previous is not None:
            previous.synchronize()
        if not self._lag:
            self._drain()

    def _drain(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.synchronize()

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
            self._verify(tx, tx.deferred)
            tx.deferred.clear()
            if tx.staging is not None:
                tx.tensors = dict(zip(tx.layout.names, tx.staging))
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
        self._drain()
        if self._inflight is not None:
            self._end("receiver closed")
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._layouts.clear()
        self._bounce = None

    @property
    def buffer_bytes(self) -> int:
        """Device memory the Receiver keeps between updates (at most one bucket)."""
        return self._bounce.numel() if self._bounce is not None else 0

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
        tx.buffers.clear()
        tx.tensors.clear()
        tx.staging = None
        tx.deferred.clear()
        self._ended[tx.update_id] = reason
        while len(self._ended) > 64:
            self._ended.popitem(last=False)
        log.info("receiver: update %d ended without commit: %s", tx.update_id, reason)


def _fingerprint_error(update_id: int, bucket: int, got: int, sent: int | None) -> FingerprintMismatchError:
    return FingerprintMismatchError(
        f"update {update_id} bucket {bucket}: fingerprint {got} != sent {sent}; the "
        "bytes changed in transit (was the slot overwritten before it was acknowledged?)"
    )


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
