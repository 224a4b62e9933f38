"""Trainer sleep/wake through ``torch_memory_saver`` (optional backend).

``torch_memory_saver`` keeps virtual addresses and swaps the physical memory underneath, so
tensors stay valid without any re-pointing; with ``enable_cpu_backup`` it copies each
allocation to freshly allocated pinned host memory on ``pause`` and frees it on ``resume``.
That per-pause pinned allocation is why it is slow (2.2 GB/s pausing, 6.8 GB/s resuming
16 GiB on an H200 host, against 55 GB/s through one reusable pinned buffer); it is offered
here for trainers that already allocate inside its regions and for side-by-side
measurement (``colosync handoff-bench``). It is imported only when used.

Allocate the trainer's state inside ``state_region()`` and its gradient buffer inside
``grad_region()`` (no backup: the next step overwrites it), before the plan runs or in the
``loader(memory)`` that the plan's ``trainer.load`` calls.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

from colosync.errors import ConfigError, UnsupportedOperation
from colosync.handoff.model.ops import Region
from colosync.handoff.model.participants import Footprint, OpReport, TrainerMemory


def tms_available() -> tuple[bool, str]:
    if importlib.util.find_spec("torch_memory_saver") is None:
        return False, "torch_memory_saver is not installed (pip install torch_memory_saver)"
    if not torch.cuda.is_available():
        return False, "torch_memory_saver needs CUDA"
    return True, "ok"


def _tms(hook_mode: str) -> Any:
    ok, why = tms_available()
    if not ok:
        raise UnsupportedOperation(why)
    from torch_memory_saver import torch_memory_saver

    # Before its first region: "torch" needs no LD_PRELOAD. (Its getter raises, so no hasattr.)
    if (
        getattr(torch_memory_saver, "_impl", None) is None
        and getattr(torch_memory_saver, "_impl_ctor_kwargs", None) is not None
    ):
        torch_memory_saver.hook_mode = hook_mode
    return torch_memory_saver


class TmsTrainerMemory(TrainerMemory):
    """Trainer memory on ``torch_memory_saver`` regions (see module docstring)."""

    def __init__(
        self,
        *,
        tag: str = "colosync.trainer",
        grad_tag: str = "colosync.trainer.grads",
        hook_mode: str = "torch",
        device: torch.device | str | None = None,
        loader: Callable[[TmsTrainerMemory], None] | None = None,
        cache_bytes: int = 0,
        name: str = "trainer",
    ) -> None:
        super().__init__(name)
        if cache_bytes < 0:
            raise ConfigError(f"cache_bytes must be >= 0 (the step's cached temporaries), got {cache_bytes}")
        self.tms = _tms(hook_mode)
        self.loader = loader  # builds the model inside this memory's regions, at the plan's load
        self.cache_bytes = cache_bytes  # as in TorchTrainerMemory: what a step may leave cached
        self.tag = tag
        self.grad_tag = grad_tag
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.state_bytes = 0
        self.grad_bytes = 0
        self._asleep = False
        self._grads_paused = False
        self._cache_held = True
        self._loaded = False

    @contextmanager
    def _region(self, tag: str, backup: bool) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.mem_get_info(self.device)[0]
        with self.tms.region(tag=tag, enable_cpu_backup=backup):
            yield
        torch.cuda.synchronize(self.device)
        grown = max(0, before - torch.cuda.mem_get_info(self.device)[0])
        if tag == self.tag:
            self.state_bytes += grown
        else:
            self.grad_bytes += grown
        self._loaded = True

    def state_region(self) -> Any:
        """Allocate parameters and optimizer state inside this (backed up on sleep)."""
        return self._region(self.tag, True)

    def grad_region(self) -> Any:
        """Allocate the gradient buffer inside this (dropped on sleep, no backup)."""
        return self._region(self.grad_tag, False)

    def regions(self) -> frozenset[Region]:
        if not self._loaded:
            return frozenset()
        if self._asleep:
            return frozenset({Region.TRAINER_BACKUP})
        held = {Region.TRAINER_STATE}
        if self.grad_bytes and not self._grads_paused:
            held.add(Region.TRAINER_GRADS)
        if self._cache_held:
            held.add(Region.TRAINER_CACHE)
        return frozenset(held)

    def region_bytes(self) -> dict[Region, int]:
        return {
            Region.TRAINER_STATE: self.state_bytes,
            Region.TRAINER_BACKUP: self.state_bytes,
            Region.TRAINER_GRADS: self.grad_bytes,
            Region.TRAINER_CACHE: self.cache_bytes,
            Region.TRAINER_LOAD: 0,
        }

    def footprint(self) -> Footprint:
        if self._asleep:
            return Footprint(self.state_bytes, 0, "cuda")
        return Footprint(0, self.state_bytes + (0 if self._grads_paused else self.grad_bytes), "cuda")

    def _timed(self, op: str, call: Any, **fields: Any) -> OpReport:
        started = time.perf_counter()
        call()
        torch.cuda.synchronize(self.device)
        return self._report(op, started, **fields)

    def load(self) -> OpReport:
        if self._loaded:
            return self._noop("load", "already loaded")
        if self.loader is None:
            return self._noop("load", "build the model inside state_region() / grad_region(), or pass loader=")
        loader = self.loader
        report = self._timed("load", lambda: loader(self))
        self._cache_held = True
        return msgspec.structs.replace(report, device_allocated=self.state_bytes + self.grad_bytes)

    def sleep(self) -> OpReport:
        if self._asleep:
            return self._noop("sleep", "already asleep")

        def call() -> None:
            if not self._grads_paused and self.grad_bytes:
                self.tms.pause(self.grad_tag)
            self.tms.pause(self.tag)
            torch.cuda.empty_cache()

        freed = self.state_bytes + (0 if self._grads_paused else self.grad_bytes)
        report = self._timed(
            "sleep", call, bytes_to_host=self.state_bytes, host_allocated=self.state_bytes, device_freed=freed
        )
        self._asleep = True
        self._grads_paused = bool(self.grad_bytes)
        self._cache_held = False
        return report

    def wake_up(self) -> OpReport:
        if not self._asleep:
            return self._noop("wake_up", "already awake")

        def call() -> None:
            self.tms.resume(self.tag)
            if self.grad_bytes:
                self.tms.resume(self.grad_tag)

        report = self._timed(
            "wake_up",
            call,
            bytes_to_device=self.state_bytes,
            host_freed=self.state_bytes,
            device_allocated=self.state_bytes + self.grad_bytes,
        )
        self._asleep = False
        self._grads_paused = False
        self._cache_held = True
        return report

    def offload_grad_buffer(self) -> OpReport:
        if self._asleep or self._grads_paused or not self.grad_bytes:
            return self._noop("offload_grad_buffer", "grad buffer already off the device or empty")
        report = self._timed("offload_grad_buffer", lambda: self.tms.pause(self.grad_tag), device_freed=self.grad_bytes)
        self._grads_paused = True
        return report

    def clear_memory(self) -> OpReport:
        if not self._cache_held:
            return self._noop("clear_memory", "no cached memory held")
        before = torch.cuda.memory_reserved(self.device)
        report = self._timed("clear_memory", torch.cuda.empty_cache)
        self._cache_held = False
        return msgspec.structs.replace(report, device_freed=max(0, before - torch.cuda.memory_reserved(self.device)))
