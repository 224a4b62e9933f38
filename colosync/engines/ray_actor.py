"""Colosync on Ray: an engine actor and a Link to it.

A Ray actor processes one caller's calls in order, which is all a Sender needs to pipeline
``Stage`` messages: ``RayLink.submit`` returns the call's ObjectRef at once and ``wait``
resolves it. Arguments and replies are msgpack bytes of colosync's typed structs; the tensor
bytes go through the transport (shared memory or CUDA IPC), never through Ray's object store.
The same actor serves every registered engine (hf, vLLM, ...) through the common ``EngineHost``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import msgspec
import psutil
import torch

from colosync.engines import build_host, engine_class
from colosync.engines.config import EngineConfig
from colosync.engines.host import codecs
from colosync.engines.process import engine_memory_factory
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.runtime.remote import MEMORY_REPLIES, MEMORY_REQUESTS, MemoryService, RemoteEngineMemory
from colosync.sync.link import Pending, batch_parts, unwrap
from colosync.wire.protocol import ArenaHandle, Batch, Codec, Commit, Prepare, Stage

log = logging.getLogger(__name__)


class RayPending:
    def __init__(self, ref: Any, reply_codec: Codec) -> None:
        self._ref, self._reply_codec = ref, reply_codec

    def wait(self) -> Any:
        import ray

        return unwrap(self._reply_codec.decode(ray.get(self._ref)))


class RayLink:
    """A ``Link`` to an ``EngineActor`` (anything exposing ``handle(bytes) -> bytes``) serving ``engine``;
    ``requests``/``replies`` add message types beyond the engine's (``remote_engine_memory`` uses it)."""

    def __init__(
        self, actor: Any, engine: str, *, requests: tuple[type, ...] = (), replies: tuple[type, ...] = ()
    ) -> None:
        cls = engine_class(engine)
        self._actor = actor
        self._codec, self._reply_codec = codecs((*cls.requests, *requests), (*cls.replies, *replies))

    def submit(self, request: msgspec.Struct) -> RayPending:
        return RayPending(self._actor.handle.remote(self._codec.encode(request)), self._reply_codec)

    def submit_batch(self, requests: list[Stage | Prepare | Commit]) -> list[Pending]:
        """Send ``requests`` as one ``Batch`` (one actor call); one pending reply each."""
        return batch_parts(self.submit(Batch(requests)), len(requests))

    def call(self, request: msgspec.Struct) -> Any:
        return self.submit(request).wait()

    def close(self) -> None:
        pass


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


__all__ = ["EngineActor", "RayLink", "RayPending", "memory_sample", "remote_engine_memory"]
