"""The transport interface: a few reusable byte slots visible to both sides.

A transport is deliberately dumb. The sender side owns ``slots`` byte buffers of
``slot_bytes`` each and publishes a typed handle; the receiver side opens the handle once and
sees the same slots. Which bytes sit in which slot, and when a slot may be reused, is the
Sender's and Receiver's business (the ``Stage`` message and its acknowledgement), so every
transport gets flow control, chunking of oversize buckets and fingerprints for free.

Flow control: with two or more slots the receiver may acknowledge a ``Stage`` before its copy
out of the slot has finished, so that copy overlaps the next one; the acknowledgement of
``Stage`` k then promises that the slots of every earlier ``Stage`` are free, and any other
reply promises that all are. With one slot every acknowledgement frees its own slot.

Ordering without the sender's host: a transport can seal a slot's writes on the sender's
stream (``SenderTransport.written`` returns the seal, which travels in ``Stage.seal``) and
have the receiver wait for that seal before it reads (``ReceiverTransport.ready``), so the
sender sends a ``Stage`` without waiting for its device. ``cuda_ipc`` seals with an
interprocess CUDA event; ``shm`` with a number its copy stream writes next to the slots, in
host memory. The fingerprint then travels with the seal (``fingerprint_cell`` /
``sent_fingerprint``) instead of inside the ``Stage``. The acknowledgement rule above still
decides when a slot may be written again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import msgspec
import torch

from colosync.errors import ConfigError
from colosync.wire.protocol import Stage


class Peers(msgspec.Struct, frozen=True):
    """The receivers one sender reaches at once (an ``EngineSet``): how many processes open the handle.

    ``receivers`` counts processes, not engines (a vLLM engine with TP=2 opens it in two workers).
    ``host``: the address the receivers reach the sender at; ``join_timeout_s``: how long a transport
    that forms a group waits for all of them; ``generation`` changes when the set's members do, so a
    Sender attaches afresh."""

    receivers: int
    host: str = "127.0.0.1"
    join_timeout_s: float = 60.0
    generation: int = 0

    def __post_init__(self) -> None:
        if self.receivers < 1:
            raise ConfigError(f"Peers needs at least one receiver, got {self.receivers}")
        if not self.join_timeout_s > 0:
            raise ConfigError(f"join_timeout_s must be positive, got {self.join_timeout_s}")


class SenderTransport(ABC):
    """Trainer side: creates the slots and the handle that describes them."""

    name: ClassVar[str]
    colocated: ClassVar[bool] = True
    """Whether the bytes pass through memory both sides map on one machine (False: over a network group)."""
    survives_abort: ClassVar[bool] = True
    """Whether the transport stays usable after an update is aborted midway; if not, a Sender attaches afresh."""

    @classmethod
    @abstractmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        """Whether this transport can work here for tensors on ``device``, and why (not)."""

    @classmethod
    @abstractmethod
    def create(cls, slot_bytes: int, slots: int, device: torch.device, peers: Peers | None = None) -> SenderTransport:
        """Allocate the slots once; they are reused for every update.

        ``peers``: the receivers that will open the handle when there are several (an ``EngineSet``);
        a transport that forms a group sizes it by them, one over shared memory ignores it (every
        receiver maps the same slots, as a vLLM engine's tensor-parallel workers do)."""

    @classmethod
    def geometry(cls, bucket_bytes: int, slots: int, device: torch.device) -> tuple[int, int]:
        """``(slot_bytes, slots)`` to create for buckets of ``bucket_bytes`` from ``device``.

        By default one slot per bucket in flight. A transport that copies through host memory
        may prefer more, smaller slots (the same bytes in all) so copies pipeline finely.
        """
        return bucket_bytes, slots

    _slot_bytes: int  # set by every transport's constructor
    _slots: int

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        return self._slots

    @abstractmethod
    def handle(self) -> bytes:
        """The encoded handle the receiver passes to ``ReceiverTransport.open``."""

    @abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """Writable ``uint8`` view of slot ``index`` (host or device memory)."""

    def attached(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """The peer has opened the handle (e.g. a name can now be unlinked)."""

    def publish(self, stage: Stage) -> None:  # noqa: B027 - optional hook, no-op by default
        """``stage``'s bytes are in its slot: written, or their copy's fence has passed.

        Called as soon as they are, before the Stage goes out (a Sender holds each Stage back until
        the next chunk is written). Shared memory needs nothing; a transport that moves the bytes
        itself (``broadcast``, ``p2p``) starts moving them here, so the move overlaps the next pack.
        """

    def written(self, index: int, device: torch.device, fingerprint: torch.Tensor | None = None) -> int:
        """Writes into slot ``index`` are queued on ``device``'s current stream: the seal the receiver waits for.

        0 (the default): no seal; the sender must wait for the writes on its host before sending
        the Stage. ``fingerprint``: on a bucket's last chunk, its ``[fingerprint, ...]`` int64 row
        on the device, written on the same stream before this call (the ``fingerprint_cell``
        where the transport has one). A transport that seals sends it with the seal.
        """
        return 0

    def fingerprint_cell(self, bucket: int) -> torch.Tensor | None:
        """Where to put bucket ``bucket``'s ``[fingerprint, flag]`` (int64 pair, on the device) for the receiver.

        ``None`` (the default): the fingerprint travels in the Stage. Otherwise the sender writes it
        there before ``written`` and sends the Stage with no fingerprint.
        """
        return None

    @abstractmethod
    def close(self) -> None:
        """Free the slots; idempotent."""


class ReceiverTransport(ABC):
    """Engine side: opens a handle and reads the slots."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def open(cls, handle: bytes, device: torch.device) -> ReceiverTransport: ...

    @abstractmethod
    def slot(self, index: int) -> torch.Tensor:
        """Readable ``uint8`` view of slot ``index``."""

    @property
    def num_slots(self) -> int:
        """How many slots the sender cycles through (2+ lets the receiver acknowledge early)."""
        return 1

    def ready(self, stage: Stage) -> None:  # noqa: B027 - optional hook, no-op by default
        """Order this process's current stream after the sender's writes for ``stage`` (its ``seal``)."""

    def sent_fingerprint(self, stage: Stage) -> torch.Tensor | None:
        """The int64 pair the sender's fingerprint of ``stage``'s bucket came in (first element), after ``ready``.

        In device memory (taken into the device's check on its stream) or host memory (read at
        once). ``None`` (the default): fingerprints travel in the Stage. The receiver zeroes it once read.
        """
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the mapping; idempotent."""
