"""Engine-side memory operations: a generic torch engine, and vLLM's sleep mode.

The handoff needs four operations from an engine — drop the KV cache, release the weights
(with or without a host mirror), bring them back — as *separate* steps, because the ``gpu``
peak-device order puts the trainer's wake-up between dropping the KV cache and releasing
the weights.

* ``TorchEngineMemory`` works on any engine that is a ``torch.nn.Module`` plus KV-cache
  tensors (colosync's ``hf`` reference engine, or a custom one): weights and KV cache are
  two ``TensorStash``es, so the same tensor objects are valid after each onload and the
  mirror lives in a ``HostPool`` that the trainer can share.
* ``VllmEngineMemory`` maps the four operations onto vLLM's sleep mode: ``offload_kv`` is
  ``sleep(level=0)`` + ``release_kv_cache_memory()`` (the ``kv_cache`` tag),
  ``offload_weights(backup)`` is ``sleep(level=1)`` (weights to CPU) or ``sleep(level=2)``
  (discarded), ``onload_weights``/``onload_kv`` are ``wake_up(tags=["weights"])`` /
  ``wake_up(tags=["kv_cache"])``. vLLM implements sleep mode on CUDA (and ROCm/XPU) only:
  its CPU backend has none, which ``vllm_sleep_support`` reports instead of failing later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from colosync.errors import SleepModeUnavailable
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.model.ops import Region
from colosync.handoff.runtime.participants import EngineMemory, Footprint, OpReport
from colosync.handoff.backends.stash import StashStats, TensorStash, storage_bytes

log = logging.getLogger(__name__)

KVSource = Callable[[], Iterable[torch.Tensor]] | Sequence[torch.Tensor] | None


class TorchEngineMemory(EngineMemory):
    """Engine memory over a ``torch.nn.Module`` and its KV-cache tensors.

    ``kv`` is a sequence of tensors or a callable returning them (read at each
    ``offload_kv``). ``release_graphs`` is called before the KV cache goes (drop captured
    CUDA graphs, whose pools pin device memory); ``after_kv_onload`` after it comes back
    (reset the engine's cache bookkeeping: the contents are zeros).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVSource = None,
        *,
        pool: HostPool | None = None,
        device: torch.device | str | None = None,
        release_graphs: Callable[[], None] | None = None,
        after_kv_onload: Callable[[], None] | None = None,
        after_weights_onload: Callable[[bool], None] | None = None,
        name: str = "engine",
    ) -> None:
        super().__init__(name)
        self.model = model
        self._kv_source = kv
        self.pool = pool if pool is not None else HostPool(name=f"{name}-pool")
        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.release_graphs = release_graphs
        self.after_kv_onload = after_kv_onload
        self.after_weights_onload = after_weights_onload
        self._weights = TensorStash(f"{name}.weights", self.device, self.pool)
        self._kv = TensorStash(f"{name}.kv", self.device, self.pool)
        self._weight_bytes = storage_bytes(self.weight_tensors())
        self._kv_bytes = storage_bytes(self.kv_tensors())
        self.weights_valid = True
        """False after weights were released without a mirror, until the caller syncs them."""

    @classmethod
    def from_engine(cls, engine: Any, **kwargs: Any) -> TorchEngineMemory:
        """Wrap an engine object exposing ``model`` and optionally ``kv_cache_tensors()``,
        ``release_cuda_graphs()`` and ``reset_kv_cache()`` (the hook colosync's hf engine offers)."""
        kv = getattr(engine, "kv_cache_tensors", None)
        return cls(
            engine.model,
            kv,
            release_graphs=getattr(engine, "release_cuda_graphs", None),
            after_kv_onload=getattr(engine, "reset_kv_cache", None),
            **kwargs,
        )

    def weight_tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def kv_tensors(self) -> list[torch.Tensor]:
        src = self._kv_source
        if src is None:
            return []
        return list(src() if callable(src) else src)

    # -- participant surface ----------------------------------------------------------------
    def regions(self) -> frozenset[Region]:
        held = set()
        if not self._weights.offloaded:
            held.add(Region.ENGINE_WEIGHTS)
        elif self._weights.backed_up:
            held.add(Region.ENGINE_MIRROR)
        if not self._kv.offloaded and self._kv_bytes:
            held.add(Region.ENGINE_KV)
        return frozenset(held)

    def region_bytes(self) -> dict[Region, int]:
        return {Region.ENGINE_WEIGHTS: self._weight_bytes, Region.ENGINE_MIRROR: self._weight_bytes,
                Region.ENGINE_KV: self._kv_bytes}

    def footprint(self) -> Footprint:
        device = self._weights.inflight_bytes + self._kv.inflight_bytes
        if not self._weights.offloaded:
            device += storage_bytes(self.weight_tensors())
        if not self._kv.offloaded:
            device += storage_bytes(self.kv_tensors())
        return Footprint(self._weights.host_bytes + self._kv.host_bytes, device, self.device.type)

    # -- operations -------------------------------------------------------------------------
    def offload_kv(self) -> OpReport:
        if self._kv.offloaded:
            return self._noop("offload_kv", "KV cache already dropped")
        started = time.perf_counter()
        if self.release_graphs is not None:
            self.release_graphs()
        self._kv_bytes = storage_bytes(self.kv_tensors())
        stats = self._kv.offload(self.kv_tensors(), backup=False)
        if stats.noop:
            return self._noop("offload_kv", "no KV cache allocated")
        self._return_to_device()
        return self._from_stats("offload_kv", started, stats)

    def offload_weights(self, backup: bool) -> OpReport:
        if self._weights.offloaded:
            return self._noop("offload_weights", "weights already off the device")
        started = time.perf_counter()
        self._weight_bytes = storage_bytes(self.weight_tensors())
        stats = self._weights.offload(self.weight_tensors(), backup=backup, on_peak=lambda: self._notify("peak"))
        if not backup:
            self.weights_valid = False
        self._return_to_device()
        note = "" if backup else "released without a mirror: weights come back as zeros until the next weight sync"
        return self._from_stats("offload_weights", started, stats, note=note)

    def onload_weights(self) -> OpReport:
        if not self._weights.offloaded:
            return self._noop("onload_weights", "weights already resident")
        started = time.perf_counter()
        from_mirror = self._weights.backed_up
        stats = self._weights.restore(zero=True, on_peak=lambda: self._notify("peak"))
        if self.after_weights_onload is not None:
            self.after_weights_onload(from_mirror)
        note = "" if from_mirror else "no mirror: weights are zeros; sync them from the trainer before generating"
        return self._from_stats("onload_weights", started, stats, note=note)

    def onload_kv(self) -> OpReport:
        if not self._kv.offloaded:
            return self._noop("onload_kv", "KV cache already allocated")
        started = time.perf_counter()
        stats = self._kv.restore(zero=True)
        if self.after_kv_onload is not None:
            self.after_kv_onload()
        return self._from_stats("onload_kv", started, stats)

    def _return_to_device(self) -> None:
        """Give freed blocks back to the device: the next user may be another process (the trainer)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _from_stats(self, op: str, started: float, stats: StashStats, note: str = "") -> OpReport:
        return self._report(
            op, started,
            host_allocated=stats.host_allocated, host_freed=stats.host_freed,
            device_allocated=stats.device_allocated, device_freed=stats.device_freed,
            bytes_to_host=stats.bytes_to_host, bytes_to_device=stats.bytes_to_device,
            device_retained=stats.device_retained, note="; ".join(n for n in (stats.note, note) if n),
        )


# ---------------------------------------------------------------------------------------------
# vLLM


def vllm_sleep_support(llm: Any | None = None) -> tuple[bool, str]:
    """Whether vLLM's sleep mode can serve the handoff here, and why not.

    Needs ``vllm`` importable, a platform with sleep mode (CUDA/ROCm/XPU; vLLM's CPU backend
    has none), and — when ``llm`` is given — an engine started with ``enable_sleep_mode=True``.
    """
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        return False, f"vllm is not importable ({exc}); install vllm to use VllmEngineMemory"
    if not current_platform.is_sleep_mode_available():
        kind = "CPU" if current_platform.is_cpu() else str(getattr(current_platform, "device_name", "this"))
        return False, (
            f"vLLM's {kind} backend has no sleep mode (Platform.is_sleep_mode_available() is False), so it "
            f"cannot release and restore its weights or KV cache; run the engine with engine_offload=False "
            f"(peak_device='cpu'), or on CUDA with enable_sleep_mode=True"
        )
    if llm is not None:
        config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "model_config", None)
        if config is not None and not getattr(config, "enable_sleep_mode", False):
            return False, "this LLM was started without sleep mode; create it with LLM(..., enable_sleep_mode=True)"
    return True, "ok"


class VllmEngineMemory(EngineMemory):
    """Engine memory of a ``vllm.LLM`` through its sleep mode (CUDA only).

    Byte counts are measured: device bytes as the change of free GPU memory
    (``torch.cuda.mem_get_info``, which sees the engine's worker processes), host bytes as
    the change of the process tree's resident memory.
    """

    def __init__(self, llm: Any, *, name: str = "engine", device: int | None = None) -> None:
        super().__init__(name)
        ok, why = vllm_sleep_support(llm)
        if not ok:
            raise SleepModeUnavailable(why)
        self.llm = llm
        self.device = torch.device("cuda", device if device is not None else torch.cuda.current_device())
        self._kv_held = True
        self._weights_held = True
        self._mirror = False
        self._sizes = {Region.ENGINE_WEIGHTS: 0, Region.ENGINE_MIRROR: 0, Region.ENGINE_KV: 0}
        self._mirror_host_bytes = 0

    def regions(self) -> frozenset[Region]:
        held = set()
        if self._weights_held:
            held.add(Region.ENGINE_WEIGHTS)
        elif self._mirror:
            held.add(Region.ENGINE_MIRROR)
        if self._kv_held:
            held.add(Region.ENGINE_KV)
        return frozenset(held)

    def region_bytes(self) -> dict[Region, int]:
        return dict(self._sizes)

    def footprint(self) -> Footprint:
        device = (self._sizes[Region.ENGINE_WEIGHTS] if self._weights_held else 0) + (
            self._sizes[Region.ENGINE_KV] if self._kv_held else 0)
        return Footprint(self._mirror_host_bytes if self._mirror else 0, device, "cuda")

    def _measure(self, op: str, call: Callable[[], object]) -> OpReport:
        from colosync.handoff.runtime.sampling import HostSampler

        host = HostSampler()
        started = time.perf_counter()
        free0, _ = torch.cuda.mem_get_info(self.device)
        h0 = host.sample().value
        call()
        free1, _ = torch.cuda.mem_get_info(self.device)
        h1 = host.sample().value
        return self._report(
            op, started,
            device_freed=max(0, free1 - free0), device_allocated=max(0, free0 - free1),
            host_allocated=max(0, h1 - h0), host_freed=max(0, h0 - h1),
        )

    def offload_kv(self) -> OpReport:
        if not self._kv_held:
            return self._noop("offload_kv", "KV cache already released")
        if not self._weights_held:
            self._kv_held = False
            return self._noop("offload_kv", "released together with the weights by sleep()")

        def call() -> None:
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()

        report = self._measure("offload_kv", call)
        self._sizes[Region.ENGINE_KV] = report.device_freed
        self._kv_held = False
        return report

    def offload_weights(self, backup: bool) -> OpReport:
        if not self._weights_held:
            return self._noop("offload_weights", "weights already released")
        report = self._measure("offload_weights", lambda: self.llm.sleep(level=1 if backup else 2))
        kv_too = self._kv_held
        self._weights_held = False
        self._kv_held = False
        self._mirror = backup
        weights = report.device_freed - (self._sizes[Region.ENGINE_KV] if kv_too else 0)
        self._sizes[Region.ENGINE_WEIGHTS] = self._sizes[Region.ENGINE_MIRROR] = max(0, weights)
        self._mirror_host_bytes = report.host_allocated if backup else 0
        if kv_too:
            report = OpReport(**{**_fields(report), "note": "vLLM's sleep() released the KV cache as well"})
        return report

    def onload_weights(self) -> OpReport:
        if self._weights_held:
            return self._noop("onload_weights", "weights already resident")
        report = self._measure("onload_weights", lambda: self.llm.wake_up(tags=["weights"]))
        self._weights_held = True
        self._mirror = False
        return report

    def onload_kv(self) -> OpReport:
        if self._kv_held:
            return self._noop("onload_kv", "KV cache already allocated")
        report = self._measure("onload_kv", lambda: self.llm.wake_up(tags=["kv_cache"]))
        self._kv_held = True
        self._sizes[Region.ENGINE_KV] = max(self._sizes[Region.ENGINE_KV], report.device_allocated)
        return report


def _fields(report: OpReport) -> dict[str, Any]:
    return {name: getattr(report, name) for name in report.__struct_fields__}
