"""One host arena per node, shared by the trainer's and the engine's processes.

Frameworks run the trainer and the engine in separate processes, so a ``HostPool`` per
process cannot make the engine's mirror reuse the pages the trainer's backup just vacated:
each pool keeps its own chunks, and the host ends up holding both copies' memory even when
the plan never holds both copies. The arena is one POSIX shared-memory segment that every
participating process maps. Its chunks are leased through a table in the segment's first
page(s), under an ``flock`` on the segment (kept open by every process after the name is
gone), so a lease in one process sees the chunks another released: in ``peak_device="gpu"``
the mirror takes exactly the trainer backup's chunks, and because the arena is sized from
the plan (the larger copy in ``gpu`` mode, both in ``cpu`` mode) a plan that would hold two
copies runs out of arena instead of out of host memory. "One host copy at a time" then holds
by construction, not only as measured.

Each process registers its mapping with CUDA (``cudaHostRegister``) once, when it maps the
arena, so copies run at the pinned rate for the whole job without pinning per cycle (vLLM's
own sleep mode allocates and pins fresh host buffers at every sleep).

Nothing leaks from ``/dev/shm``: the creator unlinks the name as soon as every process has
mapped it (``seal``); before that, whichever process closes the arena first unlinks it (so
a kill of either side leaves the name to the survivor's ``close``), and the creator's
resource tracker unlinks it if every process is gone. The memory itself goes with the last
mapping.
A chunk leased by a process that has died is reclaimed by the next lease that needs it.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import struct
from collections.abc import Iterator, Mapping
from multiprocessing import resource_tracker

import torch

from colosync.errors import ConfigError, HostPoolExhausted, StashError
from colosync.handoff.backends.host_pool import GiB, HostLease, HostPool, PinMode, chunk_bytes_for
from colosync.handoff.model.ops import Region
from colosync.handoff.model.plans import Plan
from colosync.handoff.model.simulator import arena_bytes
from colosync.wire.protocol import ArenaHandle

log = logging.getLogger(__name__)

PREFIX = "colosync-arena-"
_MAGIC = b"CSARENA1"
_HEAD = struct.Struct("<8sQQ")  # magic, chunks, chunk_bytes
_RECORD = struct.Struct("<i28s")  # owner pid (0: free), owner name
PAGE = 4096


def _header_bytes(chunks: int) -> int:
    raw = _HEAD.size + chunks * _RECORD.size
    return -(-raw // PAGE) * PAGE


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostArena:
    """A shared-memory segment of ``chunks`` x ``chunk_bytes``, mapped in this process.

    >>> arena = HostArena.for_plan(plan, sizes, chunk_bytes=1 << 30)  # in the controller
    >>> engine.setup(arena)            # the engine process maps it (RemoteEngineMemory)
    >>> arena.seal()                   # every process has it mapped: the name goes
    >>> trainer = TorchTrainerMemory(loader=..., pool=arena.pool())

    ``HostArena.attach(handle)`` maps an existing arena (what a remote participant does).
    """

    def __init__(self, name: str, nbytes: int, chunk_bytes: int, *, create: bool, pin: PinMode = "auto") -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ConfigError(f"chunk_bytes must be a positive multiple of {PAGE}, got {chunk_bytes}")
        if nbytes < chunk_bytes:
            raise ConfigError(
                f"an arena of {nbytes} bytes holds no {chunk_bytes}-byte chunk; size it with HostArena.for_plan"
            )
        if not name.startswith(PREFIX):
            raise StashError(f"refusing to map {name!r}: not a colosync arena (names start with {PREFIX!r})")
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.chunks = nbytes // chunk_bytes
        self.header_bytes = _header_bytes(self.chunks)
        self.nbytes = self.chunks * chunk_bytes
        self.creator = create
        self._linked = create
        size = self.header_bytes + self.nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if create:
            resource_tracker.register("/" + name, "shared_memory")  # unlinked if this process is killed
        try:
            self._fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        except OSError as exc:
            self._drop_name()
            raise StashError(
                f"cannot {'create' if create else 'open'} the host arena /dev/shm/{name}: {exc}; check that "
                "/dev/shm is mounted and large enough (docker: --shm-size), and that the creator is alive"
            ) from exc
        try:
            if create:
                os.ftruncate(self._fd, size)
            elif os.fstat(self._fd).st_size != size:
                raise StashError(f"/dev/shm/{name} is {os.fstat(self._fd).st_size} bytes, the handle says {size}")
            self._mmap: mmap.mmap | None = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            self._drop_name()
            raise
        self._tensor: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        if create:
            self._tensor.fill_(0)  # fault every page in now (shmem from the start), and a clean table
            _HEAD.pack_into(self._mmap, 0, _MAGIC, self.chunks, chunk_bytes)
        else:
            magic, chunks, cb = _HEAD.unpack_from(self._mmap, 0)
            if magic != _MAGIC or chunks != self.chunks or cb != chunk_bytes:
                self.close()
                raise StashError(f"/dev/shm/{name} is not the arena its handle describes")
        self.pinned = False
        if pin == "auto":
            pin = "register" if torch.cuda.is_available() else "none"
        if pin not in ("register", "none"):
            raise ConfigError(f"an arena pins with pin='register' or not at all (pin='none'), got {pin!r}")
        if pin == "register":
            err = torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), size, 0)
            self.pinned = int(getattr(err, "value", err)) == 0
            if not self.pinned:
                log.warning("cudaHostRegister of arena /dev/shm/%s failed (%s); copies will be pageable", name, err)
        if not create and not self.pinned:
            # Map every page here too (pinning does it; the creator's fill did it there), so this
            # process's RssShmem holds the whole arena, which is what the host sampler subtracts.
            self._tensor[::PAGE].sum()
        self._pool: ArenaPool | None = None
        log.info(
            "host arena %s: %s %d x %.3f GB, pinned=%s",
            name,
            "created" if create else "mapped",
            self.chunks,
            chunk_bytes / 1e9,
            self.pinned,
        )

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def create(cls, nbytes: int, *, chunk_bytes: int = GiB, pin: PinMode = "auto") -> HostArena:
        """A new arena of at least ``nbytes`` (rounded up to whole chunks)."""
        chunks = max(1, -(-nbytes // chunk_bytes))
        return cls(PREFIX + secrets.token_hex(12), chunks * chunk_bytes, chunk_bytes, create=True, pin=pin)

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        sizes: Mapping[Region, int],
        *,
        chunk_bytes: int | None = None,
        pin: PinMode = "auto",
        slack_bytes: int = 4 << 20,
    ) -> HostArena:
        """An arena just large enough for the host copies ``plan`` ever holds at once with
        these region ``sizes`` (``gpu`` mode: the larger copy; ``cpu`` mode: both), each copy
        rounded up to whole chunks after ``slack_bytes`` for its tensors' alignment. Chunks
        default to ``chunk_bytes_for`` the largest region (at most ~3% rounding per copy)."""
        if chunk_bytes is None:
            chunk_bytes = chunk_bytes_for(max(sizes.values(), default=0))
        need = arena_bytes(plan, sizes, chunk_bytes=chunk_bytes, slack_bytes=slack_bytes)
        if need == 0:
            raise ConfigError("this plan holds no host copy with these sizes: it needs no arena")
        return cls.create(need, chunk_bytes=chunk_bytes, pin=pin)

    @classmethod
    def attach(cls, handle: ArenaHandle, *, pin: PinMode = "auto") -> HostArena:
        """Map the arena another process created."""
        arena = cls(handle.name, handle.nbytes, handle.chunk_bytes, create=False, pin=pin)
        if arena.header_bytes != handle.header_bytes:
            arena.close()
            raise StashError(
                f"arena {handle.name}: header of {arena.header_bytes} bytes, handle says {handle.header_bytes}"
            )
        return arena

    @property
    def mapped_bytes(self) -> int:
        """What a process mapping the arena maps: its chunks and its table."""
        return self.header_bytes + self.nbytes

    def handle(self) -> ArenaHandle:
        return ArenaHandle(self.name, self.nbytes, self.chunk_bytes, self.header_bytes)

    def seal(self) -> None:
        """Every process that uses the arena has mapped it: drop its name (nothing left to leak)."""
        self._drop_name()

    def _drop_name(self) -> None:
        if self._linked:
            _unlink(self.name)
            resource_tracker.unregister("/" + self.name, "shared_memory")
            self._linked = False

    # -- the chunk table --------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[mmap.mmap]:
        if self._mmap is None:
            raise StashError(f"host arena {self.name} is closed")
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield self._mmap
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _record(self, mm: mmap.mmap, index: int) -> tuple[int, str]:
        pid, raw = _RECORD.unpack_from(mm, _HEAD.size + index * _RECORD.size)
        return pid, raw.rstrip(b"\0").decode(errors="replace")

    def _set(self, mm: mmap.mmap, index: int, pid: int, owner: str) -> None:
        _RECORD.pack_into(mm, _HEAD.size + index * _RECORD.size, pid, owner.encode()[:28])

    def holders(self) -> dict[str, int]:
        """Leased bytes per ``owner (pid)``, over every process that maps the arena."""
        out: dict[str, int] = {}
        with self._locked() as mm:
            for i in range(self.chunks):
                pid, owner = self._record(mm, i)
                if pid:
                    key = f"{owner} (pid {pid})"
                    out[key] = out.get(key, 0) + self.chunk_bytes
        return out

    @property
    def leased_bytes(self) -> int:
        return sum(self.holders().values())

    def take(self, owner: str, count: int, contiguous: bool = False) -> list[int]:
        """Lease ``count`` chunks (lowest free first, so a copy reuses the pages the previous
        one vacated; with ``contiguous``, the lowest run of adjacent ones, one flat range of the
        mapping) for ``owner`` of this process; raises ``HostPoolExhausted`` if the arena
        cannot hold them."""
        me = os.getpid()
        with self._locked() as mm:
            free: list[int] = []
            for i in range(self.chunks):
                pid, held_by = self._record(mm, i)
                if pid and pid != me and not _alive(pid):
                    log.warning("host arena %s: reclaiming chunk %d of %s (pid %d is gone)", self.name, i, held_by, pid)
                    self._set(mm, i, 0, "")
                    pid = 0
                if not pid:
                    free.append(i)
            if contiguous:
                free = _first_run(free, count)
            if len(free) < count:
                holders: dict[str, int] = {}
                for i in range(self.chunks):
                    pid, held_by = self._record(mm, i)
                    if pid:
                        holders[f"{held_by} (pid {pid})"] = holders.get(f"{held_by} (pid {pid})", 0) + 1
                raise HostPoolExhausted(
                    f"{owner!r} needs {count} {'adjacent ' if contiguous else ''}chunk(s) of "
                    f"{self.chunk_bytes / 1e9:.3f} GB but host arena {self.name} "
                    f"has {len(free)} free of {self.chunks} (held in chunks: {holders}). The arena is sized from the "
                    f"plan so that host copies the plan keeps apart cannot coexist: run the steps in the plan's order "
                    f"(peak_device='gpu' releases the trainer backup before the engine mirror is made), or size the "
                    f"arena for the copies you hold (HostArena.for_plan with the real sizes, or a larger slack_bytes)"
                )
            chosen = free[:count]
            for i in chosen:
                self._set(mm, i, me, owner)
            return chosen

    def give_back(self, indices: list[int]) -> None:
        me = os.getpid()
        with self._locked() as mm:
            for i in indices:
                pid, _ = self._record(mm, i)
                if pid == me:
                    self._set(mm, i, 0, "")

    def chunk(self, index: int, count: int = 1) -> torch.Tensor:
        """Chunk ``index`` (and the ``count - 1`` after it) as one flat ``uint8`` tensor."""
        if self._tensor is None:
            raise StashError(f"host arena {self.name} is closed")
        start = self.header_bytes + index * self.chunk_bytes
        return self._tensor[start : start + count * self.chunk_bytes]

    def pool(self) -> ArenaPool:
        """This process's ``HostPool`` over the arena (one per process; trainer and engine
        backends take it as their ``pool``)."""
        if self._pool is None:
            self._pool = ArenaPool(self)
        return self._pool

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release this process's chunks, unmap, and drop the name if it is still there (the
        creator's, or the survivor's when the creator was killed before ``seal``)."""
        self._drop_name()
        _unlink(self.name)
        if self._mmap is None:
            return
        if self._pool is not None:
            self._pool.release_all()
        if self.pinned and self._tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self.pinned = False
        self._tensor = None
        self._pool = None
        mm, self._mmap = self._mmap, None
        try:
            mm.close()
        except BufferError:
            log.debug("a view of arena %s is still alive; it unmaps when collected", self.name)
        os.close(self._fd)

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostArena({self.name!r}, {self.chunks} x {self.chunk_bytes / 1e9:.3f} GB, pinned={self.pinned})"


def _first_run(free: list[int], count: int) -> list[int]:
    """The lowest ``count`` adjacent indices among the sorted ``free`` ones (fewer: none)."""
    start = 0
    for i in range(1, len(free) + 1):
        if i == len(free) or free[i] != free[i - 1] + 1:
            if i - start >= count:
                return free[start : start + count]
            start = i
    return []


class _ArenaLease(HostLease):
    def __init__(self, pool: ArenaPool, owner: str, nbytes: int, indices: list[int]) -> None:
        super().__init__(pool, owner, nbytes, [pool.arena.chunk(i) for i in indices])
        self.arena = pool.arena
        self.indices = indices

    @property
    def flat(self) -> torch.Tensor:
        """The lease as one flat tensor (a ``contiguous`` lease only)."""
        if self.indices != list(range(self.indices[0], self.indices[0] + len(self.indices))):
            raise StashError(f"lease of {self.owner!r} is not one run of chunks; lease it contiguous=True")
        return self.arena.chunk(self.indices[0], len(self.indices))


class ArenaPool(HostPool):
    """A ``HostPool`` whose chunks are the arena's: leases are arena-wide (see ``HostArena``).

    Its capacity is the arena's, fixed: ``reserve`` checks instead of growing, and a lease
    that does not fit raises ``HostPoolExhausted`` naming who holds the rest.
    """

    def __init__(self, arena: HostArena) -> None:
        super().__init__(chunk_bytes=arena.chunk_bytes, pin="none", name=arena.name)
        self.arena = arena
        self.pin = "register" if arena.pinned else "none"

    @property
    def capacity_bytes(self) -> int:
        return self.arena.nbytes

    def reserve(self, nbytes: int) -> float:
        if nbytes > self.arena.nbytes:
            raise HostPoolExhausted(
                f"reserve({nbytes}) exceeds host arena {self.arena.name} of {self.arena.nbytes} bytes; "
                "size the arena from the plan (HostArena.for_plan) with the real copy sizes"
            )
        return 0.0

    def lease(self, owner: str, nbytes: int, contiguous: bool = False) -> HostLease:
        indices = self.arena.take(owner, self.chunks_for(nbytes), contiguous=contiguous)
        lease = _ArenaLease(self, owner, nbytes, indices)
        with self._lock:
            self._leases[id(lease)] = lease
        return lease

    def _give_back(self, lease: HostLease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)
        if isinstance(lease, _ArenaLease):
            self.arena.give_back(lease.indices)

    def release_all(self) -> None:
        for lease in list(self._leases.values()):
            lease.release()

    def trim(self) -> int:
        return 0  # the arena's pages stay for the job: that is the point

    def close(self) -> None:
        if self._leases:
            raise StashError(f"arena pool {self.name!r} still has leases {self.leases()}; release them before close()")
