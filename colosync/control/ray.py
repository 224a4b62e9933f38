"""A ``Link`` to an engine in a Ray actor.

A Ray actor processes one caller's calls in order, which is all a Sender needs to pipeline
``Stage`` messages: ``RayLink.submit`` returns the call's ObjectRef at once and ``wait``
resolves it. Arguments and replies are msgpack bytes of colosync's typed structs; the tensor
bytes go through the transport (shared memory or CUDA IPC), never through Ray's object store.
The actor is anything exposing ``handle(bytes) -> bytes`` (``engines.ray_actor.EngineActor``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from colosync.control.door import codecs
from colosync.control.registry import engine_class
from colosync.sync.link import Pending, batch_parts, unwrap
from colosync.wire.protocol import Batch, Codec, Commit, Prepare, Stage


class RayPending:
    def __init__(self, ref: Any, reply_codec: Codec) -> None:
        self._ref, self._reply_codec = ref, reply_codec

    def wait(self) -> Any:
        import ray

        return unwrap(self._reply_codec.decode(ray.get(self._ref)))


class RayLink:
    """A ``Link`` to an actor serving the registered engine ``engine``; ``requests``/``replies`` add
    message types beyond the engine's (``remote_engine_memory`` uses it)."""

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


__all__ = ["RayLink", "RayPending"]
