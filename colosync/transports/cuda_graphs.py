"""Replaying repeated device work as CUDA graphs, keyed on every address the work touches.

A sync of a layout seen before repeats the same device work on the same memory: the
trainer's pack of hundreds of tensors into a slot, the engine's copy out of it with its
fingerprint and NaN/Inf check. On a VM each launch costs 20-25 us of CPU, so launching that
work as one graph instead of a launch per kernel is most of what is left to save once the
bytes move at device speed.

A graph bakes in the addresses, shapes and strides of everything it reads and writes, so
replaying it after any of them changed would silently read old memory or write into freed
memory. Each ``GraphCache`` entry is therefore keyed on all of them -- callers build keys
with ``tensors_key`` (data pointers and strides; shapes and dtypes where a plan does not fix
them) -- and a key that differs in anything is new work: run eagerly the first time it is
seen (which also compiles any Triton kernel it launches), captured and replayed from the
second sighting on. A graph never outlives the cache that holds it, and callers keep one
cache per owner of the memory it names that they do not key on (a sender's plan, an
engine's bucket plan), so a graph dies with that memory.

Anything that fails to capture is run eagerly, the cache switches itself off (logged once),
and nothing else changes. Without CUDA, or with ``COLOSYNC_NO_CUDA_GRAPHS`` set, every call
runs eagerly.
"""

from __future__ import annotations

import logging
import operator
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "COLOSYNC_NO_CUDA_GRAPHS"
Step = Literal["eager", "capture", "replay"]
_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def tensors_key(tensors: Sequence[torch.Tensor], shapes: bool = False) -> tuple[Any, ...]:
    """What a graph over ``tensors`` depends on: their data pointers and strides (and shapes, dtypes).

    Pass ``shapes=True`` unless something else (a plan built from these tensors' shapes and
    dtypes) already pins them. With UVA a data pointer also names the device.
    """
    key: tuple[Any, ...] = (tuple(map(_PTR, tensors)), tuple(map(_STRIDE, tensors)))
    if shapes:
        key += (tuple(map(_SHAPE, tensors)), tuple(map(_DTYPE, tensors)))
    return key


def enabled(device: torch.device) -> bool:
    """Whether work on ``device`` may be captured at all."""
    return device.type == "cuda" and not os.environ.get(DISABLE_ENV) and torch.cuda.is_available()


_SEEN = object()  # a key run once, eagerly
_PENDING = object()  # a key whose graph ``run`` is capturing now


class GraphCache:
    """Graphs of one owner's repeated device work, by key, the most recent ``capacity`` of them.

    ``run(key, work)`` runs ``work`` (device work only: no host syncs, no allocation that
    must outlive it) eagerly on a key's first sighting and as a replayed graph from its
    second. ``counts`` says how often each happened, for tests and logs.
    """

    def __init__(self, device: torch.device, capacity: int = 16) -> None:
        self.device = device
        self.capacity = max(1, capacity)
        self.enabled = enabled(device)
        self.counts: dict[str, int] = {"eager": 0, "capture": 0, "replay": 0}
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()  # key -> _SEEN or a CUDAGraph

    def __len__(self) -> int:
        return len(self._entries)

    def step(self, key: Hashable) -> Step:
        """What ``run`` does for ``key`` now, and the bookkeeping for it (no device work here)."""
        if not self.enabled:
            return "eager"
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _SEEN
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return "eager"
        self._entries.move_to_end(key)
        if entry is _SEEN:
            self._entries[key] = _PENDING
            return "capture"
        return "replay"

    def run(self, key: Hashable | Callable[[], Hashable], work: Callable[[], None]) -> Step:
        """Run ``work`` for ``key`` (or for what ``key()`` returns: built only when graphs are on)."""
        if not self.enabled:
            work()
            self.counts["eager"] += 1
            return "eager"
        if callable(key):
            key = key()
        step = self.step(key)
        if step == "replay":
            self._entries[key].replay()
        elif step == "capture":
            graph = self._capture(work)
            if graph is None:  # not capturable: eager from now on
                step = "eager"
                work()
            else:
                self._entries[key] = graph
                graph.replay()
        else:
            work()
        self.counts[step] += 1
        return step

    def clear(self) -> None:
        self._entries.clear()

    def _capture(self, work: Callable[[], None]) -> Any:
        device = self.device
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    work()
                finally:
                    graph.capture_end()
        except Exception as exc:  # an op that cannot be captured: run this owner's work eagerly
            log.warning("CUDA graph capture failed on %s (%s: %s); running eagerly", device, type(exc).__name__, exc)
            self.enabled = False
            self._entries.clear()
            torch.cuda.current_stream(device).wait_stream(side)
            return None
        current.wait_stream(side)
        return graph


__all__ = ["GraphCache", "tensors_key", "enabled", "DISABLE_ENV"]
