"""Memory backends with real tensors: the host pool, the stash, the torch trainer backend and
the torch engine backend. Every participant operation is checked for idempotency."""

from __future__ import annotations

import pytest
import torch

from colosync.handoff import Region
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.errors import HostPoolExhausted, StashError
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.stash import TensorStash
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory

from .conftest import CHUNK, MiB, make_engine_state, make_trainer_state


def about(value: int, expected: int) -> bool:
    """Equal up to the optimizer's scalar ``step`` tensors (8 bytes each on a CPU "device")."""
    return expected <= value <= expected + 4096


def pool(**kw) -> HostPool:
    return HostPool(chunk_bytes=kw.pop("chunk_bytes", CHUNK), pin="none", **kw)


# -- host pool ----------------------------------------------------------------------------------

def test_pool_reuses_chunks_and_splits_copies_at_chunk_edges():
    p = pool(chunk_bytes=1 * MiB)
    src = torch.arange(3 * MiB // 4, dtype=torch.int32).view(torch.uint8)
    lease = p.lease("a", src.numel())
    assert p.capacity_bytes == 3 * MiB and p.leases() == {"a": 3 * MiB}
    lease.write(0, src)
    back = torch.empty_like(src)
    lease.read(0, back)
    assert torch.equal(back, src)
    part = torch.empty(1000, dtype=torch.uint8)
    lease.read(MiB - 500, part)  # straddles a chunk boundary
    assert torch.equal(part, src[MiB - 500 : MiB + 500])
    lease.release()
    lease.release()  # idempotent
    again = p.lease("b", 2 * MiB)
    assert p.capacity_bytes == 3 * MiB  # no growth: chunks were reused
    again.release()
    assert p.trim() == 3 * MiB and p.capacity_bytes == 0
    with pytest.raises(StashError, match="already released"):
        lease.write(0, src)


def test_pool_max_bytes_names_the_fix():
    p = pool(chunk_bytes=MiB, max_bytes=2 * MiB)
    held = p.lease("engine.mirror", 2 * MiB)
    with pytest.raises(HostPoolExhausted, match="peak_device='gpu'") as info:
        p.lease("trainer.state", MiB)
    assert "engine.mirror" in str(info.value)
    held.release()
    p.lease("trainer.state", MiB).release()
    p.close()


# -- stash ------------------------------------------------------------------------------------------

def test_stash_keeps_objects_views_and_aliasing():
    base = torch.randn(1024, 256)
    view = base[:, 3:7]  # non-contiguous view of the same storage
    other = torch.arange(5000, dtype=torch.int64)
    before = (base.clone(), view.clone(), other.clone())
    ids = (id(base), id(view), id(other))
    st = TensorStash("t", "cpu", pool(chunk_bytes=MiB))
    stats = st.offload([base, view, other, base], backup=True)
    assert stats.tensors == 3 and stats.bytes_to_host >= base.numel() * 4 + other.numel() * 8
    assert base.numel() == 0 and other.numel() == 0  # placeholders: using them fails loudly
    assert stats.device_freed == base.numel() * 0 + 1024 * 256 * 4 + 5000 * 8
    assert st.offload([base], backup=True).noop  # idempotent
    st.restore()
    assert st.restore().noop
    assert (id(base), id(view), id(other)) == ids
    assert torch.equal(base, before[0]) and torch.equal(view, before[1]) and torch.equal(other, before[2])
    view.fill_(7.0)  # aliasing survived: writing the view changes the base
    assert torch.all(base[:, 3:7] == 7.0)
    assert base.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()  # one flat buffer


def test_second_cycle_is_one_large_copy():
    ts = [torch.randn(64, 1024) for _ in range(32)]  # 32 x 256 KiB
    st = TensorStash("t", "cpu", pool(chunk_bytes=16 * MiB))
    first = st.offload(ts, backup=True)
    assert first.copies == 32
    st.restore()
    second = st.offload(ts, backup=True)
    assert second.copies == 1  # laid out back to back: coalesced
    st.restore()


def test_stash_reports_memory_it_could_not_free():
    t = torch.randn(1 << 20)
    extra = t.view(-1)[:10]  # a view the stash is not told about
    st = TensorStash("t", "cpu", pool(chunk_bytes=MiB))
    stats = st.offload([t], backup=True)
    assert stats.device_retained == 4 * MiB and stats.device_freed == 0
    st.restore()
    del extra


def test_backup_needs_a_pool():
    with pytest.raises(StashError, match="HostPool"):
        TensorStash("t", "cpu").offload([torch.ones(3)], backup=True)


# -- trainer ---------------------------------------------------------------------------------------

def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, model[0].in_features)
    model(x).square().mean().backward()
    opt.step()


def test_trainer_sleep_wake_keeps_objects_and_values():
    model, opt = make_trainer_state(layers=4)
    trainer = TorchTrainerMemory(model, opt, pool=pool(), device="cpu")
    params = list(model.parameters())
    snapshot = [p.detach().clone() for p in params]
    state = [opt.state[p]["exp_avg"] for p in params]
    state_copy = [s.clone() for s in state]
    assert trainer.regions() == {Region.TRAINER_STATE, Region.TRAINER_GRADS, Region.TRAINER_CACHE}
    report = trainer.sleep()
    assert about(report.bytes_to_host, 4 * 3 * 4 * MiB)  # params + exp_avg + exp_avg_sq, grads skipped
    assert report.host_allocated >= report.bytes_to_host
    assert report.device_freed >= 4 * 4 * 4 * MiB  # grads freed too
    assert trainer.regions() == {Region.TRAINER_BACKUP}
    assert all(p.numel() == 0 for p in params) and all(p.grad.numel() == 0 for p in params)
    wake = trainer.wake_up()
    assert wake.bytes_to_device == report.bytes_to_host and wake.host_freed == report.host_allocated
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(torch.equal(p, s) for p, s in zip(params, snapshot, strict=True))
    assert all(opt.state[p]["exp_avg"] is s for p, s in zip(params, state, strict=True))
    assert all(torch.equal(s, c) for s, c in zip(state, state_copy, strict=True))
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)  # skipped backup -> zeros
    train_step(model, opt)  # the optimizer still works on the same objects
    assert not all(torch.equal(p, s) for p, s in zip(params, snapshot, strict=True))


def test_trainer_backup_grads_option():
    model, opt = make_trainer_state(layers=2)
    grads = [p.grad.clone() for p in model.parameters()]
    trainer = TorchTrainerMemory(model, opt, pool=pool(), device="cpu", backup_grads=True)
    report = trainer.sleep()
    assert about(report.bytes_to_host, 2 * 4 * 4 * MiB)
    assert trainer.offload_grad_buffer().noop
    trainer.wake_up()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("op, setup", [
    ("sleep", []), ("wake_up", ["sleep"]), ("offload_grad_buffer", []), ("clear_memory", []), ("load", []),
])
def test_trainer_operations_are_idempotent(op, setup, trainer_loader):
    trainer = TorchTrainerMemory(loader=lambda: trainer_loader(layers=2), pool=pool(), device="cpu")
    if op != "load":
        assert not trainer.load().noop
    for name in setup:
        getattr(trainer, name)()
    first = getattr(trainer, op)()
    regions = trainer.regions()
    footprint = trainer.footprint()
    second = getattr(trainer, op)()
    assert not first.noop, first.note
    assert second.noop and second.note
    assert trainer.regions() == regions and trainer.footprint() == footprint
    assert second.device_freed == second.host_allocated == second.bytes_to_host == 0


def test_trainer_operations_before_load_do_nothing(trainer_loader):
    trainer = TorchTrainerMemory(loader=trainer_loader, pool=pool(), device="cpu")
    assert trainer.regions() == frozenset()
    for op in ("sleep", "wake_up", "offload_grad_buffer", "clear_memory"):
        assert getattr(trainer, op)().noop
    report = trainer.load()
    assert report.device_allocated > 0 and Region.TRAINER_STATE in trainer.regions()


def test_grad_buffer_then_sleep_then_wake():
    model, opt = make_trainer_state(layers=2)
    trainer = TorchTrainerMemory(model, opt, pool=pool(), device="cpu")
    g = trainer.offload_grad_buffer()
    assert g.device_freed == 2 * 4 * MiB and g.bytes_to_host == 0
    assert Region.TRAINER_GRADS not in trainer.regions()
    s = trainer.sleep()
    assert about(s.bytes_to_host, 2 * 3 * 4 * MiB)
    trainer.wake_up()
    assert Region.TRAINER_GRADS in trainer.regions()
    train_step(model, opt)


# -- engine ------------------------------------------------------------------------------------------

def engine(**kw) -> TorchEngineMemory:
    model, kv = make_engine_state(layers=2, kv_tensors=2)
    return TorchEngineMemory(model, kv, pool=pool(), device="cpu", **kw)


@pytest.mark.parametrize("op, setup", [
    ("offload_kv", []), ("offload_weights", []), ("onload_weights", ["offload_weights"]),
    ("onload_kv", ["offload_kv"]),
])
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
    mem = TorchEngineMemory.from_engine(eng, pool=pool())
    assert mem.region_bytes()[Region.ENGINE_KV] == 16 * MiB
    mem.offload_kv()
    mem.onload_kv()
    assert eng.resets == 1
