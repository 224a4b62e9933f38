"""Where a colocated trainer runs: a spawned process, or a Ray actor, behind one ``call``.

A framework's GPU host may have Ray or not, so a trainer actor class (a ``ServedTrainer``
named ``module:Class``, colosync's own or the caller's) runs both ways and the controller sees one surface:
``trainer.call(method, *args)``, ``pid``, ``is_alive()``, ``close()``. Under ``process`` it is
an ``ActorProcess``: a spawned process that builds the actor and answers method calls over a
pipe, arguments and replies as msgpack (no pickle on either side's receive path), and an
error there comes back as the ``colosync.errors`` class it was (other exceptions as a
``ColosyncError`` naming their type); under ``ray``, a ``RayTrainer`` around the actor handle.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any, Protocol

import msgspec

from colosync.errors import ColosyncError, ConfigError, EngineError

log = logging.getLogger(__name__)

LAUNCHERS = ("auto", "ray", "process")


def resolve_launcher(choice: str) -> str:
    """``ray`` or ``process``; ``auto`` picks Ray when it is installed."""
    if choice not in LAUNCHERS:
        raise ConfigError(f"launcher must be one of {list(LAUNCHERS)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "ray" if importlib.util.find_spec("ray") is not None else "process"


class Trainer(Protocol):
    """What the controller calls on a trainer, wherever it runs."""

    pid: int

    def call(self, method: str, *args: Any) -> Any: ...

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


def trainer_class(path: str) -> type:
    """The trainer actor class named ``module:Class``: any importable module (colosync's own,
    e.g. ``colosync.colocated.synthetic:SyntheticTrainer``, or the caller's)."""
    module, _, name = path.partition(":")
    if not module or not name or not all(part.isidentifier() for part in (*module.split("."), *name.split("."))):
        raise ConfigError(f"a trainer actor is named 'module:Class' (e.g. 'mypackage.trainer:MyTrainer'), got {path!r}")
    try:
        found: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"trainer actor {path!r}: cannot import {module!r}: {exc}") from exc
    for attr in name.split("."):
        if not hasattr(found, attr):
            raise ConfigError(f"trainer actor {path!r}: {found.__name__!r} has no {attr!r}")
        found = getattr(found, attr)
    if not isinstance(found, type):
        raise ConfigError(f"trainer actor {path!r} is not a class (a {type(found).__name__})")
    return found


def _error_reply(exc: BaseException) -> list[Any]:
    """``["err", type name, message, remote traceback, whether it is a colosync error]``."""
    return ["err", type(exc).__name__, str(exc), traceback.format_exc(), isinstance(exc, ColosyncError)]


def _colosync_error_types() -> dict[str, type[ColosyncError]]:
    """Every ``ColosyncError`` class by name (the lookup ``colosync.errors.error_from_wire`` makes)."""
    found: dict[str, type[ColosyncError]] = {}
    stack: list[type[ColosyncError]] = [ColosyncError]
    while stack:
        cls = stack.pop()
        found.setdefault(cls.__name__, cls)
        stack.extend(cls.__subclasses__())
    return found


def remote_error(method: str, reply: list[Any]) -> ColosyncError:
    """The exception a trainer process reported for ``method``: its ``colosync.errors`` class
    rebuilt by name with its message, or a ``ColosyncError`` naming any other exception's type;
    the trainer's traceback rides along as a note."""
    name, message, remote_traceback, is_colosync = reply[1], reply[2], reply[3], reply[4]
    cls = _colosync_error_types().get(name) if is_colosync else None
    exc: ColosyncError | None = None
    if cls is not None:
        with contextlib.suppress(Exception):  # a subclass whose constructor takes more than the message
            exc = cls(message)
    if exc is None:
        exc = ColosyncError(f"the trainer process failed in {method}: {name}: {message}")
    exc.add_note(f"raised in the trainer process, in {method}:\n{remote_traceback.rstrip()}")
    return exc


def _serve_actor(actor_path: str, init: bytes, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        actor = trainer_class(actor_path)(**msgspec.msgpack.decode(init))
    except BaseException as exc:
        conn.send_bytes(encoder.encode(_error_reply(exc)))
        raise
    conn.send_bytes(encoder.encode(["ok", os.getpid()]))
    while True:
        try:
            method, args = msgspec.msgpack.decode(conn.recv_bytes())
        except EOFError:
            break  # the controller is gone
        if method == "exit":
            conn.send_bytes(encoder.encode(["ok", None]))
            break
        try:
            if method.startswith("_") or not callable(getattr(actor, method, None)):
                raise ConfigError(f"the trainer has no method {method!r}")
            reply = ["ok", getattr(actor, method)(*args)]
        except Exception as exc:  # a reply, never a raise: the controller decides
            reply = _error_reply(exc)
        conn.send_bytes(encoder.encode(reply))


class ActorProcess:
    """The trainer actor ``actor`` (``module:Class``) built with ``kwargs`` in a spawned
    process; ``call(method, *args)`` runs one method there, and what it raised there raises
    here (a ``colosync.errors`` class as itself, anything else as a ``ColosyncError``)."""

    def __init__(self, actor: str, start_timeout_s: float = 300.0, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve_actor,
            args=(actor, msgspec.msgpack.encode(kwargs), child),
            name="colosync-trainer",
            daemon=True,
        )
        self._process.start()
        child.close()
        try:
            if not self._conn.poll(start_timeout_s):
                raise EngineError(f"the trainer process did not start within {start_timeout_s}s")
            self.pid = int(self._reply("start"))
        except BaseException:
            self._process.terminate()
            self._process.join(5)
            self._conn.close()
            raise
        log.info("trainer %s started in process %d", actor, self.pid)

    def _reply(self, method: str) -> Any:
        try:
            reply = msgspec.msgpack.decode(self._conn.recv_bytes())
        except EOFError:
            self._process.join(5)
            raise EngineError(
                f"the trainer process died during {method} (exit code {self._process.exitcode}); its log went to "
                "this process's stderr"
            ) from None
        if reply[0] == "err":
            raise remote_error(method, reply)
        return reply[1]

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send_bytes(msgspec.msgpack.encode([method, list(args)]))
        return self._reply(method)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        if self._process.is_alive():
            with contextlib.suppress(ColosyncError, OSError):
                self.call("exit")
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout_s)
        self._conn.close()


class RayTrainer:
    """A trainer actor as a Ray actor, behind the same ``call``."""

    def __init__(self, actor: Any) -> None:
        import ray

        self.actor = actor
        self.pid = int(ray.get(actor.pid.remote()))

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def is_alive(self) -> bool:
        return True  # Ray raises on a dead actor; there is no cheaper check

    def close(self) -> None:
        pass


__all__ = ["LAUNCHERS", "ActorProcess", "RayTrainer", "Trainer", "remote_error", "resolve_launcher", "trainer_class"]
