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

import contextlib
import operator
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from colosync.errors import ConfigError
from colosync.kernels import fused, gather
from colosync.sync.link import EngineOutcome
from colosync.sync.plan import STAGING, Plan, Plans, StreamSource, ViewKey
from colosync.transports import SenderTransport
from colosync.transports.cuda_graphs import GraphCache
from colosync.wire.protocol import Ack, Begin, BeginAgain, Commit, Delivery, Prepare, Stage

if TYPE_CHECKING:
    from colosync.sync.link import Pending

PHASES = ("pack", "transfer", "stage", "prepare", "commit")
_CURRENT_STREAM = contextlib.nullcontext()


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
    engines: tuple[EngineOutcome, ...] = ()  # a set of engines: what each serves now, and its time

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


def _no_publish(stage: Stage) -> None:
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
        begin: Begin | BeginAgain,
        publish: Callable[[Stage], None] = _no_publish,
        timer: PhaseTimer | None = None,
        submit_batch: Callable[[list[Any]], list[Pending]] | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.lag = 1 if num_slots >= 2 else 0  # which later Stage's reply frees a slot
        self.timer = timer if timer is not None else PhaseTimer()
        self._submit, self._publish, self._submit_batch = submit, publish, submit_batch
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
        if fence is None:  # written (no copy still queued): a transport that moves the bytes starts them now
            self._publish(stage)
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

        With ``submit_batch`` (a link to an ``EngineHost``) the held Stages, Prepare and Commit
        go as one ``Batch``. Returns the Commit's reply (its ``delivery`` says what the engine checked)."""
        tail: list[Any] = [self._ready(*self._held.popleft()) for _ in range(len(self._held))]
        tail += [prepare, commit]
        t = time.perf_counter()
        replies = self._replies
        if self._submit_batch is not None:
            replies += self._submit_batch(tail)
        else:
            replies += map(self._submit, tail)
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
        self._replies.append(self._submit(self._ready(stage, fence, fp)))

    def _ready(self, stage: Stage, fence: Any, fp: Any) -> Stage:
        """``stage`` once its bytes may be read: its fence passed, its fingerprint in."""
        t = time.perf_counter()
        if fence is not None:
            fence.synchronize()
            self._publish(stage)  # its copy has landed only now
        if fp is not None:
            stage = msgspec.structs.replace(stage, fingerprint=int(fp.item() if isinstance(fp, torch.Tensor) else fp))
        self.timer.add("transfer", t)
        return stage


def _on_gpu(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


class StagingBuffers:
    """Where buckets that cannot be packed into a slot are packed, and the stream that copies them to host slots.

    A bucket on a GPU bound for host slots (``shm``) is packed on the current stream and copied
    out chunk by chunk on a stream of its own, from two buffers in turn. With one stream and
    one buffer, the pack of bucket b + 1 waited for the last copy out of bucket b and the copy
    engine sat idle through the pack: 0.12-0.18 ms at each bucket boundary of seed-lora on an
    H200 (``benchmarks/seed-lora``). Now bucket b + 1 is packed while bucket b's last chunks go
    out, and waits only for the copies out of bucket b - 1 (``copied``). Elsewhere one buffer
    serves: its copies are on the current stream, in order.
    """

    def __init__(self, bucket_bytes: int, plans: Plans) -> None:
        self._bucket_bytes = bucket_bytes
        self._plans = plans  # their staging views go stale when a buffer is replaced
        self._buffers: list[torch.Tensor | None] = [None, None]
        # per buffer and device, a CUDA event after the copies out of it: kept when the buffer is replaced,
        # since the copies also read the device's result rows (``BucketStreamer._gather``), which stay
        self._freed: dict[tuple[int, torch.device], Any] = {}
        self._streams: dict[torch.device, Any] = {}

    def buffer(self, which: int, size: int, device: torch.device) -> torch.Tensor:
        """``size`` bytes of buffer ``which`` on ``device``, for the current stream once copies out of it are done."""
        buf = self._buffers[which]
        if buf is None or buf.numel() < size or buf.device != device:
            if buf is not None and buf.device in self._streams:
                buf.record_stream(self._streams[buf.device])  # not reused before the copies out of it are done
            buf = self._buffers[which] = torch.empty(max(size, self._bucket_bytes), dtype=torch.uint8, device=device)
            self._plans.drop_views(staging_only=True)
        freed = self._freed.get((which, device))
        if freed is not None:
            torch.cuda.current_stream(device).wait_event(freed)
        return buf[:size]

    def copier(self, device: torch.device) -> Any:
        """The stream for copies to host slots on ``device``, made to wait for the current stream's work so far."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def copied(self, which: int, stream: Any) -> None:
        """Every copy out of buffer ``which`` is queued on ``stream``."""
        key = (which, stream.device)
        if key not in self._freed:
            self._freed[key] = torch.cuda.Event()
        self._freed[key].record(stream)

    def drain(self) -> None:
        """Wait for every copy queued to host slots (before they are unmapped, or written by another push)."""
        for stream in self._streams.values():
            stream.synchronize()

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b is not None]


class BucketStreamer:
    """Packs plans' buckets into one transport's slots (the Sender keeps one per attached transport)."""

    def __init__(self, transport: SenderTransport, plans: Plans, bucket_bytes: int) -> None:
        self.transport = transport
        self._plans = plans
        self._slot_device = transport.slot(0).device
        self._staging = StagingBuffers(bucket_bytes, plans)
        self._fp_ring: torch.Tensor | None = None
        # Fingerprints in device memory and device-side ordering (cuda_ipc): no host sync per Stage.
        self._device_fp = transport.fingerprint_cell(0) is not None
        # Graphs of the pack, per plan (straight into a slot, or the gather into the staging buffer): a graph
        # names the plan's memory (padding index, gather table, views), so it lives and dies with the plan.
        self._graphs: weakref.WeakKeyDictionary[Plan, dict[torch.device, GraphCache]] = weakref.WeakKeyDictionary()
        self._checked: dict[torch.device, torch.Tensor] = {}  # per device, a [fingerprint, 0] row per bucket mod 64

    def stream(
        self,
        plan: Plan,
        uid: int,
        pipe: SlotPipeline,
        tensors: list[torch.Tensor] | None,
        source: StreamSource | None,
        check: bool = False,
    ) -> None:
        """Send every bucket of ``plan`` for update ``uid``: from ``tensors`` (plan order), else from ``source``.

        ``check``: ``plan`` was found by the tensors' names alone; each bucket's are checked before it is packed.
        """
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
            # One C++ pass over the sources' shapes, strides and dtypes, for the check, gather rows and graph keys
            # (an arena's own tensors are told by identity: nothing of theirs is read).
            layout = plan.layout_number(bucket, srcs) if check or (device.type == "cuda" and plan.arena is None) else 0
            if check:
                plan.check(bucket, srcs, layout)
            to_host = device.type == "cuda" and not to_cuda  # copies out on the staging buffers' stream
            staged: int | None = None  # which staging buffer the bucket is packed in
            direct = False  # packed straight into its slot
            cell: torch.Tensor | None = None  # where the bucket's fingerprint goes on the device
            checked: torch.Tensor | None = None
            if plan.single[bucket] and srcs[0].is_contiguous():
                packed = srcs[0].reshape(-1).view(torch.uint8)  # the tensor's own bytes: nothing to pack
            elif size <= slot_bytes and device == slot_device:
                slot = pipe.acquire()
                packed = transport.slot(slot)[:size]
                if self._device_fp and packed.is_cuda:
                    cell = transport.fingerprint_cell(bucket)
                if cell is not None:
                    self._pack_checked(plan, bucket, slot, packed, srcs, cell, layout)  # one graph once seen
                else:
                    plan.pack(ViewKey(bucket, slot), packed, srcs)
                direct = True
            else:
                staged = bucket % 2 if to_host else 0
                packed = self._staging.buffer(staged, size, device)
                checked = self._gather(plan, bucket, packed, srcs, layout)  # packed and fingerprinted in one pass
                if checked is None:
                    plan.pack(ViewKey(bucket, STAGING - staged), packed, srcs)  # views per buffer
            # One pass for the fingerprint -- fused with the copy into the slot where there is one copy.
            fuse = not direct and 0 < size <= slot_bytes and packed.is_cuda and packed.device == slot_device
            if size and not fuse and cell is None and checked is None:
                checked = fused.copy_check(packed, None, None)
            timer.add("pack", t)
            copier = self._staging.copier(device) if to_host and packed.is_cuda else None  # None: current stream
            if copier is not None and checked is not None:
                checked.record_stream(copier)  # the copier reads the fingerprint: not reused before it has
            for offset in range(0, max(size, 1), slot_bytes):
                nbytes = min(slot_bytes, size - offset)
                last = offset + slot_bytes >= size  # the bucket's last chunk carries its fingerprint
                if not direct:
                    slot = pipe.acquire()
                fp: Any = None
                fence = None
                with torch.cuda.stream(copier) if copier is not None else _CURRENT_STREAM:  # not around the link
                    if not direct:
                        if fuse:
                            cell = transport.fingerprint_cell(bucket) if self._device_fp else None
                            if cell is not None:
                                cell.zero_()
                            checked = fused.copy_check(packed, transport.slot(slot)[:size], None, out=cell)
                        elif nbytes:
                            transport.slot(slot)[:nbytes].copy_(packed[offset : offset + nbytes], non_blocking=True)
                        if last and cell is None and self._device_fp and checked is not None and checked.is_cuda:
                            cell = transport.fingerprint_cell(bucket)
                            if cell is not None:
                                cell.copy_(checked)
                    if last and cell is None:
                        fp = checked[0] if checked is not None else 0
                    seal = 0
                    if packed.is_cuda or to_cuda:
                        on = packed.device if packed.is_cuda else slot_device
                        # a fingerprint on the device goes with the seal, if the transport seals (fp: last chunk only)
                        on_device = cell if cell is not None and last else checked if _on_gpu(fp) else None
                        seal = transport.written(slot, on, on_device)  # the engine waits for it
                        if seal and on_device is not None:
                            fp = None
                        elif _on_gpu(fp):
                            fp = self._fp_slot(bucket).copy_(fp, non_blocking=True)
                        if not seal or isinstance(fp, torch.Tensor):
                            fence = torch.cuda.Event()
                            fence.record(torch.cuda.current_stream(on))
                pipe.put(Stage(uid, bucket, offset, nbytes, slot, None, seal), fence, fp)
            if copier is not None and staged is not None:
                self._staging.copied(staged, copier)
            elif copier is not None:  # the copies read the source's own memory: not reused or rewritten before
                packed.record_stream(copier)
                if source is not None:  # a source may refill the same memory for its next bucket
                    torch.cuda.current_stream(device).wait_stream(copier)
        # the last Stage stays held: ``finish`` sends it with Prepare and Commit (one Batch where the link can)

    def _pack_checked(
        self,
        plan: Plan,
        bucket: int,
        slot: int,
        packed: torch.Tensor,
        srcs: list[torch.Tensor],
        cell: torch.Tensor,
        layout: int,
    ) -> None:
        """Pack a bucket into its slot and fingerprint it into ``cell``: a CUDA graph replay for work seen before.

        Tensors that are the plan's arena views already live in the slot: only the fingerprint
        runs. Sources the gather kernel takes are packed and fingerprinted in one launch that
        reads them through a device table (``kernels.gather``), so the graph does not depend on
        where they are. Anything else is packed with ``_foreach_copy_`` and fingerprinted after.
        """
        cache = self._graph_cache(plan, packed.device)
        i0, i1 = plan.bounds[bucket]
        arena = plan.arena
        how: Any = None  # what the graph depends on besides the slot, the cell and the plan
        table: torch.Tensor | None = None  # the gather kernel's rows, when it packs
        if arena is not None and slot == 0 and all(map(operator.is_, srcs, arena[i0:i1])):
            how = "arena"
        elif not layout:  # not read up front for a plan with an arena; other tensors are keyed by it
            layout = plan.layout_number(bucket, srcs)
        if how is None and gather.enabled(packed.device):
            rows = plan.gather_table(bucket, packed.device)
            if rows.bind(srcs, layout):
                how, table = "gather", rows.table

        def work() -> None:
            cell.zero_()
            if table is not None:
                plan.zero_gaps(bucket, packed)
                gather.launch(table, packed, cell)
                return
            plan.pack(ViewKey(bucket, slot), packed, srcs)
            fused.copy_check(packed, None, None, out=cell)

        def key() -> tuple[Any, ...]:
            where = how or (tuple(map(torch.Tensor.data_ptr, srcs)), layout)  # what the graph bakes in
            return (bucket, slot, packed.data_ptr(), packed.numel(), cell.data_ptr(), where)

        cache.run(key, work)  # the key only with graphs on

    def _gather(
        self, plan: Plan, bucket: int, packed: torch.Tensor, srcs: list[torch.Tensor], layout: int
    ) -> torch.Tensor | None:
        """Pack bucket ``bucket`` into ``packed`` in one launch: its ``[fingerprint, 0]``, or None if it cannot.

        The launch (with the zeroing of the padding and of the result) replays as a CUDA graph
        for a bucket seen before: the table names the sources, so only the staging buffer and
        the result row are keyed. That is ~0.1 ms of the trainer's CPU before the first chunk
        of an update may leave the GPU.
        """
        device = packed.device
        if not gather.enabled(device):
            return None
        table = plan.gather_table(bucket, device)
        if not table.bind(srcs, layout):
            return None
        rows = self._checked.get(device)
        if rows is None:
            rows = self._checked[device] = torch.zeros(64, 2, dtype=torch.int64, device=device)
        checked = rows[bucket % 64]  # read (stream-ordered) before the same row is written again

        def work() -> None:
            checked.zero_()
            plan.zero_gaps(bucket, packed)
            gather.launch(table.table, packed, checked)

        self._graph_cache(plan, device).run(
            (bucket, STAGING, packed.data_ptr(), packed.numel(), checked.data_ptr()), work
        )
        return checked

    def _graph_cache(self, plan: Plan, device: torch.device) -> GraphCache:
        caches = self._graphs.get(plan)
        if caches is None:
            caches = self._graphs[plan] = {}
        cache = caches.get(device)
        if cache is None:  # a graph is captured and replayed on one device
            capacity = min(256, 4 * len(plan.sizes) * (self.transport.num_slots + 1) + 4)
            cache = caches[device] = GraphCache(device, capacity)
        return cache

    def drain(self) -> None:
        """Wait for the copies out to host slots this streamer queued (a push failed, or the transport closes)."""
        self._staging.drain()

    def graph_counts(self) -> dict[str, int]:
        """How often packs ran eagerly, were captured and were replayed (all plans)."""
        total = {"eager": 0, "capture": 0, "replay": 0}
        for caches in self._graphs.values():
            for cache in caches.values():
                for k, v in cache.counts.items():
                    total[k] += v
        return total

    def _fp_slot(self, bucket: int) -> torch.Tensor:
        if self._fp_ring is None:
            self._fp_ring = torch.empty(64, dtype=torch.int64, pin_memory=True)
        return self._fp_ring[bucket % 64]


__all__ = ["BucketStreamer", "PhaseTimer", "SlotPipeline", "StagingBuffers", "SyncReport"]
