"""The trainer's view of one engine's Receiver: submit a control message, wait for its reply.

``submit`` returns at once so a Sender can keep several ``Stage`` messages in flight (one per
transport slot) while the engine copies the previous slot out; replies come back in order.
The links themselves are the control plane's (``colosync.control``: in this process, a
socket, a Ray actor) and vLLM's collective RPC (``engines.vllm.link``). This module knows
the wire's messages only, never the engine's side.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

import msgspec

from colosync.errors import ColosyncError, EngineError
from colosync.wire.protocol import Ack, BatchReply, Failed, TransactionRequest


class Pending(Protocol):
    def wait(self) -> Ack:
        """The reply; raises the ``ColosyncError`` subclass the engine reported."""


class Link(Protocol):
    """``submit`` sends one request and returns its pending reply.

    Every link colosync provides also has ``submit_batch(requests) -> list[Pending]``: the
    requests as one ``Batch`` (one hop where the engine is remote), answered part by part. A
    Sender uses it for the tail of every update, and ``BeginAgain`` for a repeated manifest
    (the engine's ``EngineTransaction`` expands it). A link without it gets single requests and
    full Begins.
    """

    def submit(self, request: TransactionRequest) -> Pending: ...

    def close(self) -> None: ...


class EngineOutcome(msgspec.Struct, frozen=True):
    """What one engine of a set (``control.engine_set``) serves after an update, and what it cost."""

    engine: str
    committed_update_id: int | None  # None: unknown (the engine is gone or did not answer)
    serving: bool = True
    seconds: float = 0.0  # from the update's Begin to this engine's Commit reply
    error: str = ""  # why it did not commit this update; "" if it did


@runtime_checkable
class ReportsEngines(Protocol):
    """A link to several engines, which says what each serves after the last update."""

    def outcomes(self) -> tuple[EngineOutcome, ...]: ...


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


R = TypeVar("R")


def unwrap(reply: R) -> R:
    """``reply``, unless it is a ``Failed``: then raise the error it carries."""
    if isinstance(reply, Failed):
        raise reply.to_exception()
    return reply
