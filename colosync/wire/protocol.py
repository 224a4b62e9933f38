"""Control messages between a Sender and a Receiver.

Only these typed structs cross the control channel (a pipe, vLLM's collective RPC, a Ray
call); tensor bytes travel through a transport. Messages are tagged msgspec structs encoded
as msgpack, so decoding can never execute code and a malformed message is rejected with a
``ManifestError`` before it touches any state.
"""

from __future__ import annotations

import msgspec

from colosync.errors import ColosyncError, ManifestError, error_from_wire
from colosync.wire.manifest import UpdateManifest


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
    highest_update_id: int = 0  # the largest id ever begun; a new update must exceed it

    def next_update_id(self) -> int:
        return max(self.committed_update_id, self.in_flight_update_id or 0, self.highest_update_id) + 1


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


class _RepeatedBegin:
    """Encode and decode a ``Begin`` that repeats the previous layout without re-walking it.

    A sender announces the same manifest every update with only ``update_id`` changed. Its
    msgpack bytes are then ``prefix + update_id + rest`` with ``prefix`` and ``rest`` equal to
    last time, so encoding is one concatenation and decoding one comparison of the bytes
    plus the new id; the manifest is rebuilt around the previous one's ``Layout`` object
    (``__post_init__`` still validates the id), so receivers find their per-layout state
    by identity. Anything that differs by a single byte takes the normal path.
    """

    _KEY = b"\xa9update_id"  # msgpack of the str "update_id"

    def __init__(self) -> None:
        self.prefix = self.rest = b""
        self.manifest: UpdateManifest | None = None

    def remember(self, data: bytes, message: "Begin") -> None:
        at = data.find(self._KEY, 0, 64)
        if at < 0:
            return
        start = at + len(self._KEY)
        number = msgspec.msgpack.encode(message.manifest.update_id)
        if data[start : start + len(number)] != number:
            return
        self.prefix, self.rest, self.manifest = data[:start], data[start + len(number) :], message.manifest

    def decode(self, data: bytes) -> "Begin | None":
        size = len(data) - len(self.prefix) - len(self.rest)
        if self.manifest is None or not 0 < size <= 9 or not data.startswith(self.prefix) or not data.endswith(self.rest):
            return None
        try:
            uid = msgspec.msgpack.decode(data[len(self.prefix) : len(self.prefix) + size], type=int)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        try:
            return Begin(msgspec.structs.replace(self.manifest, update_id=uid))
        except ManifestError:
            return None

    def encode(self, message: "Begin") -> bytes | None:
        cached, manifest = self.manifest, message.manifest
        if (
            cached is None
            or manifest.layout is not cached.layout
            or manifest.kind != cached.kind
            or manifest.lora != cached.lora
        ):
            return None
        return b"".join((self.prefix, msgspec.msgpack.encode(manifest.update_id), self.rest))


class Codec:
    """msgpack encoder/decoder for one union of message types."""

    def __init__(self, message_type: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._sent = _RepeatedBegin()
        self._received = _RepeatedBegin()

    def encode(self, message: msgspec.Struct) -> bytes:
        if type(message) is Begin:
            data = self._sent.encode(message)
            if data is None:
                data = self._encoder.encode(message)
                self._sent.remember(data, message)
            return data
        return self._encoder.encode(message)

    def decode(self, data: bytes):  # noqa: ANN201 - returns a member of the union
        if len(data) > 256:  # only a manifest is that long
            repeated = self._received.decode(data)
            if repeated is not None:
                return repeated
        try:
            message = self._decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ManifestError(f"malformed control message: {exc}") from None
        if type(message) is Begin:
            self._received.remember(bytes(data), message)
        return message
