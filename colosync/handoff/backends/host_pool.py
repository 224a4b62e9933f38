"""A pool of large host buffers that offloaded state is copied into and out of, reused.

Two facts shape it. Allocating pinned host memory is slow (0.87 s per fresh GiB with
``cudaHostAlloc`` on an H200 host) while copies through pinned memory run at the PCIe rate
(55 GB/s), so the buffers are allocated once and reused for every sleep/wake. And in
``peak_device="gpu"`` mode the engine's weight mirror and the trainer's backup never exist at
the same time, so one pool sized for the larger of the two can serve both: the mirror
literally takes the place the trainer's backup just vacated, and the host never holds more
than one large copy (plus one chunk of rounding).

Memory is handed out as ``HostLease``s of whole chunks. A lease behaves like one flat byte
range; ``write``/``read`` split a copy at chunk boundaries, so a copy of many tensors laid out
back to back becomes a few chunk-sized DMA transfers. By default
(``chunk_bytes="auto"``) the chunk size follows the job: the first ``reserve`` or lease picks
``chunk_bytes_for`` its size (1/32 of it, between 2 MiB and 1 GiB), so rounding never costs
more than ~3% of the copy, whether the copy is a 40 GB optimizer state or a 50 MB test model.

Pinning modes: ``register`` (default with CUDA) allocates ordinary memory, touches it with a
parallel fill and page-locks it with ``cudaHostRegister`` (much faster than
``cudaHostAlloc``, and the pages show up as the process's anonymous memory, which is what a
cgroup charges); ``alloc`` uses torch's pinned allocator; ``none`` (default without CUDA)
uses ordinary memory.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch

from colosync.errors import ConfigError, HostPoolExhausted, StashError

log = logging.getLogger(__name__)

PinMode = Literal["auto", "register", "alloc", "none"]
GiB = 1 << 30
MIN_AUTO_CHUNK = 2 << 20


def chunk_bytes_for(copy_bytes: int) -> int:
    """The chunk size for copies of about ``copy_bytes``: 1/32 of it (at most ~3% rounding per
    lease), page-aligned, between 2 MiB and 1 GiB (fewer, larger DMA transfers for big copies)."""
    return max(MIN_AUTO_CHUNK, min(GiB, copy_bytes // 32)) // 4096 * 4096


class HostLease:
    """A flat byte range of ``nbytes`` made of the pool's chunks, held by one owner."""

    def __init__(self, pool: HostPool, owner: str, nbytes: int, chunks: list[torch.Tensor]) -> None:
        self.pool = pool
        self.owner = owner
        self.nbytes = nbytes
        self.chunks = chunks
        self.chunk_bytes = pool.chunk_bytes
        self.released = False

    @property
    def capacity(self) -> int:
        return len(self.chunks) * self.chunk_bytes

    def pieces(self, offset: int, length: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """``(chunk slice, start, end)`` covering bytes ``[offset, offset+length)`` of the lease;
        ``start``/``end`` are relative to ``offset``."""
        if self.released:
            raise StashError(f"host lease of {self.owner!r} was already released")
        if offset < 0 or offset + length > self.capacity:
            raise StashError(
                f"range [{offset}, {offset + length}) is outside {self.owner!r}'s lease of {self.capacity} bytes"
            )
        done = 0
        while done < length:
            pos = offset + done
            index, within = divmod(pos, self.chunk_bytes)
            take = min(length - done, self.chunk_bytes - within)
            yield self.chunks[index][within : within + take], done, done + take
            done += take

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Copy the 1-D ``uint8`` tensor ``src`` (any device) to ``[offset, offset+len)``."""
        for piece, a, b in self.pieces(offset, src.numel()):
            piece.copy_(src[a:b], non_blocking=True)

    def read(self, offset: int, dst: torch.Tensor) -> None:
        """Copy ``[offset, offset+len)`` into the 1-D ``uint8`` tensor ``dst`` (any device)."""
        for piece, a, b in self.pieces(offset, dst.numel()):
            dst[a:b].copy_(piece, non_blocking=True)

    def release(self) -> None:
        """Give the chunks back to the pool (they stay allocated for the next lease)."""
        if not self.released:
            self.pool._give_back(self)
            self.released = True


class HostPool:
    """Reusable host chunks shared by the participants of one process.

    ``max_bytes`` caps the pool: a lease that would grow it beyond raises
    ``HostPoolExhausted`` instead of letting the host run out. ``trim()`` frees unleased chunks.
    """

    def __init__(
        self,
        *,
        chunk_bytes: int | Literal["auto"] = "auto",
        pin: PinMode = "auto",
        max_bytes: int | None = None,
        name: str = "colosync-host-pool",
    ) -> None:
        if chunk_bytes != "auto" and (not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % 4096):
            raise ConfigError(
                f"chunk_bytes must be 'auto' or a positive multiple of 4096 (a page), got {chunk_bytes!r}; "
                f"e.g. HostPool(chunk_bytes=1 << 30)"
            )
        self._auto = pin == "auto"
        if pin == "auto":
            pin = "register" if torch.cuda.is_available() else "none"
        if pin in ("register", "alloc") and not torch.cuda.is_available():
            raise StashError(f"pin={pin!r} needs CUDA; use pin='none' on a machine without a GPU")
        self._chunk_bytes = None if chunk_bytes == "auto" else chunk_bytes
        self.pin: str = pin
        self.max_bytes = max_bytes
        self.name = name
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._finalizers: dict[int, weakref.finalize] = {}
        self._leases: dict[int, HostLease] = {}
        self._lock = threading.Lock()
        self.alloc_seconds = 0.0

    @property
    def chunk_bytes(self) -> int:
        """The pool's chunk size (1 GiB until an ``"auto"`` pool's first reserve or lease sizes it)."""
        return GiB if self._chunk_bytes is None else self._chunk_bytes

    def _size_chunks(self, nbytes: int) -> None:
        if self._chunk_bytes is None:
            self._chunk_bytes = chunk_bytes_for(nbytes)
            log.debug("host pool %s: %d-byte chunks for a first copy of %d bytes", self.name, self._chunk_bytes, nbytes)

    # -- accounting -------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return len(self._all) * self.chunk_bytes

    @property
    def leased_bytes(self) -> int:
        return sum(lease.capacity for lease in self._leases.values())

    def leases(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lease in self._leases.values():
            out[lease.owner] = out.get(lease.owner, 0) + lease.nbytes
        return out

    @property
    def pinned(self) -> bool:
        return self.pin in ("register", "alloc")

    # -- allocation -------------------------------------------------------------------------
    def chunks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk_bytes)

    def reserve(self, nbytes: int) -> float:
        """Grow the pool to at least ``nbytes`` now (the slow part), so leases are fast later.
        Returns the seconds it took."""
        started = time.perf_counter()
        with self._lock:
            self._size_chunks(nbytes)
            while self.capacity_bytes < nbytes:
                self._grow_one()
        return time.perf_counter() - started

    def lease(self, owner: str, nbytes: int) -> HostLease:
        """``nbytes`` of host memory for ``owner``, from free chunks first, growing the pool if needed."""
        with self._lock:
            self._size_chunks(nbytes)
            need = self.chunks_for(nbytes)
            if len(self._free) < need:
                grow = need - len(self._free)
                if self.max_bytes is not None and self.capacity_bytes + grow * self.chunk_bytes > self.max_bytes:
                    raise HostPoolExhausted(
                        f"{owner!r} needs {nbytes / 1e9:.2f} GB of host memory but pool {self.name!r} has "
                        f"{len(self._free) * self.chunk_bytes / 1e9:.2f} GB free of {self.capacity_bytes / 1e9:.2f} GB "
                        f"and may not grow past max_bytes={self.max_bytes / 1e9:.2f} GB (leased: {self.leases()}); "
                        f"raise max_bytes, or use peak_device='gpu' so the host copies do not coexist"
                    )
                log.info(
                    "host pool %s grows by %d chunk(s) for %s (reserve it up front to keep this off the critical path)",
                    self.name,
                    grow,
                    owner,
                )
                for _ in range(grow):
                    self._grow_one()
            chunks = [self._free.pop() for _ in range(need)]
            lease = HostLease(self, owner, nbytes, chunks)
            self._leases[id(lease)] = lease
            return lease

    def _give_back(self, lease: HostLease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)
            self._free.extend(reversed(lease.chunks))

    def trim(self) -> int:
        """Free every unleased chunk; returns the bytes given back to the OS."""
        with self._lock:
            freed = 0
            while self._free:
                chunk = self._free.pop()
                self._all = [c for c in self._all if c is not chunk]
                self._release_chunk(chunk)
                freed += self.chunk_bytes
        if freed and self.pin == "alloc":
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
        return freed

    def close(self) -> None:
        if self._leases:
            raise StashError(f"pool {self.name!r} still has leases {self.leases()}; release them before close()")
        self.trim()

    def _grow_one(self) -> None:
        started = time.perf_counter()
        n = self.chunk_bytes
        if self.pin == "alloc":
            chunk = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        else:
            chunk = torch.empty(n, dtype=torch.uint8)
            chunk.fill_(0)  # fault the pages in now (in parallel), not during the first copy
            if self.pin == "register":
                try:
                    _check_cuda(torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), n, 0), "cudaHostRegister")
                    # If the chunk is collected without trim() (an exception mid-run), unregister it
                    # before its memory is freed, or a later registration of the same pages fails.
                    self._finalizers[id(chunk)] = weakref.finalize(chunk, _unregister, chunk.data_ptr())
                except (StashError, AttributeError, RuntimeError) as exc:
                    if not self._auto:
                        raise
                    log.warning(
                        "cudaHostRegister failed (%s); pool %s falls back to torch's pinned allocator", exc, self.name
                    )
                    self.pin = "alloc"
                    chunk = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self._all.append(chunk)
        self._free.append(chunk)
        self.alloc_seconds += time.perf_counter() - started

    def _release_chunk(self, chunk: torch.Tensor) -> None:
        finalizer = self._finalizers.pop(id(chunk), None)
        if finalizer is not None:
            finalizer()  # unregisters, once

    def __repr__(self) -> str:
        return (
            f"HostPool({self.name!r}, capacity={self.capacity_bytes / 1e9:.2f} GB, "
            f"leased={self.leased_bytes / 1e9:.2f} GB, pin={self.pin})"
        )


def _unregister(ptr: int) -> None:
    _check_cuda(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


def _check_cuda(result: object, what: str) -> None:
    raw: Any = getattr(result, "value", result)  # torch.cuda.cudart() returns an error enum or a plain int
    try:
        code = int(raw)
    except (TypeError, ValueError):
        return
    if code != 0:
        raise StashError(f"{what} failed with CUDA error {code} ({result}); use HostPool(pin='alloc') or pin='none'")
