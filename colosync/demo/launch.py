"""Where the demo's engine and trainer run: two Ray actors, or two plain processes.

The GPU host of a framework may have Ray or not (this project's H200 host has neither Ray
nor vLLM), so the demo runs the same actor classes both ways behind one small surface: a
driver link to the engine (``Generate``, ``Score``), ``trainer.call(method, *args)``, and the
two participants' memory for a ``HandoffExecutor`` in this process (the controller).

Under ``process`` the engine is an ``EngineProcess`` (its authenticated socket) and the
trainer an ``ActorProcess``: a spawned process that builds the actor and answers method calls
over a pipe, arguments and replies as msgpack (no pickle on either side's receive path).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any, Protocol

import msgspec
import psutil
import torch

from colosync.errors import ColosyncError, ConfigError, EngineError
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.runtime.participants import EngineMemory, TrainerMemory
from colosync.handoff.runtime.remote import BytesMemoryLink, RemoteTrainerMemory

log = logging.getLogger(__name__)

LAUNCHERS = ("auto", "ray", "process")


def resolve_launcher(choice: str) -> str:
    if choice not in LAUNCHERS:
        raise ConfigError(f"launcher must be one of {list(LAUNCHERS)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "ray" if importlib.util.find_spec("ray") is not None else "process"


class Trainer(Protocol):
    def call(self, method: str, *args: Any) -> Any: ...


# =========================================================================================
# A trainer in a plain process.
# =========================================================================================


DEFAULT_TRAINER = "colosync.demo.actors:TrainerActor"


def trainer_class(path: str) -> type:
    """The trainer actor class named ``module:Class`` (one of colosync's own)."""
    module, _, name = path.partition(":")
    if not module.startswith("colosync.") or not name:
        raise ConfigError(f"a trainer actor is named 'colosync.<module>:<Class>', got {path!r}")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def _serve_actor(actor_path: str, init: bytes, conn: Connection) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        actor = trainer_class(actor_path)(**msgspec.msgpack.decode(init))
    except BaseException as exc:
        conn.send_bytes(encoder.encode(["err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"]))
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
            reply = ["err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"]
        conn.send_bytes(encoder.encode(reply))


class ActorProcess:
    """A trainer actor (``actor``: ``module:Class``, default ``TrainerActor``) in a spawned
    process; ``call(method, *args)`` runs one method there."""

    def __init__(self, start_timeout_s: float = 300.0, actor: str = DEFAULT_TRAINER, **kwargs: Any) -> None:
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
        if not self._conn.poll(start_timeout_s):
            self._process.terminate()
            raise EngineError(f"the trainer process did not start within {start_timeout_s}s")
        self.pid = int(self._reply("start"))

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
            raise ColosyncError(f"the trainer process failed in {method}: {reply[1]}: {reply[2]}")
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
    """A ``TrainerActor`` as a Ray actor, behind the same ``call``."""

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


# =========================================================================================
# Both participants.
# =========================================================================================


class Cluster:
    """The demo's engine and trainer, started by ``launcher`` (``ray`` or ``process``).

    ``driver``: a link to the engine for ``Generate`` and ``Score``; ``trainer``: the trainer
    actor; ``engine_memory`` / ``trainer_memory``: the participants for a ``HandoffExecutor``."""

    def __init__(
        self,
        launcher: str,
        *,
        engine: str,
        model_dir: str,
        device: str,
        threads: int,
        trainer_kwargs: dict[str, Any],
        ray_address: str | None = None,
        trainer_actor: str = DEFAULT_TRAINER,
    ) -> None:
        from colosync.engines.config import EngineConfig

        self.launcher, self.engine = launcher, engine
        self.device = torch.device(device)
        config = EngineConfig(engine=engine, model_dir=model_dir, device=device, max_lora_rank=16, threads=threads)
        actor_class = trainer_class(trainer_actor)
        self._proc: Any = None
        self._ray = False
        if launcher == "ray":
            import ray

            from colosync.engines.ray_actor import EngineActor, RayLink

            ray.init(
                address=ray_address,
                num_cpus=None if ray_address else 2,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                ignore_reinit_error=True,
            )
            self._ray = True
            gpu = 0.5 if self.device.type == "cuda" else 0
            # Any: Ray types an actor handle's methods as the class's plain functions, without ``.remote``.
            engine_actor: Any = ray.remote(num_cpus=1, num_gpus=gpu)(EngineActor).remote(msgspec.msgpack.encode(config))
            self._engine_actor = engine_actor
            self.engine_pid = int(ray.get(engine_actor.pid.remote()))
            self.driver: Any = RayLink(self._engine_actor, engine)
            actor: Any = ray.remote(num_cpus=1, num_gpus=gpu)(actor_class).remote(
                engine=self._engine_actor, **trainer_kwargs
            )
            self.trainer: RayTrainer | ActorProcess = RayTrainer(actor)
        elif launcher == "process":
            from colosync.engines.process import EngineProcess

            self._proc = EngineProcess(config)
            assert self._proc.pid is not None
            self.engine_pid = self._proc.pid
            self.driver = self._proc.link
            address = msgspec.msgpack.encode(self._proc.address)
            self.trainer = ActorProcess(actor=trainer_actor, engine=address, **trainer_kwargs)
        else:
            raise ConfigError(f"launcher must be ray or process here, got {launcher!r}")

    def engine_memory(self, arena: HostArena | None = None, pin: str = "auto") -> EngineMemory:
        if self._proc is not None:
            memory: EngineMemory = self._proc.memory(arena=arena, pin=pin)
            return memory
        from colosync.engines.ray_actor import remote_engine_memory

        return remote_engine_memory(self._engine_actor, self.engine, arena=arena, pin=pin)

    def trainer_memory(self, arena: HostArena | None = None, pin: str = "auto") -> TrainerMemory:
        link = BytesMemoryLink(lambda data: self.trainer.call("handoff", data))
        return RemoteTrainerMemory(
            link, arena=arena, pin=pin, alive=self.trainer.is_alive, where=f"trainer ({self.launcher})"
        )

    def memory_now(self) -> tuple[int, int]:
        """Resident host bytes of both process trees, and device bytes in use (all processes)."""
        host = 0
        for pid in (self.engine_pid, self.trainer.pid):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                host += proc.memory_info().rss
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        host += child.memory_info().rss
        device = 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            device = total - free
        return host, device

    def close(self) -> None:
        try:
            with contextlib.suppress(ColosyncError, OSError):
                self.trainer.call("close")
            self.trainer.close()
            if self._proc is not None:
                self._proc.close()
        finally:
            if self._ray:
                import ray

                ray.shutdown()


__all__ = ["DEFAULT_TRAINER", "LAUNCHERS", "ActorProcess", "Cluster", "RayTrainer", "resolve_launcher", "trainer_class"]
