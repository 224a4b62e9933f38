"""Trainer-side driver: named tensors -> buckets -> transport slots -> one transaction.

The Sender owns one transport per engine link, created on first use and reused for every
update. It plans buckets from shapes alone (once per layout), packs each bucket with one
fused copy (straight into the transport slot when the slot lives on the tensors' device; a
bucket that is one tensor is sent from the tensor's own bytes), keeps a ``Stage`` in flight
per slot so packing overlaps the engine's copy-out, and finishes with prepare and commit.
Control messages are pipelined: the engine's replies are read only when a slot must be
reused and at the end, and fingerprints are computed on the device and read back without a
separate sync. Any failure aborts the update on the engine and re-raises; the engine keeps
serving its last committed version.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from colosync import transports
from colosync.wire import fused
from colosync.wire.bucket import plan_buckets, typed_views
from colosync.errors import ColosyncError, ManifestError, TransportError, TransportUnavailable
from colosync.sync.link import Link, Pending
from colosync.wire.manifest import LoraSpec, TensorMeta, UpdateManifest, align_up
from colosync.wire.protocol import Abort, Attach, Begin, Commit, Prepare, Stage, Status

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


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


class _Plan:
    """Buckets for one layout of named tensors, planned once and reused every update."""

    def __init__(self, specs: list[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> None:
        self.specs = specs
        self.layout = plan_buckets(specs, bucket_bytes)
        metas, sizes = self.layout.tensors, self.layout.bucket_sizes
        self.metas: tuple[TensorMeta, ...] = metas
        self.sizes: tuple[int, ...] = sizes
        starts = [0] * (len(sizes) + 1)
        for i, meta in enumerate(metas):  # plan_buckets fills buckets in order
            starts[meta.bucket + 1] = i + 1
        self.bounds = [(starts[b], starts[b + 1]) for b in range(len(sizes))]
        self.single = [
            i1 - i0 == 1 and metas[i0].nbytes == size and size > 0 for (i0, i1), size in zip(self.bounds, sizes)
        ]
        self.total = sum(m.nbytes for m in metas)
        self.gaps: list[list[tuple[int, int]]] = []  # padding inside each bucket, zeroed after packing
        for (i0, i1), size in zip(self.bounds, sizes):
            gaps, pos = [], 0
            for m in metas[i0:i1]:
                if m.offset > pos:
                    gaps.append((pos, m.offset))
                pos = max(pos, m.offset + m.nbytes)
            if pos < size:
                gaps.append((pos, size))
            self.gaps.append(gaps)
        self.views: dict[tuple, list[torch.Tensor]] = {}  # typed views of pack destinations
        self.arena: list[torch.Tensor] | None = None  # the tensors, if they live in the transport buffer
        self._gap_index: dict[tuple, torch.Tensor] = {}

    def gap_index(self, bucket: int, device: torch.device) -> torch.Tensor | None:
        gaps = self.gaps[bucket]
        if not gaps:
            return None
        index = self._gap_index.get((bucket, device))
        if index is None:
            index = torch.cat([torch.arange(a, b) for a, b in gaps]).to(device)
            self._gap_index[(bucket, device)] = index
        return index

    def manifest(self, update_id: int, lora: LoraSpec | None) -> UpdateManifest:
        return UpdateManifest(update_id, "lora" if lora else "full", self.layout, lora)


class _Chunk:
    __slots__ = ("stage", "fence", "fp")

    def __init__(self, stage: Stage, fence: Any, fp: Any) -> None:
        self.stage, self.fence, self.fp = stage, fence, fp


class Sender:
    """Pushes updates to one engine through one transport.

    >>> sender = Sender(link, transport="shm")
    >>> report = sender.push_peft(peft_model)           # LoRA
    >>> report = sender.push(model.named_parameters())  # full weights

    ``transport="auto"`` (the default) attaches the first transport in preference order
    (``colosync.transports.names()``) that works end to end -- the engine really opening its
    handle is the test -- and logs why it passed over the others (``transport_log``).
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
        self.transport_log: list[str] = []  # why each transport was picked or passed over
        self._transport: transports.SenderTransport | None = None
        self._next_id: int | None = None
        self._staging: torch.Tensor | None = None
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._last_plan: _Plan | None = None
        self._fp_ring: torch.Tensor | None = None
        self._arena: tuple[_Plan, list[torch.Tensor]] | None = None

    # -- public -----------------------------------------------------------------------------
    @property
    def transport(self) -> transports.SenderTransport | None:
        return self._transport

    def push_peft(self, peft_model: torch.nn.Module, adapter: str = "default") -> SyncReport:
        return self.push(peft_lora_tensors(peft_model, adapter), lora=peft_lora_spec(peft_model, adapter))

    def push(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        lora: LoraSpec | None = None,
        update_id: int | None = None,
    ) -> SyncReport:
        """Send ``named`` as one transaction: a LoRA update if ``lora`` is given, else full weights."""
        start = time.perf_counter()
        items = named if isinstance(named, list) else list(named)
        tensors = [t for _, t in items]
        specs = list(zip([n for n, _ in items], map(_SHAPE, tensors), map(_DTYPE, tensors)))
        return self._push(specs, tensors, None, lora, update_id, start)

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
        normalized = [(n, tuple(shape), dtype) for n, shape, dtype in specs]
        return self._push(normalized, None, _Peek(tensors), lora, update_id, start)

    def arena(self, specs: Sequence[tuple[str, Sequence[int], torch.dtype]], device: torch.device | str) -> list[torch.Tensor]:
        """Tensors for ``specs`` that live inside the transport's shared buffer (``cuda_ipc``).

        Keep the trainer's weights in them (allocate the adapter there, or copy into them once)
        and ``push`` them: a sync then packs nothing, the engine copies straight out of them.
        Do not write them while a push is running. The buffer holds exactly one update, so its
        memory is that update's size, and this Sender then pushes only those tensors (use a
        second Sender for other updates).
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        specs = [(n, tuple(shape), dtype) for n, shape, dtype in specs]
        total = sum(align_up(math.prod(shape) * dtype.itemsize) for _, shape, dtype in specs)
        self.close()
        self.bucket_bytes = max(align_up(total), 8192)
        self.slots = 1
        transport = self._ensure_transport(device, None)
        if transport.slot(0).device != device:
            raise TransportUnavailable(
                f"the {transport.name} transport keeps its buffer in {transport.slot(0).device} memory, so it "
                f"cannot host an arena for tensors on {device}; use transport='cuda_ipc'"
            )
        self._plans.clear()  # plans made under another bucket size would not fit the arena
        self._last_plan = None
        plan = self._plan([(n, torch.Size(shape), dtype) for n, shape, dtype in specs])
        assert len(plan.sizes) <= 1, "an arena is one bucket"
        views = typed_views(transport.slot(0)[: plan.sizes[0]], plan.metas) if plan.sizes else []
        plan.arena = views
        self._arena = (plan, views)
        return list(views)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._staging = None
        self._arena = None
        for plan in self._plans.values():
            plan.views.clear()
            plan.arena = None

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _push(
        self,
        specs: list,
        tensors: list[torch.Tensor] | None,
        stream: "_Peek | None",
        lora: LoraSpec | None,
        update_id: int | None,
        start: float,
    ) -> SyncReport:
        timer = _Timer()
        plan = self._plan(specs)
        if self._arena is not None and plan is not self._arena[0]:
            raise TransportError(
                f"this Sender's buffer is an arena for {len(self._arena[1])} tensors; pushing other tensors "
                "through it would overwrite them: push the arena's tensors, or use a second Sender"
            )
        if self.device is not None:
            device = self.device
        elif tensors:
            device = tensors[0].device
        else:
            first = stream.peek() if stream is not None else None
            device = first[1].device if first is not None else self._default_device()
        transport = self._ensure_transport(device, plan)
        uid = self._claim_update_id(update_id)
        manifest = plan.manifest(uid, lora)
        replies: list[Pending] = []
        try:
            # Pipelined: the engine's replies are read only when a slot must be reused and at
            # the end; the first failure is raised (replies come back in order).
            replies.append(self.link.submit(Begin(manifest)))
            if tensors is not None:
                sources = lambda b: tensors[plan.bounds[b][0] : plan.bounds[b][1]]  # noqa: E731
            else:
                sources = lambda b: [stream.take(m) for m in plan.metas[plan.bounds[b][0] : plan.bounds[b][1]]]  # noqa: E731
            self._stream_buckets(plan, uid, sources, transport, timer, replies)
            if stream is not None:
                stream.finish()
            t = time.perf_counter()
            replies.append(self.link.submit(Prepare(uid)))
            replies.append(self.link.submit(Commit(uid)))
            for pending in replies[:-1]:
                pending.wait()
            t = timer.add("prepare", t)
            replies[-1].wait()
            timer.add("commit", t)
        except BaseException as exc:
            self._abort(uid, exc)
            raise
        seconds = dict(timer.seconds, total=time.perf_counter() - start)
        report = SyncReport(uid, manifest.kind, transport.name, len(plan.metas), len(plan.sizes), plan.total, seconds)
        log.info("pushed update %d: %d tensors, %d bytes in %.2f ms via %s", uid, report.tensors, report.bytes,
                 seconds["total"] * 1e3, transport.name)
        return report

    def _default_device(self) -> torch.device:
        """Where an update with no tensors "lives": anywhere the requested transport can run."""
        if self.transport_name != "auto" and torch.cuda.is_available():
            cpu_ok, _ = transports.sender_class(self.transport_name).available(torch.device("cpu"))
            if not cpu_ok:
                return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _plan(self, specs: list) -> _Plan:
        last = self._last_plan
        if last is not None and last.specs == specs:
            return last
        key = tuple(specs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(specs, self.bucket_bytes)
            while len(self._plans) > 8:
                self._plans.popitem(last=False)
        self._last_plan = plan
        return plan

    def _ensure_transport(self, device: torch.device, plan: "_Plan | None") -> transports.SenderTransport:
        if self._transport is not None:
            return self._transport
        bucket_bytes, slots = self.bucket_bytes, self.slots
        if plan is not None and plan.sizes:  # no bigger than the first update needs
            bucket_bytes = min(bucket_bytes, align_up(max(plan.sizes), 1 << 16))
            slots = max(1, min(slots, len(plan.sizes)))
        explicit = self.transport_name != "auto"
        passed: list[str] = []
        for name, cls, why in transports.candidates(self.transport_name, device):
            if cls is None:
                if explicit:
                    raise TransportUnavailable(f"transport {name!r} cannot run here: {why}")
                passed.append(f"{name!r}: {why}")
                log.info("transport auto: passed over %r: %s", name, why)
                continue
            try:
                slot_bytes, nslots = cls.geometry(bucket_bytes, slots, device)
                transport = cls.create(slot_bytes, nslots, device)
            except Exception as exc:
                if explicit:
                    raise
                passed.append(f"{name!r}: {exc}")
                log.warning("transport auto: passed over %r: it could not be created: %s", name, exc)
                continue
            try:
                ack = self.link.submit(Attach(transport=cls.name, handle=transport.handle())).wait()
            except TransportError as exc:
                transport.close()
                if explicit:
                    raise
                passed.append(f"{name!r}: {exc}")
                log.warning("transport auto: passed over %r: the engine could not open it: %s", name, exc)
                continue
            except BaseException:
                transport.close()
                raise
            transport.attached()
            if not explicit:
                log.info("transport auto: picked %r (%s)", name, why)
            self.transport_log = [f"picked {name!r}: {why}"] + [f"passed over {p}" for p in passed]
            self._transport = transport
            for known in self._plans.values():
                known.views.clear()
            if self._next_id is None:
                self._next_id = ack.next_update_id()
            return transport
        raise TransportUnavailable("no transport works here: " + "; ".join(passed))

    def _claim_update_id(self, requested: int | None) -> int:
        if self._next_id is None:
            self._next_id = self.link.submit(Status()).wait().next_update_id()
        uid = self._next_id if requested is None else requested
        self._next_id = max(self._next_id, uid + 1)
        return uid

    def _abort(self, uid: int, exc: BaseException) -> None:
        try:
            ack = self.link.submit(Abort(uid, reason=f"sender failed: {type(exc).__name__}: {exc}")).wait()
        except Exception as abort_exc:  # the original error matters more
            log.debug("abort of update %d not acknowledged: %s", uid, abort_exc)
            return
        if ack.committed_update_id >= uid:  # the Commit was already on its way and landed
            exc.add_note(f"colosync: the engine did commit update {uid} before this error reached the sender")

    def _stream_buckets(
        self,
        plan: _Plan,
        uid: int,
        sources,  # noqa: ANN001 - bucket index -> its source tensors
        transport: transports.SenderTransport,
        timer: _Timer,
        replies: list[Pending],
    ) -> None:
        n, slot_bytes = transport.num_slots, transport.slot_bytes
        slot_device = transport.slot(0).device
        last_use = [-1] * n  # the chunk that last wrote each slot in this update
        outbox: deque[_Chunk] = deque()
        state = {"waited": -1}  # index into replies of the last reply read

        def submit_through(chunk: int) -> None:
            # Stage k is replies[k + 1]; a Stage goes out only once its bytes are in the slot.
            while outbox and len(replies) - 1 <= chunk:
                t = time.perf_counter()
                c = outbox.popleft()
                if c.fence is not None:
                    c.fence.synchronize()
                transport.flush()
                stage = c.stage
                if c.fp is not None:
                    stage = msgspec.structs.replace(stage, fingerprint=int(c.fp.item() if isinstance(c.fp, torch.Tensor) else c.fp))
                timer.add("transfer", t)
                replies.append(self.link.submit(stage))

        def free(slot: int) -> None:
            used = last_use[slot]
            if used < 0:
                return
            need = used + 1 if n >= 2 else used  # see transports.base: acknowledgements lag by one
            submit_through(need)
            t = time.perf_counter()
            for k in range(state["waited"] + 1, need + 2):
                replies[k].wait()
            state["waited"] = max(state["waited"], need + 1)
            timer.add("stage", t)

        chunk = 0
        for bucket, size in enumerate(plan.sizes):
            t = time.perf_counter()
            srcs = sources(bucket)
            device = srcs[0].device if srcs else slot_device
            if plan.single[bucket] and srcs[0].is_contiguous():
                packed = srcs[0].reshape(-1).view(torch.uint8)  # the tensor's own bytes: nothing to pack
                direct = False
            elif size <= slot_bytes and device == slot_device:
                slot = chunk % n
                free(slot)
                packed = transport.slot(slot)[:size]
                self._pack(plan, ("slot", slot), bucket, packed, srcs)
                direct = True
            else:
                packed = self._staging_buffer(size, device)
                self._pack(plan, ("staging",), bucket, packed, srcs)
                direct = False
            # One pass for the fingerprint -- fused with the copy into the slot where there is one copy.
            fuse = not direct and 0 < size <= slot_bytes and packed.is_cuda and packed.device == slot_device
            checked = fused.copy_check(packed, None, None) if size and not fuse else None
            timer.add("pack", t)
            for offset in range(0, max(size, 1), slot_bytes):
                nbytes = min(slot_bytes, size - offset)
                slot = chunk % n
                if not direct:
                    free(slot)
                    if fuse:
                        checked = fused.copy_check(packed, transport.slot(slot)[:size], None)
                    elif nbytes:
                        transport.slot(slot)[:nbytes].copy_(packed[offset : offset + nbytes], non_blocking=True)
                last = offset + slot_bytes >= size
                fp: Any = None
                if last:
                    fp = checked[0] if checked is not None else 0
                    if isinstance(fp, torch.Tensor) and fp.is_cuda:
                        fp = self._fp_slot(bucket).copy_(fp, non_blocking=True)
                fence = None
                if packed.is_cuda or slot_device.type == "cuda":
                    fence = torch.cuda.Event()
                    fence.record(torch.cuda.current_stream(packed.device if packed.is_cuda else slot_device))
                outbox.append(_Chunk(Stage(uid, bucket, offset, nbytes, slot, None), fence, fp))
                last_use[slot] = chunk
                chunk += 1
                if len(outbox) > 1:
                    submit_through(len(replies) - 1)  # the oldest chunk still held back
        submit_through(chunk)

    def _pack(self, plan: _Plan, where: tuple, bucket: int, packed: torch.Tensor, srcs: list[torch.Tensor]) -> None:
        i0, i1 = plan.bounds[bucket]
        if plan.arena is not None and where == ("slot", 0):
            arena = plan.arena[i0:i1]
            if all(map(operator.is_, srcs, arena)) or all(a.data_ptr() == s.data_ptr() for a, s in zip(arena, srcs)):
                return  # the tensors already live here: nothing to copy
        key = (where, bucket)
        views = plan.views.get(key)
        if views is None:
            views = plan.views[key] = typed_views(packed, plan.metas[i0:i1])
        with torch.no_grad():
            torch._foreach_copy_(views, srcs, non_blocking=True)
        gaps = plan.gap_index(bucket, packed.device)
        if gaps is not None:  # padding is whatever the slot held: make it zero
            packed.index_fill_(0, gaps, 0)

    def _fp_slot(self, bucket: int) -> torch.Tensor:
        if self._fp_ring is None:
            self._fp_ring = torch.empty(64, dtype=torch.int64, pin_memory=True)
        return self._fp_ring[bucket % 64]

    def _staging_buffer(self, size: int, device: torch.device) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._staging = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=device)
            for plan in self._plans.values():
                for key in [k for k in plan.views if k[0] == ("staging",)]:
                    del plan.views[key]
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
