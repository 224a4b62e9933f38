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
16 MiB measured fastest on seed-lora (2 to 64 MiB swept on one H100): smaller chunks cost more in
per-chunk work (the trainer's CPU alone spends ~90 us on each) than their shorter last copy in saves;
larger ones wait longer for it, since nothing overlaps it (``benchmarks/seed-lora``).

Seals: behind each chunk's device->host copy the sender's stream writes the bucket's
fingerprint and a number, the seal, into a pair of words after the slots, and the Stage
goes out at once, naming the seal. The receiver's host polls for it (``ready``) and only
then queues its copy in. Without seals the sender's host waited for each copy before its
Stage could leave and cross the socket; now nothing on the sender's host waits for the
device, as with ``cuda_ipc``'s events (on seed-lora this alone measured even, the copies
set the pace: ``benchmarks/seed-lora``). Seal numbers only grow, so a late write of an
aborted update can never pass for the one awaited. A sender that dies before its seal lands
is seen at once: it holds an exclusive ``flock`` on the segment for its life, which the
kernel drops with its last descriptor, and a waiting receiver tries the lock every
``PROBE_S``. A process forked from the sender closes its copy of the descriptor at once
(``os.register_at_fork``); one that hangs instead gets ``WAIT_TIMEOUT_S``.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import time
import weakref
from multiprocessing import resource_tracker

import msgspec
import torch

from colosync.errors import ManifestError, TransportError
from colosync.transports.base import Peers, ReceiverTransport, SenderTransport
from colosync.wire.protocol import Stage

log = logging.getLogger(__name__)

PREFIX = "colosync-"
CHUNK_BYTES = int(float(os.environ.get("COLOSYNC_SHM_CHUNK_MB", "16")) * (1 << 20)) // 8192 * 8192
"""Slot size for buckets on a GPU (``COLOSYNC_SHM_CHUNK_MB`` overrides; a multiple of 8 KiB)."""
SEAL_NUMBERS = 4096  # seals the sender copies from one table on the device
SPIN_S = 0.05  # ``ready``: how long the receiver polls a seal without sleeping
POLL_S = 0.0005  # ``ready``, past SPIN_S: the sleep between two polls
PROBE_S = 0.002  # ``ready``, past SPIN_S: how often it checks that the sender still lives
WAIT_TIMEOUT_S = 30.0  # ``ready``: how long a sender's copy may take before the Stage is refused


class ShmHandle(msgspec.Struct, frozen=True):
    name: str
    slot_bytes: int
    slots: int

    @property
    def seals_offset(self) -> int:
        """Where the ``[fingerprint, seal]`` int64 pairs, one per slot, start (64-byte aligned)."""
        return -(-self.slot_bytes * self.slots // 64) * 64

    @property
    def nbytes(self) -> int:
        return self.seals_offset + 16 * self.slots


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


class Segment:
    """A mapped segment, optionally registered with CUDA as pinned host memory.

    Its descriptor stays open: the creator holds an exclusive ``flock`` on it for its life, and
    an opener tries the lock to learn whether the creator still lives (``creator_alive``)."""

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
            elif (found := os.fstat(fd).st_size) < size:
                raise TransportError(
                    f"/dev/shm/{name} is {found} bytes, the handle says {size}: the trainer and the engine run "
                    "different colosync versions; upgrade both"
                )
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
            if create:  # the lock goes on a description of its own: mmap keeps a duplicate of ``fd``, which
                # a forked child would hold on to; the child closes this one (``_forget_locks_in_child``)
                lock = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
                os.close(fd)
                fd = lock
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new name: nobody else holds it
        except (OSError, TransportError) as exc:
            os.close(fd)
            if create:
                _unlink(name)
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"cannot map {size} bytes of /dev/shm/{name}: {exc}") from exc
        self._close_fd = weakref.finalize(self, os.close, fd)  # also for a mapping dropped without close()
        self._fd = fd
        if create:
            _CREATED.add(self)
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

    def creator_alive(self) -> bool:
        """Whether the segment's creator still holds its lock (it is dropped when the creator dies)."""
        if not self._close_fd.alive:
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # closed
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def pairs(self, handle: ShmHandle) -> torch.Tensor:
        """The ``[fingerprint, seal]`` int64 pair of each slot, after the slots."""
        return self.view(handle.seals_offset, 16 * handle.slots).view(torch.int64).view(handle.slots, 2)

    def words(self, start: int, count: int) -> memoryview:
        """``count`` int64 words from byte ``start``; release the view before ``close``."""
        if self._mmap is None:
            raise TransportError("the shared memory segment is closed")
        return memoryview(self._mmap)[start : start + 8 * count].cast("q")

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        if self.tensor is None:
            raise TransportError("the shared memory segment is closed")
        return self.tensor[start : start + nbytes]

    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """Like ``view``, but the tensor's storage is exactly these bytes (not the whole segment)."""
        if self._mmap is None:
            raise TransportError("the shared memory segment is closed")
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes, offset=start)

    def close(self) -> None:
        if self._mmap is None:
            return
        self._close_fd()  # drops the creator's lock
        if self._pinned and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.tensor = None  # drop our export of the mmap buffer before closing it
        try:
            self._mmap.close()
        except BufferError:
            log.debug("a view of the shared memory is still alive; it unmaps when collected")
        self._mmap = None


_CREATED: weakref.WeakSet[Segment] = weakref.WeakSet()  # this process's own segments, whose lock it holds


def _forget_locks_in_child() -> None:
    """A child forked from a sender closes its copy of each segment's descriptor: the lock then dies with the sender."""
    for mapping in list(_CREATED):
        mapping._close_fd()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def _want_pin(device: torch.device) -> bool:
    return device.type == "cuda" or torch.cuda.is_available()


class SealNumbers:
    """Seal numbers in device memory to copy from, ``SEAL_NUMBERS`` at a time (one kernel refills them)."""

    def __init__(self, device: torch.device) -> None:
        self._table = torch.empty(SEAL_NUMBERS, dtype=torch.int64, device=device)
        self._first = -SEAL_NUMBERS  # the number in the table's first row

    def row(self, number: int) -> torch.Tensor:
        """A one-element view holding ``number`` (seals only grow), for a copy on the current stream."""
        at = number - self._first
        if not 0 <= at < SEAL_NUMBERS:  # in place, on this stream: after the copies from the rows before
            torch.arange(number, number + SEAL_NUMBERS, out=self._table)
            self._first, at = number, 0
        return self._table[at : at + 1]


class ShmSender(SenderTransport):
    name = "shm"

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        if not os.path.isdir("/dev/shm"):
            return False, "/dev/shm is not mounted"
        pinned = "pinned" if _want_pin(device) else "pageable (no CUDA)"
        return True, f"POSIX shared memory, {pinned}"

    @classmethod
    def create(cls, slot_bytes: int, slots: int, device: torch.device, peers: Peers | None = None) -> ShmSender:
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
        self._device = device
        self._name = PREFIX + secrets.token_hex(16)
        self._handle = ShmHandle(self._name, slot_bytes, slots)
        self._linked = True
        resource_tracker.register("/" + self._name, "shared_memory")
        try:
            self._map = Segment(self._name, self._handle.nbytes, create=True, pin=_want_pin(device))
        except BaseException:
            self._drop_name()
            raise
        self._seals = self._map.pairs(self._handle)
        self._sealed = 0  # the last seal handed out; they only grow
        self._numbers: dict[torch.device, SealNumbers] = {}
        log.debug("shm: created /dev/shm/%s, %d x %d bytes, pinned=%s", self._name, slots, slot_bytes, self._map.pinned)

    @property
    def pinned(self) -> bool:
        return self._map.pinned

    def handle(self) -> bytes:
        return msgspec.msgpack.encode(self._handle)

    def slot(self, index: int) -> torch.Tensor:
        start = index * self._slot_bytes
        return self._map.view(start, self._slot_bytes)

    def written(self, index: int, device: torch.device, fingerprint: torch.Tensor | None = None) -> int:
        if device.type != "cuda":
            return 0  # written by the host: done before the Stage is sent
        # Copies only, in the direction of the chunk's: a kernel here would wait for the GPU to come back
        # from the engine's context (~0.25 ms a chunk without MPS, measured), a host-to-device copy for the
        # engine's 16 MiB copies in on the same copy engine. So the seals come from a table of numbers on
        # the device, refilled (one kernel, on this stream) once every SEAL_NUMBERS seals.
        self._sealed += 1
        numbers = self._numbers.get(device)
        if numbers is None:
            numbers = self._numbers[device] = SealNumbers(device)
        seal = self._seals[index]
        if fingerprint is not None:  # first, so the seal, copied after it on this stream, vouches for it
            seal[:1].copy_(fingerprint[:1], non_blocking=True)
        seal[1:].copy_(numbers.row(self._sealed), non_blocking=True)
        return self._sealed

    def attached(self) -> None:
        self._drop_name()

    def _drop_name(self) -> None:
        if self._linked:
            _unlink(self._name)
            resource_tracker.unregister("/" + self._name, "shared_memory")
            self._linked = False

    def close(self) -> None:
        self._drop_name()
        self._seals = self._seals[:0]  # no view left: the segment unmaps now
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
        self._map = Segment(handle.name, handle.nbytes, create=False, pin=device.type == "cuda")
        # The sender unlinks the name once every receiver (e.g. each vLLM TP worker) has acknowledged.
        self._seals = self._map.pairs(handle)
        self._words: memoryview | None = self._map.words(handle.seals_offset, 2 * handle.slots)  # a poll: ~50 ns

    def _exists(self, index: int) -> None:
        if not 0 <= index < self._handle.slots:  # past the slots lie the seals
            raise ManifestError(f"shm slot {index} does not exist: the segment has {self._handle.slots}")

    def slot(self, index: int) -> torch.Tensor:
        self._exists(index)
        start = index * self._handle.slot_bytes
        return self._map.view(start, self._handle.slot_bytes)

    @property
    def num_slots(self) -> int:
        return self._handle.slots

    @property
    def pinned(self) -> bool:
        return self._map.pinned

    def ready(self, stage: Stage) -> None:
        if not stage.seal:
            return
        words = self._words
        if words is None:
            raise TransportError("the shared memory segment is closed")
        self._exists(stage.slot)
        word, seal = 2 * stage.slot + 1, stage.seal
        start = time.monotonic()
        probe = start + SPIN_S
        while words[word] != seal:
            now = time.monotonic()
            if now - start < SPIN_S:
                time.sleep(0)  # yield the GIL: the socket thread reads on
                continue
            time.sleep(POLL_S)
            if now < probe:
                continue
            probe = now + PROBE_S
            if words[word] == seal:
                return
            if not self._map.creator_alive():
                raise TransportError(
                    f"the sender died before its copy into shm slot {stage.slot} (update {stage.update_id}, "
                    f"bucket {stage.bucket}) finished; the update is abandoned"
                )
            if now - start > WAIT_TIMEOUT_S:
                raise TransportError(
                    f"the sender's copy into shm slot {stage.slot} did not finish within {WAIT_TIMEOUT_S:.0f} s; "
                    "the sender hung mid-update (its GPU work never completed)"
                )

    def sent_fingerprint(self, stage: Stage) -> torch.Tensor | None:
        if not stage.seal:
            return None
        return self._seals[stage.slot].clone()  # [fingerprint, seal] in host memory: the seal matched in ``ready``

    def close(self) -> None:
        if self._words is not None:
            self._words.release()
            self._words = None
        self._seals = self._seals[:0]  # no view left: the segment unmaps now
        self._map.close()
