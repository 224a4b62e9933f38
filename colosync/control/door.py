"""Bytes in, bytes out, and never an exception: where every serving loop meets a typed handler.

A socket thread, a Ray actor method and a vLLM worker's ``collective_rpc`` target all receive
msgpack bytes and must answer with bytes, whatever arrived: garbage, an unknown message, a
request the handler refuses, or a handler that breaks. A raised exception there would drop a
client's reply stream out of step, fail a Ray call opaquely, or kill a vLLM worker. So the
decoding, the ``Failed`` reply for every failure and the encoding live here once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Union

import msgspec

from colosync.errors import ColosyncError, EngineError
from colosync.wire.protocol import Ack, Batch, BatchReply, Codec, Failed, TransactionRequest

log = logging.getLogger(__name__)

TRANSACTION_TYPES: tuple[type, ...] = TransactionRequest.__args__


def codecs(requests: tuple[type, ...] = (), replies: tuple[type, ...] = ()) -> tuple[Codec, Codec]:
    """Request and reply codecs for the transaction messages (and ``Batch``) plus an engine's own."""
    # Unions built at run time from the engine's own message types.
    return (
        Codec(Union[(*TRANSACTION_TYPES, Batch, *requests)]),
        Codec(Union[(Ack, Failed, BatchReply, *replies)]),
    )


class Door:
    """``serve(data, handle)``: decode ``data``, call ``handle`` on the request, encode its reply.

    A request that does not decode, and any exception ``handle`` raises, become a ``Failed``
    reply (``status`` adds the engine's state to a refusal, where there is one to add).
    """

    def __init__(
        self,
        requests: tuple[type, ...] = (),
        replies: tuple[type, ...] = (),
        status: Callable[[], Ack | None] | None = None,
    ) -> None:
        self.request_codec, self.reply_codec = codecs(requests, replies)
        self._status = status

    def decode(self, data: bytes) -> msgspec.Struct:
        """The request in ``data``, or the ``Failed`` reply that says why it is not one."""
        try:
            return self.request_codec.decode(bytes(data))
        except ColosyncError as exc:
            return Failed.from_exception(exc)

    def answer(self, request: msgspec.Struct, handle: Callable[[Any], msgspec.Struct]) -> msgspec.Struct:
        """``handle(request)``, or the ``Failed`` reply for why it did not answer."""
        if isinstance(request, Failed):  # what decode returned for bytes that were not a request
            return request
        if type(request) is Batch:  # each request exactly as if it had come alone
            replies = [self.answer(part, handle) for part in request.requests]
            return BatchReply([r if isinstance(r, Ack | Failed) else _not_a_transaction_reply(r) for r in replies])
        try:
            return handle(request)
        except ColosyncError as exc:
            return Failed.from_exception(exc, getattr(exc, "status", None) or self._status_quietly())
        except Exception as exc:
            log.exception("engine: request %s failed", type(request).__name__)
            return Failed.from_exception(exc)

    def _status_quietly(self) -> Ack | None:
        """The engine's state beside a refusal, if it can be had: a courtesy, never a second failure."""
        if self._status is None:
            return None
        try:
            return self._status()
        except Exception:
            log.exception("engine: reading the status for a refusal failed")
            return None

    def encode(self, reply: msgspec.Struct) -> bytes:
        try:
            return self.reply_codec.encode(reply)
        except Exception as exc:  # a reply msgspec cannot encode must still be a reply
            log.exception("engine: cannot encode a %s reply", type(reply).__name__)
            return self.reply_codec.encode(Failed.from_exception(exc))

    def serve(self, data: bytes, handle: Callable[[Any], msgspec.Struct]) -> bytes:
        return self.encode(self.answer(self.decode(data), handle))


def _not_a_transaction_reply(reply: msgspec.Struct) -> Failed:
    return Failed.from_exception(EngineError(f"a batched request was answered with {type(reply).__name__}"))


__all__ = ["TRANSACTION_TYPES", "Door", "codecs"]
