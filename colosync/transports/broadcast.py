"""``broadcast``: one sender's bytes to every engine of a set at once, over a torch.distributed group.

Separated mode puts engines on other GPUs and nodes, where no memory is shared. The bytes go
out as collectives of a process group the sender and every receiving process join (gloo for
host memory, NCCL for device memory) -- the runtime users already have, not a home-made one.
The group is formed once per attach and reused for every update: the sender hosts a
``TCPStore``, each receiver that opens the handle takes the next rank from it, and all of them
build the group in the background (so an engine's Attach never waits for the others'). Only
bytes cross the group; the control messages stay on each engine's own typed link.

Each slot is an ordinary buffer on each side. ``publish`` (the Stage is about to go out)
starts a broadcast of the slot's bytes; the receiver's ``ready`` joins the same broadcast into
its own slot. Collectives must be called in the same order on every rank, which holds while
every engine takes every Stage; once an update is aborted midway it may not have, so the
transport is not reused after an abort (``survives_abort``): the Sender attaches a fresh one.
A receiver that never joins is reported by rank (``GroupJoinError``), and a rank that dies
mid-broadcast fails the sender's next publish or wait, never silently.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
from typing import Annotated, Any, Literal

import msgspec
import torch
import torch.distributed as dist

from colosync.errors import GroupJoinError, ManifestError, TransportError
from colosync.transports.base import Peers, ReceiverTransport, SenderTransport
from colosync.wire.protocol import Stage

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
Mode = Literal["broadcast", "p2p"]
_RANKS = "colosync/ranks"  # the store's counter of ranks handed out (the sender is rank 0)


class GroupHandle(msgspec.Struct, frozen=True):
    """Where the group's store listens, how big the group is, and the slots every rank keeps (each bounded:
    a handle comes from another process)."""

    host: Annotated[str, msgspec.Meta(max_length=255)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    world_size: Annotated[int, msgspec.Meta(ge=2, le=1 << 16)]
    backend: Backend
    mode: Mode
    slot_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]
    slots: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=24 * 3600)]


class _Group:
    """One rank of a process group, joined on a thread of its own; ``get`` waits for it."""

    def __init__(self, store: Any, rank: int, handle: GroupHandle, device: torch.device) -> None:
        self.store: Any = store
        self.rank, self.handle, self.device = rank, handle, device
        self._pg: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Not a daemon: a thread inside torch's group constructor cannot be stopped, and one that
        # returns while the interpreter is shutting down aborts the process ("terminate called
        # without an active exception"). So it enters the constructor only once every rank has
        # opened the handle (until then ``close`` ends it at once), and the process's exit waits for
        # a group still forming, at most its join timeout.
        # The thread holds the store by an argument of its own: ``close`` drops ``self.store``, and a
        # ``None`` that reached torch's constructor would be taken as a null store and crash the process.
        self._thread = threading.Thread(
            target=self._join, args=(store,), name=f"colosync-broadcast-join-{rank}", daemon=False
        )
        self._thread.start()

    def _every_rank_opened(self, store: Any) -> float:
        """Wait until every rank has taken its rank from the store; returns the seconds left of the timeout.

        Raises ``TransportError`` when closed first, ``GroupJoinError`` (through ``get``) at the timeout."""
        h = self.handle
        deadline = time.monotonic() + h.timeout_s
        pause = 0.002
        while int(store.add(_RANKS, 0)) + 1 < h.world_size:
            if self._closed:
                raise TransportError("closed before every rank opened the handle")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"not every rank opened the handle within {h.timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return max(deadline - time.monotonic(), 1.0)

    def _join(self, store: Any) -> None:
        h = self.handle
        made: list[Any] = []  # the group, held in a list so that no local name keeps it alive
        try:
            timeout = datetime.timedelta(seconds=self._every_rank_opened(store))
            if h.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                with torch.cuda.device(self.device):
                    made.append(dist.ProcessGroupNCCL(store, self.rank, h.world_size, options))
                    # NCCL connects lazily; connect now, so a rank that never comes is GroupJoinError here
                    # rather than a hang in the first send
                    made[0].eager_connect_single_device(self.device)
            else:
                made.append(dist.ProcessGroupGloo(store, self.rank, h.world_size, timeout))
        except BaseException as exc:  # reported by ``get``, where a caller can act on it
            self._error = exc
            _leave(made)
            return
        with self._lock:
            if not self._closed:
                self._pg = made.pop()
                return
        _leave(made)  # closed while it was joining: nobody will use it

    def get(self) -> Any:
        """The joined process group; ``GroupJoinError`` if some rank did not join in time."""
        h = self.handle
        self._thread.join(h.timeout_s + 5.0)
        if self._pg is not None:
            return self._pg
        if self._closed:
            raise TransportError("this broadcast group was closed (its update was aborted); push again")
        try:
            opened = str(int(self.store.add(_RANKS, 0)) + 1)  # the sender and every receiver that took a rank
            missing = str(list(range(int(opened), h.world_size)))
        except Exception:  # the store's host is gone: say what is known
            opened = missing = "unknown"
        why = f"{type(self._error).__name__}: {self._error}" if self._error else "still joining"
        raise GroupJoinError(
            f"the group at {h.host}:{h.port} did not form within {h.timeout_s:g} s: {opened} of its "
            f"{h.world_size} ranks opened the handle (missing ranks: {missing}); this is rank {self.rank}. Every "
            f"engine process of the set must receive the Attach, reach {h.host}:{h.port}, and reach every other "
            f"rank (gloo: set GLOO_SOCKET_IFNAME to the interface they share) ({why})"
        ) from self._error

    def send(self, tensor: torch.Tensor) -> list[Any]:
        """Start sending ``tensor`` from rank 0 to every other rank; returns the works."""
        pg = self.get()
        with self._on_device():
            if self.handle.mode == "broadcast":
                return [pg.broadcast([tensor], _from_rank_0())]
            return [pg.send([tensor], rank, 0) for rank in range(1, self.handle.world_size)]

    def receive(self, tensor: torch.Tensor) -> Any:
        """Start receiving rank 0's ``tensor``; returns the work."""
        pg = self.get()
        with self._on_device():
            if self.handle.mode == "broadcast":
                return pg.broadcast([tensor], _from_rank_0())
            return pg.recv([tensor], 0, 0)

    def _on_device(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def close(self) -> None:
        """Leave the group, now or once it has joined, without waiting for work a gone peer will never finish."""
        with self._lock:
            self._closed = True
            doomed, self._pg = [self._pg] if self._pg is not None else [], None
        _leave(doomed)
        self.store = None  # the sender's store closes its port with its last reference


def _leave(doomed: list[Any]) -> None:
    """Abort the group in ``doomed`` (its pending work fails on every rank at once) and destroy it off this
    thread, since destroying a group waits for its pending work; the list holds the last reference."""
    if doomed:
        with contextlib.suppress(Exception):
            doomed[0].abort()
    # not a daemon, for the same reason as the join thread: the destructor runs inside torch
    threading.Thread(target=doomed.clear, name="colosync-broadcast-close", daemon=False).start()


def _from_rank_0() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def _backend(device: torch.device) -> Backend:
    return "nccl" if device.type == "cuda" else "gloo"


def _slots(slots: int, slot_bytes: int, device: torch.device) -> torch.Tensor:
    if slot_bytes <= 0 or slots <= 0:
        raise TransportError(f"broadcast needs slot_bytes > 0 and slots > 0, got {slot_bytes}, {slots}")
    return torch.empty(slots, slot_bytes, dtype=torch.uint8, device=device)


class BroadcastSender(SenderTransport):
    """Every slot to every receiver with one ``broadcast`` collective (NCCL pipelines it along a ring)."""

    name = "broadcast"
    mode: Mode = "broadcast"
    colocated = False
    survives_abort = False

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        if not dist.is_available():
            return False, "this torch has no torch.distributed"
        how = "one collective to every engine" if cls.mode == "broadcast" else "a send to each engine"
        if device.type == "cuda":
            if not dist.is_nccl_available():
                return False, "this torch has no NCCL"
            return True, f"NCCL, {how} (each engine on a GPU of its own, not this process's)"
        if not dist.is_gloo_available():
            return False, "this torch has no gloo"
        return True, f"gloo from host memory, {how} (engines on any host that reaches this one)"

    @classmethod
    def create(cls, slot_bytes: int, slots: int, device: torch.device, peers: Peers | None = None) -> BroadcastSender:
        return cls(slot_bytes, slots, device, peers or Peers(receivers=1))

    def __init__(self, slot_bytes: int, slots: int, device: torch.device, peers: Peers) -> None:
        self._slot_bytes, self._slots = slot_bytes, slots
        self._device = device
        self._buffers = _slots(slots, slot_bytes, device)
        timeout = datetime.timedelta(seconds=peers.join_timeout_s)
        # Receivers reach the store at ``peers.host``. Nothing authenticates a rank: keep the port on a trusted network.
        self._store: Any = dist.TCPStore(peers.host, 0, None, True, timeout, wait_for_workers=False)
        self._handle = GroupHandle(
            host=peers.host,
            port=int(self._store.port),
            world_size=peers.receivers + 1,
            backend=_backend(device),
            mode=self.mode,
            slot_bytes=slot_bytes,
            slots=slots,
            timeout_s=peers.join_timeout_s,
        )
        self._group = _Group(self._store, 0, self._handle, device)
        self._work: list[list[Any]] = [[] for _ in range(slots)]
        log.debug(
            "broadcast: group of %d at %s:%d (%s), %d x %d bytes",
            self._handle.world_size,
            peers.host,
            self._handle.port,
            self._handle.backend,
            slots,
            slot_bytes,
        )

    def handle(self) -> bytes:
        return msgspec.msgpack.encode(self._handle)

    def slot(self, index: int) -> torch.Tensor:
        return self._buffers[index]

    def publish(self, stage: Stage) -> None:
        previous, self._work[stage.slot] = self._work[stage.slot], []
        for work in previous:  # every engine acknowledged these before the slot was written again
            _finish(work, f"an earlier {self.name} from slot {stage.slot}")
        if stage.nbytes:
            self._work[stage.slot] = self._group.send(self._buffers[stage.slot][: stage.nbytes])

    def close(self) -> None:
        self._work = [[] for _ in range(self._slots)]
        self._group.close()
        self._store = None


class P2pSender(BroadcastSender):
    """Every slot to each receiver by a ``send`` of its own: a dead receiver fails only its own sends."""

    name = "p2p"
    mode: Mode = "p2p"


class BroadcastReceiver(ReceiverTransport):
    name = "broadcast"

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> BroadcastReceiver:
        return cls(msgspec.msgpack.decode(handle, type=GroupHandle), device)

    def __init__(self, handle: GroupHandle, device: torch.device) -> None:
        if handle.backend == "nccl" and device.type != "cuda":
            raise TransportError("an NCCL broadcast group needs an engine on a GPU; this one runs on the CPU")
        self._handle = handle
        timeout = datetime.timedelta(seconds=handle.timeout_s)
        try:
            store = dist.TCPStore(handle.host, handle.port, None, False, timeout)
            rank = int(store.add(_RANKS, 1))
        except Exception as exc:
            raise TransportError(
                f"cannot reach the sender's broadcast group at {handle.host}:{handle.port} from "
                f"{socket.gethostname()}: {exc}; give EngineSet(host=...) an address this engine reaches"
            ) from exc
        if rank >= handle.world_size:
            raise TransportError(
                f"the broadcast group at {handle.host}:{handle.port} is full ({handle.world_size} ranks): more "
                "processes opened its handle than the sender counted; a link that receives in several workers "
                "must count them (its ``receivers``)"
            )
        on = device if handle.backend == "nccl" else torch.device("cpu")
        self._buffers = _slots(handle.slots, handle.slot_bytes, on)
        self._group = _Group(store, rank, handle, device)
        log.debug("broadcast: joining %s:%d as rank %d of %d", handle.host, handle.port, rank, handle.world_size)

    @property
    def num_slots(self) -> int:
        return self._handle.slots

    @property
    def rank(self) -> int:
        return self._group.rank

    def slot(self, index: int) -> torch.Tensor:
        if not 0 <= index < self._handle.slots:
            raise ManifestError(f"broadcast slot {index} does not exist: the group keeps {self._handle.slots}")
        return self._buffers[index]

    def ready(self, stage: Stage) -> None:
        if stage.nbytes:
            work = self._group.receive(self.slot(stage.slot)[: stage.nbytes])
            _finish(work, f"the {self._handle.mode} of update {stage.update_id}, bucket {stage.bucket}")

    def close(self) -> None:
        self._group.close()


def _finish(work: Any, what: str) -> None:
    try:
        work.wait()
    except Exception as exc:
        raise TransportError(
            f"{what} failed: {exc}; a rank of the group is gone or stalled, so this update is abandoned (the "
            "next push forms a new group)"
        ) from exc


__all__ = ["BroadcastReceiver", "BroadcastSender", "GroupHandle", "P2pSender"]
