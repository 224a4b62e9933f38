"""A bucket plan: one layout of named tensors, planned once from shapes and reused every update.

A plan holds the one ``Layout`` that every manifest it makes shares (receivers key their
per-layout caches on it by identity), each bucket's range of tensors, which buckets are one
whole tensor (sent from that tensor's own bytes, nothing packed), the padding to zero after
packing, and the typed views of each place a bucket is packed into, made once. Views are
keyed by ``ViewKey`` and forgotten in one place, ``Plan.drop_views``, when the buffers they
view are replaced or freed.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from colosync.errors import ManifestError
from colosync.kernels.gather import GatherTable
from colosync.transports.cuda_graphs import LayoutVersion
from colosync.wire.bucket import TensorSpec, plan_buckets, typed_views
from colosync.wire.manifest import AdapterPolicy, Layout, LoraSpec, TensorMeta, UpdateManifest, manifest_digest

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")

STAGING = -1
"""``ViewKey.slot`` of the Sender's first staging buffer (a bucket that cannot be packed into a slot); ``STAGING - 1``
is its second (``sync.pipeline.StagingBuffers``)."""


class LayoutChanged(Exception):
    """A bucket's tensors no longer have the shapes or dtypes of the plan found by their names alone.

    ``Plan.check`` raises it before the bucket is packed; the Sender aborts the update and plans again.
    """


class ViewKey(NamedTuple):
    """Which cached views: those of bucket ``bucket`` packed into transport slot ``slot`` (or ``STAGING``)."""

    bucket: int
    slot: int


class Plan:
    """Buckets for one layout of named tensors (``TensorSpec``s, in send order)."""

    def __init__(self, specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> None:
        self.specs = [TensorSpec(name, tuple(shape), dtype) for name, shape, dtype in specs]
        # the specs column by column, which is how ``Plans.find`` compares a push's tensors with them
        self.names = [s.name for s in self.specs]
        self.shapes = [s.shape for s in self.specs]
        self.dtypes = [s.dtype for s in self.specs]
        self.layout: Layout = plan_buckets(self.specs, bucket_bytes)
        metas, sizes = self.layout.tensors, self.layout.bucket_sizes
        self.metas: tuple[TensorMeta, ...] = metas
        self.sizes: tuple[int, ...] = sizes
        starts = [0] * (len(sizes) + 1)
        for i, meta in enumerate(metas):  # plan_buckets fills buckets in order
            starts[meta.bucket + 1] = i + 1
        self.bounds = [(starts[b], starts[b + 1]) for b in range(len(sizes))]
        self.single = [
            i1 - i0 == 1 and metas[i0].nbytes == size and size > 0
            for (i0, i1), size in zip(self.bounds, sizes, strict=True)
        ]
        self.total = sum(m.nbytes for m in metas)
        self.gaps: list[list[tuple[int, int]]] = []  # padding inside each bucket, zeroed after packing
        for (i0, i1), size in zip(self.bounds, sizes, strict=True):
            gaps, pos = [], 0
            for m in metas[i0:i1]:
                if m.offset > pos:
                    gaps.append((pos, m.offset))
                pos = max(pos, m.offset + m.nbytes)
            if pos < size:
                gaps.append((pos, size))
            self.gaps.append(gaps)
        self.arena: list[torch.Tensor] | None = None  # the tensors, where they live in transport slot 0
        self._views: dict[ViewKey, list[torch.Tensor]] = {}
        self._gap_index: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._gather: dict[tuple[int, torch.device], GatherTable] = {}
        self._digests: dict[tuple[str, LoraSpec | None, AdapterPolicy], bytes] = {}
        self._layouts = [LayoutVersion() for _ in sizes]  # per bucket: its sources' layout as last seen
        self._checked = [0] * len(sizes)  # per bucket: the layout number of the sources that last passed ``check``

    def manifest(self, update_id: int, lora: LoraSpec | None, adapters: AdapterPolicy = "drop") -> UpdateManifest:
        return UpdateManifest(update_id, "lora" if lora else "full", self.layout, lora, adapters)

    def digest(self, manifest: UpdateManifest) -> bytes:
        """``manifest_digest`` of one of this plan's manifests, computed once per kind, LoRA spec and adapter policy."""
        key = (manifest.kind, manifest.lora, manifest.adapters)
        found = self._digests.get(key)
        if found is None:
            found = self._digests[key] = manifest_digest(manifest)
        return found

    def pack(self, key: ViewKey, packed: torch.Tensor, srcs: list[torch.Tensor]) -> None:
        """Copy bucket ``key.bucket``'s tensors into ``packed`` (one fused copy) and zero its padding."""
        i0, i1 = self.bounds[key.bucket]
        if self.arena is not None and key.slot == 0:
            arena = self.arena[i0:i1]
            if all(map(operator.is_, srcs, arena)) or all(
                a.data_ptr() == s.data_ptr() for a, s in zip(arena, srcs, strict=False)
            ):
                return  # the tensors already live here: nothing to copy
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = typed_views(packed, self.metas[i0:i1])
        with torch.no_grad():
            torch._foreach_copy_(views, srcs, non_blocking=True)
        self.zero_gaps(key.bucket, packed)

    def zero_gaps(self, bucket: int, packed: torch.Tensor) -> None:
        """Zero the padding of bucket ``bucket`` packed in ``packed`` (whatever the buffer held there before)."""
        if self.gaps[bucket]:
            index = self._gap_index.get((bucket, packed.device))
            if index is None:
                index = torch.cat([torch.arange(a, b) for a, b in self.gaps[bucket]]).to(packed.device)
                self._gap_index[(bucket, packed.device)] = index
            packed.index_fill_(0, index, 0)

    def gather_table(self, bucket: int, device: torch.device) -> GatherTable:
        """The gather kernel's rows for bucket ``bucket`` on ``device`` (``kernels.gather``), made once."""
        table = self._gather.get((bucket, device))
        if table is None:
            i0, i1 = self.bounds[bucket]
            table = self._gather[(bucket, device)] = GatherTable(self.metas[i0:i1], device)
        return table

    def layout_number(self, bucket: int, srcs: Sequence[torch.Tensor]) -> int:
        """Bucket ``bucket``'s ``srcs`` as a ``LayoutVersion`` number: what ``check``, gather rows and graphs key on."""
        return self._layouts[bucket].of(srcs)

    def check(self, bucket: int, srcs: Sequence[torch.Tensor], layout: int = 0) -> None:
        """Raise ``LayoutChanged`` unless ``srcs`` have the shapes and dtypes planned for bucket ``bucket``.

        ``layout`` (``Plan.layout_number``): the same number as at the last check that passed means the
        same shapes and dtypes, and nothing is read again."""
        if layout and layout == self._checked[bucket]:
            return
        i0, i1 = self.bounds[bucket]
        if list(map(_SHAPE, srcs)) != self.shapes[i0:i1] or list(map(_DTYPE, srcs)) != self.dtypes[i0:i1]:
            raise LayoutChanged(
                f"bucket {bucket}'s tensors changed shape or dtype since the last push with these names"
            )
        self._checked[bucket] = layout

    def drop_views(self, staging_only: bool = False) -> None:
        """Forget the views of buffers that were replaced or freed: the staging buffer's, or all (and the arena)."""
        if staging_only:
            for key in [k for k in self._views if k.slot <= STAGING]:
                del self._views[key]
            return
        self._views.clear()
        self.arena = None


class Plans:
    """The Sender's plans by layout, most recent first to be checked; at most ``keep`` of them."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.last: Plan | None = None
        self._last_specs: list[tuple[str, Sequence[int], torch.dtype]] | None = None  # as the caller built them
        self._plans: OrderedDict[tuple[tuple[str, Sequence[int], torch.dtype], ...], Plan] = OrderedDict()

    def find(self, names: list[str], tensors: list[torch.Tensor], bucket_bytes: int) -> Plan:
        """The plan for these named tensors, reading each tensor's shape and dtype once.

        A push that repeats the last plan costs three list comparisons; one of the arena's own
        tensors (``Sender.arena``: shapes and dtypes fixed by the plan that made them) costs a
        comparison of names and identities only.
        """
        last = self.last
        if last is not None and names == last.names:
            arena = last.arena
            if arena is not None and len(arena) == len(tensors) and all(map(operator.is_, tensors, arena)):
                return last
            shapes, dtypes = list(map(_SHAPE, tensors)), list(map(_DTYPE, tensors))
            if shapes == last.shapes and dtypes == last.dtypes:
                return last
        else:
            shapes, dtypes = list(map(_SHAPE, tensors)), list(map(_DTYPE, tensors))
        return self.get(list(zip(names, shapes, dtypes, strict=True)), bucket_bytes)

    def named(self, names: list[str]) -> Plan | None:
        """The last plan if ``names`` are its names, shapes and dtypes unread: check each bucket (``Plan.check``).

        Reading 624 tensors' shapes and dtypes cost ~0.25 ms of CPU on an H200 host before the
        first byte could move; checked bucket by bucket, all but the first bucket's share runs
        while earlier buckets' copies are on their way. The Sender takes a plan this way only
        for the layout the engine committed last (``Sender.push``).
        """
        last = self.last
        return last if last is not None and names == last.names else None

    def get(self, specs: list[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> Plan:
        """The plan for ``specs``, made once per layout (a repeated layout costs one list comparison)."""
        if self._last_specs == specs and self.last is not None:
            return self.last
        key = tuple(specs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = Plan(specs, bucket_bytes)
            while len(self._plans) > self.keep:
                self._plans.popitem(last=False)
        self.last, self._last_specs = plan, specs
        return plan

    def drop_views(self, staging_only: bool = False) -> None:
        """``Plan.drop_views`` on every plan (their buffers belong to the Sender, not to one plan)."""
        for plan in self._plans.values():
            plan.drop_views(staging_only)

    def clear(self) -> None:
        self._plans.clear()
        self.last = self._last_specs = None


class StreamSource:
    """Pull tensors from a source iterator in plan order, checking each against its plan entry."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._it = tensors
        self._head: tuple[str, torch.Tensor] | None = None

    def peek(self) -> tuple[str, torch.Tensor] | None:
        if self._head is None:
            self._head = next(self._it, None)
        return self._head

    def take(self, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
        """The next ``len(metas)`` tensors, which must be ``metas`` exactly (names, shapes, dtypes)."""
        return [self._take(meta) for meta in metas]

    def _take(self, meta: TensorMeta) -> torch.Tensor:
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
            raise ManifestError(
                f"the source yielded {extra[0]!r} beyond its planned tensors; list every tensor in the specs"
            )


__all__ = ["LayoutChanged", "Plan", "Plans", "StreamSource", "ViewKey", "STAGING"]
