"""A colocated job's two participants: one engine and one trainer, each in a process of its own.

The controller (this process) drives both and holds neither's memory: ``driver`` is its link
to the engine (``Generate``, ``Score``, ...), ``trainer`` the trainer actor behind ``call``,
and ``engine_memory`` / ``trainer_memory`` the two participants a ``HandoffExecutor`` here
runs the plan against. ``launcher="process"`` starts an ``EngineProcess`` (its authenticated
socket) and an ``ActorProcess``; ``"ray"`` an ``EngineActor`` and the trainer as Ray actors,
half a GPU each on CUDA, in the caller's Ray when it is initialised (``close()`` then kills
the two actors and leaves Ray running) or in one started here (and shut down by ``close()``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
import psutil
import torch

from colosync.colocated.launch import ActorProcess, RayTrainer, Trainer, trainer_class
from colosync.errors import ColosyncError, ConfigError
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.model.participants import EngineMemory, TrainerMemory
from colosync.handoff.runtime.remote import BytesMemoryLink, RemoteTrainerMemory

log = logging.getLogger(__name__)


class Cluster:
    """An ``engine`` serving ``model_dir`` and the trainer actor ``trainer_actor``
    (``module:Class``, any importable one, built with ``engine=`` its link and ``trainer_kwargs``),
    started by ``launcher`` (``ray`` or ``process``) on ``device``."""

    def __init__(
        self,
        launcher: str,
        *,
        engine: str,
        model_dir: str,
        device: str,
        trainer_actor: str,
        trainer_kwargs: dict[str, Any],
        threads: int = 0,
        max_lora_rank: int = 16,
        ray_address: str | None = None,
    ) -> None:
        from colosync.engines.config import EngineConfig

        self.launcher, self.engine = launcher, engine
        self.device = torch.device(device)
        config = EngineConfig(
            engine=engine, model_dir=model_dir, device=device, max_lora_rank=max_lora_rank, threads=threads
        )
        actor_class = trainer_class(trainer_actor)
        self._proc: Any = None
        self._ray_started = False  # Ray was initialised here (not by the caller): close() shuts it down
        self._ray_actors: list[Any] = []  # what close() kills on the Ray path
        self.trainer: Trainer
        if launcher == "ray":
            import ray

            from colosync.control.ray import RayLink
            from colosync.engines.ray_actor import EngineActor

            if not ray.is_initialized():
                ray.init(
                    address=ray_address,
                    num_cpus=None if ray_address else 2,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
                self._ray_started = True
            try:
                gpu = 0.5 if self.device.type == "cuda" else 0
                # Any: Ray types an actor handle's methods as the class's plain functions, without ``.remote``.
                engine_actor: Any = ray.remote(num_cpus=1, num_gpus=gpu)(EngineActor).remote(
                    msgspec.msgpack.encode(config)
                )
                self._engine_actor = engine_actor
                self._ray_actors.append(engine_actor)
                self.engine_pid = int(ray.get(engine_actor.pid.remote()))
                self.driver: Any = RayLink(self._engine_actor, engine)
                actor: Any = ray.remote(num_cpus=1, num_gpus=gpu)(actor_class).remote(
                    engine=self._engine_actor, **trainer_kwargs
                )
                self._ray_actors.append(actor)
                self.trainer = RayTrainer(actor)
            except BaseException:
                self._release_ray()  # neither actor outlives a cluster that did not start
                raise
        elif launcher == "process":
            from colosync.engines.process import EngineProcess

            self._proc = EngineProcess(config)
            assert self._proc.pid is not None
            self.engine_pid = self._proc.pid
            self.driver = self._proc.link
            address = msgspec.msgpack.encode(self._proc.address)
            try:
                self.trainer = ActorProcess(trainer_actor, engine=address, **trainer_kwargs)
            except BaseException:
                self._proc.close()
                raise
        else:
            raise ConfigError(f"launcher must be ray or process here, got {launcher!r}")
        log.info(
            "cluster: %s engine (pid %d) and trainer (pid %d) on %s", engine, self.engine_pid, self.trainer.pid, device
        )

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

    def _release_ray(self) -> None:
        """Kill the actors started here, then shut Ray down if it was started here (the
        caller's Ray keeps running)."""
        import ray

        try:
            for actor in reversed(self._ray_actors):
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(actor)
            self._ray_actors.clear()
        finally:
            if self._ray_started:
                self._ray_started = False
                ray.shutdown()

    def close(self) -> None:
        try:
            with contextlib.suppress(ColosyncError, OSError):
                self.trainer.call("close")
            self.trainer.close()
            if self._proc is not None:
                self._proc.close()
        finally:
            if self.launcher == "ray":
                self._release_ray()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Cluster"]
