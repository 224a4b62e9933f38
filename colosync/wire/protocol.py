"""Control messages between a Sender and a Receiver.

Only these typed structs cross the control channel (a socket, vLLM's collective RPC, a Ray
call); tensor bytes travel through a transport. Messages are tagged msgspec structs encoded
as msgpack, so decoding can never execute code. The peer may be hostile or broken, so every
integer, length and count is bounded where it is declared and *any* failure to decode
(garbage, truncation, recursion, out-of-range integers, oversize messages) is a
``ManifestError`` that leaves no state touched, never an exception that ends the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from colosync.errors import ColosyncError, ManifestError, error_from_wire
from colosync.wire.manifest import MAX_NAME, UpdateId, UpdateManifest

MAX_MESSAGE_BYTES = 256 << 20
"""The largest control message a decoder reads (a manifest of a million tensors fits)."""

Index = Annotated[int, msgspec.Meta(ge=0, lt=2**48)]
Fingerprint = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Who a client is, sent once per connection: its process (so the engine can tell when it dies).

    ``adapter``: the named adapter this connection's updates are for, each its own transaction
    (own versions, owner, verification and rollback) on an engine that serves several; ``""``
    is the engine's default: full weights and its one adapter."""

    pid: Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
    host: Text = ""
    name: Text = ""
    adapter: Text = ""


class Attach(msgspec.Struct, tag="attach", frozen=True):
    """Open the sender's transport and own the engine's update channel; once per sender.

    An engine has one owner at a time. ``takeover=True`` ends a live owner's ownership (its
    in-flight update is aborted); without it a second sender is refused with
    ``EngineBusyError`` until the owner disconnects or dies.
    """

    transport: Text
    handle: Annotated[bytes, msgspec.Meta(max_length=1 << 16)]  # the transport's own typed handle
    takeover: bool = False


class Begin(msgspec.Struct, tag="begin", frozen=True):
    manifest: UpdateManifest


class BeginAgain(msgspec.Struct, tag="begin_again", frozen=True):
    """``Begin`` of the manifest of the last ``Begin`` on this connection, under a new ``update_id``.

    A sender repeats one layout update after update, and a 624-tensor manifest is ~70 KB on
    the wire; this is ~40 bytes. ``digest`` (``manifest_digest``) names the manifest meant: an
    engine whose last Begin on this connection has another one refuses it with
    ``UnknownLayoutError``, so a reference can never stand for the wrong layout.
    """

    update_id: UpdateId
    digest: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Stage(msgspec.Struct, tag="stage", frozen=True):
    """Bytes ``[offset, offset + nbytes)`` of ``bucket`` are ready in transport ``slot``.

    The last chunk of a bucket carries the bucket's fingerprint, computed by the sender where
    the bytes were packed; the receiver checks it once the whole bucket has arrived.
    ``seal`` (nonzero) says the bytes may still be on their way: the sender queued them on a
    device stream and sent the Stage without waiting, and the receiver's transport waits for
    this seal before it reads the slot (``ReceiverTransport.ready``). The fingerprint then
    travels with the seal, not in the Stage.
    """

    update_id: UpdateId
    bucket: Index
    offset: Index
    nbytes: Index
    slot: Index
    fingerprint: Fingerprint | None = None
    seal: Index = 0

    def __post_init__(self) -> None:
        if min(self.bucket, self.offset, self.nbytes, self.slot) < 0:
            raise ManifestError(f"stage message has a negative field: {self}")


class Prepare(msgspec.Struct, tag="prepare", frozen=True):
    update_id: UpdateId


class Probe(msgspec.Struct, frozen=True):
    """Proof of delivery: completions with the trainer's own logprobs under the update being sent.

    After commit and before it serves anything else, the engine scores the same completions
    and compares; a deviation over ``tolerance`` rolls a LoRA update back and fails a full
    update closed (``DeliveryError``).
    """

    prompts: Annotated[list[list[int]], msgspec.Meta(max_length=4096)]
    completions: Annotated[list[list[int]], msgspec.Meta(max_length=4096)]
    logprobs: Annotated[list[list[float]], msgspec.Meta(max_length=4096)]
    tolerance: float = 1e-3

    def __post_init__(self) -> None:
        if not self.prompts or not all(self.prompts) or not all(self.completions):
            raise ManifestError("a Probe needs at least one non-empty prompt and non-empty completions")
        if not (len(self.prompts) == len(self.completions) == len(self.logprobs)):
            raise ManifestError(
                f"a Probe has {len(self.prompts)} prompts, {len(self.completions)} completions and "
                f"{len(self.logprobs)} logprob rows; give one completion and one logprob row per prompt"
            )
        for i, (completion, row) in enumerate(zip(self.completions, self.logprobs, strict=True)):
            if len(completion) != len(row):
                raise ManifestError(f"Probe row {i}: {len(completion)} completion tokens but {len(row)} logprobs")
        if not (self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ManifestError(f"Probe tolerance must be a positive number, got {self.tolerance}")

    @classmethod
    def from_model(
        cls, model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8, tolerance: float = 1e-3
    ) -> Probe:
        """The probe of the model the trainer is about to push: its greedy completions of ``prompts``
        and their logprobs, computed the way the hf engine scores (``colosync.decoding``).

        ``model`` is a Hugging Face causal LM, a PEFT model included (then its active adapter
        counts, as the engine will serve it). For a full update that drops an adapter, probe the
        merged model (``merge_and_unload()``) or the base model alone.
        """
        from colosync.decoding import generate

        if max_new_tokens < 1:
            raise ManifestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        training = bool(getattr(model, "training", False))
        model.eval()  # no dropout: the engine scores in eval mode
        try:
            completions, logprobs = generate(model, prompts, max_new_tokens)
        finally:
            model.train(training)
        return cls([list(p) for p in prompts], completions, logprobs, tolerance)


class Commit(msgspec.Struct, tag="commit", frozen=True):
    update_id: UpdateId
    probe: Probe | None = None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    update_id: UpdateId
    reason: Text = ""


class Detach(msgspec.Struct, tag="detach", frozen=True):
    """The owner is done (``Sender.close``): drop its transport and let another sender attach."""

    reason: Text = ""


class Revert(msgspec.Struct, tag="revert", frozen=True):
    """Undo committed update ``update_id`` (it failed verification): reinstate the previous version,
    or, where the engine cannot (a full update), stop serving until a verified update commits."""

    update_id: UpdateId
    reason: Text = ""


class Status(msgspec.Struct, tag="status", frozen=True):
    """Ask which update the engine serves."""


TransactionRequest = Attach | Detach | Begin | BeginAgain | Stage | Prepare | Commit | Abort | Revert | Status

MAX_BATCH = 1 << 16


class Batch(msgspec.Struct, tag="batch", frozen=True):
    """Several requests of one update in one message: the Stages still held back, then Prepare
    and Commit. The engine applies them in order exactly as if each had come alone (a failed one
    does not stop the rest: each later one is refused as it would be) and answers one
    ``BatchReply``. What it saves is the engine's hop between its socket and its engine thread
    for each request after the first (``control.channel``)."""

    requests: Annotated[list[Stage | Prepare | Commit], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class Delivery(msgspec.Struct, frozen=True):
    """What the engine checked after installing an update (``Ack.delivery`` of a Commit)."""

    changed: int  # modules (LoRA) or parameters/layers (full) the engine actually changed
    expected: int  # what the manifest says should change
    max_deviation: float | None = None  # the probe's largest |logprob difference|; None: no probe
    seconds: float = 0.0  # what verification cost on the engine


class Ack(msgspec.Struct, tag="ack", frozen=True):
    committed_update_id: int
    in_flight_update_id: int | None = None
    highest_update_id: int = 0  # the largest id ever begun; a new update must exceed it
    serving: bool = True  # False: failed closed after a full update that did not verify
    delivery: Delivery | None = None
    adapter: int = 0  # the update whose LoRA adapter the engine applies now; 0: none
    waited_s: float = 0.0  # a commit's wait for room beside versions still in use (vLLM, commit_mode="inflight")

    def next_update_id(self) -> int:
        return max(self.committed_update_id, self.in_flight_update_id or 0, self.highest_update_id) + 1


class Failed(msgspec.Struct, tag="failed", frozen=True):
    error: str  # the exception type's name, e.g. "ShapeMismatchError"
    message: str
    status: Ack | None = None  # the engine's state after the failure (a stale sender resynchronises from it)

    @classmethod
    def from_exception(cls, exc: BaseException, status: Ack | None = None) -> Failed:
        name = type(exc).__name__ if isinstance(exc, ColosyncError) else "EngineError"
        message = str(exc) if isinstance(exc, ColosyncError) else f"{type(exc).__name__}: {exc}"
        return cls(error=name, message=message, status=status)

    def to_exception(self) -> ColosyncError:
        exc = error_from_wire(self.error, self.message)
        exc.status = self.status  # type: ignore[attr-defined]  # read by a Sender resynchronising its ids
        return exc


class BatchReply(msgspec.Struct, tag="batch_reply", frozen=True):
    """The replies to a ``Batch``, one per request, in order."""

    replies: Annotated[list[Ack | Failed], msgspec.Meta(max_length=MAX_BATCH)]


class Codec:
    """msgpack encoder/decoder for one union of message types."""

    def __init__(self, message_type: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        """The message: a member of this codec's union."""
        if len(data) > MAX_MESSAGE_BYTES:
            raise ManifestError(
                f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}; "
                "split the update (fewer tensors per manifest)"
            )
        try:
            return self._decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ManifestError(f"malformed control message: {exc}") from None
        except ColosyncError:
            raise
        except Exception as exc:  # RecursionError, OverflowError, MemoryError...: hostile input, never fatal
            raise ManifestError(f"malformed control message ({type(exc).__name__}: {exc})") from None


# -- memory handoff across a process boundary -------------------------------------------------
# A handoff executor drives a trainer's or an engine's memory operations in another process
# (an engine process, a Ray actor, a trainer run by a controller). These messages carry the
# operation and its report; region and operation names are the handoff's own strings
# (``engine.offload_weights``, ``trainer.backup``), validated where they are turned back into
# the handoff's enums, so the wire stays below the handoff layer.

Count = Annotated[int, msgspec.Meta(ge=0, lt=2**62)]
Pid = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class ArenaHandle(msgspec.Struct, frozen=True):
    """A node-wide host arena (POSIX shared memory) another process maps: name, size, chunking."""

    name: Text
    nbytes: Count
    chunk_bytes: Count
    header_bytes: Count

    @property
    def mapped_bytes(self) -> int:
        """What a process mapping the arena maps: its chunks and its table."""
        return self.header_bytes + self.nbytes


class MemorySetup(msgspec.Struct, tag="memory_setup", frozen=True):
    """Give a remote participant its host memory: map ``arena`` (shared with the other side),
    or, without one, a private pool of ``chunk_bytes`` chunks. Before the first operation, and
    again (while the participant holds no host copy) to rebuild it over other host memory."""

    arena: ArenaHandle | None = None
    chunk_bytes: Count = 1 << 30
    pin: Text = "auto"


class MemoryOp(msgspec.Struct, tag="memory_op", frozen=True):
    """Run one participant operation (``op`` as ``actor.method``) for step ``step`` of ``phase``."""

    op: Text
    backup: bool = True
    phase: Text = ""
    step: Annotated[int, msgspec.Meta(ge=0, lt=2**16)] = 0


class MemoryQuery(msgspec.Struct, tag="memory_query", frozen=True):
    """Ask a remote participant what it holds now (no operation)."""


class MemorySample(msgspec.Struct, frozen=True):
    """One process tree's memory at one moment, taken in that process.

    ``host_pids``: anon + shared memory per pid of the tree (shared pages as proportional
    set size when the tree maps a shared arena, so a page mapped by two processes counts
    once over both); ``device_used``: bytes in use on its GPU by every process (None
    without CUDA); ``host_bytes``/``device_bytes``/``device_type``: the participant's own
    accounting at that moment (its ``Footprint``)."""

    host_pids: dict[Pid, Count]
    host_bytes: Count
    device_bytes: Count
    device_type: Text
    device_used: Count | None = None


class MemoryState(msgspec.Struct, tag="memory_state", frozen=True):
    """What a remote participant holds now: its regions, their sizes, its footprint and process."""

    participant: Text
    actor: Text
    pid: Pid
    regions: Annotated[list[Text], msgspec.Meta(max_length=64)]
    region_bytes: dict[Text, Count]
    sample: MemorySample


class MemoryOpDone(msgspec.Struct, tag="memory_op_done", frozen=True):
    """The report of one remote operation (the handoff's ``OpReport`` fields), the participant's
    state after it, and its process's memory at each peak the operation marked."""

    participant: Text
    op: Text
    noop: bool
    seconds: float
    host_allocated: Count
    host_freed: Count
    device_allocated: Count
    device_freed: Count
    bytes_to_host: Count
    bytes_to_device: Count
    device_retained: Count
    note: Annotated[str, msgspec.Meta(max_length=1 << 16)]
    state: MemoryState
    peaks: Annotated[list[MemorySample], msgspec.Meta(max_length=1024)] = []


class LoanHandle(msgspec.Struct, frozen=True):
    """Device memory one participant lends another (``handoff.backends.loan``): on CUDA an IPC
    handle of one ``cudaMalloc`` block, on the CPU the name of a POSIX shared-memory segment."""

    kind: Text
    """``cuda_ipc`` or ``shm``."""
    nbytes: Count
    pid: Pid
    """The lender: a borrower in the same process uses the memory directly."""
    handle: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    device_uuid: Text = ""
    name: Text = ""


class MemoryLend(msgspec.Struct, tag="memory_lend", frozen=True):
    """Ask an engine participant to put its KV cache in memory it can lend, and for its handle."""


class MemoryLent(msgspec.Struct, tag="memory_lent", frozen=True):
    handle: LoanHandle
    state: MemoryState


class MemoryBorrow(msgspec.Struct, tag="memory_borrow", frozen=True):
    """Give a trainer participant the engine's lent memory to wake up into."""

    handle: LoanHandle
