"""One serving loop for every place an engine lives.

An engine is reached through a Unix socket (``EngineProcess``), a Ray actor, or vLLM's
collective RPC into its workers, and each of them moves msgpack bytes. ``EngineHost`` is the
one place where those bytes become a typed request, go to the transaction side (a
``Receiver``, or a link to the Receivers inside vLLM's workers) or to the engine's own
serving code, and come back as a typed reply, a failure included (``Failed``, never a
raised exception and never a crash). So every host refuses garbage, reports a rejected
update and expires an abandoned one the same way.
"""

from __future__ import annotations

import abc
import logging
from typing import Any, ClassVar, Protocol, Union

import msgspec
import torch

from colosync.errors import ColosyncError, ManifestError
from colosync.sync.link import Link
from colosync.sync.receiver import Receiver
from colosync.sync.target import EngineTarget
from colosync.wire.protocol import Abort, Ack, Codec, Failed, Status, TransactionRequest

log = logging.getLogger(__name__)

TRANSACTION_TYPES: tuple[type, ...] = TransactionRequest.__args__


class Transactions(Protocol):
    """The transaction side of an engine: a ``Receiver`` or anything that forwards to one."""

    def handle(self, request: TransactionRequest) -> Ack: ...

    def status(self) -> Ack: ...

    def abort(self, update_id: int, reason: str) -> None: ...

    def check_timeout(self) -> None: ...

    def close(self) -> None: ...


class ServedEngine(Protocol):
    """An engine a host can serve: its own requests, and a transaction side."""

    requests: ClassVar[tuple[type, ...]]
    replies: ClassVar[tuple[type, ...]]

    def transactions(self, policy: Any) -> Transactions: ...

    def handle(self, request: Any) -> msgspec.Struct: ...


class HostedTarget(EngineTarget):
    """An ``EngineTarget`` served by a host: the host builds its ``Receiver`` on ``device``."""

    requests: ClassVar[tuple[type, ...]] = ()
    replies: ClassVar[tuple[type, ...]] = ()
    device: torch.device
    receiver: Receiver

    def transactions(self, policy: Any) -> Receiver:
        self.receiver = Receiver(self, self.device, policy)
        return self.receiver

    @property
    def committed_update_id(self) -> int:
        return self.receiver.committed_update_id

    def handle(self, request: Any) -> msgspec.Struct:
        raise ManifestError(f"this engine serves no {type(request).__name__} requests")


class LinkTransactions:
    """Transactions forwarded over a ``Link`` (the vLLM workers' Receivers behind collective RPC)."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def handle(self, request: TransactionRequest) -> Ack:
        return self.link.submit(request).wait()

    def status(self) -> Ack:
        return self.handle(Status())

    def abort(self, update_id: int, reason: str) -> None:
        self.handle(Abort(update_id, reason))

    def check_timeout(self) -> None:
        pass  # the Receivers at the far end keep their own clocks

    def close(self) -> None:
        self.link.close()


def codecs(requests: tuple[type, ...] = (), replies: tuple[type, ...] = ()) -> tuple[Codec, Codec]:
    """Request and reply codecs for the transaction messages plus an engine's own."""
    return (Codec(Union[(*TRANSACTION_TYPES, *requests)]),  # noqa: UP007 - a union built at run time
            Codec(Union[(Ack, Failed, *replies)]))  # noqa: UP007


class EngineHost:
    """Bytes in, bytes out: decode, dispatch, reply; never raises.

    >>> host = EngineHost(receiver)                       # a vLLM worker: transactions only
    >>> host = EngineHost(engine.transactions(policy), engine)  # an engine with its own requests
    >>> reply = host.handle_bytes(data)
    """

    def __init__(self, transactions: Transactions, engine: ServedEngine | None = None,
                 extra_requests: tuple[type, ...] = ()) -> None:
        self.transactions = transactions
        self.engine = engine
        requests = (*(engine.requests if engine else ()), *extra_requests)
        self.request_codec, self.reply_codec = codecs(requests, engine.replies if engine else ())

    def decode(self, data: bytes) -> msgspec.Struct:
        """The request in ``data``, or the ``Failed`` reply that says why it is not one."""
        try:
            return self.request_codec.decode(bytes(data))
        except ColosyncError as exc:
            return Failed.from_exception(exc)

    def handle(self, request: msgspec.Struct) -> msgspec.Struct:
        if isinstance(request, Failed):  # what decode returned for bytes that were not a request
            return request
        try:
            self.transactions.check_timeout()  # hosts without a timer still expire abandoned updates
            if isinstance(request, TRANSACTION_TYPES):
                return self.transactions.handle(request)
            if self.engine is None:
                raise ManifestError(f"this host serves transaction messages only, not {type(request).__name__}")
            return self.engine.handle(request)
        except ColosyncError as exc:
            return Failed.from_exception(exc)
        except Exception as exc:
            log.exception("engine: request %s failed", type(request).__name__)
            return Failed.from_exception(exc)

    def encode(self, reply: msgspec.Struct) -> bytes:
        return self.reply_codec.encode(reply)

    def handle_bytes(self, data: bytes) -> bytes:
        return self.encode(self.handle(self.decode(data)))

    def close(self) -> None:
        self.transactions.close()


def build_host(config: Any, extra_requests: tuple[type, ...] = ()) -> EngineHost:
    """The host for an ``EngineConfig``: the registry's engine class, built from the config."""
    from colosync.engines import engine_class

    engine = engine_class(config.engine).from_config(config)
    return EngineHost(engine.transactions(config.policy()), engine, extra_requests)


__all__ = ["EngineHost", "HostedTarget", "LinkTransactions", "ServedEngine", "Transactions", "build_host", "codecs"]
