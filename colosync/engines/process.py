"""Run an engine in its own process, reachable over an authenticated Unix socket.

Trainer and engine are separate processes in every real deployment, and a sender can die,
stall or misbehave at any moment; this is where that is survived. The engine process serves
``EngineHost`` through ``ChannelServer`` (``colosync.engines.channel``): one task per
connection, deadlines on authentication and on every message, engine work on one thread,
and a connection that ends for any reason aborts only that client's in-flight update.
Several clients can connect (a trainer that syncs, a driver that generates, a replacement
sender after a crash); one of them owns the update channel at a time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import tempfile
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from colosync.engines import engine_class
from colosync.engines.channel import ChannelServer, Deadlines, SocketLink
from colosync.engines.config import EngineAddress, EngineConfig
from colosync.engines.host import Session, build_host, codecs
from colosync.errors import ColosyncError, EngineError
from colosync.wire.protocol import Ack, Failed

log = logging.getLogger(__name__)


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Stop the engine process (after replying)."""


def _serve(config_bytes: bytes, ready: Connection) -> None:
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    logging.basicConfig(level=config.log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    server: ChannelServer | None = None

    def shutdown(request: Shutdown, session: Session) -> Ack:
        if server is not None:
            server.stop()
        return host.transactions.status()

    try:
        host = build_host(config, handlers={Shutdown: shutdown})
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
        host.close()
        shutil.rmtree(folder, ignore_errors=True)


class EngineProcess:
    """Start an engine in a fresh (spawned) process and talk to it.

    >>> with EngineProcess(EngineConfig(engine="hf", model_dir=path)) as engine:
    ...     sender = Sender(engine.link, transport="shm")

    ``engine.address`` is what another process needs to connect (``connect(address, "hf")``).
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_serve, args=(msgspec.msgpack.encode(config), child), name=f"colosync-{config.engine}", daemon=True
        )
        self._process.start()
        child.close()
        if not parent.poll(start_timeout_s):
            self._process.terminate()
            raise EngineError(f"engine {config.engine!r} did not start within {start_timeout_s}s")
        try:
            first = parent.recv_bytes()
        except EOFError:
            self._process.join(5)
            raise EngineError(
                f"engine {config.engine!r} died during start-up (exit code {self._process.exitcode}); its log "
                "went to this process's stderr (raise EngineConfig.log_level to 'INFO' for more)"
            ) from None
        failed = _try_decode(first, Failed)
        if failed is not None:
            self._process.join(5)
            raise failed.to_exception()
        self.address = msgspec.msgpack.decode(first, type=EngineAddress)
        self.link = self.connect()

    def connect(self, name: str = "") -> SocketLink:
        """A new connection to this engine (one per thread or process that talks to it)."""
        return connect(self.address, self.config.engine, name)

    def call(self, request: msgspec.Struct) -> Any:
        return self.link.call(request)

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
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout_s)
        self.link.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: EngineAddress, engine: str, name: str = "") -> SocketLink:
    """A link to the engine process at ``address`` serving the registered engine ``engine`` (e.g. ``"hf"``)."""
    cls = engine_class(engine)
    return SocketLink(address, *codecs((*cls.requests, Shutdown), cls.replies), name=name)


def _try_decode(data: bytes, cls: type) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=cls)
    except msgspec.ValidationError:
        return None


__all__ = ["EngineAddress", "EngineConfig", "EngineProcess", "Shutdown", "connect"]
