"""Move a set of device tensors to host memory and back, keeping every tensor object.

Trainers and engines hold references to their tensors everywhere — ``Parameter`` objects in
modules and optimizers, optimizer state dicts, KV-cache lists — so offloading must not
create new tensors: after a restore the very same Python objects must be valid. The stash
does it with ``tensor.data = ...``: on offload every tensor is pointed at an empty
placeholder (a tensor of zero elements, so using a sleeping model fails loudly), on restore
at a view of freshly allocated device memory with the original dtype, shape, strides and
aliasing.

The unit that is copied is the *storage* (or, after the first restore, a region of the
stash's own flat buffer), not the tensor, so views and tensors sharing memory keep sharing
it. On restore all regions are laid out back to back in **one** device allocation, and the
host copy uses the same layout, so from the second cycle on a sleep or wake is a handful of
chunk-sized DMA copies regardless of how many tensors there are. Regions can be offloaded
without a backup (gradients, KV cache): they come back zeroed.

A restore can also land in memory the stash does not own (``restore(into=...)``: a view of
another process's ``DeviceLoan``), which the next offload then leaves allocated, since
neither allocating nor freeing it is the stash's to do.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from colosync.errors import StashError
from colosync.handoff.backends.host_pool import HostLease, HostPool
from colosync.handoff.model.participants import COUNTERS, OpReport

log = logging.getLogger(__name__)

ALIGN = 4096


class StashStats(OpReport, frozen=True, kw_only=True):
    """What one offload or restore of a stash did: an ``OpReport`` of the stash (its owner and
    ``offload``/``restore``), plus how many tensors it moved in how many copies."""

    participant: str = ""
    op: str = ""
    tensors: int = 0
    copies: int = 0

    def __add__(self, other: StashStats) -> StashStats:
        """Both operations as one (a participant that offloads two stashes in one step)."""
        summed = {
            name: getattr(self, name) + getattr(other, name) for name in (*COUNTERS, "seconds", "tensors", "copies")
        }
        return StashStats(
            participant=self.participant or other.participant,
            op=self.op or other.op,
            noop=self.noop and other.noop,
            note="; ".join(n for n in (self.note, other.note) if n),
            **summed,
        )


@dataclass
class _View:
    tensor: torch.Tensor
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    byte_offset: int  # from the start of its region


@dataclass
class _Region:
    nbytes: int
    src_ptr: int  # device address of the region's first byte at offload time
    storage_ptr: int  # the storage it lies in (copies merge only within one storage)
    views: list[_View] = field(default_factory=list)
    offset: int = 0  # in the flat layout (device buffer and host lease alike)


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def _bytes_view(storage: torch.UntypedStorage, start: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (length,), (1,))


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what freeing them would return)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class TensorStash:
    """Offload/restore one set of tensors as a unit (see module docstring)."""

    def __init__(
        self, owner: str, device: torch.device | str, pool: HostPool | None = None, *, empty_cache: bool = True
    ) -> None:
        self.owner = owner
        self.device = torch.device(device)
        self.pool = pool
        self.empty_cache = empty_cache
        self._regions: list[_Region] | None = None  # set while offloaded
        self._lease: HostLease | None = None
        self._total = 0
        self.inflight_bytes = 0
        """Device bytes allocated by a restore in progress, not yet behind the tensors."""
        # Layout of the flat buffer made by the last restore (to find regions at next offload).
        self._flat_ptr: int | None = None
        self._flat_nbytes = 0
        self._flat_lent = False  # the flat buffer is a view of memory the stash does not own
        self._layout_starts: list[int] = []
        self._layout_sizes: list[int] = []

    @property
    def offloaded(self) -> bool:
        return self._regions is not None

    @property
    def backed_up(self) -> bool:
        return self._lease is not None

    @property
    def host_bytes(self) -> int:
        return self._lease.nbytes if self._lease is not None else 0

    @property
    def offloaded_bytes(self) -> int:
        return self._total if self.offloaded else 0

    # -- offload ----------------------------------------------------------------------------
    def offload(
        self, tensors: Iterable[torch.Tensor], *, backup: bool, on_peak: Callable[[], None] | None = None
    ) -> StashStats:
        """Copy ``tensors`` to a host lease (when ``backup``) and free their device memory."""
        started = time.perf_counter()
        if self.offloaded:
            return StashStats(noop=True, note=f"{self.owner}: already offloaded")
        if backup and self.pool is None:
            raise StashError(f"{self.owner}: backup=True needs a HostPool; pass pool=HostPool(...)")
        pool = self.pool if backup else None
        mine = self._collect(tensors)
        if not mine:
            return StashStats(noop=True, note=f"{self.owner}: nothing resident to offload")
        regions, storages = self._group(mine)
        total = self._layout(regions)
        lease = None
        copies = 0
        if pool is not None and total:
            lease = pool.lease(self.owner, total)
            merged = self._coalesce(regions)
            self._copy_out(lease, merged, storages)
            copies = len(merged)
            self._sync()
        self._lease = lease
        if on_peak is not None:
            on_peak()
        for region in regions:
            for view in region.views:
                view.tensor.data = torch.empty(0, dtype=view.dtype, device=self.device)
        # What is freed is what nothing else references any more.
        freed = retained = 0
        unique: dict[int, torch.UntypedStorage] = {}
        for st, _start in storages.values():
            unique.setdefault(st.data_ptr(), st)
        storages.clear()
        lent = 0
        for st in unique.values():
            if self._flat_lent and st.data_ptr() == self._flat_ptr:
                lent = st.nbytes()  # stays with its lender: neither freed nor retained by us
                if torch._C._storage_Use_Count(st._cdata) > 1:
                    log.warning(
                        "%s: tensors not given to the stash still view the lent memory; after this offload they "
                        "read whatever its lender puts there (the engine's KV cache): offload them too",
                        self.owner,
                    )
                continue
            # one reference is ``st`` itself (the dict holds the same object)
            if torch._C._storage_Use_Count(st._cdata) > 1:
                retained += st.nbytes()
            else:
                freed += st.nbytes()
        if retained:
            log.warning(
                "%s: %.3f GB stay allocated after offload: other tensors (not given to the stash) still "
                "reference the same storage; offload them too",
                self.owner,
                retained / 1e9,
            )
        unique.clear()
        if lent:
            self._sync()  # the lender's process may use the memory as soon as this returns
        self._regions = regions
        self._total = total
        self._flat_ptr = None
        if self.empty_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return StashStats(
            participant=self.owner,
            op="offload",
            seconds=time.perf_counter() - started,
            tensors=len(mine),
            copies=copies,
            host_allocated=lease.nbytes if lease is not None else 0,
            # data bytes (the copies also span the alignment gaps between regions)
            bytes_to_host=sum(r.nbytes for r in regions) if lease is not None else 0,
            device_freed=freed,
            device_retained=retained,
        )

    def _copy_out(
        self,
        lease: HostLease,
        copies: list[tuple[int, int, int]],
        storages: dict[int, tuple[torch.UntypedStorage, int]],
    ) -> None:
        for src_ptr, dst_off, length in copies:
            st, start = storages[src_ptr]
            lease.write(dst_off, _bytes_view(st, start, length, self.device))

    def _collect(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if t.device.type != self.device.type or (self.device.index is not None and t.device != self.device):
                continue
            if t.numel() == 0 or t.is_sparse:
                continue
            out.append(t)
        return out

    def _group(self, tensors: list[torch.Tensor]) -> tuple[list[_Region], dict[int, tuple[torch.UntypedStorage, int]]]:
        """Regions to copy, and for each region's source address its storage and byte start."""
        by_storage: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
        for t in tensors:
            st = t.untyped_storage()
            entry = by_storage.setdefault(st.data_ptr(), (st, []))
            entry[1].append(t)
        regions: dict[tuple[int, int], _Region] = {}
        sources: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for ptr, (st, ts) in by_storage.items():
            spans = None
            if ptr == self._flat_ptr and st.nbytes() == self._flat_nbytes:
                spans = self._flat_spans(ts)
            for t in ts:
                off = int(t.storage_offset()) * t.element_size()  # an int outside tracing
                start, length = spans[id(t)] if spans is not None else (0, st.nbytes())
                region = regions.get((ptr, start))
                if region is None:
                    region = regions[(ptr, start)] = _Region(nbytes=length, src_ptr=ptr + start, storage_ptr=ptr)
                    sources[ptr + start] = (st, start)
                region.views.append(_View(t, t.dtype, t.shape, tuple(t.stride()), off - start))
        ordered = sorted(regions.values(), key=lambda r: r.src_ptr)
        return ordered, sources

    def _flat_spans(self, ts: list[torch.Tensor]) -> dict[int, tuple[int, int]] | None:
        """Map each tensor on the stash's flat buffer to the layout region holding it, or
        None when one does not fit a single region (then the whole buffer is one region)."""
        spans = {}
        for t in ts:
            off = t.storage_offset() * t.element_size()
            i = bisect.bisect_right(self._layout_starts, off) - 1
            if i < 0 or off + _extent(t) > self._layout_starts[i] + self._layout_sizes[i]:
                return None
            spans[id(t)] = (self._layout_starts[i], self._layout_sizes[i])
        return spans

    @staticmethod
    def _layout(regions: list[_Region]) -> int:
        offset = 0
        for region in regions:
            region.offset = offset
            offset += -(-region.nbytes // ALIGN) * ALIGN
        return offset

    @staticmethod
    def _coalesce(regions: list[_Region]) -> list[tuple[int, int, int]]:
        """``(src_ptr, dst_offset, length)`` copies, merging regions that sit at the same distance
        from each other on the device as in the layout (true for the stash's own flat buffer)."""
        out: list[list[int]] = []
        last_storage = None
        for r in regions:
            if out and r.storage_ptr == last_storage:
                src, dst, length = out[-1]
                if r.src_ptr - src == r.offset - dst and r.src_ptr >= src + length:
                    out[-1][2] = r.offset + r.nbytes - dst
                    continue
            out.append([r.src_ptr, r.offset, r.nbytes])
            last_storage = r.storage_ptr
        return [(c[0], c[1], c[2]) for c in out]

    # -- restore ----------------------------------------------------------------------------
    def restore(
        self,
        *,
        zero: bool = True,
        on_peak: Callable[[], None] | None = None,
        into: torch.Tensor | None = None,
    ) -> StashStats:
        """Allocate one device buffer (or take ``into``: a ``uint8`` tensor whose storage is exactly
        ``offloaded_bytes`` long), fill it from the host copy (or zeros), re-point every tensor."""
        started = time.perf_counter()
        if self._regions is None:
            return StashStats(noop=True, note=f"{self.owner}: already resident")
        regions, total, lease = self._regions, self._total, self._lease
        if into is None:
            self.inflight_bytes = total
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            flat = _checked_home(self.owner, into, total, self.device)
        if lease is not None:
            lease.read(0, flat)
        elif zero:
            flat.zero_()
        self._sync()
        if on_peak is not None:
            on_peak()
        storage = flat.untyped_storage()
        for region in regions:
            for v in region.views:
                byte = region.offset + v.byte_offset
                itemsize = v.dtype.itemsize
                if byte % itemsize:
                    raise StashError(f"{self.owner}: misaligned view at byte {byte} for {v.dtype}")
                v.tensor.data = torch.empty(0, dtype=v.dtype, device=self.device).set_(
                    storage, byte // itemsize, v.size, v.stride
                )
        self.inflight_bytes = 0
        if lease is not None:
            lease.release()
            self._lease = None
        self._flat_ptr = flat.data_ptr()
        self._flat_nbytes = total
        self._flat_lent = into is not None
        self._layout_starts = [r.offset for r in regions]
        self._layout_sizes = [r.nbytes for r in regions]
        self._regions = None
        self._total = 0
        del flat, storage
        return StashStats(
            participant=self.owner,
            op="restore",
            seconds=time.perf_counter() - started,
            tensors=sum(len(r.views) for r in regions),
            device_allocated=total if into is None else 0,
            bytes_to_device=sum(r.nbytes for r in regions) if lease is not None else 0,
            copies=lease.pool.chunks_for(total) if lease is not None else 0,
            host_freed=lease.nbytes if lease is not None else 0,
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _checked_home(owner: str, into: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``into`` if a restore of ``total`` bytes can make it the flat buffer, else a ``StashError``."""
    storage = into.untyped_storage()
    problems = []
    if into.dtype != torch.uint8 or into.dim() != 1:
        problems.append(f"it is {into.dtype} with {into.dim()} dims, not 1-D uint8")
    if into.device.type != device.type or (device.index is not None and into.device != device):
        problems.append(f"it is on {into.device}, the stash on {device}")
    if into.data_ptr() != storage.data_ptr() or storage.nbytes() != total or into.numel() != total:
        problems.append(f"its storage holds {storage.nbytes()} bytes, the restore needs exactly {total}")
    if problems:
        raise StashError(
            f"{owner}: cannot restore into the given memory: {'; '.join(problems)}; pass a view whose storage is "
            "exactly offloaded_bytes long (DeviceLoan.view does)"
        )
    return into
