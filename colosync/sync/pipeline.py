"""One update's trip through a transport's slots: slot flow control, and packing buckets into slots.

``SlotPipeline`` decides which slot each chunk of bytes goes to and which of the engine's
replies must be read before a slot is written again. It keeps the Sender pipelined: a chunk
is held back until the next one is written (its fence has then had time to pass) and then
sent as a ``Stage``; replies are read only when a slot must be reused and at the end, always
in order, so the first failure is the one raised.

The acknowledgement-lag rule (``colosync.transports.base``): with two or more slots the
receiver may acknowledge ``Stage`` k before its copy out of the slot has finished, so the
reply to Stage k promises only that the slots of every *earlier* Stage are free. Reusing the
slot that chunk u wrote therefore needs the reply to Stage u + 1. With one slot every reply
frees its own slot: reusing it needs the reply to Stage u.

``BucketStreamer`` packs each bucket of a ``Plan`` -- straight into a slot when the slot lives
on the tensors' device, from a tensor's own bytes when a bucket is that one tensor, else
through a staging buffer -- fingerprints it in the same pass as its copy into the slot where
it can, and hands each chunk to the pipeline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from colosync.errors import ConfigError
from colosync.sync.plan import STAGING, Plan, Plans, StreamSource, ViewKey
from colosync.transports import SenderTransport
from colosync.wire import fused
from colosync.wire.protocol import Ack, Begin, Commit, Delivery, Prepare, Stage

if TYPE_CHECKING:
    from colosync.sync.link import Pending

PHASES = ("pack", "transfer", "stage", "prepare", "commit")


class SyncReport(msgspec.Struct, frozen=True):
    """What one push did, for logs, tables and ``--json``."""

    update_id: int
    kind: str
    transport: str
    tensors: int
    buckets: int
    bytes: int
    seconds: dict[str, float]  # PHASES and total; "verify" is the engine's share of "commit" when verified
    delivery: Delivery | None = None  # what the engine checked: modules changed, probe deviation

    @property
    def gbps(self) -> float:
        total = self.seconds.get("total", 0.0)
        return self.bytes / total / 1e9 if total > 0 else 0.0


@dataclass
class PhaseTimer:
    """Seconds spent in each phase of one push (see ``SyncReport.seconds``)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now


def _no_flush() -> None:
    pass


class SlotPipeline:
    """Flow control over ``num_slots`` transport slots for one update (see the module docstring).

    ``submit`` sends a control message and returns its pending reply (``Link.submit``); the
    pipeline submits ``begin`` at once. Use: ``slot = acquire()``, write the chunk's bytes into
    that slot, ``put(Stage(..., slot, ...), fence, fingerprint)``; at the end ``finish``.
    """

    def __init__(
        self,
        num_slots: int,
        submit: Callable[[Any], Pending],
        begin: Begin,
        flush: Callable[[], None] = _no_flush,
        timer: PhaseTimer | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.lag = 1 if num_slots >= 2 else 0  # which later Stage's reply frees a slot
        self.timer = timer if timer is not None else PhaseTimer()
        self._submit, self._flush = submit, flush
        self._replies: list[Pending] = [submit(begin)]  # Begin's, then Stage k's at index k + 1
        self._read = 0  # replies[:_read] have been read
        self._last_use = [-1] * num_slots  # the chunk that last wrote each slot
        self._held: deque[tuple[Stage, Any, Any]] = deque()  # written, not yet sent
        self.chunks = 0  # chunks put so far

    def acquire(self) -> int:
        """The slot for the next chunk, once every reply that promises it is free has been read."""
        slot = self.chunks % self.num_slots
        used = self._last_use[slot]
        if used >= 0:
            self._read_through(used + self.lag)
        return slot

    def put(self, stage: Stage, fence: Any = None, fingerprint: Any = None) -> None:
        """Hold the chunk just written into ``stage.slot`` and send the one held before it.

        ``fence`` (a CUDA event or ``None``) is waited on before the Stage goes out, and
        ``fingerprint`` (an int or a 0-d host tensor, ``None`` but on a bucket's last chunk) is
        then written into it.
        """
        self._last_use[stage.slot] = self.chunks
        self.chunks += 1
        held = self._held
        held.append((stage, fence, fingerprint))
        if len(held) > 1:
            self._send(*held.popleft())

    def send_held(self) -> None:
        """Send every chunk still held back."""
        while self._held:
            self._send(*self._held.popleft())

    def finish(self, prepare: Prepare, commit: Commit) -> Ack:
        """Send what is held, then ``prepare`` and ``commit``, and read every reply (the first failure raises).

        Returns the Commit's reply (its ``delivery`` says what the engine checked)."""
        self.send_held()
        t = time.perf_counter()
        replies = self._replies
        replies.append(self._submit(prepare))
        replies.append(self._submit(commit))
        for pending in replies[self._read : -1]:
            pending.wait()
        t = self.timer.add("prepare", t)
        ack = replies[-1].wait()
        self._read = len(replies)
        self.timer.add("commit", t)
        return ack

    def _read_through(self, stage: int) -> None:
        """Read every reply up to and including Stage ``stage``'s, sending Stages through it first."""
        held, replies = self._held, self._replies
        while held and len(replies) - 1 <= stage:
            self._send(*held.popleft())
        t = time.perf_counter()
        for pending in replies[self._read : stage + 2]:
            pending.wait()
        self._read = max(self._read, stage + 2)
        self.timer.add("stage", t)

    def _send(self, stage: Stage, fence: Any, fp: Any) -> None:
        t = time.perf_counter()
        if fence is not None:
            fence.synchronize()
        self._flush()
        if fp is not None:
            stage = msgspec.structs.replace(stage, fingerprint=int(fp.item() if isinstance(fp, torch.Tensor) else fp))
        self.timer.add("transfer", t)
        self._replies.append(self._submit(stage))


class BucketStreamer:
    """Packs plans' buckets into one transport's slots (the Sender keeps one per attached transport)."""

    def __init__(self, transport: SenderTransport, plans: Plans, bucket_bytes: int) -> None:
        self.transport = transport
        self._plans = plans  # their staging views go stale when the staging buffer is replaced
        self._bucket_bytes = bucket_bytes
        self._slot_device = transport.slot(0).device
        self._staging: torch.Tensor | None = None
        self._fp_ring: torch.Tensor | None = None

    def stream(
        self, plan: Plan, uid: int, pipe: SlotPipeline, tensors: list[torch.Tensor] | None, source: StreamSource | None
    ) -> None:
        """Send every bucket of ``plan`` for update ``uid``: from ``tensors`` (plan order), else from ``source``."""
        transport, timer = self.transport, pipe.timer
        slot_bytes, slot_device = transport.slot_bytes, self._slot_device
        to_cuda = slot_device.type == "cuda"
        for bucket, size in enumerate(plan.sizes):
            t = time.perf_counter()
            i0, i1 = plan.bounds[bucket]
            if source is not None:
                srcs = source.take(plan.metas[i0:i1])
            else:
                if tensors is None:
                    raise ConfigError("stream() sends from tensors or from a source; pass one")
                srcs = tensors[i0:i1]
            device = srcs[0].device if srcs else slot_device
            direct = False  # packed straight into its slot
            if plan.single[bucket] and srcs[0].is_contiguous():
                packed = srcs[0].reshape(-1).view(torch.uint8)  # the tensor's own bytes: nothing to pack
            elif size <= slot_bytes and device == slot_device:
                slot = pipe.acquire()
                packed = transport.slot(slot)[:size]
                plan.pack(ViewKey(bucket, slot), packed, srcs)
                direct = True
            else:
                packed = self._staging_buffer(size, device)
                plan.pack(ViewKey(bucket, STAGING), packed, srcs)
            # One pass for the fingerprint -- fused with the copy into the slot where there is one copy.
            fuse = not direct and 0 < size <= slot_bytes and packed.is_cuda and packed.device == slot_device
            checked = fused.copy_check(packed, None, None) if size and not fuse else None
            timer.add("pack", t)
            for offset in range(0, max(size, 1), slot_bytes):
                nbytes = min(slot_bytes, size - offset)
                if not direct:
                    slot = pipe.acquire()
                    if fuse:
                        checked = fused.copy_check(packed, transport.slot(slot)[:size], None)
                    elif nbytes:
                        transport.slot(slot)[:nbytes].copy_(packed[offset : offset + nbytes], non_blocking=True)
                fp: Any = None
                if offset + slot_bytes >= size:  # the bucket's last chunk carries its fingerprint
                    fp = checked[0] if checked is not None else 0
                    if isinstance(fp, torch.Tensor) and fp.is_cuda:
                        fp = self._fp_slot(bucket).copy_(fp, non_blocking=True)
                fence = None
                if packed.is_cuda or to_cuda:
                    fence = torch.cuda.Event()
                    fence.record(torch.cuda.current_stream(packed.device if packed.is_cuda else slot_device))
                pipe.put(Stage(uid, bucket, offset, nbytes, slot, None), fence, fp)
        pipe.send_held()

    def _fp_slot(self, bucket: int) -> torch.Tensor:
        if self._fp_ring is None:
            self._fp_ring = torch.empty(64, dtype=torch.int64, pin_memory=True)
        return self._fp_ring[bucket % 64]

    def _staging_buffer(self, size: int, device: torch.device) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._staging = torch.empty(max(size, self._bucket_bytes), dtype=torch.uint8, device=device)
            self._plans.drop_views(staging_only=True)
        return buf[:size]


__all__ = ["BucketStreamer", "PhaseTimer", "SlotPipeline", "SyncReport"]
