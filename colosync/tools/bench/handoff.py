"""Sleep/wake throughput of the trainer backends, side by side (``colosync handoff-bench``).

The acceptance bar is the PCIe rate: on an H200 host one reusable pinned buffer moves 55 GB/s
each way, and a ~40 GB trainer state should sleep and wake at >= 40 GB/s. The benchmark
builds ``tensors`` bf16 parameters totalling ``size_bytes`` on the device, measures the raw
pinned copy rate through one reusable buffer as the reference, then times ``sleep()`` and
``wake_up()`` of each backend (median of ``repeats``; the first cycle, which lays the state
out into one buffer, is reported apart) and checks the bytes survived the round trip.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from colosync.errors import ConfigError
from colosync.tools.bench.machine import run_header

Progress = Callable[[str], None]
BACKENDS = ("torch", "tms")


def _make_tensors(size_bytes: int, tensors: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    per = max(1, size_bytes // tensors // dtype.itemsize)
    gen = torch.Generator(device=device).manual_seed(0) if device.type == "cuda" else torch.Generator().manual_seed(0)
    out = []
    for _ in range(tensors):
        t = torch.empty(per, dtype=dtype, device=device)
        t.uniform_(-1, 1, generator=gen) if dtype.is_floating_point else t.random_(generator=gen)
        out.append(t)
    return out


def _checksum(ts: Sequence[torch.Tensor]) -> list[float]:
    picks = [ts[0], ts[len(ts) // 2], ts[-1]]
    return [float(t.float().sum().item()) for t in picks]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_rate(device: torch.device, nbytes: int, repeats: int = 5, pool: Any = None) -> dict[str, float]:
    """GB/s of device->host and host->device copies through one reusable host buffer."""
    from colosync.handoff.backends.host_pool import HostPool

    own = pool is None
    pool = pool or HostPool(chunk_bytes=min(nbytes, 1 << 30) // 4096 * 4096 or 4096)
    lease = pool.lease("bench.reference", nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h, h2d = [], []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        lease.write(0, dev)
        _sync(device)
        d2h.append(nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        lease.read(0, dev)
        _sync(device)
        h2d.append(nbytes / (time.perf_counter() - t0) / 1e9)
    lease.release()
    del dev
    if own:
        pool.close()
    return {"bytes": nbytes, "d2h_gbps": statistics.median(d2h), "h2d_gbps": statistics.median(h2d)}


def bench_torch(
    size_bytes: int,
    tensors: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    chunk_bytes: int,
    progress: Progress,
) -> dict[str, Any]:
    from colosync.handoff.backends.host_pool import HostPool
    from colosync.handoff.backends.torch_trainer import TorchTrainerMemory

    ts = _make_tensors(size_bytes, tensors, device, dtype)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in ts])
    del ts
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    pool = HostPool(chunk_bytes=chunk_bytes, name="bench-torch")
    progress(f"torch: reserving {nbytes / 1e9:.1f} GB of host memory (once)")
    reserve_s = pool.reserve(nbytes)
    trainer = TorchTrainerMemory(model, pool=pool, device=device)
    before = _checksum(params)
    sleeps, wakes = [], []
    first: dict[str, float] = {}
    for i in range(repeats + 1):
        progress(f"torch: cycle {i + 1}/{repeats + 1}")
        s = trainer.sleep()
        w = trainer.wake_up()
        if i == 0:
            first = {"sleep_gbps": s.bytes_to_host / s.seconds / 1e9, "wake_gbps": w.bytes_to_device / w.seconds / 1e9}
        else:
            sleeps.append(s.bytes_to_host / s.seconds / 1e9)
            wakes.append(w.bytes_to_device / w.seconds / 1e9)
    ok = _checksum(params) == before and all(p is q for p, q in zip(params, model.parameters(), strict=True))
    ref = pinned_copy_rate(device, min(nbytes, 4 << 30), pool=pool)
    del model, params, trainer
    pool.close()
    return {
        "backend": "torch",
        "available": True,
        "bytes": nbytes,
        "tensors": tensors,
        "dtype": str(dtype),
        "pool_reserve_seconds": reserve_s,
        "sleep_gbps_median": statistics.median(sleeps),
        "wake_gbps_median": statistics.median(wakes),
        "sleep_gbps": sleeps,
        "wake_gbps": wakes,
        "first_cycle": first,
        "verified": ok,
        "reference_pinned_copy": ref,
    }


def bench_tms(
    size_bytes: int, tensors: int, device: torch.device, dtype: torch.dtype, repeats: int, progress: Progress
) -> dict[str, Any]:
    from colosync.handoff.backends.tms_trainer import TmsTrainerMemory, tms_available

    ok, why = tms_available() if device.type == "cuda" else (False, "torch_memory_saver needs CUDA")
    if not ok:
        return {"backend": "torch_memory_saver", "available": False, "reason": why}
    try:
        import importlib.metadata as md

        version = md.version("torch_memory_saver")
    except Exception:  # the version is informational
        version = "unknown"
    trainer = TmsTrainerMemory(device=device)
    with trainer.state_region():
        ts = _make_tensors(size_bytes, tensors, device, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    before = _checksum(ts)
    sleeps, wakes = [], []
    for i in range(repeats):
        progress(f"torch_memory_saver: cycle {i + 1}/{repeats}")
        s = trainer.sleep()
        w = trainer.wake_up()
        sleeps.append(nbytes / s.seconds / 1e9)
        wakes.append(nbytes / w.seconds / 1e9)
    verified = _checksum(ts) == before
    del ts
    return {
        "backend": "torch_memory_saver",
        "available": True,
        "version": version,
        "bytes": nbytes,
        "tensors": tensors,
        "dtype": str(dtype),
        "sleep_gbps_median": statistics.median(sleeps),
        "wake_gbps_median": statistics.median(wakes),
        "sleep_gbps": sleeps,
        "wake_gbps": wakes,
        "verified": verified,
    }


def run_bench(
    *,
    size_bytes: int,
    tensors: int = 400,
    device: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 5,
    backends: tuple[str, ...] = ("torch", "tms"),
    chunk_bytes: int | None = None,
    progress: Progress | None = None,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    if chunk_bytes is None:  # 1 GiB chunks, smaller for small states (at most ~3% rounding waste)
        from colosync.handoff.backends.host_pool import chunk_bytes_for

        chunk_bytes = chunk_bytes_for(size_bytes)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    say = progress or (lambda _m: None)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    out = run_header(argv, device=dev) | {
        "device": str(dev),
        "size_bytes": size_bytes,
        "tensors": tensors,
        "repeats": repeats,
        "results": [],
    }
    for name in backends:
        if name == "torch":
            out["results"].append(bench_torch(size_bytes, tensors, dev, dtype, repeats, chunk_bytes, say))
        else:
            out["results"].append(bench_tms(size_bytes, tensors, dev, dtype, repeats, say))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out
