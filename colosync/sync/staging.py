"""Where a full update waits for its commit: host memory lent to the Receiver, not the engine's device.

Engines that install full updates at commit (hf, vLLM) stage them here (``HostStaging``) and
report where the bytes sat (``FullFootprint``), so a colocated trainer keeps the device memory a
second copy of the model would take. ``return_cached`` hands what an install left in PyTorch's
cache back to the driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgspec
import torch

from colosync.errors import ConfigError
from colosync.sync.target import Staging
from colosync.wire.bucket import typed_views
from colosync.wire.manifest import TensorMeta, UpdateManifest


class HostLeaser(Protocol):
    """Host memory to borrow a staging area from: the node's shared arena (``ArenaPool`` in
    ``colosync.handoff.backends``), seen from this layer by shape only. ``lease(...,
    contiguous=True).flat`` is the lease as one flat ``uint8`` tensor."""

    def lease(self, owner: str, nbytes: int, contiguous: bool = False) -> Any: ...


STAGING_ALIGN = 4096  # where each bucket starts inside the leased range


class HostStaging:
    """A full update's landing place in host memory, lent to the Receiver through ``staging()``.

    Why: a full update staged on the engine's device costs the engine the whole payload in
    device memory (more with a prepared copy), memory a colocated trainer cannot use. Staged
    here instead, the payload sits in host memory (pinned when CUDA is present, so the
    install at commit runs at DMA speed) until the engine copies it into its served weights
    while paused; the device holds at most the Receiver's bounce buffer and the transport's
    slots beside them. Pinning is slow, so with ``keep`` the area is reused by every update
    of the same layout (one update is in flight at a time: a new Begin ends the old one
    before it asks for staging); without it (an engine on the CPU, where the area would be
    memory the model itself needs) it is freed when the update ends.

    With a ``pool`` (``use_pool``: the shared arena of a colocated job) the area is one
    contiguous lease of its already pinned chunks, taken for one update and given back when
    it ends: the sync runs while neither host copy exists, so a full update's staging takes
    its turn in the same pages as the engine's mirror and the trainer's backup instead of
    pinning memory of its own. An arena without room refuses the update before a byte lands.
    """

    def __init__(self, keep: bool, pin: bool | None = None, pool: HostLeaser | None = None) -> None:
        self.keep = keep
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.pool = pool
        self._layout: Any = None
        self._staging: Staging | None = None
        self._lease: Any = None

    def use_pool(self, pool: HostLeaser | None) -> None:
        """Lend from ``pool`` from the next update on (``None``: allocate again)."""
        self.release()
        self.pool = pool

    def lend(self, manifest: UpdateManifest) -> Staging:
        """Per-bucket host buffers for ``manifest`` and typed views of its tensors inside them."""
        if self._staging is not None and self._layout == manifest.layout:
            return self._staging
        self.release()
        if self.pool is not None:
            flats = self._leased(manifest.bucket_sizes)
        else:
            flats = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for size in manifest.bucket_sizes]
        members: list[list[TensorMeta]] = [[] for _ in flats]
        for t in manifest.tensors:
            members[t.bucket].append(t)
        views = {
            m.name: v
            for flat, metas in zip(flats, members, strict=True)
            for m, v in zip(metas, typed_views(flat, metas), strict=True)
        }
        self._staging = Staging([views[t.name] for t in manifest.tensors], flats)
        self._layout = manifest.layout
        return self._staging

    def _leased(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """The buckets back to back (page-aligned) in one contiguous lease of the pool."""
        assert self.pool is not None
        if not sizes:
            return []
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end = -(-(end + size) // STAGING_ALIGN) * STAGING_ALIGN
        self._lease = self.pool.lease("engine.sync_staging", end, contiguous=True)
        try:
            flat = self._lease.flat
        except BaseException:
            self.release()
            raise
        return [flat[o : o + size] for o, size in zip(offsets, sizes, strict=True)]

    def done(self) -> None:
        """The update that used the area ended (committed or not): free it unless it is kept
        (a pool's lease always goes back: the next host copy needs its pages)."""
        if not self.keep or self._lease is not None:
            self.release()

    def release(self) -> None:
        self._staging, self._layout = None, None
        if self._lease is not None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # no copy may still be landing in pages the pool lends on
            self._lease.release()
            self._lease = None

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies inside the area (the model must never alias it)."""
        if self._staging is None or self._staging.buckets is None or tensor.device.type != "cpu":
            return False
        ptr = tensor.data_ptr()
        return any(f.data_ptr() <= ptr < f.data_ptr() + f.numel() for f in self._staging.buckets)

    def disown_if_aliased(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Hand the area to the engine if any of ``tensors`` (the model's) lives in it; True then.

        An engine whose loader keeps a staged tensor as its parameter (``param.data = t``)
        would otherwise see the next update land in what it serves before that update commits.
        """
        if self._staging is None or not any(self.owns(t) for t in tensors):
            return False
        if self._lease is not None:  # pages of the shared arena: the next host copy would overwrite them
            raise ConfigError(
                "the engine's model keeps a staged tensor as its own, but the staging area is a lease of the "
                "shared arena; stage this engine's full updates in its own memory (HostStaging.use_pool(None))"
            )
        self.release()  # the model keeps its memory alive; the next update gets a fresh area
        return True

    @property
    def nbytes(self) -> int:
        if self._staging is None or self._staging.buckets is None:
            return 0
        return sum(f.numel() for f in self._staging.buckets)


class FullFootprint(msgspec.Struct, frozen=True):
    """Where a full update's bytes sat in the engine at ``prepare`` (what ``HostStaging`` bounds).

    ``outside_bytes``: bytes of the update's staged or prepared tensors held anywhere but the
    host staging area (a staged copy on the device, a prepared copy, a cast); 0 when the
    update goes straight from the area into the weights. ``device_bytes``: the part of those
    on a device.
    """

    update_id: int
    payload_bytes: int
    host_staging_bytes: int
    outside_bytes: int
    device_bytes: int


def full_footprint(manifest: UpdateManifest, area: HostStaging, tensors: Iterable[torch.Tensor]) -> FullFootprint:
    """Account ``tensors`` (what ``prepare`` received and built) against ``area``, by storage."""
    outside: dict[tuple[str, int], int] = {}
    for t in tensors:
        if area.owns(t) or not t.numel():
            continue
        storage = t.untyped_storage()
        outside[(str(t.device), storage.data_ptr())] = storage.nbytes()
    device = sum(n for (where, _), n in outside.items() if where != "cpu")
    return FullFootprint(manifest.update_id, manifest.total_bytes, area.nbytes, sum(outside.values()), device)


def return_cached(device: torch.device) -> None:
    """Give the allocator's cached, unused device blocks back to the driver after an install.

    What a full update staged or cast on the device stays reserved by PyTorch's caching
    allocator after it is freed, invisible to a colocated trainer: after a commit that memory
    is held by nobody, so it goes back.
    """
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


__all__ = ["STAGING_ALIGN", "FullFootprint", "HostLeaser", "HostStaging", "full_footprint", "return_cached"]
