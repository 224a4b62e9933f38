"""Handoff participants in another process: the executor's side and the serving side.

Frameworks put the trainer and the engine in separate processes (an engine process, Ray
actors, vLLM's workers), so the executor must drive operations across a process boundary
and still check every invariant as measured. Two halves, joined by any link that carries
colosync's typed messages (``call(request) -> reply``: the engine process's socket, a Ray
actor method, a trainer's own socket server):

* ``MemoryService`` lives with the participant. It answers ``MemorySetup`` (map the node's
  shared ``HostArena``, or make a private pool), ``MemoryOp`` (run one operation) and
  ``MemoryQuery`` (what is held), and samples its own process tree's memory at every peak an
  operation marks, because only that process can see the moment inside its operation.
* ``RemoteEngineMemory`` / ``RemoteTrainerMemory`` are ``EngineMemory`` / ``TrainerMemory``
  for the executor: each operation is one request, the reply is the ``OpReport`` plus the
  participant's state after it and its peak samples, which the executor combines with its
  own samples of every other process. A link that breaks (the process died, the socket
  closed) raises ``ParticipantError`` naming the participant, its pid and the operation.

Nothing here imports a framework or an engine: the engines and integrations bring links.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, Union

import msgspec

from colosync.errors import ColosyncError, ConfigError, HandoffError, ParticipantError
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.model.ops import HOST_COPIES, Op, Region
from colosync.handoff.model.participants import (
    EngineMemory,
    Footprint,
    MemoryParticipant,
    OpReport,
    TrainerMemory,
)
from colosync.handoff.runtime.sampling import DeviceSampler, HostSampler, trim_host_allocator
from colosync.wire.protocol import (
    ArenaHandle,
    LoanHandle,
    MemoryBorrow,
    MemoryLend,
    MemoryLent,
    MemoryOp,
    MemoryOpDone,
    MemoryQuery,
    MemorySample,
    MemorySetup,
    MemoryState,
)

log = logging.getLogger(__name__)

MEMORY_REQUESTS: tuple[type, ...] = (MemorySetup, MemoryOp, MemoryQuery, MemoryLend, MemoryBorrow)
MEMORY_REPLIES: tuple[type, ...] = (MemoryState, MemoryOpDone, MemoryLent)

Factory = Callable[[HostPool], MemoryParticipant]
"""Builds the served participant once its host memory is known (the arena's pool, or a private one)."""


class MemoryLink(Protocol):
    """Anything that sends one typed request and returns its typed reply (raising the
    ``ColosyncError`` a ``Failed`` reply carries): ``SocketLink``, ``RayLink``, ..."""

    def call(self, request: msgspec.Struct) -> Any: ...


# =========================================================================================
# Serving side: in the participant's process.
# =========================================================================================


class MemoryService:
    """Serve one participant's memory operations to an executor in another process.

    Give the ``participant`` itself, or a ``factory`` that builds it from the host pool that
    ``MemorySetup`` decides (the shared arena when the controller sends one). ``handle``
    takes a request and returns the reply; errors raise (the host turns them into
    ``Failed``)."""

    def __init__(self, participant: MemoryParticipant | None = None, *, factory: Factory | None = None) -> None:
        if (participant is None) == (factory is None):
            raise ConfigError("give MemoryService a participant or a factory that builds one, not both")
        self.participant = participant
        self.factory = factory
        self.arena: HostArena | None = None
        self.pool: HostPool | None = None
        self._host = HostSampler()
        self._device = DeviceSampler()

    def handlers(self) -> dict[type, Callable[[Any, Any], msgspec.Struct]]:
        """``{request type: handler(request, session)}`` for an ``EngineHost``."""
        return {t: (lambda request, _session: self.handle(request)) for t in MEMORY_REQUESTS}

    def handle(self, request: msgspec.Struct) -> msgspec.Struct:
        if isinstance(request, MemorySetup):
            return self.setup(request)
        if isinstance(request, MemoryOp):
            return self.run(request)
        if isinstance(request, MemoryQuery):
            return self.state()
        if isinstance(request, MemoryLend):
            engine = self._ready()
            if not isinstance(engine, EngineMemory):
                raise HandoffError(f"only an engine lends its KV cache; {engine.name!r} is a {engine.actor}")
            return MemoryLent(engine.lend(), self.state())
        if isinstance(request, MemoryBorrow):
            trainer = self._ready()
            if not isinstance(trainer, TrainerMemory):
                raise HandoffError(
                    f"only a trainer borrows the engine's KV cache; {trainer.name!r} is a {trainer.actor}"
                )
            trainer.borrow(request.handle)
            return self.state()
        raise ConfigError(
            f"a MemoryService serves {[t.__name__ for t in MEMORY_REQUESTS]}, not {type(request).__name__}"
        )

    def setup(self, request: MemorySetup) -> MemoryState:
        if self.participant is not None and self.factory is None:
            if request.arena is not None:
                raise ConfigError(
                    "this participant was built with its own host pool, so it cannot move into the arena; "
                    "serve it with MemoryService(factory=...) to let the controller choose its memory"
                )
            return self.state()
        if self.participant is not None:
            if self.arena is not None and request.arena is not None and request.arena.name == self.arena.name:
                return self.state()  # already in this arena
            held = self.participant.regions() & HOST_COPIES
            if held:
                raise ConfigError(
                    f"this participant holds {sorted(r.value for r in held)} in its current host memory; bring it "
                    "back to the device (finish the phase) before moving it to other host memory"
                )
            self.close()  # nothing of it is on the host: rebuild it over the new memory
            self.participant, self.pool = None, None
            gc.collect()
            trim_host_allocator()  # the old private pool's chunks go back to the OS
        if request.arena is not None:
            self.arena = HostArena.attach(request.arena, pin=_pin(request.pin))
            self.pool = self.arena.pool()
            self._host = HostSampler(shared=True, arenas=[self.arena], count_arenas=False)  # the controller counts it
        else:
            self.pool = HostPool(chunk_bytes=request.chunk_bytes, pin=_pin(request.pin))
            self._host = HostSampler()
        assert self.factory is not None
        self.participant = self.factory(self.pool)
        return self.state()

    def _ready(self) -> MemoryParticipant:
        if self.participant is None:
            raise ConfigError(
                "this participant is not set up yet: send MemorySetup (RemoteEngineMemory/RemoteTrainerMemory do)"
            )
        return self.participant

    def sample(self) -> MemorySample:
        fp = self._ready().footprint()
        if fp.device_type == "cpu":
            trim_host_allocator()  # freed CPU tensors must show up as freed
        self._host.refresh()
        host = self._host.sample()
        device = self._device.sample()
        return MemorySample(
            host_pids=host.by_pid,
            host_bytes=fp.host_bytes,
            device_bytes=fp.device_bytes,
            device_type=fp.device_type,
            device_used=device.used if device is not None else None,
        )

    def state(self) -> MemoryState:
        p = self._ready()
        return MemoryState(
            participant=p.name,
            actor=p.actor,
            pid=p.pid,
            regions=[r.value for r in Region if r in p.regions()],
            region_bytes={r.value: n for r, n in p.region_bytes().items()},
            sample=self.sample(),
        )

    def run(self, request: MemoryOp) -> MemoryOpDone:
        p = self._ready()
        try:
            op = Op(request.op)
        except ValueError:
            raise HandoffError(f"unknown operation {request.op!r}; known: {[o.value for o in Op]}") from None
        peaks: list[MemorySample] = []

        def on_peak(_p: MemoryParticipant, event: str) -> None:
            if event == "peak":
                peaks.append(self.sample())

        p.step_context = (request.phase, request.step)
        p.add_listener(on_peak)
        try:
            report = p.run(op, backup=request.backup)
        finally:
            p.remove_listener(on_peak)
        return MemoryOpDone(
            participant=report.participant,
            op=report.op,
            noop=report.noop,
            seconds=report.seconds,
            host_allocated=report.host_allocated,
            host_freed=report.host_freed,
            device_allocated=report.device_allocated,
            device_freed=report.device_freed,
            bytes_to_host=report.bytes_to_host,
            bytes_to_device=report.bytes_to_device,
            device_retained=report.device_retained,
            note=report.note,
            state=self.state(),
            peaks=peaks,
        )

    def close(self) -> None:
        if self.participant is not None:
            self.participant.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None


def _pin(text: str) -> Any:
    if text not in ("auto", "register", "alloc", "none"):
        raise ConfigError(f"pin must be one of auto, register, alloc, none; got {text!r}")
    return text


# =========================================================================================
# Executor side.
# =========================================================================================


class RemoteParticipant(MemoryParticipant):
    """A participant served by a ``MemoryService`` in another process (see module docstring).

    ``alive`` tells whether that process still runs (``EngineProcess.is_alive``), for the
    error when a call fails; ``where`` says what the process is, for messages.
    """

    remote = True

    def __init__(
        self,
        link: MemoryLink,
        *,
        arena: HostArena | ArenaHandle | None = None,
        chunk_bytes: int = 1 << 30,
        pin: str = "auto",
        name: str | None = None,
        alive: Callable[[], bool] | None = None,
        where: str = "",
    ) -> None:
        super().__init__(name)
        self.link = link
        self.alive = alive
        self.where = where
        self.peaks: list[MemorySample] = []
        """The remote process's samples at the peaks the last operation marked."""
        handle = arena.handle() if isinstance(arena, HostArena) else arena
        self.arena = handle
        """The shared arena the remote process maps (its samples leave it to the controller's)."""
        self._state = self._call(MemorySetup(handle, chunk_bytes, pin), "setup")
        if self._state.actor != self.actor:
            raise ConfigError(
                f"the remote participant {self._state.participant!r} is a {self._state.actor}, not a {self.actor}; "
                f"use Remote{self._state.actor.capitalize()}Memory"
            )
        if name is None:
            self.name = self._state.participant

    # -- state ------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._state.pid

    @property
    def state(self) -> MemoryState:
        return self._state

    def refresh(self) -> None:
        self._state = self._call(MemoryQuery(), "query")

    def regions(self) -> frozenset[Region]:
        return frozenset(Region(r) for r in self._state.regions)

    def region_bytes(self) -> dict[Region, int]:
        return {Region(r): n for r, n in self._state.region_bytes.items()}

    def footprint(self) -> Footprint:
        s = self._state.sample
        return Footprint(s.host_bytes, s.device_bytes, s.device_type)

    # -- operations -------------------------------------------------------------------------
    def run(self, op: Op, *, backup: bool = True) -> OpReport:
        phase, step = self.step_context
        done: MemoryOpDone = self._call(MemoryOp(op.value, backup, phase, step), op.value)
        self._state = done.state
        self.peaks = list(done.peaks)
        return OpReport(
            participant=self.name,
            op=done.op,
            noop=done.noop,
            seconds=done.seconds,
            host_allocated=done.host_allocated,
            host_freed=done.host_freed,
            device_allocated=done.device_allocated,
            device_freed=done.device_freed,
            bytes_to_host=done.bytes_to_host,
            bytes_to_device=done.bytes_to_device,
            device_retained=done.device_retained,
            note=done.note,
        )

    def _call(self, request: msgspec.Struct, what: str) -> Any:
        started = time.perf_counter()
        try:
            return self.link.call(request)
        except HandoffError:
            raise  # the participant itself refused or failed (its own, specific error)
        except (ColosyncError, OSError, EOFError) as exc:
            pid = getattr(getattr(self, "_state", None), "pid", None)
            gone = False
            if self.alive is not None:  # a broken link usually means a dead process: give the OS a moment to say so
                deadline = time.monotonic() + 2.0
                while not (gone := not self.alive()) and time.monotonic() < deadline:
                    time.sleep(0.02)
            who = f"{self.name!r}" + (f" (pid {pid}" + (f", {self.where}" if self.where else "") + ")" if pid else "")
            how = "died" if gone else "stopped answering"
            phase, step = self.step_context
            at = f" at {phase} step {step}" if phase else ""
            raise ParticipantError(
                f"the {self.actor} participant {who} {how} during {what}{at} after "
                f"{time.perf_counter() - started:.2f}s ({type(exc).__name__}: {exc}); what it held is lost with its "
                f"process, and every other participant keeps its state: restart the {self.actor} and run the "
                f"plan's init phase again",
                participant=self.name,
                op=what,
                phase=phase,
                step=step,
            ) from exc


class RemoteEngineMemory(RemoteParticipant, EngineMemory):
    """An ``EngineMemory`` in another process (an engine process, a Ray actor, a vLLM worker host)."""

    actor = "engine"

    def offload_kv(self) -> OpReport:
        return self.run(Op.ENGINE_OFFLOAD_KV)

    def offload_weights(self, backup: bool) -> OpReport:
        return self.run(Op.ENGINE_OFFLOAD_WEIGHTS, backup=backup)

    def onload_weights(self) -> OpReport:
        return self.run(Op.ENGINE_ONLOAD_WEIGHTS)

    def onload_kv(self) -> OpReport:
        return self.run(Op.ENGINE_ONLOAD_KV)

    def lend(self) -> LoanHandle:
        lent: MemoryLent = self._call(MemoryLend(), "lend")
        self._state = lent.state
        return lent.handle


class RemoteTrainerMemory(RemoteParticipant, TrainerMemory):
    """A ``TrainerMemory`` in another process (a trainer driven by a controller)."""

    actor = "trainer"

    def load(self) -> OpReport:
        return self.run(Op.TRAINER_LOAD)

    def sleep(self) -> OpReport:
        return self.run(Op.TRAINER_SLEEP)

    def wake_up(self) -> OpReport:
        return self.run(Op.TRAINER_WAKE_UP)

    def offload_grad_buffer(self) -> OpReport:
        return self.run(Op.TRAINER_OFFLOAD_GRAD_BUFFER)

    def clear_memory(self) -> OpReport:
        return self.run(Op.TRAINER_CLEAR_MEMORY)

    def borrow(self, handle: LoanHandle) -> None:
        self._state = self._call(MemoryBorrow(handle), "borrow")


class BytesMemoryLink:
    """A ``MemoryLink`` over any ``bytes -> bytes`` hop to a ``MemoryService`` (a Ray actor
    method that returns ``serve_bytes(service)(data)``, e.g.
    ``BytesMemoryLink(lambda b: ray.get(trainer_actor.memory.remote(b)))``)."""

    def __init__(self, handle: Callable[[bytes], bytes]) -> None:
        from colosync.wire.protocol import Codec, Failed

        self._handle = handle
        self._encoder = msgspec.msgpack.Encoder()
        self._replies = Codec(Union[(*MEMORY_REPLIES, Failed)])

    def call(self, request: msgspec.Struct) -> Any:
        from colosync.wire.protocol import Failed

        reply = self._replies.decode(self._handle(self._encoder.encode(request)))
        if isinstance(reply, Failed):
            raise reply.to_exception()
        return reply


def serve_bytes(service: MemoryService) -> Callable[[bytes], bytes]:
    """``bytes -> bytes`` for a ``MemoryService``: decode a memory request, handle it, encode
    the reply or a ``Failed`` (never raises), e.g. behind a Ray actor method."""
    from colosync.wire.protocol import Codec, Failed

    requests = Codec(Union[MEMORY_REQUESTS])  # noqa: UP007
    encoder = msgspec.msgpack.Encoder()

    def handle(data: bytes) -> bytes:
        try:
            reply = service.handle(requests.decode(data))
        except Exception as exc:  # a reply, never a raise: the caller is another process
            if not isinstance(exc, ColosyncError):
                log.exception("memory service: request failed")
            reply = Failed.from_exception(exc)
        return encoder.encode(reply)

    return handle


__all__ = [
    "MEMORY_REPLIES",
    "MEMORY_REQUESTS",
    "BytesMemoryLink",
    "MemoryLink",
    "MemoryService",
    "RemoteEngineMemory",
    "RemoteParticipant",
    "RemoteTrainerMemory",
    "serve_bytes",
]
