"""What a step's floor is made of, measured in the same run as the step.

``colosync bench-step`` holds each phase against two floors: the bytes it copied at the pinned copy
rates (``pinned_rates``), and that plus the device bytes it allocated and freed at the rates the CUDA
allocator's own calls run at here (``allocator_times``). Both are measured in the controller before
any participant starts, on a device with nothing else on it, so a step's operations are compared
with what the hardware and the driver need, not with each other.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any


def pinned_rates(device: Any, nbytes: int = 1 << 30) -> dict[str, float]:
    """Median GB/s of one reusable pinned host buffer copied to the device and back (the
    floor's rates; ``colosync handoff-bench``'s reference copy)."""
    from colosync.tools.bench.handoff import pinned_copy_rate

    if device.type != "cuda":
        return {"to_device": 0.0, "to_host": 0.0}
    rates = pinned_copy_rate(device, nbytes)
    return {"to_device": rates["h2d_gbps"], "to_host": rates["d2h_gbps"]}


@dataclass
class AllocatorTimes:
    """A fresh block of ``block_bytes`` allocated and freed once per repeat: each call's seconds.

    Kept whole, not only as rates: the first allocation finds memory nobody used yet, the later
    ones follow a free of the same block, and the difference says what the driver defers."""

    block_bytes: int = 0
    allocate_s: list[float] = field(default_factory=list)
    free_s: list[float] = field(default_factory=list)

    def s_per_gb(self) -> dict[str, float]:
        """Median seconds per GB to ``allocate`` and to ``free`` (zeros when nothing was timed)."""
        gb = self.block_bytes / 1e9
        if not gb or not self.allocate_s or not self.free_s:
            return {"allocate": 0.0, "free": 0.0}
        return {"allocate": statistics.median(self.allocate_s) / gb, "free": statistics.median(self.free_s) / gb}


def allocator_times(device: Any, nbytes: int, repeats: int = 3) -> AllocatorTimes:
    """Time allocating a fresh ``nbytes`` block on ``device`` through torch's allocator (``cudaMalloc``)
    and giving it back (``empty_cache``: ``cudaFree``), ``repeats`` times, in this process. Nothing off
    CUDA, where there is no allocator to time."""
    import torch

    if device.type != "cuda" or nbytes <= 0:
        return AllocatorTimes()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    times = AllocatorTimes(nbytes)
    for _ in range(repeats):
        started = time.perf_counter()
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        times.allocate_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        del block
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        times.free_s.append(time.perf_counter() - started)
    return times


def allocator_floor(allocated: int, freed: int, rates: dict[str, float]) -> float:
    """Seconds the allocator's calls need to allocate ``allocated`` and free ``freed`` device bytes at ``rates``."""
    return allocated / 1e9 * rates.get("allocate", 0.0) + freed / 1e9 * rates.get("free", 0.0)


def copy_floor(to_host: int, to_device: int, rates: dict[str, float]) -> float:
    """Seconds ``to_host`` and ``to_device`` bytes take, one after the other, at the pinned ``rates``."""
    if not rates["to_host"] or not rates["to_device"]:
        return 0.0
    return to_host / rates["to_host"] / 1e9 + to_device / rates["to_device"] / 1e9
