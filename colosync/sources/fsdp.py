"""torch FSDP2 trainers as a source: bucketed all-gathers, one sender per engine, LoRA-only gathers.

Why it looks like this:

* **One collective per bucket, not per parameter.** ``DTensor.full_tensor()`` per parameter
  is one small all-gather each, and gathering everything before sending holds the whole model
  on the sending rank. Here the update is cut into the Sender's own buckets (the same
  ``plan_buckets`` layout, from ``(name, shape, dtype)`` only): each rank copies its local
  shards of a bucket into its segment of one flat buffer, and one in-place
  ``all_gather_into_tensor`` over the FSDP shard group fills the whole bucket.
* **Two buckets in flight, two buffers in all.** The sending rank copies bucket ``k`` out of
  the gather buffer into a second, bucket-sized buffer laid out tensor after tensor, starts
  the gather of bucket ``k + 1`` into the first (``async_op``), and only then hands bucket
  ``k`` to the Sender: the gather of one bucket overlaps the push of the previous one, and the
  sender's memory above the model is those two buffers (``stats.peak_buffer_bytes``), freed
  when the sync ends. Other ranks hold one. Because both buffers are reused, the source's
  buckets must be the Sender's (same ``bucket_bytes``; checked before anything moves).
* **Uneven shards.** FSDP2 shards dim 0 like ``torch.chunk``: ``ceil(N / R)`` rows per rank,
  the last ranks short or empty. Each rank's segment reserves the padded chunk, and the copy
  out takes only the real rows, so ``N % R != 0`` costs a little padding, never a wrong row.
* **HSDP.** On a 2-D mesh ``(replicate, shard)`` each shard group gathers on its own; the
  replicate dim already holds copies, so only the shard groups that contain a sending rank
  gather at all.
* **One rank per engine.** ``EngineMap`` names the sending rank of each engine (rank 0 and one
  engine by default); every rank of those ranks' shard groups holds a gathered bucket, but
  only the senders copy it out and talk to an engine, so each engine receives the payload
  once.
* **Collective failure.** If an engine refuses or dies mid-push, its sender keeps taking part
  in the remaining gathers (without copying out) so no rank is left inside a collective, then
  every rank learns the outcome from one all-gather of flags and every rank raises:
  the sender its own error, the others ``PeerFailedError`` naming it.

Names come from ``colosync.sources.plain.select``: FSDP, ``torch.compile``, checkpoint and PEFT
wrappers stripped for full weights, PEFT's saved LoRA names for ``kind="lora"``, which gathers
the adapter's parameters only. Not handled (each refused with a message saying so): shards on
a dim other than 0, tensor-parallel DTensors (``Shard`` on two mesh dims, ``Partial``,
``_StridedShard``), parameters on several meshes, merging an adapter into full weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from colosync.errors import ConversionError
from colosync.sources.base import Agreement, EngineMap, Spec, fingerprint, global_rank, group_ranks
from colosync.sources.plain import Entry, Kind, lora_spec_of, select
from colosync.sync.sender import DEFAULT_BUCKET_BYTES
from colosync.wire.bucket import plan_buckets
from colosync.wire.manifest import align_up

if TYPE_CHECKING:
    from colosync.sync.sender import Sender, SyncReport
    from colosync.wire.manifest import AdapterPolicy, LoraSpec
    from colosync.wire.protocol import Probe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    """One tensor of the update and how it is sharded (the same on every rank)."""

    name: str
    param_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as sent (the source's dtype, else the parameter's)
    chunk_rows: int  # rows of each rank's padded shard, ceil(N / R); 0: not sharded (every rank holds it)

    @property
    def sharded(self) -> bool:
        return self.chunk_rows > 0

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def local_rows(self, rank: int) -> int:
        """Rows shard ``rank`` holds (``torch.chunk``'s split, as FSDP2 shards dim 0)."""
        return max(0, min(self.chunk_rows, self.shape[0] - rank * self.chunk_rows))


@dataclass(frozen=True)
class _Bucket:
    """One Sender bucket: its items, their places in a rank's gather segment and in the copy-out buffer."""

    first: int  # index of its first item
    count: int
    seg_offsets: tuple[int, ...]  # per item: offset in a rank's segment, -1 if not sharded
    seg_bytes: int  # one rank's segment (the gather input); the gather output is R times this
    out_offsets: tuple[int, ...]  # per item: offset in the copy-out buffer, -1 if not sharded
    out_bytes: int


@dataclass
class FsdpStats:
    """What this rank did in its last sync (logs, the memory test, the bench)."""

    buckets: int = 0  # buckets stepped through
    gathers: int = 0  # all_gather_into_tensor calls this rank took part in
    gathered_bytes: int = 0  # bytes those gathers delivered to this rank (padding included)
    tensors_yielded: int = 0  # tensors handed to the consumer (sending ranks only)
    peak_buffer_bytes: int = 0  # most bytes of this sync's buffers alive at once (while anything held them)
    wait_seconds: float = 0.0  # time spent waiting for gathers to finish (small when they overlap the push)
    seconds: float = 0.0


class _Buffers:
    """The buffers of one sync, counted for as long as anything (a view, a consumer) keeps them alive."""

    def __init__(self, stats: FsdpStats) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._stats = stats
        self._live: list[tuple[Any, int]] = []

    def new(self, nbytes: int, device: torch.device) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._live.append((self._ref(t.untyped_storage()), nbytes))
        self.note()
        return t

    def live_bytes(self) -> int:
        return sum(n for ref, n in self._live if not ref.expired())

    def note(self) -> None:
        self._stats.peak_buffer_bytes = max(self._stats.peak_buffer_bytes, self.live_bytes())


class FsdpSource:
    """Stream an FSDP2 (``fully_shard``) model's weights or PEFT LoRA to one rank per engine.

    Every rank of the model's group constructs it (a collective: it checks the sharding and
    that every rank planned the same stream) and calls :meth:`push` or iterates
    :meth:`tensors` (collectives: every rank takes part).

    >>> source = FsdpSource(model, kind="lora")                          # fully_shard'ed PEFT model
    >>> sender = Sender(link, bucket_bytes=source.bucket_bytes) if source.is_sender else None
    >>> source.push(sender)                                              # on every rank
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kind: Kind = "lora",
        *,
        adapter: str = "default",
        engines: EngineMap | None = None,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model, self.kind, self.adapter, self.dtype = model, kind, adapter, dtype
        self.bucket_bytes = bucket_bytes
        self.engines = engines if engines is not None else EngineMap()
        self.agreement = Agreement(group, "FSDP source")
        self.engines.check(self.agreement.ranks)
        self.rank = global_rank()
        self.stats = FsdpStats()
        self.lora: LoraSpec | None = None
        self.shard_group: dist.ProcessGroup | None = None
        self.shard_size, self.shard_rank = 1, 0
        self.device = torch.device("cpu")
        self._items: list[_Item] = []
        self._buckets: list[_Bucket] = []
        self._last_buffers: _Buffers | None = None
        problems: list[str] = []
        try:
            entries = select(model, kind, adapter)
            self.lora = lora_spec_of(model, adapter) if kind == "lora" else None
            problems += self._find_mesh(entries)
            if not problems:
                self._items = [self._item(e) for e in entries]
                self._buckets = self._plan()
                problems += self._check_locals(self._locals())
        except ConversionError as exc:
            problems.append(str(exc))
        plan = [(i.name, i.shape, str(i.dtype), i.chunk_rows) for i in self._items]
        self.agreement.problems(problems, plan=fingerprint([*plan, self.bucket_bytes]))
        shard_ranks = group_ranks(self.shard_group) if self.shard_group is not None else [self.rank]
        self.gathers = any(s in shard_ranks for s in self.engines.senders)  # HSDP: only groups that feed an engine
        log.debug(
            "fsdp source: rank %d, shard group %s, %d tensors in %d buckets, sender=%s",
            self.rank,
            shard_ranks,
            len(self._items),
            len(self._buckets),
            self.is_sender,
        )

    # -- public -----------------------------------------------------------------------------
    @property
    def is_sender(self) -> bool:
        return self.engines.engine_of(self.rank) is not None

    def specs(self) -> list[Spec]:
        """Every tensor of the update (engine names, full shapes), in stream order, on every rank."""
        return [(i.name, i.shape, i.dtype) for i in self._items]

    def max_buffer_bytes(self) -> int:
        """The most a sending rank's two buffers hold at once: its memory above the model during a sync."""
        return self._gather_bytes() + max((b.out_bytes for b in self._buckets), default=0)

    def largest_bucket_bytes(self) -> int:
        """The largest single buffer a bucket needs (its gather, or its copy-out): the unit of the bound above."""
        gathered = [b.seg_bytes * self.shard_size for b in self._buckets] if self.gathers else []
        return max([*gathered, *(b.out_bytes for b in self._buckets)], default=0)

    def live_buffer_bytes(self) -> int:
        """Bytes of the last sync's buffers still alive (0 once a push returned: nothing is kept)."""
        return self._last_buffers.live_bytes() if self._last_buffers is not None else 0

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective generator: the update's tensors on sending ranks, nothing elsewhere.

        Every rank must iterate it to the end. A tensor is a view into a reused buffer, valid
        until the first tensor of the next bucket is requested (clone it to keep it).
        """
        locals_ = self._locals()
        self.agreement.problems(self._check_locals(locals_))
        return self._stream(locals_, [self.is_sender])

    def push(
        self,
        sender: Sender | None,
        update_id: int | None = None,
        verify: Probe | None = None,
        adapters: AdapterPolicy = "drop",
    ) -> SyncReport | None:
        """Collective: one update through ``sender`` on each rank the ``EngineMap`` names
        (``adapters``: what a full update does to a served adapter, as in ``Sender.push``).

        Sending ranks pass their ``Sender`` (made with ``bucket_bytes=source.bucket_bytes``),
        others ``None``. Returns the ``SyncReport`` where a Sender sent, ``None`` elsewhere;
        raises on every rank if any sender failed, after every rank has left the gathers.
        """
        locals_ = self._locals()
        problems = self._check_locals(locals_)
        if self.is_sender:
            if sender is None:
                problems.append(
                    f"rank {self.rank} feeds engine {self.engines.engine_of(self.rank)} but got sender=None; "
                    "create the Sender on the ranks where source.is_sender is True"
                )
            elif sender.bucket_bytes != self.bucket_bytes:
                problems.append(
                    f"the Sender's bucket_bytes ({sender.bucket_bytes}) differ from the source's "
                    f"({self.bucket_bytes}): the source gathers the Sender's buckets into two reused buffers; "
                    "make the Sender with bucket_bytes=source.bucket_bytes"
                )
        elif sender is not None:
            log.warning("fsdp source: rank %d is not in %s; its Sender is not used", self.rank, self.engines)
        self.agreement.problems(problems)
        sending = [self.is_sender]
        stream = self._stream(locals_, sending)
        error: BaseException | None = None
        report = None
        if self.is_sender and sender is not None:
            try:
                report = sender.push_stream(
                    self.specs(), stream, lora=self.lora, update_id=update_id, verify=verify, adapters=adapters
                )
            except BaseException as exc:  # re-raised by outcome(), once every rank has left the gathers
                error = exc
                sending[0] = False  # keep gathering, stop copying out
        for _ in stream:  # the rest of the gathers: other ranks, and a sender whose push failed
            pass
        self.agreement.outcome(error, f"{self.kind} update")
        if report is not None:
            s = self.stats
            log.info(
                "fsdp source: pushed %s update %d from rank %d: %d tensors in %d buckets, %d gathers, "
                "peak buffers %d bytes, %.1f ms (%.1f ms waiting on gathers)",
                self.kind,
                report.update_id,
                self.rank,
                s.tensors_yielded,
                s.buckets,
                s.gathers,
                s.peak_buffer_bytes,
                s.seconds * 1e3,
                s.wait_seconds * 1e3,
            )
        return report

    # -- the bucket schedule ----------------------------------------------------------------
    def _stream(self, locals_: list[torch.Tensor], sending: list[bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather bucket after bucket; ``sending[0]`` may turn False mid-way (then only gather)."""
        self.stats = stats = FsdpStats()
        start = time.perf_counter()
        buffers = self._last_buffers = _Buffers(stats)
        gather_buf = buffers.new(self._gather_bytes(), self.device) if self.gathers else None
        out_buf = (
            buffers.new(max((b.out_bytes for b in self._buckets), default=0), self.device) if self.is_sender else None
        )
        pending: Any = None
        if self._buckets and gather_buf is not None:
            pending = self._launch(self._buckets[0], gather_buf, locals_)
        for k, bucket in enumerate(self._buckets):
            if pending is not None:
                t = time.perf_counter()
                pending.wait()
                stats.wait_seconds += time.perf_counter() - t
            out = self._copy_out(bucket, gather_buf, out_buf, locals_) if sending[0] and out_buf is not None else None
            pending = None  # the gather buffer is free again: start the next bucket's gather
            if k + 1 < len(self._buckets) and gather_buf is not None:
                pending = self._launch(self._buckets[k + 1], gather_buf, locals_)
            stats.buckets += 1
            buffers.note()
            if out is not None:
                for item, tensor in zip(self._items[bucket.first : bucket.first + bucket.count], out, strict=True):
                    stats.tensors_yielded += 1
                    yield item.name, tensor
        out = None
        del gather_buf, out_buf
        buffers.note()
        stats.seconds = time.perf_counter() - start

    def _launch(self, bucket: _Bucket, gather_buf: torch.Tensor, locals_: list[torch.Tensor]) -> Any:
        """Copy this rank's shards of ``bucket`` into its segment and start the in-place gather."""
        size = bucket.seg_bytes
        if not size:
            return None
        seg = gather_buf[self.shard_rank * size : (self.shard_rank + 1) * size]
        dsts, srcs = [], []
        for j, offset in enumerate(bucket.seg_offsets):
            local = locals_[bucket.first + j]
            if offset >= 0 and local.numel():
                item = self._items[bucket.first + j]
                dsts.append(
                    seg[offset : offset + local.numel() * item.dtype.itemsize].view(item.dtype).view(local.shape)
                )
                srcs.append(local)
        with torch.no_grad():
            if dsts:
                torch._foreach_copy_(dsts, srcs)  # casts to the sent dtype where asked
        self.stats.gathers += 1
        self.stats.gathered_bytes += size * self.shard_size
        return dist.all_gather_into_tensor(
            gather_buf[: size * self.shard_size], seg, group=self.shard_group, async_op=True
        )

    def _copy_out(
        self, bucket: _Bucket, gather_buf: torch.Tensor | None, out_buf: torch.Tensor, locals_: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The bucket's full tensors: sharded ones copied out of the gather (real rows only), others as held."""
        size, ranks = bucket.seg_bytes, self.shard_size
        gathered = gather_buf[: size * ranks].view(ranks, size) if size and gather_buf is not None else None
        dsts, srcs, out = [], [], []
        for j in range(bucket.count):
            item, local = self._items[bucket.first + j], locals_[bucket.first + j]
            if not item.sharded:
                out.append(local if local.dtype == item.dtype else local.to(item.dtype))
                continue
            offset = bucket.out_offsets[j]
            dst = out_buf[offset : offset + item.nbytes]
            out.append(dst.view(item.dtype).view(item.shape))
            if gathered is None or not item.nbytes:
                continue
            src, rows, chunk = bucket.seg_offsets[j], item.shape[0], item.chunk_rows
            chunk_bytes = chunk * item.row_bytes
            whole = rows // chunk  # ranks whose shard is full
            if whole:
                dsts.append(dst[: whole * chunk_bytes].view(whole, chunk_bytes))
                srcs.append(gathered[:whole, src : src + chunk_bytes])
            rest = (rows - whole * chunk) * item.row_bytes  # the one short shard, if any
            if rest:
                dsts.append(dst[whole * chunk_bytes :])
                srcs.append(gathered[whole, src : src + rest])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return out

    def _gather_bytes(self) -> int:
        return max((b.seg_bytes for b in self._buckets), default=0) * self.shard_size if self.gathers else 0

    # -- planning ---------------------------------------------------------------------------
    def _find_mesh(self, entries: list[Entry]) -> list[str]:
        """The one FSDP mesh and its shard dim; refuse any other sharding."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh, shard_dim, problems = None, None, []
        for e in entries:
            p = e.param
            if not isinstance(p, DTensor):
                continue
            placements = tuple(p.placements)
            shards = [d for d, pl in enumerate(placements) if type(pl) is Shard]
            others = [pl for d, pl in enumerate(placements) if d not in shards and not isinstance(pl, Replicate)]
            if len(shards) != 1 or others or placements[shards[0]].dim != 0:  # type: ignore[attr-defined]
                problems.append(
                    f"{e.param_name} is a DTensor placed {placements}: only FSDP2's Shard(0) on one mesh dim "
                    "(Replicate on the others, HSDP) is supported; tensor-parallel DTensors are not"
                )
                continue
            if mesh is None:
                mesh, shard_dim = p.device_mesh, shards[0]
            elif p.device_mesh != mesh or shards[0] != shard_dim:
                problems.append(
                    f"{e.param_name} lives on mesh {p.device_mesh} (shard dim {shards[0]}) but others on {mesh} "
                    f"(shard dim {shard_dim}); fully_shard every module over one mesh"
                )
        if mesh is not None and shard_dim is not None and not problems:
            self.shard_group = mesh.get_group(shard_dim)
            self.shard_size, self.shard_rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
            outside = [r for r in mesh.mesh.flatten().tolist() if r not in self.agreement.ranks]
            if outside:
                problems.append(f"mesh ranks {outside} are outside the source's group; pass group= covering the mesh")
            backend = dist.get_backend(self.shard_group)
            self.device = (
                torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            )
        elif entries:
            self.device = entries[0].param.device
        return problems

    def _item(self, e: Entry) -> _Item:
        from torch.distributed.tensor import DTensor

        shape = tuple(e.param.shape)
        chunk = -(-shape[0] // self.shard_size) if isinstance(e.param, DTensor) and shape and shape[0] else 0
        return _Item(e.name, e.param_name, shape, self.dtype or e.param.dtype, chunk)

    def _plan(self) -> list[_Bucket]:
        """The Sender's buckets (``plan_buckets`` on the same specs and size), with gather and copy-out offsets."""
        layout = plan_buckets(self.specs(), self.bucket_bytes)
        buckets, first = [], 0
        for b in range(len(layout.bucket_sizes)):
            count = len(layout.bucket_tensors(b))
            seg_offsets, out_offsets, seg, out = [], [], 0, 0
            for item in self._items[first : first + count]:
                if item.sharded:
                    seg_offsets.append(seg)
                    out_offsets.append(out)
                    seg += align_up(item.chunk_rows * item.row_bytes)
                    out += align_up(item.nbytes)
                else:
                    seg_offsets.append(-1)
                    out_offsets.append(-1)
            buckets.append(_Bucket(first, count, tuple(seg_offsets), seg, tuple(out_offsets), out))
            first += count
        return buckets

    def _locals(self) -> list[torch.Tensor]:
        """This rank's piece of every item now (the model's parameters may have been replaced since)."""
        from torch.distributed.tensor import DTensor

        params = dict(_named(self.model))
        out = []
        for item in self._items:
            p = params.get(item.param_name)
            if p is None:
                raise ConversionError(f"parameter {item.param_name!r} is gone from the model; make a new FsdpSource")
            out.append((p.to_local() if isinstance(p, DTensor) else p).detach())
        return out

    def _check_locals(self, locals_: list[torch.Tensor]) -> list[str]:
        problems = []
        for item, local in zip(self._items, locals_, strict=True):
            want = (item.local_rows(self.shard_rank), *item.shape[1:]) if item.sharded else item.shape
            if tuple(local.shape) != want:
                problems.append(
                    f"{item.param_name} holds {list(local.shape)} on rank {self.rank}, expected {list(want)} "
                    f"(shard {self.shard_rank} of {self.shard_size} of {list(item.shape)}); if FSDP left it "
                    "unsharded after a forward, call model.reshard() before pushing"
                )
        return problems[:4]


def _named(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from colosync.sources.plain import unwrap

    return unwrap(model).named_parameters()


__all__ = ["EngineMap", "FsdpSource", "FsdpStats"]
