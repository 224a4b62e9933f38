"""Where an update's bytes land in engine memory, and how they are checked on the way in.

Why it is built this way:

- The hot path runs once per Stage, never once per tensor. What depends only on the layout
  (which tensors share a bucket, the float runs the non-finite check reads, typed views of a
  slot) is worked out once per ``Layout`` and kept in a ``LayoutPlan``. A sender repeats one
  layout update after update, and a ``Layout`` is frozen, hashed once and shared by identity,
  so an update after the first finds its plan with one dict lookup and lands each bucket
  with one fused copy.
- The destination sets the strategy, once per update, because it is the engine that decides
  where bytes may go: an engine that lends nothing gets buffers the Receiver allocates and
  hands out views of (``OwnedLanding``); one that lends per-bucket flat buffers gets one flat
  copy per bucket (``BucketLanding``); one that lends only tensors gets each bucket copied
  straight out of the transport slot into them (``TensorLanding``). That last copy reads
  typed views of the whole bucket on the device, so a bucket that arrives in host memory or
  in pieces is assembled first in the bounce buffer: one bucket of device memory, kept
  between updates (and grown to the largest bucket that needed it) rather than allocated
  per update.
- An engine may lend flat buckets in host memory (``sync.staging.HostStaging``: a full
  update then costs its device nothing). A bucket coming through a device slot is checked
  there, chunk by chunk (its fingerprint and flag are the sums of its chunks'), and each chunk
  is copied to the host once; anything else is copied and checked on the host.
- Chunk order is checked here (``Landing.admit``) because the landing is what knows how many
  bytes of each bucket have arrived; a chunk out of place is refused before anything lands,
  so the update stays in flight and the sender can still abort it cleanly.
- A cached view is only as good as the memory it looks into: slot views until the next
  attach, bounce views until the bounce buffer grows. ``ViewKey`` says which memory a view
  list belongs to, so each event drops exactly the views it invalidates (an id-based key
  could be reused by a new allocation and hand out views of freed memory).
- On a GPU nothing waits on the host mid-update except the flow control below: each bucket's
  fingerprint and non-finite flag go into one device tensor as its bytes land and are read
  back in one transfer at ``prepare``. On the CPU there is nothing to overlap, so each bucket
  is checked as it completes. A flagged bucket is re-checked tensor by tensor, so the error
  names the tensors and NaN bits in padding do not reject an update.
- A layout seen before lands through CUDA graphs (``transports.cuda_graphs``): the copy out
  of the slot, the fingerprint and the NaN/Inf check of a bucket are captured on the second
  sighting of the same memory and replayed as one launch after that. The key names every
  address the work touches (slot, destination tensors with their shapes and strides, the
  result row, the sender's fingerprint cell), so new destination storage, a new slot or a
  new layout is new work, never a stale replay; the graphs live on the layout's bucket plans
  and are dropped when a new transport attaches. The result rows are kept per layout for
  the same reason: the same memory update after update.
- Where the transport seals the sender's writes (``cuda_ipc``: the stream waits on the
  sender's interprocess event; ``shm``: the host waits for a seal written behind the copy,
  ``ReceiverTransport.ready``), the sender's fingerprint comes with the seal rather than in
  the Stage. In device memory (``cuda_ipc``) it is copied into the bucket's result row on the
  stream, the cell zeroed, and compared with the rest at ``prepare``; in host memory
  (``shm``) it is read at once, as if it had come in the Stage.
- The ``Fence`` is what lets the sender reuse a slot: with two or more slots a Stage is
  acknowledged as soon as the previous Stage's copies have finished, so the copy of one chunk
  overlaps the arrival of the next (``transports.base`` says what an acknowledgement
  promises); with one slot, once its own have.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from colosync.errors import FingerprintMismatchError, ManifestError, NonFiniteError, TransactionStateError
from colosync.kernels import fused
from colosync.kernels.fused import Segment
from colosync.sync.target import ReceiverPolicy, Staging
from colosync.transports.cuda_graphs import GraphCache, LayoutVersion
from colosync.wire.bucket import tensor_views, typed_views
from colosync.wire.manifest import Layout, LoraSpec, TensorMeta, UpdateManifest
from colosync.wire.protocol import Stage

if TYPE_CHECKING:
    from colosync.transports.base import ReceiverTransport

SLOT = "slot"
BOUNCE = "bounce"


class ViewKey(NamedTuple):
    """The memory a cached list of typed views looks into."""

    source: str  # SLOT (a transport slot) or BOUNCE (the bounce buffer)
    slot: int = 0  # the slot's index; 0 for the bounce buffer (not ``index``: that is tuple.index)


class BucketPlan:
    """What landing one bucket of a layout needs, computed once per layout."""

    __slots__ = ("size", "indices", "metas", "names", "single", "segments", "views", "layout_version", "_graphs")

    def __init__(self, size: int, indices: list[int], metas: list[TensorMeta]) -> None:
        self.size, self.indices, self.metas = size, indices, metas
        self.names = [m.name for m in metas]
        self.single = len(metas) == 1 and metas[0].offset == 0 and metas[0].nbytes == size
        self.segments = fused.segments(metas, size)  # None: check finiteness tensor by tensor (fp8)
        self.views: dict[ViewKey, list[torch.Tensor]] = {}
        self.layout_version = LayoutVersion()  # of the engine's destination tensors, which its graphs bake in
        self._graphs: GraphCache | None = None

    def graphs(self, device: torch.device) -> GraphCache:
        """This bucket's landing graphs (a few destinations, slots and policies each)."""
        cache = self._graphs
        if cache is None or cache.device != device:
            cache = self._graphs = GraphCache(device, capacity=8)
        return cache

    def forget_graphs(self) -> None:
        self._graphs = None

    def typed(self, key: ViewKey, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of this bucket's tensors inside ``buffer``, built once per ``key``."""
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = typed_views(buffer, self.metas)
        return views

    def forget(self, source: str) -> None:
        for key in [k for k in self.views if k.source == source]:
            del self.views[key]


class LayoutPlan:
    """The receive plan of one layout, shared by every update that repeats it."""

    def __init__(self, layout: Layout) -> None:
        self.names = tuple(t.name for t in layout.tensors)
        members: list[list[int]] = [[] for _ in layout.bucket_sizes]
        for i, t in enumerate(layout.tensors):
            members[t.bucket].append(i)
        self.buckets = [
            BucketPlan(size, idx, [layout.tensors[i] for i in idx])
            for size, idx in zip(layout.bucket_sizes, members, strict=True)
        ]
        # (kind, lora) pairs the engine has accepted with this layout
        self.validated: set[tuple[str, LoraSpec | None]] = set()
        # [fingerprint, non-finite, sent fingerprint] per bucket, on the device: reused by every
        # update of this layout (one is in flight at a time), so graphs see the same rows
        self.results: torch.Tensor | None = None
        self.host_results: torch.Tensor | None = None  # their pinned host copy, each row copied as its bucket lands
        self.results_zeroed = False  # zeroed since the last update wrote them (at the end of its ``verify``)


class Plans:
    """The plans of the most recently used layouts, keyed by the ``Layout`` itself."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[Layout, LayoutPlan] = OrderedDict()

    def get(self, layout: Layout) -> LayoutPlan:
        plan = self._plans.get(layout)
        if plan is None:
            plan = self._plans[layout] = LayoutPlan(layout)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(layout)
        return plan

    def __contains__(self, layout: Layout) -> bool:
        return layout in self._plans

    def __len__(self) -> int:
        return len(self._plans)

    def forget_views(self, source: str) -> None:
        for plan in self._plans.values():
            for bucket in plan.buckets:
                bucket.forget(source)

    def forget_graphs(self) -> None:
        for plan in self._plans.values():
            for bucket in plan.buckets:
                bucket.forget_graphs()

    def graph_counts(self) -> dict[str, int]:
        """How often bucket landings ran eagerly, were captured and were replayed (all plans)."""
        total = {"eager": 0, "capture": 0, "replay": 0}
        for plan in self._plans.values():
            for bucket in plan.buckets:
                if bucket._graphs is not None:
                    for k, v in bucket._graphs.counts.items():
                        total[k] += v
        return total

    def clear(self) -> None:
        self._plans.clear()


class Fence:
    """Waits for the device copies a Stage issued before its slot may be reused (no-op off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lag = False  # acknowledge a Stage before its copy is done (2+ slots)
        self._pending: Any = None  # CUDA event after the last Stage's copies
        self._events: list[Any] = []  # two, used in turn: one may be pending while the other is recorded
        self._turn = 0

    def staged(self) -> None:
        """After a Stage's copies: wait for the previous Stage's (or this one's, with one slot)."""
        if self.device.type != "cuda":
            return
        if not self._events:
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn ^= 1
        event = self._events[self._turn]  # not the pending one: that is the other
        event.record(torch.cuda.current_stream(self.device))
        previous, self._pending = self._pending, event
        if previous is not None:
            previous.synchronize()
        if not self.lag:
            self.drain()

    def drain(self) -> None:
        """Wait for every copy issued so far: all slots (and the bounce buffer) are free after it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.synchronize()


class RowMirror:
    """Copies verdict rows to pinned host memory on a stream of their own.

    A device-to-host copy queues on the GPU's device-to-host copy engine behind whatever other
    processes queued there: over ``shm`` that is the trainer's 16 MiB chunks. On the engine's
    own stream, a bucket's row copy would hold up the host-to-device copy of the next chunk
    until the trainer's queued chunks were out (0.5-0.8 ms once per seed-lora update on an
    H200, ``benchmarks/seed-lora``); here it waits alone, and ``wait`` is called only at prepare.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None
        self._done: Any = None  # event after the last copy

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` once the current stream's work so far (the check that wrote ``src``) is done."""
        if self._stream is None:
            self._stream, self._done = torch.cuda.Stream(self.device), torch.cuda.Event()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self._done.record(stream)

    def wait(self) -> None:
        """Until every copy so far is in host memory."""
        if self._done is not None:
            self._done.synchronize()


class BounceBuffer:
    """One bucket of device memory, kept between updates, grown to the largest bucket that needs it."""

    def __init__(self, device: torch.device, fence: Fence, plans: Plans) -> None:
        self.device, self._fence, self._plans = device, fence, plans
        self.tensor: torch.Tensor | None = None

    def get(self, size: int) -> torch.Tensor:
        if self.tensor is None or self.tensor.numel() < size:
            self._fence.drain()  # a lagging copy may still read the old buffer
            self.release()
            self.tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.tensor

    def release(self) -> None:
        self.tensor = None
        self._plans.forget_views(BOUNCE)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() if self.tensor is not None else 0


class Lander:
    """What the Receiver keeps between updates to land bytes: plans, the bounce buffer, the fence."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.plans = Plans()
        self.fence = Fence(device)
        self.bounce = BounceBuffer(device, self.fence, self.plans)
        self.mirror = RowMirror(device)

    def attached(self, num_slots: int) -> None:
        """A new transport is open: views of the old one's slots are void."""
        self.fence.lag = num_slots >= 2
        self.plans.forget_views(SLOT)
        self.plans.forget_graphs()

    def open(self, manifest: UpdateManifest, plan: LayoutPlan, lent: Any, policy: ReceiverPolicy) -> Landing:
        """The landing for one update, given what the engine's ``staging()`` lent (``None``: nothing)."""
        if lent is None:
            owned = OwnedLanding(self, manifest, plan, policy)
            owned.zero_rows()
            return owned
        tensors, flats = (lent.tensors, lent.buckets) if isinstance(lent, Staging) else (lent, None)
        if not isinstance(tensors, list):
            tensors = list(tensors)
        if len(tensors) != len(manifest.tensors) or (flats is not None and len(flats) != len(manifest.bucket_sizes)):
            raise TransactionStateError(
                f"the engine lent {len(tensors)} staging tensors for an update of {len(manifest.tensors)}; "
                "staging() must return one per manifest tensor, in order (and one buffer per bucket)"
            )
        landing: Landing
        if flats is not None:
            landing = BucketLanding(self, manifest, plan, policy, tensors)
            landing.flats = flats
        else:
            landing = TensorLanding(self, manifest, plan, policy, tensors)
        landing.zero_rows()
        return landing

    def close(self) -> None:
        self.fence.drain()
        self.mirror.wait()
        self.plans.clear()
        self.bounce.release()


Verdict = tuple[int, torch.Tensor, "int | None"]  # (bucket, [fingerprint, non-finite] (lazy), sent fingerprint)
# (a sent fingerprint of None whose bucket is in ``Landing.device_sent`` is in the bucket's result row)


class Landing(abc.ABC):
    """One update's bytes on their way in: where each bucket lands and what it was checked to be.

    A subclass per destination kind says where a chunk goes (``_land``); the strategies it
    picks from are the methods ``_into_flat``, ``_from_slot`` and ``_via_bounce``.
    """

    kind: ClassVar[str]  # "owned", "buckets" or "tensors": what the engine lent

    def __init__(
        self,
        lander: Lander,
        manifest: UpdateManifest,
        plan: LayoutPlan,
        policy: ReceiverPolicy,
        staging: list[torch.Tensor] | None = None,
    ) -> None:
        self.manifest, self.plan, self.staging = manifest, plan, staging
        self._lander = lander
        self._fingerprints = policy.verify_fingerprints
        self._finite = policy.reject_nonfinite
        self._check = self._fingerprints or self._finite
        self._on_device = self._check and lander.device.type == "cuda"  # verdicts wait on the device
        self.received: dict[int, int] = {}  # bucket -> bytes landed so far
        self.buffers: dict[int, torch.Tensor] = {}  # Receiver-owned bucket buffers (OwnedLanding)
        # what ``prepare`` hands the engine: the lent tensors by name, named here at begin, where the engine
        # waits for the first chunk anyway, not at prepare (~0.07 ms for 624 tensors on a GPU host)
        self.tensors: dict[str, torch.Tensor] = {} if staging is None else dict(zip(plan.names, staging, strict=True))
        self.deferred: list[Verdict] = []  # device verdicts to read at ``prepare``
        self.results: torch.Tensor | None = None  # one zeroed [fingerprint, non-finite, sent] row per bucket
        self.device_sent: set[int] = set()  # buckets whose sent fingerprint came in device memory
        self.mirrored: set[int] = set()  # buckets whose result row is on its way to ``plan.host_results``
        self._cell: torch.Tensor | None = None  # the admitted chunk's sent-fingerprint cell, if any

    @property
    def update_id(self) -> int:
        return self.manifest.update_id

    @property
    def lent(self) -> list[torch.Tensor]:
        """The staging tensors the engine lent (landings of kind "buckets" and "tensors", until ``release``)."""
        if self.staging is None:
            raise TransactionStateError(f"update {self.update_id} has no staging tensors lent by the engine")
        return self.staging

    def admit(self, msg: Stage, transport: ReceiverTransport) -> torch.Tensor | None:
        """The chunk's bytes in its slot, once it is known to fit the slot and continue its bucket."""
        sizes = self.manifest.bucket_sizes
        if msg.bucket >= len(sizes):
            raise ManifestError(f"stage names bucket {msg.bucket} but update {msg.update_id} has {len(sizes)}")
        size, done = sizes[msg.bucket], self.received.get(msg.bucket, 0)
        if size and done == size:
            raise ManifestError(f"bucket {msg.bucket} of update {msg.update_id} is already complete; stage it once")
        slot = transport.slot(msg.slot)
        if msg.nbytes > slot.numel():
            raise ManifestError(
                f"stage of {msg.nbytes} bytes exceeds transport slot {msg.slot}; chunk buckets by the slot size"
            )
        if msg.offset != done or msg.offset + msg.nbytes > size:
            raise ManifestError(
                f"bucket {msg.bucket}: chunk [{msg.offset}, {msg.offset + msg.nbytes}) does not continue "
                f"the {done} bytes received of {size}; chunks must arrive in order"
            )
        transport.ready(msg)  # this stream now waits for the sender's writes (no-op unless the Stage is sealed)
        last = msg.offset + msg.nbytes == size
        self._cell = transport.sent_fingerprint(msg) if last and msg.fingerprint is None else None
        if not msg.nbytes:
            return None
        return slot if msg.nbytes == slot.numel() else slot[: msg.nbytes]

    def land(self, msg: Stage, src: torch.Tensor | None) -> None:
        """Land one admitted chunk; at a bucket's last, fingerprint and check it (one pass on a GPU)."""
        b = self.plan.buckets[msg.bucket]
        last = msg.offset + msg.nbytes == b.size
        row = self._row(msg.bucket) if last and self._on_device else None
        cell, self._cell = self._cell, None
        sent = msg.fingerprint
        if not (last and self._fingerprints):
            cell = None
        elif cell is not None and (row is None or not cell.is_cuda):  # checked or sent on the host: read it here
            sent = int(cell[0].item())  # (the current stream waits for the sender: ``admit``)
            cell.zero_()
            cell = None
        elif cell is not None:
            self.device_sent.add(msg.bucket)
        checked, result = self._land(b, msg, src, last, row, cell)
        if last:
            self._landed(msg, b, checked, result, row, sent)
        self.received[msg.bucket] = msg.offset + msg.nbytes

    def missing_buckets(self) -> list[int]:
        """Buckets not complete yet; an empty one counts as complete only once its (0-byte) Stage came,
        which is when its tensors are published."""
        received = self.received
        return [b for b, size in enumerate(self.manifest.bucket_sizes) if b not in received or received[b] != size]

    def verify(self) -> None:
        """Read the verdicts deferred on the device (one transfer) and raise the first failure.

        Then zero the rows for the layout's next update: the engine is using the GPU now, while at the
        next ``begin`` the trainer is packing on it, and two processes' work on one GPU takes turns."""
        self._verify(self.deferred)
        self.deferred.clear()
        if self.results is not None and self.results is self.plan.results:
            self.results.zero_()  # ordered after the reads above: same stream, and they were waited for
            self.plan.results_zeroed = True

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """The update's tensors by name, for ``EngineTarget.prepare``."""
        return self.tensors

    def release(self) -> None:
        """Let go of everything this update staged."""
        self.buffers.clear()
        self.tensors.clear()
        self.staging = None
        self.deferred.clear()
        self.results = None
        self.device_sent.clear()
        self.mirrored.clear()
        self._cell = None

    # -- strategies ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _land(
        self,
        b: BucketPlan,
        msg: Stage,
        src: torch.Tensor | None,
        last: bool,
        row: torch.Tensor | None,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Put one chunk where this destination wants it; return (the bucket's bytes, its verdict).

        ``cell``: the sender's fingerprint in device memory, to take into the result row (``_take_sent``)."""

    def _into_flat(
        self,
        flat: torch.Tensor,
        b: BucketPlan,
        msg: Stage,
        src: torch.Tensor | None,
        last: bool,
        row: torch.Tensor | None,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket is one run of bytes: copy the chunk to its place and check it (see the branches)."""
        words = (msg.offset | msg.nbytes) % 8 == 0  # the device check reads whole int64 words
        if src is not None and src.is_cuda and not flat.is_cuda and words and (self._on_device or not self._check):
            # Staged in host memory (``HostStaging``): check each chunk where it is, on the device
            # (gathered in the bucket's result row), then copy it to the host, asynchronously into
            # pinned memory (the fence waits for it before the slot is reused; ``prepare`` before
            # the engine reads it). A host-side check of the bucket would read it again, on the CPU.
            self._take_sent(msg.bucket, cell)
            result = None
            if self._check:
                segs = fused.clip(self._segments(b), msg.offset, msg.nbytes)
                result = fused.copy_check(src, None, segs, offset=msg.offset, out=self._row(msg.bucket))
            # fp8 has no device check: ``_landed`` checks the host tensors, so the last copy waits
            host_check = last and self._finite and b.segments is None
            flat[msg.offset : msg.offset + msg.nbytes].copy_(src, non_blocking=flat.is_pinned() and not host_check)
            return flat, result
        if self._check and last and msg.offset == 0 and src is not None and src.device == flat.device:
            segs = self._segments(b)
            if row is None or not flat.is_cuda:
                return flat, fused.copy_check(src, flat, segs, out=row)  # copy + fingerprint + check
            bucket = msg.bucket

            def work() -> None:
                self._take_sent(bucket, cell)
                fused.copy_check(src, flat, segs, out=row)

            key = (
                "flat",
                bucket,
                src.data_ptr(),
                src.numel(),
                flat.data_ptr(),
                flat.numel(),
                flat.stride(),
                row.data_ptr(),
                cell.data_ptr() if cell is not None else 0,
                self._finite,
            )
            self._run(b, key, work)
            return flat, row
        self._take_sent(msg.bucket, cell)
        if src is not None:
            flat[msg.offset : msg.offset + msg.nbytes].copy_(src, non_blocking=flat.is_cuda)
        if last and self._check and b.size:
            return flat, fused.copy_check(flat, None, self._segments(b), out=row)
        return flat, None

    def _from_slot(
        self, b: BucketPlan, msg: Stage, src: torch.Tensor, row: torch.Tensor | None, cell: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole bucket is in a slot on the device: check it there, then one fused copy out."""
        views = b.typed(ViewKey(SLOT, msg.slot), src)
        segs = self._segments(b)
        if row is None or not src.is_cuda:
            result = fused.copy_check(src, None, segs, out=row) if self._check else None
            self._scatter(b, views)
            return src, result
        lent = self.lent
        dsts = [lent[i] for i in b.indices]
        bucket = msg.bucket

        def work() -> None:
            self._take_sent(bucket, cell)
            fused.copy_check(src, None, segs, out=row)
            with torch.no_grad():
                torch._foreach_copy_(dsts, views, non_blocking=True)

        def key() -> tuple[Any, ...]:  # the engine lends these tensors: addresses and layout are keyed
            return (
                "slot",
                bucket,
                src.data_ptr(),
                src.numel(),
                row.data_ptr(),
                cell.data_ptr() if cell is not None else 0,
                self._finite,
                b.layout_version.key(dsts),
            )

        self._run(b, key, work)
        return src, row

    def _via_bounce(
        self,
        b: BucketPlan,
        msg: Stage,
        src: torch.Tensor | None,
        last: bool,
        row: torch.Tensor | None,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Assemble the bucket in the bounce buffer; once whole, check it and copy it out in one go."""
        self._take_sent(msg.bucket, cell)
        bounce = self._lander.bounce.get(b.size)
        if src is not None:
            bounce[msg.offset : msg.offset + msg.nbytes].copy_(src, non_blocking=bounce.is_cuda)
        checked = bounce[: b.size]
        result = None
        if last and b.size:
            if self._check:
                result = fused.copy_check(checked, None, self._segments(b), out=row)
            self._scatter(b, b.typed(ViewKey(BOUNCE), checked))
        return checked, result

    # -- helpers ------------------------------------------------------------------------------
    def _scatter(self, b: BucketPlan, views: list[torch.Tensor]) -> None:
        lent = self.lent
        with torch.no_grad():
            torch._foreach_copy_([lent[i] for i in b.indices], views, non_blocking=True)

    def _segments(self, b: BucketPlan) -> list[Segment] | None:
        return b.segments if self._finite else None

    def zero_rows(self) -> None:
        """Have this update's result rows zeroed by ``begin``, off the path of the first Stage, if it checks on a
        GPU (the layout's previous update zeroed them at its ``verify`` unless it failed before)."""
        if self._on_device and self.plan.buckets:
            self._row(0)

    def _row(self, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``'s zeroed ``[fingerprint, non-finite]`` pair (the layout's rows, zeroed once per update)."""
        results = self.results
        if results is None:
            device = self._lander.device
            results = self.plan.results
            if results is None or results.device != device:
                results = self.plan.results = torch.zeros(len(self.plan.buckets), 3, dtype=torch.int64, device=device)
                self.plan.host_results = torch.empty(results.shape, dtype=torch.int64, pin_memory=True)
            elif not self.plan.results_zeroed:
                results.zero_()
            self.plan.results_zeroed = False
            self.results = results
        return results[bucket, :2]

    def _take_sent(self, bucket: int, cell: torch.Tensor | None) -> None:
        """Copy the sender's fingerprint from its device cell into the result row, and zero the cell."""
        if cell is None:
            return
        results = self.results
        if results is None:
            raise TransactionStateError("a device fingerprint arrived for a landing with no result rows")
        results[bucket, 2:].copy_(cell[:1])
        cell.zero_()  # a sender that skips writing it next time cannot pass with a stale value

    def _run(self, b: BucketPlan, key: Any, work: Callable[[], None]) -> None:  # key: a tuple, or what builds it
        b.graphs(self._lander.device).run(key, work)

    def _landed(
        self,
        msg: Stage,
        b: BucketPlan,
        checked: torch.Tensor,
        result: torch.Tensor | None,
        row: torch.Tensor | None,
        sent: int | None,
    ) -> None:
        """A bucket is complete in ``checked``: publish it and check (or queue the check of) it."""
        self._publish(b, checked)
        if self._finite and b.segments is None:  # fp8 has no device check: tensor by tensor
            check_finite(self._bucket_tensors(b), self.update_id)
        if not self._check:
            return
        if result is None:  # an empty bucket: its fingerprint is 0
            result = fused.copy_check(checked[:0], None, None, out=row)
        item = (msg.bucket, result, sent)
        if not result.is_cuda:
            self._verify([item])
            return
        self.deferred.append(item)  # read at prepare, all buckets at once
        results, host = self.results, self.plan.host_results
        if results is not None and host is not None and result.data_ptr() == results[msg.bucket].data_ptr():
            # on its way to pinned memory now, so prepare reads it on the host without a device round trip
            self._lander.mirror.copy(host[msg.bucket], results[msg.bucket])
            self.mirrored.add(msg.bucket)

    def _publish(self, b: BucketPlan, checked: torch.Tensor) -> None:  # noqa: B027 - optional hook, no-op by default
        """Make a complete bucket's tensors visible to ``prepare`` (staged ones already are)."""

    def _bucket_tensors(self, b: BucketPlan) -> dict[str, torch.Tensor]:
        lent = self.lent
        return dict(zip(b.names, (lent[i] for i in b.indices), strict=True))

    def _verify(self, items: list[Verdict]) -> None:
        """Read the verdicts ([fingerprint, non-finite] per bucket) in one transfer; raise the first."""
        if not items:
            return
        results, host = self.results, self.plan.host_results
        values: list[tuple[int, int, int | None]]
        if host is not None and all(b in self.mirrored for b, _, _ in items):
            self._lander.mirror.wait()  # the rows' copies into pinned memory are done
            rows = host.tolist()
            values = [(rows[b][0], rows[b][1], rows[b][2]) for b, _, _ in items]
        elif results is not None and all(r.data_ptr() == results[b].data_ptr() for b, r, _ in items):
            rows = results.tolist()  # one transfer for the whole update
            values = [(rows[b][0], rows[b][1], rows[b][2]) for b, _, _ in items]
        else:  # (a device-sent fingerprint is only ever in the rows: without them it fails closed below)
            values = [(got, bad, None) for got, bad in torch.stack([result for _, result, _ in items]).tolist()]
        for (bucket, _, sent), (got, bad, on_device) in zip(items, values, strict=True):
            if sent is None and bucket in self.device_sent:
                sent = on_device
            if self._fingerprints and (sent is None or got != sent):
                raise fingerprint_error(self.update_id, bucket, got, sent)
            if bad and self._finite:
                # Name the tensors; a bucket flagged only for its padding passes.
                check_finite(self._bucket_tensors(self.plan.buckets[bucket]), self.update_id)


class OwnedLanding(Landing):
    """The engine lends nothing: one Receiver-owned buffer per bucket, handed out as views."""

    kind = "owned"

    def _land(
        self,
        b: BucketPlan,
        msg: Stage,
        src: torch.Tensor | None,
        last: bool,
        row: torch.Tensor | None,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        buffer = self.buffers.get(msg.bucket)
        if buffer is None:
            buffer = self.buffers[msg.bucket] = torch.empty(b.size, dtype=torch.uint8, device=self._lander.device)
        return self._into_flat(buffer, b, msg, src, last, row, cell)

    def _publish(self, b: BucketPlan, checked: torch.Tensor) -> None:
        self.tensors.update(tensor_views(checked, b.metas))

    def _bucket_tensors(self, b: BucketPlan) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] for name in b.names}


class BucketLanding(Landing):
    """The engine lends per-bucket flat buffers that are its tensors' storage: one flat copy per bucket."""

    kind = "buckets"

    flats: Any = None  # one uint8 buffer per bucket, lent by the engine (set right after construction)

    def _land(
        self,
        b: BucketPlan,
        msg: Stage,
        src: torch.Tensor | None,
        last: bool,
        row: torch.Tensor | None,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._into_flat(self.flats[msg.bucket], b, msg, src, last, row, cell)

    def release(self) -> None:
        super().release()
        self.flats = None


class TensorLanding(Landing):
    """The engine lends only tensors: copy each bucket into them from the slot (or the bounce buffer)."""

    kind = "tensors"

    def _land(
        self,
        b: BucketPlan,
        msg: Stage,
        src: torch.Tensor | None,
        last: bool,
        row: torch.Tensor | None,
        cell: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if b.single:  # the tensor is the whole bucket: land flat in it
            tensor = self.lent[b.indices[0]]
            if tensor.is_contiguous():
                return self._into_flat(tensor.reshape(-1).view(torch.uint8), b, msg, src, last, row, cell)
        if last and msg.offset == 0 and src is not None and src.device == self._lander.device:
            return self._from_slot(b, msg, src, row, cell)
        return self._via_bounce(b, msg, src, last, row, cell)


def fingerprint_error(update_id: int, bucket: int, got: int, sent: int | None) -> FingerprintMismatchError:
    return FingerprintMismatchError(
        f"update {update_id} bucket {bucket}: fingerprint {got} != sent {sent}; the "
        "bytes changed in transit (was the slot overwritten before it was acknowledged?)"
    )


def check_finite(views: dict[str, torch.Tensor], update_id: int) -> None:
    """Raise ``NonFiniteError`` naming the tensors of ``views`` that hold NaN or Inf."""
    floats = [
        (n, t if t.dtype.itemsize > 1 else t.float()) for n, t in views.items() if t.is_floating_point() and t.numel()
    ]
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
