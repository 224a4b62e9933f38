"""Trainer-side driver: named tensors -> buckets -> transport slots -> one transaction.

The Sender owns one transport per engine link, created on first use and reused for every
update. It plans buckets from shapes alone, packs each bucket with one fused copy (straight
into the transport slot when the slot lives on the tensors' device), keeps up to one
``Stage`` in flight per slot so packing overlaps the engine's copy-out, and finishes with
prepare and commit. Any failure aborts the update on the engine and re-raises; the engine
keeps serving its last committed version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from . import transports
from .bucket import fingerprint, pack_into, plan_buckets
from .errors import ColosyncError, ManifestError
from .link import Link, Pending
from .manifest import LoraSpec, TensorMeta, UpdateManifest
from .protocol import Abort, Attach, Begin, Commit, Prepare, Stage, Status

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20


class SyncReport(msgspec.Struct, frozen=True):
    """What one push did, for logs, tables and ``--json``."""

    update_id: int
    kind: str
    transport: str
    tensors: int
    buckets: int
    bytes: int
    seconds: dict[str, float]  # pack, transfer, stage, prepare, commit, total

    @property
    def gbps(self) -> float:
        total = self.seconds.get("total", 0.0)
        return self.bytes / total / 1e9 if total > 0 else 0.0


@dataclass
class _Timer:
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("pack", "transfer", "stage", "prepare", "commit"), 0.0)
    )

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now


def peft_lora_spec(peft_model: torch.nn.Module, adapter: str = "default") -> LoraSpec:
    """The ``LoraSpec`` of a PEFT model's adapter (rank, alpha, targets, rslora)."""
    cfg = peft_model.peft_config[adapter]
    targets = cfg.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return LoraSpec(rank=int(cfg.r), alpha=float(cfg.lora_alpha), target_modules=targets,
                    use_rslora=bool(getattr(cfg, "use_rslora", False)))


def peft_lora_tensors(peft_model: torch.nn.Module, adapter: str = "default") -> list[tuple[str, torch.Tensor]]:
    """The adapter's weights under PEFT's saved names (no adapter name in them)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter)
    return list(state.items())


class Sender:
    """Pushes updates to one engine through one transport.

    >>> sender = Sender(link, transport="shm")
    >>> report = sender.push_peft(peft_model)           # LoRA
    >>> report = sender.push(model.named_parameters())  # full weights
    """

    def __init__(
        self,
        link: Link,
        transport: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        slots: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.link = link
        self.transport_name = transport
        self.bucket_bytes = bucket_bytes
        self.slots = slots
        self.device = torch.device(device) if device is not None else None
        self._transport: transports.SenderTransport | None = None
        self._next_id: int | None = None
        self._staging: torch.Tensor | None = None

    # -- public -----------------------------------------------------------------------------
    def push_peft(self, peft_model: torch.nn.Module, adapter: str = "default") -> SyncReport:
        return self.push(peft_lora_tensors(peft_model, adapter), lora=peft_lora_spec(peft_model, adapter))

    def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        lora: LoraSpec | None = None,
        update_id: int | None = None,
    ) -> SyncReport:
        """Send ``named`` as one transaction: a LoRA update if ``lora`` is given, else full weights."""
        items = [(n, t) for n, t in named]
        return self.push_stream([(n, tuple(t.shape), t.dtype) for n, t in items], iter(items), lora, update_id)

    def push_stream(
        self,
        specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
        tensors: Iterator[tuple[str, torch.Tensor]],
        lora: LoraSpec | None = None,
        update_id: int | None = None,
    ) -> SyncReport:
        """Like ``push`` for sources that materialize tensors lazily (memory bounded by a bucket).

        ``specs`` lists every tensor's name, shape and dtype up front; ``tensors`` must yield
        them in the same order.
        """
        start = time.perf_counter()
        timer = _Timer()
        metas, sizes = plan_buckets(specs, self.bucket_bytes)
        first_device = self._source_device(tensors_peek := _Peek(tensors))
        transport = self._ensure_transport(first_device)
        uid = self._claim_update_id(update_id)
        manifest = UpdateManifest(
            update_id=uid, kind="lora" if lora else "full", tensors=tuple(metas), bucket_sizes=tuple(sizes), lora=lora
        )
        try:
            self.link.submit(Begin(manifest)).wait()
            self._stream_buckets(manifest, tensors_peek, transport, timer)
            t = time.perf_counter()
            self.link.submit(Prepare(uid)).wait()
            t = timer.add("prepare", t)
            self.link.submit(Commit(uid)).wait()
            timer.add("commit", t)
        except BaseException as exc:
            self._abort(uid, exc)
            raise
        seconds = dict(timer.seconds, total=time.perf_counter() - start)
        report = SyncReport(uid, manifest.kind, transport.name, len(metas), len(sizes), manifest.total_bytes, seconds)
        log.info("pushed update %d: %d tensors, %d bytes in %.1f ms via %s", uid, report.tensors, report.bytes,
                 seconds["total"] * 1e3, transport.name)
        return report

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._staging = None

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _source_device(self, peek: "_Peek") -> torch.device:
        if self.device is not None:
            return self.device
        first = peek.peek()
        return first[1].device if first is not None else torch.device("cpu")

    def _ensure_transport(self, device: torch.device) -> transports.SenderTransport:
        if self._transport is None:
            cls = transports.resolve(self.transport_name, device)
            transport = cls.create(self.bucket_bytes, self.slots, device)
            try:
                ack = self.link.submit(Attach(transport=cls.name, handle=transport.handle())).wait()
            except BaseException:
                transport.close()
                raise
            transport.attached()
            self._transport = transport
            if self._next_id is None:
                self._next_id = ack.committed_update_id + 1
        return self._transport

    def _claim_update_id(self, requested: int | None) -> int:
        if self._next_id is None:
            self._next_id = self.link.submit(Status()).wait().committed_update_id + 1
        uid = self._next_id if requested is None else requested
        self._next_id = max(self._next_id, uid + 1)
        return uid

    def _abort(self, uid: int, exc: BaseException) -> None:
        try:
            self.link.submit(Abort(uid, reason=f"sender failed: {type(exc).__name__}: {exc}")).wait()
        except Exception as abort_exc:  # the original error matters more
            log.debug("abort of update %d not acknowledged: %s", uid, abort_exc)

    def _stream_buckets(
        self, manifest: UpdateManifest, tensors: "_Peek", transport: transports.SenderTransport, timer: _Timer
    ) -> None:
        in_flight: list[Pending | None] = [None] * transport.num_slots
        chunk = 0
        by_bucket: list[list[TensorMeta]] = [[] for _ in manifest.bucket_sizes]
        for meta in manifest.tensors:
            by_bucket[meta.bucket].append(meta)
        slot_bytes = transport.slot_bytes
        for bucket, size in enumerate(manifest.bucket_sizes):
            t = time.perf_counter()
            metas = by_bucket[bucket]
            sources = [tensors.take(meta) for meta in metas]
            device = sources[0].device if sources else transport.slot(0).device
            direct = size <= slot_bytes and device == transport.slot(0).device
            if direct:  # pack straight into the slot: no staging copy at all
                slot = chunk % transport.num_slots
                t = self._wait_slot(in_flight, slot, timer, t)
                packed = transport.slot(slot)[:size]
            else:
                packed = self._staging_buffer(size, device)
            pack_into(packed, metas, sources)
            fp = fingerprint(packed)
            t = timer.add("pack", t)
            for offset in range(0, max(size, 1), slot_bytes):
                nbytes = min(slot_bytes, size - offset)
                slot = chunk % transport.num_slots
                if not direct:
                    t = self._wait_slot(in_flight, slot, timer, t)
                    dst = transport.slot(slot)[:nbytes]
                    dst.copy_(packed[offset : offset + nbytes], non_blocking=True)
                    if dst.is_cuda or packed.is_cuda:
                        torch.cuda.current_stream(dst.device if dst.is_cuda else packed.device).synchronize()
                transport.flush()
                t = timer.add("transfer", t)
                last = offset + slot_bytes >= size
                in_flight[slot] = self.link.submit(
                    Stage(manifest.update_id, bucket, offset, nbytes, slot, fp if last else None)
                )
                chunk += 1
        t = time.perf_counter()
        for pending in in_flight:
            if pending is not None:
                pending.wait()
        timer.add("stage", t)
        tensors.finish()

    @staticmethod
    def _wait_slot(in_flight: list[Pending | None], slot: int, timer: _Timer, t: float) -> float:
        pending = in_flight[slot]
        if pending is None:
            return t
        t = timer.add("pack", t)  # time so far belongs to packing; waiting is staging
        in_flight[slot] = None
        pending.wait()
        return timer.add("stage", t)

    def _staging_buffer(self, size: int, device: torch.device) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._staging = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=device)
        return buf[:size]


class _Peek:
    """Pull tensors from a source iterator in manifest order, checking names as they come."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._it = tensors
        self._head: tuple[str, torch.Tensor] | None = None

    def peek(self) -> tuple[str, torch.Tensor] | None:
        if self._head is None:
            self._head = next(self._it, None)
        return self._head

    def take(self, meta: TensorMeta) -> torch.Tensor:
        head = self.peek()
        self._head = None
        if head is None:
            raise ManifestError(f"the source ended before tensor {meta.name!r}; it must yield every planned tensor")
        name, tensor = head
        if name != meta.name:
            raise ManifestError(f"the source yielded {name!r} where the plan expects {meta.name!r}; keep the order")
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.torch_dtype:
            raise ManifestError(
                f"tensor {name!r} is {list(tensor.shape)} {tensor.dtype} but was planned as "
                f"{list(meta.shape)} {meta.dtype}; the specs must describe the tensors exactly"
            )
        return tensor

    def finish(self) -> None:
        extra = self.peek()
        if extra is not None:
            raise ManifestError(f"the source yielded {extra[0]!r} beyond its planned tensors")


__all__ = ["Sender", "SyncReport", "peft_lora_spec", "peft_lora_tensors", "DEFAULT_BUCKET_BYTES", "ColosyncError"]
