"""What a trainer participant offers the controller of a colocated step, whatever it trains.

The controller (``colosync.colocated.step.Colocated``) never holds the trainer's model: the
trainer runs in a process of its own (``ActorProcess``) or a Ray actor, and the controller
asks it, by method name, for four things: ``planned_sizes()`` (a ``TrainerPlan``: what its
handoff moves, so the plan can be sized before anything runs), ``push(probe=None)`` (one
sync into the engine, the ``SyncReport`` as msgpack bytes; a ``Probe`` rides the push when the
step verifies), ``handoff(data)`` (its memory operations for the controller's executor) and
``close()``. ``ServedTrainer`` implements all but the push and the sizes once, so a trainer
class writes only its model, its step and what its sleep moves.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch

from colosync.engines.ray_actor import memory_sample
from colosync.errors import ConfigError
from colosync.wire.protocol import Probe


class TrainerPlan(msgspec.Struct, frozen=True):
    """What a trainer tells the controller's plan about itself, per GPU (``HandoffSizes`` terms)."""

    backup: int  # what its sleep moves to the host
    resident: int  # what it holds on the device awake (the backup, the grad buffer, the rest)
    grad_buffer: int  # the part of ``resident`` freed without a backup
    sync_kind: str  # ``lora`` or ``full``
    sync_bytes: int  # the bytes of one push

    def __post_init__(self) -> None:
        if self.cache < 0:
            raise ConfigError(
                f"a trainer's resident bytes ({self.resident}) must cover its backup ({self.backup}) and grad "
                f"buffer ({self.grad_buffer}): count every device byte the awake trainer holds in resident"
            )

    @property
    def cache(self) -> int:
        """What ``resident`` holds beyond the backup and the grad buffer: the step's cached temporaries."""
        return self.resident - self.backup - self.grad_buffer


class ServedTrainer:
    """What every trainer actor offers its controller besides its step: ``handoff(data)``, its
    memory operations for a ``HandoffExecutor`` elsewhere (msgpack requests in, replies out;
    ``BytesMemoryLink`` on the controller's side) served by the ``TrainerMemory`` that
    ``trainer_memory(pool)`` builds; ``memory``, ``pid`` and ``close`` (of its ``sender``).

    A subclass sets ``device`` and ``sender`` and defines ``trainer_memory``,
    ``planned_sizes() -> TrainerPlan`` and ``push(probe=None) -> bytes`` (the msgpack of the
    ``SyncReport``; ``as_probe(probe)`` turns what arrived into the ``Probe`` to verify with)."""

    _service: Any = None
    device: torch.device
    sender: Any

    def trainer_memory(self, pool: Any) -> Any:
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        return memory_sample(self.device)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.sender.close()
        self.close_memory()

    def handoff(self, data: bytes) -> bytes:
        if self._service is None:
            from colosync.handoff.runtime.remote import MemoryService, serve_bytes

            service = MemoryService(factory=self.trainer_memory)
            self._service = (service, serve_bytes(service))
        reply: bytes = self._service[1](data)
        return reply

    def close_memory(self) -> None:
        if self._service is not None:
            self._service[0].close()


def as_probe(probe: Any) -> Probe | None:
    """The ``Probe`` a ``push`` received: as sent under Ray, or decoded from msgpack's plain
    mapping under ``ActorProcess``; ``None`` stays ``None`` (an unverified push)."""
    if probe is None or isinstance(probe, Probe):
        return probe
    return msgspec.convert(probe, Probe)


def engine_link(engine: Any, engine_name: str) -> Any:
    """The trainer's link to its engine: ``engine`` is the msgpack of an ``EngineAddress`` (an
    ``EngineProcess``'s socket) or a Ray actor handle of an ``EngineActor``."""
    if isinstance(engine, bytes):
        from colosync.control.channel import EngineAddress
        from colosync.engines.process import connect

        return connect(msgspec.msgpack.decode(engine, type=EngineAddress), engine_name, "trainer")
    from colosync.control.ray import RayLink

    return RayLink(engine, engine_name)


__all__ = ["ServedTrainer", "TrainerPlan", "as_probe", "engine_link"]
