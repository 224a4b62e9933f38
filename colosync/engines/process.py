"""Run an engine in its own process, reachable over an authenticated Unix socket.

Trainer and engine are separate processes in every real deployment, and a sender can die,
stall or misbehave at any moment; this is where that is survived. The engine process serves
``EngineHost`` through ``ChannelServer`` (``colosync.control.channel``): one task per
connection, deadlines on authentication and on every message, engine work on one thread,
and a connection that ends for any reason aborts only that client's in-flight update.
Several clients can connect (a trainer that syncs, a driver that generates, a replacement
sender after a crash); one of them owns the update channel at a time.

The engine process also serves its memory handoff: ``EngineProcess.memory()`` is an
``EngineMemory`` for a ``HandoffExecutor`` in the trainer's (or a controller's) process, each
operation one typed request on its own connection (``colosync.handoff.runtime.remote``).
``ParticipantServer`` is the same for a trainer: it serves a trainer's ``MemoryService`` from
a background thread of the trainer's process, for a controller in another one.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import torch

from colosync.control.channel import ChannelServer, Deadlines, EngineAddress, SocketLink
from colosync.control.door import codecs
from colosync.control.registry import engine_class
from colosync.engines.config import EngineConfig
from colosync.engines.host import build_host
from colosync.errors import ColosyncError, ConfigError, EngineError, UnsupportedOperation
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.model.participants import MemoryParticipant
from colosync.handoff.runtime.remote import (
    MEMORY_REPLIES,
    MEMORY_REQUESTS,
    MemoryService,
    RemoteEngineMemory,
    RemoteTrainerMemory,
)
from colosync.sync.transaction import Session
from colosync.wire.protocol import Ack, ArenaHandle, Failed, Hello

log = logging.getLogger(__name__)


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Stop the engine process (after replying)."""


def _serve(config_bytes: bytes, ready: Connection) -> None:
    os.dup2(2, 1)  # what the engine prints is its log (vLLM logs to stdout): the user's stdout stays theirs
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    logging.basicConfig(level=config.log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    server: ChannelServer | None = None

    os.setpgrp()  # a group of its own, with whatever the engine starts (vLLM's engine core): ended together

    def stop_serving() -> None:
        if server is None:  # still starting: nothing to clean up but the processes the engine started
            os.killpg(os.getpgrp(), signal.SIGKILL)
        else:
            server.stop_from_signal()  # serve() returns and everything below cleans up

    _exit_with_parent(stop_serving)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_serving())  # EngineProcess's terminate()

    services: list[MemoryService] = []

    def shutdown(request: Shutdown, session: Session) -> Ack:
        if server is not None:
            server.stop()
        return host.transaction.status()

    def memory(request: msgspec.Struct, session: Session) -> msgspec.Struct:
        return services[0].handle(request)

    try:
        host = build_host(config, handlers={Shutdown: shutdown, **dict.fromkeys(MEMORY_REQUESTS, memory)})
        services.append(MemoryService(factory=engine_memory_factory(host.engine)))
    except BaseException as exc:
        ready.send_bytes(msgspec.msgpack.encode(Failed.from_exception(exc)))
        raise
    folder = tempfile.mkdtemp(prefix="colosync-engine-")
    os.chmod(folder, 0o700)
    address = EngineAddress(os.path.join(folder, "socket"), secrets.token_bytes(32))
    server = ChannelServer(
        address,
        host.open_session,
        lambda session, data: host.handle_bytes(data, session),
        host.close_session,
        Deadlines(config.auth_timeout_s, config.message_timeout_s),
        tick=host.tick,
    )

    def announce() -> None:
        ready.send_bytes(msgspec.msgpack.encode(address))
        ready.close()

    try:
        server.serve(ready=announce)
    finally:
        services[0].close()
        host.close()
        shutil.rmtree(folder, ignore_errors=True)


def _exit_with_parent(stop: Callable[[], None], grace_s: float = 30.0) -> None:
    """Call ``stop`` when the process that started this one exits, however it exits (killed
    included); end this process's group ``grace_s`` later if ``stop`` did not.

    The parent is watched by polling who the parent is (an orphan is re-parented), not through
    a pipe, whose end a process the trainer forks (a DataLoader worker) would keep open."""
    started_by = mp.parent_process()  # its pid, not getppid(): the parent may be gone already
    parent = started_by.pid if started_by is not None and started_by.pid else os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.warning("engine: the process that started it is gone; shutting down")
        stop()
        time.sleep(grace_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="colosync-parent-watch", daemon=True).start()


GUARD_HINT = (
    'start engines from code under `if __name__ == "__main__":`: an engine runs in a spawned process, which '
    "imports the script that started it again, and an unguarded script would start another engine from there"
)


def _unguarded_main() -> str | None:
    """The path of the ``__main__`` script when its source has no ``if __name__ == "__main__":`` guard."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    try:
        source = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return None if re.search(r"""if\s+__name__\s*==\s*['"]__main__['"]""", source) else path


def engine_memory_factory(engine: object) -> Callable[[HostPool], MemoryParticipant]:
    """How a served engine's memory becomes an ``EngineMemory`` once its host pool is known:
    the engine's own ``memory_participant(pool)`` when it has one, vLLM's sleep mode for an
    engine holding an ``llm`` (vLLM keeps its own host buffers), else ``TorchEngineMemory``
    over its ``model`` (the hf engine). An engine with ``stage_full_updates_in(pool)`` stages
    its full updates in that pool too (the shared arena, when the controller made one)."""

    def build(pool: HostPool) -> MemoryParticipant:
        stage_in = getattr(engine, "stage_full_updates_in", None)
        if callable(stage_in):
            stage_in(pool)  # a full update waits for its commit in the same (shared, pinned) pages
        own = getattr(engine, "memory_participant", None)
        if callable(own):
            participant: MemoryParticipant = own(pool)
            return participant
        llm = getattr(engine, "llm", None)
        if llm is not None:
            from colosync.engines.vllm.memory import VllmEngineMemory

            return VllmEngineMemory(llm)
        if isinstance(getattr(engine, "model", None), torch.nn.Module):
            from colosync.handoff.backends.torch_engine import TorchEngineMemory

            return TorchEngineMemory.from_engine(engine, pool=pool)
        raise UnsupportedOperation(
            f"engine {type(engine).__name__} has no memory to hand over (no model, no vLLM LLM); give it a "
            "memory_participant(pool) method returning an EngineMemory, or run it with engine_offload=False"
        )

    return build


class EngineProcess:
    """Start an engine in a fresh (spawned) process and talk to it.

    >>> with EngineProcess(EngineConfig(engine="hf", model_dir=path)) as engine:
    ...     sender = Sender(engine.link, transport="shm")

    ``engine.address`` is what another process needs to connect (``connect(address, "hf")``).

    The process is not daemonic, so the engine may start processes of its own (vLLM's engine
    core does); it ends with ``close``, at this process's exit, or by itself once this process
    is gone (killed included).
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0) -> None:
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned child re-running an unguarded script
            raise ConfigError(
                f"EngineProcess started while a spawned process imported its parent's script; {GUARD_HINT}"
            )
        self.config = config
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_serve, args=(msgspec.msgpack.encode(config), child), name=f"colosync-{config.engine}", daemon=False
        )
        self._process.start()
        # Runs at this process's exit before multiprocessing joins its children (a daemon would be terminated there)
        self._finalizer = mp_util.Finalize(None, _stop, args=(self._process,), exitpriority=10)
        child.close()
        if not parent.poll(start_timeout_s):
            _stop(self._process)
            raise EngineError(f"engine {config.engine!r} did not start within {start_timeout_s}s")
        try:
            first = parent.recv_bytes()
        except EOFError:
            self._process.join(5)
            unguarded = _unguarded_main()
            raise EngineError(
                f"engine {config.engine!r} died during start-up (exit code {self._process.exitcode}); "
                + (
                    f'the script {unguarded} has no `if __name__ == "__main__":` guard, the likely cause: {GUARD_HINT}'
                    if unguarded
                    else "its log went to this process's stderr (raise EngineConfig.log_level to 'INFO' for more)"
                )
            ) from None
        failed = _try_decode(first, Failed)
        if failed is not None:
            self._process.join(5)
            raise failed.to_exception()
        self.address = msgspec.msgpack.decode(first, type=EngineAddress)
        self.link = self.connect()

    def connect(self, name: str = "", timeout_s: float | None = None, adapter: str = "") -> SocketLink:
        """A new connection to this engine (one per thread or process that talks to it).

        ``timeout_s``: how long a reply may take before the engine counts as stalled (the
        connection then closes and the wait raises ``EngineError``); ``None`` waits for as long as it takes.
        ``adapter``: a named adapter this connection's Sender updates (an engine with ``max_loras > 1``)."""
        return connect(self.address, self.config.engine, name, timeout_s, adapter)

    def call(self, request: msgspec.Struct) -> Any:
        return self.link.call(request)

    def memory(
        self, *, arena: HostArena | ArenaHandle | None = None, chunk_bytes: int = 1 << 30, pin: str = "auto"
    ) -> RemoteEngineMemory:
        """This engine's memory as an ``EngineMemory`` for a ``HandoffExecutor`` here, on a
        connection of its own. ``arena``: the node's shared host arena (the engine maps it and
        keeps its mirror there); without one the engine makes a private pool of ``chunk_bytes``."""
        link = SocketLink(self.address, *codecs(MEMORY_REQUESTS, MEMORY_REPLIES), name="handoff")
        return RemoteEngineMemory(
            link,
            arena=arena,
            chunk_bytes=chunk_bytes,
            pin=pin,
            alive=self.is_alive,
            where=f"{self.config.engine} engine process",
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._process.is_alive():
            with contextlib.suppress(ColosyncError, OSError):
                self.link.call(Shutdown())
            self._process.join(timeout_s)
            _stop(self._process, timeout_s)
        self._finalizer.cancel()
        self.link.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(process: BaseProcess, timeout_s: float = 10.0) -> None:
    """End ``process``: SIGTERM (it cleans up on the way out), then SIGKILL if it is still there."""
    if process.is_alive():
        process.terminate()
        process.join(timeout_s)
    if process.is_alive() and process.pid is not None:
        log.warning("engine process %s ignored SIGTERM for %.0f s; killing it and its group", process.pid, timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the engine leads its group (os.setpgrp in _serve)
        process.join(timeout_s)


def connect(
    address: EngineAddress, engine: str, name: str = "", timeout_s: float | None = None, adapter: str = ""
) -> SocketLink:
    """A link to the engine process at ``address`` serving the registered engine ``engine`` (e.g. ``"hf"``);
    ``timeout_s`` and ``adapter`` as for ``EngineProcess.connect``."""
    cls = engine_class(engine)
    codec, reply_codec = codecs((*cls.requests, Shutdown), cls.replies)
    return SocketLink(address, codec, reply_codec, name=name, timeout_s=timeout_s, adapter=adapter)


class ParticipantServer:
    """Serve a ``MemoryService`` (a trainer's) on an authenticated Unix socket from a background
    thread of this process, so a controller elsewhere can drive it with ``connect_trainer``.

    >>> server = ParticipantServer(MemoryService(factory=lambda pool: TorchTrainerMemory(loader=..., pool=pool)))
    >>> address = server.address    # hand it to the controller; server.close() when done
    """

    def __init__(self, service: MemoryService, deadlines: Deadlines | None = None) -> None:
        self.service = service
        requests, replies = codecs((*MEMORY_REQUESTS, Hello), MEMORY_REPLIES)
        self._codecs = (requests, replies)
        folder = tempfile.mkdtemp(prefix="colosync-participant-")
        os.chmod(folder, 0o700)
        self._folder = folder
        self.address = EngineAddress(os.path.join(folder, "socket"), secrets.token_bytes(32))
        self._server = ChannelServer(self.address, lambda pid: pid, self._handle, lambda *_: None, deadlines)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._server.serve, kwargs={"ready": started.set}, name="colosync-participant", daemon=True
        )
        self._thread.start()
        if not started.wait(30):
            raise EngineError("the participant server did not start listening within 30 s")

    def _handle(self, _session: object, data: bytes) -> bytes:
        requests, replies = self._codecs
        try:
            request = requests.decode(bytes(data))
            reply = Ack(committed_update_id=0) if isinstance(request, Hello) else self.service.handle(request)
        except Exception as exc:  # a reply, never a raise: the loop must keep serving
            if not isinstance(exc, ColosyncError):
                log.exception("participant server: request failed")
            reply = Failed.from_exception(exc)
        try:
            return replies.encode(reply)
        except Exception as exc:
            return replies.encode(Failed.from_exception(exc))

    def close(self) -> None:
        self._server.stop()
        self._thread.join(10)
        self.service.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> ParticipantServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_trainer(
    address: EngineAddress,
    *,
    arena: HostArena | ArenaHandle | None = None,
    chunk_bytes: int = 1 << 30,
    pin: str = "auto",
    alive: Callable[[], bool] | None = None,
) -> RemoteTrainerMemory:
    """The trainer served by a ``ParticipantServer`` at ``address``, as a ``TrainerMemory``."""
    link = SocketLink(address, *codecs(MEMORY_REQUESTS, MEMORY_REPLIES), name="handoff")
    return RemoteTrainerMemory(
        link, arena=arena, chunk_bytes=chunk_bytes, pin=pin, alive=alive, where="trainer process"
    )


def _try_decode(data: bytes, cls: type) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=cls)
    except msgspec.ValidationError:
        return None


__all__ = [
    "EngineAddress",
    "EngineConfig",
    "EngineProcess",
    "ParticipantServer",
    "Shutdown",
    "connect",
    "connect_trainer",
    "engine_memory_factory",
]
