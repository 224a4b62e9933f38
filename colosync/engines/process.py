"""Run an engine in its own process, reachable over a Unix socket of msgpack messages.

Trainer and engine are separate processes in every real deployment, and a sender can die at
any moment; this is where that is handled. The engine process listens on a private Unix
socket (0700 directory, HMAC-authenticated by ``multiprocessing.connection``), so several
clients can connect -- a trainer that syncs, a driver that generates, a replacement sender
after a crash. Only ``send_bytes``/``recv_bytes`` of msgpack structs cross the socket. If the
connection that began an update drops, that update is aborted at once; a silent one is
aborted by the Receiver's timeout.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

import msgspec

from colosync.engines import engine_class
from colosync.engines.config import EngineAddress, EngineConfig
from colosync.engines.host import build_host, codecs
from colosync.errors import ColosyncError, EngineError
from colosync.sync.link import PipeLink
from colosync.wire.protocol import Begin, Failed

log = logging.getLogger(__name__)


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


def _serve(config_bytes: bytes, ready: Connection) -> None:
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    logging.basicConfig(level=config.log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    try:
        host = build_host(config, extra_requests=(Shutdown,))
    except BaseException as exc:
        ready.send_bytes(msgspec.msgpack.encode(Failed.from_exception(exc)))
        raise
    receiver = host.transactions
    folder = tempfile.mkdtemp(prefix="colosync-engine-")
    os.chmod(folder, 0o700)
    address = EngineAddress(os.path.join(folder, "socket"), secrets.token_bytes(32))
    listener = Listener(address.path, family="AF_UNIX", authkey=address.authkey)
    clients: list[Connection] = []
    lock = threading.Lock()

    def accept_forever() -> None:
        while True:
            try:
                conn = listener.accept()
            except Exception:  # listener closed, or a client failed authentication
                if listener._listener is None:  # closed: stop
                    return
                continue
            with lock:
                clients.append(conn)

    threading.Thread(target=accept_forever, daemon=True).start()
    ready.send_bytes(msgspec.msgpack.encode(address))
    ready.close()
    owner: Connection | None = None  # the connection that began the in-flight update
    try:
        running = True
        while running:
            with lock:
                current = list(clients)
            for conn in wait(current, timeout=0.2) if current else ():
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    with lock:
                        clients.remove(conn)
                    in_flight = receiver.status().in_flight_update_id
                    if conn is owner and in_flight is not None:
                        receiver.abort(in_flight, "the sender disconnected mid-update")
                    continue
                request = host.decode(data)
                if isinstance(request, Shutdown):
                    reply, running = receiver.status(), False
                else:
                    reply = host.handle(request)
                    if isinstance(request, Begin) and not isinstance(reply, Failed):
                        owner = conn
                conn.send_bytes(host.encode(reply))
            if not current:
                time.sleep(0.05)
            receiver.check_timeout()
    finally:
        host.close()
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


class EngineProcess:
    """Start an engine in a fresh (spawned) process and talk to it.

    >>> with EngineProcess(EngineConfig(engine="hf", model_dir=path)) as engine:
    ...     sender = Sender(engine.link, transport="shm")
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0) -> None:
        self.config = config
        self._cls = engine_class(config.engine)
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
                f"engine {config.engine!r} died during start-up (exit code {self._process.exitcode}); see its log"
            ) from None
        failed = _try_decode(first, Failed)
        if failed is not None:
            self._process.join(5)
            raise failed.to_exception()
        self.address = msgspec.msgpack.decode(first, type=EngineAddress)
        self.link = self.connect()

    def connect(self) -> PipeLink:
        """A new connection to this engine (one per thread or process that talks to it)."""
        return connect(self.address, self._cls)

    def call(self, request: msgspec.Struct) -> Any:
        return self.link.call(request)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._process.is_alive():
            try:
                self.link.call(Shutdown())
            except (ColosyncError, OSError):
                pass
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout_s)
        self.link.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: EngineAddress, engine_cls: type) -> PipeLink:
    try:
        conn = Client(address.path, family="AF_UNIX", authkey=address.authkey)
    except OSError as exc:
        raise EngineError(f"cannot reach the engine at {address.path}: {exc}; is it running?") from exc
    return PipeLink(conn, *codecs((*engine_cls.requests, Shutdown), engine_cls.replies))


def _try_decode(data: bytes, cls: type) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=cls)
    except msgspec.ValidationError:
        return None


__all__ = ["EngineAddress", "EngineConfig", "EngineProcess", "Shutdown", "connect"]
