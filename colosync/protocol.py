"""Control messages between a Sender and a Receiver.

Only these typed structs cross the control channel (a pipe, vLLM's collective RPC, a Ray
call); tensor bytes travel through a transport. Messages are tagged msgspec structs encoded
as msgpack, so decoding can never execute code and a malformed message is rejected with a
``ManifestError`` before it touches any state.
"""

from __future__ import annotations

import msgspec

from .errors import ColosyncError, ManifestError, error_from_wire
from .manifest import UpdateManifest


class Attach(msgspec.Struct, tag="attach", frozen=True):
    """Open the sender's transport; sent once per sender/receiver pair."""

    transport: str
    handle: bytes  # the transport's own typed handle, msgpack-encoded by that transport


class Begin(msgspec.Struct, tag="begin", frozen=True):
    manifest: UpdateManifest


class Stage(msgspec.Struct, tag="stage", frozen=True):
    """Bytes ``[offset, offset + nbytes)`` of ``bucket`` are ready in transport ``slot``.

    The last chunk of a bucket carries the bucket's fingerprint, computed by the sender where
    the bytes were packed; the receiver checks it once the whole bucket has arrived.
    """

    update_id: int
    bucket: int
    offset: int
    nbytes: int
    slot: int
    fingerprint: int | None = None

    def __post_init__(self) -> None:
        if min(self.bucket, self.offset, self.nbytes, self.slot) < 0:
            raise ManifestError(f"stage message has a negative field: {self}")


class Prepare(msgspec.Struct, tag="prepare", frozen=True):
    update_id: int


class Commit(msgspec.Struct, tag="commit", frozen=True):
    update_id: int


class Abort(msgspec.Struct, tag="abort", frozen=True):
    update_id: int
    reason: str = ""


class Status(msgspec.Struct, tag="status", frozen=True):
    """Ask which update the engine serves."""


TransactionRequest = Attach | Begin | Stage | Prepare | Commit | Abort | Status


class Ack(msgspec.Struct, tag="ack", frozen=True):
    committed_update_id: int
    in_flight_update_id: int | None = None


class Failed(msgspec.Struct, tag="failed", frozen=True):
    error: str  # the exception type's name, e.g. "ShapeMismatchError"
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> "Failed":
        name = type(exc).__name__ if isinstance(exc, ColosyncError) else "EngineError"
        message = str(exc) if isinstance(exc, ColosyncError) else f"{type(exc).__name__}: {exc}"
        return cls(error=name, message=message)

    def to_exception(self) -> ColosyncError:
        return error_from_wire(self.error, self.message)


class Codec:
    """msgpack encoder/decoder for one union of message types."""

    def __init__(self, message_type: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):  # noqa: ANN201 - returns a member of the union
        try:
            return self._decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ManifestError(f"malformed control message: {exc}") from None
