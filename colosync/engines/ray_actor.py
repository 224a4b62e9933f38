"""Colosync on Ray: any registered engine (hf, vLLM, ...) served from a Ray actor.

The actor is a host like the engine process: the same ``EngineHost`` behind ``handle(bytes)``,
and the same memory service for a handoff executor. Its link is ``control.ray.RayLink``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import msgspec
import psutil
import torch

from colosync.control.ray import RayLink
from colosync.engines.config import EngineConfig
from colosync.engines.host import build_host
from colosync.engines.process import engine_memory_factory
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.runtime.remote import MEMORY_REPLIES, MEMORY_REQUESTS, MemoryService, RemoteEngineMemory
from colosync.wire.protocol import ArenaHandle

log = logging.getLogger(__name__)


def memory_sample(device: torch.device) -> dict[str, int]:
    """Resident host memory of this process and its children (e.g. vLLM's engine core), and
    peak device memory since the last sample."""
    me = psutil.Process(os.getpid())
    rss = me.memory_info().rss
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rss += child.memory_info().rss
    out = {"host_rss": rss, "gpu_peak": 0}
    if device.type == "cuda":
        out["gpu_peak"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    return out


class EngineActor:
    """Hosts any registered engine in a Ray actor: ``ray.remote(EngineActor).remote(encoded EngineConfig)``."""

    def __init__(self, config_bytes: bytes) -> None:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        logging.basicConfig(level=config.log_level)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = torch.device(config.device)
        services: list[MemoryService] = []

        def memory(request: msgspec.Struct, session: Any) -> msgspec.Struct:
            return services[0].handle(request)

        self.host = build_host(config, handlers=dict.fromkeys(MEMORY_REQUESTS, memory))
        services.append(MemoryService(factory=engine_memory_factory(self.host.engine)))

    def handle(self, data: bytes) -> bytes:
        return self.host.handle_bytes(data)

    def memory(self) -> dict[str, int]:
        return memory_sample(self.device)

    def pid(self) -> int:
        return os.getpid()


def remote_engine_memory(
    actor: Any,
    engine: str,
    *,
    arena: HostArena | ArenaHandle | None = None,
    chunk_bytes: int = 1 << 30,
    pin: str = "auto",
) -> RemoteEngineMemory:
    """The memory of the engine in ``actor`` (an ``EngineActor``) as an ``EngineMemory`` for a
    ``HandoffExecutor``: the same typed requests as the engine process's, through ``handle``;
    ``arena``/``chunk_bytes``/``pin`` as for ``EngineProcess.memory``."""
    link = RayLink(actor, engine, requests=MEMORY_REQUESTS, replies=MEMORY_REPLIES)
    return RemoteEngineMemory(link, arena=arena, chunk_bytes=chunk_bytes, pin=pin, where=f"Ray actor {engine}")


__all__ = ["EngineActor", "memory_sample", "remote_engine_memory"]
