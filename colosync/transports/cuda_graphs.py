"""Replaying repeated device work as CUDA graphs, keyed on every address the work touches.

A sync of a layout seen before repeats the same device work on the same memory: the
trainer's pack of hundreds of tensors into a slot, the engine's copy out of it with its
fingerprint and NaN/Inf check. On a VM each launch costs 20-25 us of CPU, so launching that
work as one graph instead of a launch per kernel is most of what is left to save once the
bytes move at device speed.

A graph bakes in the addresses, shapes and strides of everything it reads and writes, so
replaying it after any of them changed would silently read old memory or write into freed
memory. Each ``GraphCache`` entry is therefore keyed on all of them -- callers build keys
with ``LayoutVersion.key`` (data pointers, and a number for shapes, strides, dtypes and
devices) -- and a key that differs in anything is new work: run eagerly the first time it is
seen (which also compiles any Triton kernel it launches), captured and replayed from the
second sighting on. A graph never outlives the cache that holds it, and callers keep one
cache per owner of the memory it names that they do not key on (a sender's plan, an
engine's bucket plan), so a graph dies with that memory.

Anything that fails to capture is run eagerly, the cache switches itself off (logged once),
and nothing else changes. Without CUDA, or with ``COLOSYNC_NO_CUDA_GRAPHS`` set, every call
runs eagerly.
"""

from __future__ import annotations

import functools
import itertools
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
_DEVICE = operator.attrgetter("device")


Guard = Callable[[Sequence[torch.Tensor]], bool]
_versions = itertools.count(1)


def _layout_of(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
    columns = (_SHAPE, _STRIDE, _DTYPE, _DEVICE, torch.Tensor.is_conj, torch.Tensor.is_neg)
    return tuple(tuple(map(column, tensors)) for column in columns)


def _python_guard(tensors: Sequence[torch.Tensor]) -> Guard:
    want = _layout_of(tensors)
    return lambda ts: _layout_of(ts) == want


def _torch_guard(tensors: Sequence[torch.Tensor]) -> Guard:
    if len(set(map(id, tensors))) < len(tensors):  # TensorGuards refuses a tensor passed twice (tied weights)
        return _python_guard(tensors)
    from torch._C._dynamo.guards import TensorGuards

    sizes: list[Any] = [list(t.shape) for t in tensors]  # per tensor, every size and stride static: compared exactly
    strides: list[Any] = [list(t.stride()) for t in tensors]
    check = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides).check

    def holds(ts: Sequence[torch.Tensor]) -> bool:
        try:
            return bool(check(*ts))
        except TypeError:  # another number of tensors
            return False

    return holds


@functools.cache
def _guard_maker() -> Callable[[Sequence[torch.Tensor]], Guard]:
    """torch's ``TensorGuards`` where it imports and tells apart what it must, else the Python comparison."""
    try:
        a = torch.zeros(4, 4)
        holds = _torch_guard([a])
        b = torch.zeros(4, 4)
        b.data = b.data.t()  # the same shape, other strides
        changed = [[b], [a.double()], [torch.zeros(4, 5)], [a, a], [torch.zeros(4, 4)[1:]]]
        if holds([a]) and holds([torch.ones(4, 4)]) and not any(holds(ts) for ts in changed):
            return _torch_guard
        reason = "it did not tell changed layouts apart"
    except Exception as exc:  # a private torch API: any failure means the Python comparison
        reason = f"{type(exc).__name__}: {exc}"
    log.info("layouts are compared in Python (torch's TensorGuards unusable: %s)", reason)
    return _python_guard


class LayoutVersion:
    """A number for the shapes, strides, dtypes and devices of a list of tensors: the same while they keep them.

    Everything built over tensors -- a graph, a gather table, a checked plan -- is valid for as
    long as their layout and addresses stay. Reading them tensor by tensor in Python cost every
    seed-lora sync on an H100 host 171 us on the trainer (shape, dtype, contiguity) and 291 us on
    the engine (its graph key) for 624 tensors. ``of`` checks them against the last tensors seen in
    one C++ pass (torch's ``TensorGuards``, the check behind ``torch.compile``'s guards: 89 us there)
    and hands out a new number only when something changed. Numbers
    are unique in the process, so two owners' never collide. Where ``TensorGuards`` is missing or
    fails its self-test, the layout is compared in Python, as before. A tensor that changes
    anything else the guard sees (``requires_grad``, its Python type, its dispatch keys under the
    thread's modes such as ``torch.inference_mode``) gets a new number too: the caller then checks
    again what it would have checked anyway. So call ``of`` for one owner's tensors in one context.
    """

    def __init__(self) -> None:
        self._state: tuple[Guard, int] | None = None  # whether tensors still have the layout last seen, its number

    def of(self, tensors: Sequence[torch.Tensor]) -> int:
        state = self._state
        if state is None or not state[0](tensors):
            state = self._state = (_guard_maker()(tensors), next(_versions))  # one assignment: never a mixed pair
        return state[1]

    def key(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], int]:
        """What work over ``tensors`` depends on: their data pointers (with UVA they name the device too) and layout."""
        return tuple(map(_PTR, tensors)), self.of(tensors)


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


__all__ = ["GraphCache", "LayoutVersion", "enabled", "DISABLE_ENV"]
