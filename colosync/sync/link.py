"""The trainer's view of one engine's Receiver: submit a control message, wait for its reply.

``submit`` returns at once so a Sender can keep several ``Stage`` messages in flight (one per
transport slot) while the engine copies the previous slot out; replies come back in order.
``LocalLink`` calls a Receiver in the same process; ``PipeLink`` talks to an engine process
over a pipe of msgpack bytes; other engines (vLLM's collective RPC, Ray actors) provide their
own ``Link``.
"""

from __future__ import annotations

from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

import msgspec

from colosync.errors import ColosyncError, EngineError
from colosync.sync.receiver import Receiver
from colosync.wire.protocol import Ack, BatchReply, Codec, Failed, TransactionRequest


class Pending(Protocol):
    def wait(self) -> Ack:
        """The reply; raises the ``ColosyncError`` subclass the engine reported."""


class Link(Protocol):
    """``submit`` sends one request and returns its pending reply.

    A link to an ``EngineHost`` (``SocketLink``, ``RayLink``) also has ``submit_batch(requests)
    -> list[Pending]``: it sends the requests as one ``Batch``, and a Sender then uses it for the
    tail of every update and ``BeginAgain`` for a repeated manifest, both of which only a host
    understands.
    """

    def submit(self, request: TransactionRequest) -> Pending: ...

    def close(self) -> None: ...


class BatchPart:
    """The reply to one request of a ``Batch``: its place in the batch's ``BatchReply``."""

    def __init__(self, batch: Pending, index: int) -> None:
        self._batch, self._index = batch, index

    def wait(self) -> Ack:
        reply = self._batch.wait()  # raises if the batch as a whole was refused
        if not isinstance(reply, BatchReply) or self._index >= len(reply.replies):
            raise EngineError(f"the engine answered a Batch with {type(reply).__name__}; this is a colosync bug")
        part = reply.replies[self._index]
        if isinstance(part, Failed):
            raise part.to_exception()
        return part


def batch_parts(batch: Pending, count: int) -> list[Pending]:
    """One pending reply per request of a ``Batch`` whose own pending reply is ``batch``."""
    return [BatchPart(batch, i) for i in range(count)]


class Done:
    """A reply that is already known."""

    def __init__(self, reply: Ack | None = None, error: ColosyncError | None = None) -> None:
        self._reply, self._error = reply, error

    def wait(self) -> Ack:
        if self._error is not None:
            raise self._error
        if self._reply is None:
            raise EngineError("a reply that carries neither an Ack nor an error; this is a colosync bug")
        return self._reply


class LocalLink:
    """A Receiver living in this process (tests, or an engine embedded in the trainer)."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def submit(self, request: TransactionRequest) -> Done:
        try:
            return Done(self.receiver.handle(request))
        except ColosyncError as exc:
            return Done(error=exc)

    def close(self) -> None:
        pass


R = TypeVar("R")


def unwrap(reply: R) -> R:
    """``reply``, unless it is a ``Failed``: then raise the error it carries."""
    if isinstance(reply, Failed):
        raise reply.to_exception()
    return reply


class PipeLink:
    """Ordered request/reply over a ``multiprocessing`` pipe carrying msgpack bytes only."""

    def __init__(self, conn: Connection, codec: Codec, reply_codec: Codec) -> None:
        self._conn, self._codec, self._reply_codec = conn, codec, reply_codec
        self._waiting: deque[_PipePending] = deque()

    def submit(self, request: msgspec.Struct) -> _PipePending:
        try:
            self._conn.send_bytes(self._codec.encode(request))
        except (OSError, EOFError) as exc:
            raise EngineError(f"the engine process is gone ({exc}); restart it") from exc
        pending = _PipePending(self)
        self._waiting.append(pending)
        return pending

    def call(self, request: msgspec.Struct) -> Any:
        return self.submit(request).wait()

    def _receive_until(self, target: _PipePending, timeout: float | None) -> None:
        while not target.done:
            if timeout is not None and not self._conn.poll(timeout):
                raise EngineError(f"the engine did not answer within {timeout}s")
            try:
                data = self._conn.recv_bytes()
            except (OSError, EOFError) as exc:
                raise EngineError(f"the engine process is gone ({exc}); restart it") from exc
            head = self._waiting.popleft()
            head.reply = self._reply_codec.decode(data)
            head.done = True

    def close(self) -> None:
        self._conn.close()


class _PipePending:
    timeout: float | None = None

    def __init__(self, link: PipeLink) -> None:
        self._link = link
        self.reply: msgspec.Struct | None = None
        self.done = False

    def wait(self) -> Any:
        """The reply: an ``Ack`` for a transaction message, the engine's own reply otherwise."""
        self._link._receive_until(self, self.timeout)
        return unwrap(self.reply)
