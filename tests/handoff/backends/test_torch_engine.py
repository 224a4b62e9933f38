"""The torch engine backend with real tensors: KV cache and weights off and back, with and
without a mirror; every operation is idempotent."""

from __future__ import annotations

import pytest
import torch

from colosync.handoff import Region
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from tests.helpers import MiB, cpu_host_pool, make_engine_state


def engine(**kw) -> TorchEngineMemory:
    model, kv = make_engine_state(layers=2, kv_tensors=2)
    return TorchEngineMemory(model, kv, pool=cpu_host_pool(), device="cpu", **kw)


@pytest.mark.parametrize(
    "op, setup",
    [
        ("offload_kv", []),
        ("offload_weights", []),
        ("onload_weights", ["offload_weights"]),
        ("onload_kv", ["offload_kv"]),
    ],
)
def test_engine_operations_are_idempotent(op, setup):
    e = engine()
    for name in setup:
        e.run_op = getattr(e, name)(True) if name == "offload_weights" else getattr(e, name)()
    call = (lambda: e.offload_weights(True)) if op == "offload_weights" else getattr(e, op)
    first = call()
    regions, footprint = e.regions(), e.footprint()
    second = call()
    assert not first.noop and second.noop
    assert e.regions() == regions and e.footprint() == footprint


def test_engine_mirror_round_trip_keeps_weights():
    calls = []
    e = engine(release_graphs=lambda: calls.append("graphs"), after_kv_onload=lambda: calls.append("kv"))
    weights = [p.detach().clone() for p in e.model.parameters()]
    kv = e.kv_tensors()
    assert e.offload_kv().device_freed == 2 * 16 * MiB and calls == ["graphs"]
    assert e.regions() == {Region.ENGINE_WEIGHTS}
    off = e.offload_weights(backup=True)
    assert off.bytes_to_host == 2 * 16 * MiB and e.regions() == {Region.ENGINE_MIRROR}
    assert e.footprint().host_bytes >= off.bytes_to_host and e.footprint().device_bytes == 0
    on = e.onload_weights()
    assert on.bytes_to_device == off.bytes_to_host and on.host_freed > 0
    assert all(torch.equal(p, w) for p, w in zip(e.model.parameters(), weights, strict=True))
    e.onload_kv()
    assert calls == ["graphs", "kv"]
    assert all(t is k and t.numel() == 16 * MiB // 4 and not t.any() for t, k in zip(e.kv_tensors(), kv, strict=True))


def test_engine_without_mirror_comes_back_empty():
    e = engine()
    off = e.offload_weights(backup=False)
    assert off.bytes_to_host == 0 and off.host_allocated == 0 and e.regions() == {Region.ENGINE_KV}
    assert not e.weights_valid
    on = e.onload_weights()
    assert "sync" in on.note
    assert all(not p.any() for p in e.model.parameters())


def test_engine_from_engine_hook():
    class HfLikeEngine:
        def __init__(self):
            self.model, self._kv = make_engine_state(layers=1, kv_tensors=1)
            self.resets = 0

        def kv_cache_tensors(self):
            return self._kv

        def reset_kv_cache(self):
            self.resets += 1

    eng = HfLikeEngine()
    mem = TorchEngineMemory.from_engine(eng, pool=cpu_host_pool())
    assert mem.region_bytes()[Region.ENGINE_KV] == 16 * MiB
    mem.offload_kv()
    mem.onload_kv()
    assert eng.resets == 1


def test_engine_weights_hook_learns_whether_a_mirror_came_back():
    seen = []
    e = engine(after_weights_onload=seen.append)
    e.offload_weights(backup=True)
    assert e.onload_weights().note == ""
    e.offload_weights(backup=False)
    assert "no mirror" in e.onload_weights().note
    assert e.onload_weights().noop and seen == [True, False]
