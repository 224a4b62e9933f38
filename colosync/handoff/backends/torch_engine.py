"""Engine-side memory operations of any engine that is a ``torch.nn.Module`` plus KV-cache tensors.

The handoff needs four operations from an engine — drop the KV cache, release the weights
(with or without a host mirror), bring them back — as *separate* steps, because the ``gpu``
peak-device order puts the trainer's wake-up between dropping the KV cache and releasing
the weights.

``TorchEngineMemory`` works on colosync's ``hf`` reference engine or a custom one: weights
and KV cache are two ``TensorStash``es, so the same tensor objects are valid after each
onload and the mirror lives in a ``HostPool`` that the trainer can share. After ``lend()`` the
KV cache lives in a ``DeviceLoan`` that the trainer wakes up in while the KV cache is dropped,
so neither drop nor onload frees or allocates device memory. (vLLM's sleep mode
is the other engine backend; it depends on vLLM, so it lives with the engines:
``colosync.engines.vllm.memory``.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from colosync.errors import StashError
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.loan import DeviceLoan
from colosync.handoff.backends.stash import TensorStash, storage_bytes
from colosync.handoff.model.ops import Region
from colosync.handoff.model.participants import EngineMemory, Footprint, OpReport
from colosync.wire.protocol import LoanHandle

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
        if self.device.type == "cpu":
            _own_file_backed(self.weight_tensors())
        self._weights = TensorStash(f"{name}.weights", self.device, self.pool)
        self._kv = TensorStash(f"{name}.kv", self.device, self.pool)
        self._weight_bytes = storage_bytes(self.weight_tensors())
        self._kv_bytes = storage_bytes(self.kv_tensors())
        self.weights_valid = True
        """False after weights were released without a mirror, until the caller syncs them."""
        self.loan: DeviceLoan | None = None
        """The block the KV cache lives in once ``lend()`` was called, lent to the trainer while dropped."""

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
        return {
            Region.ENGINE_WEIGHTS: self._weight_bytes,
            Region.ENGINE_MIRROR: self._weight_bytes,
            Region.ENGINE_KV: self._kv_bytes,
        }

    def footprint(self) -> Footprint:
        device = self._weights.inflight_bytes + self._kv.inflight_bytes
        if not self._weights.offloaded:
            device += storage_bytes(self.weight_tensors())
        if self.loan is not None:
            device += self.loan.nbytes  # the block is the engine's while the trainer wakes up in it
        elif not self._kv.offloaded:
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
        return self._report_moves("offload_kv", started, stats)

    def offload_weights(self, backup: bool) -> OpReport:
        if self._weights.offloaded:
            return self._noop("offload_weights", "weights already off the device")
        started = time.perf_counter()
        self._weight_bytes = storage_bytes(self.weight_tensors())
        stats = self._weights.offload(self.weight_tensors(), backup=backup, on_peak=self._peak)
        if not backup:
            self.weights_valid = False
        self._return_to_device()
        note = "" if backup else "released without a mirror: weights come back as zeros until the next weight sync"
        return self._report_moves("offload_weights", started, stats, note=note)

    def onload_weights(self) -> OpReport:
        from_mirror = self._weights.backed_up
        hook = self.after_weights_onload
        return self._onload(
            "onload_weights",
            self._weights,
            "weights already resident",
            peak=True,
            after=None if hook is None else (lambda: hook(from_mirror)),
            note="" if from_mirror else "no mirror: weights are zeros; sync them from the trainer before generating",
        )

    def onload_kv(self) -> OpReport:
        into = self._kv_home() if self._kv.offloaded else None
        return self._onload("onload_kv", self._kv, "KV cache already allocated", after=self.after_kv_onload, into=into)

    def lend(self) -> LoanHandle:
        """Move the KV cache into one exportable block (its contents are forgotten, as at every
        ``offload_kv``) and return the block's handle; the same handle on every later call."""
        if self.loan is not None:
            return self.loan.handle
        resident = not self._kv.offloaded
        if resident:
            if self.release_graphs is not None:
                self.release_graphs()  # they captured the KV cache's old addresses
            self._kv.offload(self.kv_tensors(), backup=False)
            self._return_to_device()
        if not self._kv.offloaded_bytes:
            raise StashError(f"{self.name}: no KV cache to lend; give TorchEngineMemory its KV tensors (kv=)")
        try:
            self.loan = DeviceLoan.allocate(self._kv.offloaded_bytes, self.device)
        except BaseException:
            if resident:  # the engine stays where the plan has it: KV cache allocated (zeroed, as after onload)
                self._kv.restore(zero=True)
            raise
        if resident:
            self._kv.restore(zero=True, into=self._kv_home())
            if self.after_kv_onload is not None:
                self.after_kv_onload()
        return self.loan.handle

    def close(self) -> None:
        """Give the KV cache's block up (it goes once no tensor views it)."""
        if self.loan is not None:
            self.loan.close()
            self.loan = None

    def _kv_home(self) -> torch.Tensor | None:
        return None if self.loan is None else self.loan.view(0, self._kv.offloaded_bytes)

    def _onload(
        self,
        op: str,
        stash: TensorStash,
        resident: str,
        *,
        after: Callable[[], None] | None,
        peak: bool = False,
        note: str = "",
        into: torch.Tensor | None = None,
    ) -> OpReport:
        """Restore ``stash`` (from its mirror, else zeros; into ``into`` when given), then run the
        engine's ``after`` hook."""
        if not stash.offloaded:
            return self._noop(op, resident)
        started = time.perf_counter()
        stats = stash.restore(zero=True, on_peak=self._peak if peak else None, into=into)
        if after is not None:
            after()
        return self._report_moves(op, started, stats, note=note)

    def _return_to_device(self) -> None:
        """Give freed blocks back to the device: the next user may be another process (the trainer)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _own_file_backed(tensors: Iterable[torch.Tensor]) -> None:
    """Copy CPU tensors that are views of a memory-mapped file (``from_pretrained`` maps
    safetensors checkpoints) into ordinary memory. An offload frees and the executor counts
    anonymous memory; a file mapping would be neither freed by an offload nor counted."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((lo, hi))
    except OSError:
        return
    if not spans:
        return
    copies: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    with torch.no_grad():
        for t in tensors:
            ptr = t.data_ptr()
            if not t.numel() or not any(lo <= ptr < hi for lo, hi in spans):
                continue
            key = (ptr, tuple(t.shape), tuple(t.stride()))
            if key not in copies:
                copies[key] = t.detach().clone()
            t.data = copies[key]
