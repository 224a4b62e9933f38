"""vLLM's sleep mode as the engine side of a colocated memory handoff.

The handoff (``colosync.handoff``) needs four operations from an engine, as separate steps:
drop the KV cache, release the weights (with or without a host mirror), bring them back.
``VllmEngineMemory`` maps them onto vLLM's sleep mode: ``offload_kv`` is ``sleep(level=0)`` +
``release_kv_cache_memory()`` (the ``kv_cache`` tag), ``offload_weights(backup)`` is
``sleep(level=1)`` (weights to CPU) or ``sleep(level=2)`` (discarded), and
``onload_weights``/``onload_kv`` are ``wake_up(tags=["weights"])`` /
``wake_up(tags=["kv_cache"])``. vLLM implements sleep mode on CUDA (and ROCm/XPU) only: its
CPU backend has none, which ``vllm_sleep_support`` reports instead of failing later.

It lives with the engines, not in ``colosync.handoff``, because it depends on vLLM: the
handoff layer stays framework-free and engines build on it. vLLM is imported only when used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from colosync.errors import SleepModeUnavailable
from colosync.handoff.model.ops import Region
from colosync.handoff.model.participants import EngineMemory, Footprint, OpReport
from colosync.handoff.runtime.sampling import HostSampler


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
            self._sizes[Region.ENGINE_KV] if self._kv_held else 0
        )
        return Footprint(self._mirror_host_bytes if self._mirror else 0, device, "cuda")

    def _measure(self, op: str, call: Callable[[], object]) -> OpReport:
        host = HostSampler()
        started = time.perf_counter()
        free0, _ = torch.cuda.mem_get_info(self.device)
        h0 = host.sample().value
        call()
        free1, _ = torch.cuda.mem_get_info(self.device)
        h1 = host.sample().value
        return self._report(
            op,
            started,
            device_freed=max(0, free1 - free0),
            device_allocated=max(0, free0 - free1),
            host_allocated=max(0, h1 - h0),
            host_freed=max(0, h0 - h1),
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
            report = msgspec.structs.replace(report, note="vLLM's sleep() released the KV cache as well")
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
