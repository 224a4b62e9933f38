"""CPU staging through one POSIX shared-memory segment per sender/receiver pair.

Works in any container where two processes share ``/dev/shm``; no CUDA IPC needed. The
segment is created once (mode 0600, name ``colosync-`` plus 128 random bits), reused for every
update, and its name is unlinked as soon as the receivers have acknowledged mapping it, so nothing can leak
past the two processes that use it. If the creator dies before that, Python's resource
tracker unlinks it. When CUDA is present each side registers its mapping as pinned memory
(``cudaHostRegister``), so device<->host copies run at DMA speed instead of through a pageable
bounce buffer.

For buckets on a GPU the segment is cut into more, smaller slots (``CHUNK_BYTES`` each, the
same total of ``slots`` buckets): the sender's device->host copy of one chunk then overlaps
the engine's host->device copy of the previous one, which PCIe (full duplex) runs at once.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import logging
import mmap
import os
import secrets
from multiprocessing import resource_tracker

import msgspec
import torch

from colosync.errors import TransportError
from colosync.transports.base import ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)

PREFIX = "colosync-"
CHUNK_BYTES = int(float(os.environ.get("COLOSYNC_SHM_CHUNK_MB", "16")) * (1 << 20)) // 8192 * 8192
"""Slot size for buckets on a GPU (``COLOSYNC_SHM_CHUNK_MB`` overrides; a multiple of 8 KiB)."""


class ShmHandle(msgspec.Struct, frozen=True):
    name: str
    slot_bytes: int
    slots: int


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


class _Mapping:
    """A mapped segment, optionally registered with CUDA as pinned host memory."""

    def __init__(self, name: str, size: int, create: bool, pin: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        except OSError as exc:
            raise TransportError(
                f"cannot {'create' if create else 'open'} shared memory /dev/shm/{name}: {exc}; "
                "check that /dev/shm is mounted and large enough (docker: --shm-size)"
            ) from exc
        try:
            if create:
                os.ftruncate(fd, size)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
        except OSError as exc:
            if create:
                _unlink(name)
            raise TransportError(f"cannot map {size} bytes of /dev/shm/{name}: {exc}") from exc
        finally:
            os.close(fd)
        tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.tensor: torch.Tensor | None = tensor
        self._pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 0)
            self._pinned = int(err) == 0
            if not self._pinned:
                log.warning("cudaHostRegister of /dev/shm/%s failed (%s); copies will be pageable", name, err)

    @property
    def pinned(self) -> bool:
        return self._pinned

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        if self.tensor is None:
            raise TransportError("the shared memory segment is closed")
        return self.tensor[start : start + nbytes]

    def close(self) -> None:
        if self._mmap is None:
            return
        if self._pinned and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.tensor = None  # drop our export of the mmap buffer before closing it
        try:
            self._mmap.close()
        except BufferError:
            log.debug("a view of the shared memory is still alive; it unmaps when collected")
        self._mmap = None


def _want_pin(device: torch.device) -> bool:
    return device.type == "cuda" or torch.cuda.is_available()


class ShmSender(SenderTransport):
    name = "shm"

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        if not os.path.isdir("/dev/shm"):
            return False, "/dev/shm is not mounted"
        pinned = "pinned" if _want_pin(device) else "pageable (no CUDA)"
        return True, f"POSIX shared memory, {pinned}"

    @classmethod
    def create(cls, slot_bytes: int, slots: int, device: torch.device) -> ShmSender:
        return cls(slot_bytes, slots, device)

    @classmethod
    def geometry(cls, bucket_bytes: int, slots: int, device: torch.device) -> tuple[int, int]:
        total = bucket_bytes * slots
        if device.type != "cuda" or CHUNK_BYTES <= 0 or bucket_bytes <= CHUNK_BYTES:
            return bucket_bytes, slots
        return CHUNK_BYTES, max(2, total // CHUNK_BYTES)

    def __init__(self, slot_bytes: int, slots: int, device: torch.device) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise TransportError(f"shm needs slot_bytes > 0 and slots > 0, got {slot_bytes}, {slots}")
        self._slot_bytes, self._slots = slot_bytes, slots
        self._name = PREFIX + secrets.token_hex(16)
        self._linked = True
        resource_tracker.register("/" + self._name, "shared_memory")
        try:
            self._map = _Mapping(self._name, slot_bytes * slots, create=True, pin=_want_pin(device))
        except BaseException:
            self._drop_name()
            raise
        log.debug("shm: created /dev/shm/%s, %d x %d bytes, pinned=%s", self._name, slots, slot_bytes, self._map.pinned)

    @property
    def pinned(self) -> bool:
        return self._map.pinned

    def handle(self) -> bytes:
        return msgspec.msgpack.encode(ShmHandle(self._name, self._slot_bytes, self._slots))

    def slot(self, index: int) -> torch.Tensor:
        start = index * self._slot_bytes
        return self._map.view(start, self._slot_bytes)

    def attached(self) -> None:
        self._drop_name()

    def _drop_name(self) -> None:
        if self._linked:
            _unlink(self._name)
            resource_tracker.unregister("/" + self._name, "shared_memory")
            self._linked = False

    def close(self) -> None:
        self._drop_name()
        self._map.close()


class ShmReceiver(ReceiverTransport):
    name = "shm"

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> ShmReceiver:
        return cls(msgspec.msgpack.decode(handle, type=ShmHandle), device)

    def __init__(self, handle: ShmHandle, device: torch.device) -> None:
        if not handle.name.startswith(PREFIX):
            raise TransportError(f"refusing to map {handle.name!r}: not a colosync segment")
        self._handle = handle
        self._map = _Mapping(handle.name, handle.slot_bytes * handle.slots, create=False, pin=device.type == "cuda")
        # The sender unlinks the name once every receiver (e.g. each vLLM TP worker) has acknowledged.

    def slot(self, index: int) -> torch.Tensor:
        start = index * self._handle.slot_bytes
        return self._map.view(start, self._handle.slot_bytes)

    @property
    def num_slots(self) -> int:
        return self._handle.slots

    @property
    def pinned(self) -> bool:
        return self._map.pinned

    def close(self) -> None:
        self._map.close()
