"""The two participants of a handoff, as interfaces, and what their operations report.

A trainer and an inference engine are written by different frameworks; the handoff only
needs a few operations from each. Every operation is idempotent (calling it in the state it
leads to does nothing and says so) and returns an ``OpReport`` with the host and device
bytes it moved, allocated and freed, so a plan's expectations can be checked against what
really happened. Participants also say which ``Region``s they hold and how large each is,
which lets the executor compare the live state with the plan and simulate the plan with the
participants' real sizes.

Listeners let an observer (the executor's sampler) look at the machine at the moments that
matter inside an operation, e.g. after a copy to the host and before the device frees.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from colosync.errors import UnsupportedOperation
from colosync.handoff.model.ops import Op, Region
from colosync.wire.protocol import LoanHandle

Listener = Callable[["MemoryParticipant", str], None]
"""Called as ``listener(participant, event)``; event ``"peak"`` marks the moment inside an
operation when it holds both the old and the new copy."""


class OpReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one participant operation did."""

    participant: str
    op: str
    noop: bool = False
    """True when the operation found nothing to do (it is idempotent)."""
    seconds: float = 0.0
    host_allocated: int = 0
    host_freed: int = 0
    device_allocated: int = 0
    device_freed: int = 0
    bytes_to_host: int = 0
    """Bytes copied device -> host."""
    bytes_to_device: int = 0
    """Bytes copied host -> device."""
    device_retained: int = 0
    """Device bytes the operation meant to free but something else still references."""
    note: str = ""

    @property
    def gbps(self) -> float:
        moved = max(self.bytes_to_host, self.bytes_to_device)
        return moved / self.seconds / 1e9 if self.seconds > 0 and moved else 0.0


COUNTERS: tuple[str, ...] = tuple(
    f for f in OpReport.__struct_fields__ if f not in ("participant", "op", "noop", "seconds", "note")
)
"""The byte counts of an ``OpReport``: what a participant's helpers add up for it."""


class Footprint(msgspec.Struct, frozen=True):
    """What a participant holds now, as it accounts for it."""

    host_bytes: int
    """Host copies (mirror, backup) the participant holds."""
    device_bytes: int
    """Bytes of the participant's tensors resident on its device."""
    device_type: str
    """``cuda``, ``cpu``, ...: on ``cpu`` the device bytes are host memory too."""


class MemoryParticipant(abc.ABC):
    """Common surface of a trainer or engine memory backend."""

    actor: str = ""

    remote = False
    """True for a participant whose memory lives in another process (``runtime.remote``)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.actor
        self._listeners: list[Listener] = []
        self.step_context: tuple[str, int] = ("", 0)
        """The plan's phase and step index of the operation the executor is running."""

    @property
    def pid(self) -> int:
        """The process whose memory this participant holds (this one, unless remote)."""
        return os.getpid()

    def refresh(self) -> None:
        """Re-read state held elsewhere before it is looked at (one round trip for a remote
        participant); a local participant has nothing to do."""
        return None

    @abc.abstractmethod
    def regions(self) -> frozenset[Region]:
        """The regions this participant holds now."""

    @abc.abstractmethod
    def region_bytes(self) -> dict[Region, int]:
        """The size of each of this participant's regions (held or not)."""

    @abc.abstractmethod
    def footprint(self) -> Footprint:
        """Host and device bytes held now."""

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, event: str) -> None:
        for listener in list(self._listeners):
            listener(self, event)

    def run(self, op: Op, *, backup: bool = True) -> OpReport:
        """Perform ``op`` (one of this participant's operations)."""
        if op.actor != self.actor:
            raise UnsupportedOperation(
                f"{op.value} is not an operation of the {self.actor} ({self.name!r}); run it on the {op.actor}"
            )
        method = getattr(self, op.method)
        return method(backup) if op is Op.ENGINE_OFFLOAD_WEIGHTS else method()

    def close(self) -> None:
        """Let go of what the participant holds for the job's length (a loan); the default holds nothing."""
        return None

    def _report(self, op: str, started: float, **fields: Any) -> OpReport:
        return OpReport(participant=self.name, op=op, seconds=time.perf_counter() - started, **fields)

    def _report_moves(
        self, op: str, started: float, moves: OpReport, *, note: str = "", device_freed: int = 0
    ) -> OpReport:
        """This participant's report of ``op`` from the byte counts of what a helper did
        (``moves``, e.g. a ``TensorStash``'s), plus ``device_freed`` bytes freed besides."""
        counts = {name: getattr(moves, name) for name in COUNTERS}
        counts["device_freed"] += device_freed
        return self._report(op, started, note="; ".join(n for n in (moves.note, note) if n), **counts)

    def _noop(self, op: str, why: str) -> OpReport:
        return OpReport(participant=self.name, op=op, noop=True, note=why)

    def _peak(self) -> None:
        """Mark the peak of an operation (it holds the old and the new copy): listeners sample now."""
        self._notify("peak")


class TrainerMemory(MemoryParticipant):
    """Memory operations of a trainer that shares its GPUs with an engine."""

    actor = "trainer"

    @abc.abstractmethod
    def load(self) -> OpReport:
        """Bring the trainer's state onto the device (checkpoint load); no-op once loaded."""

    @abc.abstractmethod
    def sleep(self) -> OpReport:
        """Back the state up to the host and free the device; no-op while asleep."""

    @abc.abstractmethod
    def wake_up(self) -> OpReport:
        """Restore the state onto the device (same tensor objects) and free the host backup."""

    @abc.abstractmethod
    def offload_grad_buffer(self) -> OpReport:
        """Free the gradient buffer without a backup (the next step overwrites it)."""

    @abc.abstractmethod
    def clear_memory(self) -> OpReport:
        """Return the allocator's cached, unused device memory to the device."""

    def borrow(self, handle: LoanHandle) -> None:
        """Wake up from now on inside the memory the engine lends (``HandoffConfig(lend_kv=True)``)."""
        raise UnsupportedOperation(
            f"the trainer {self.name!r} ({type(self).__name__}) cannot wake up in memory the engine lends; "
            "use TorchTrainerMemory, or plan without lend_kv"
        )


class EngineMemory(MemoryParticipant):
    """Memory operations of an inference engine that shares its GPUs with a trainer."""

    actor = "engine"

    @abc.abstractmethod
    def offload_kv(self) -> OpReport:
        """Drop the KV cache and CUDA graphs (pure device memory, never backed up)."""

    @abc.abstractmethod
    def offload_weights(self, backup: bool) -> OpReport:
        """Release the weights from the device, keeping a host mirror when ``backup``."""

    @abc.abstractmethod
    def onload_weights(self) -> OpReport:
        """Bring the weights back (from the mirror, or empty when released without backup)."""

    @abc.abstractmethod
    def onload_kv(self) -> OpReport:
        """Re-allocate the KV cache (its contents are forgotten)."""

    def lend(self) -> LoanHandle:
        """Keep the KV cache from now on in one block the trainer can borrow while the KV cache is
        dropped, and return its handle (``HandoffConfig(lend_kv=True)``); the contents are forgotten."""
        raise UnsupportedOperation(
            f"the engine {self.name!r} ({type(self).__name__}) cannot lend its KV cache's memory; "
            "use TorchEngineMemory, or plan without lend_kv"
        )


class WeightSync(MemoryParticipant):
    """The weight sync as the plan's ``sync.weights`` step: ``push(mark)`` pushes the trainer's
    weights into the engine (e.g. ``lambda mark: sender.push_peft(model)``) and may call
    ``mark()`` at its peak (staged, before commit) so the executor samples memory there.

    ``sizes`` are the sync's planned regions (``HandoffSizes.sync_region_bytes()``): the
    executor holds what it measures during the step against them. The sync holds nothing
    between steps; its memory lives, while it runs, in the trainer's and engine's processes.
    """

    actor = "sync"

    def __init__(
        self,
        push: Callable[[Callable[[], None]], object],
        sizes: dict[Region, int] | None = None,
        *,
        device_type: str = "cpu",
        name: str = "sync",
    ) -> None:
        super().__init__(name)
        self.push = push
        self.sizes = dict(sizes or {})
        self.device_type = device_type
        self.last_result: object = None

    def regions(self) -> frozenset[Region]:
        return frozenset()

    def region_bytes(self) -> dict[Region, int]:
        return dict(self.sizes)

    def footprint(self) -> Footprint:
        return Footprint(0, 0, self.device_type)

    def weights(self) -> OpReport:
        started = time.perf_counter()
        self.last_result = self.push(self._peak)
        return self._report("weights", started, note=f"pushed: {self.last_result!r}"[:200])
