"""The torch trainer backend with real tensors: sleep/wake keeps objects and values, every
operation is idempotent."""

from __future__ import annotations

import pytest
import torch

from colosync.errors import ConfigError, UnsupportedOperation
from colosync.handoff import Op, Region
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from tests.helpers import MiB, cpu_host_pool, make_trainer_state


def about(value: int, expected: int) -> bool:
    """Equal up to the optimizer's scalar ``step`` tensors (8 bytes each on a CPU "device")."""
    return expected <= value <= expected + 4096


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, model[0].in_features)
    model(x).square().mean().backward()
    opt.step()


def test_trainer_sleep_wake_keeps_objects_and_values():
    model, opt = make_trainer_state(layers=4)
    trainer = TorchTrainerMemory(model, opt, pool=cpu_host_pool(), device="cpu")
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


def test_a_sleep_counts_what_the_cache_gives_back_once(monkeypatch):
    # A CPU "device" has no CUDA cache: this stands in for empty_cache returning the freed storage
    # (which the stashes already counted) plus 3 MiB of other cached blocks.
    model, opt = make_trainer_state(layers=2)
    trainer = TorchTrainerMemory(model, opt, pool=cpu_host_pool(), device="cpu")
    grads = trainer.offload_grad_buffer()
    assert grads.device_freed == 2 * 4 * MiB
    freed = 2 * 3 * 4 * MiB  # params + exp_avg + exp_avg_sq of two layers
    monkeypatch.setattr(trainer, "_empty_cache", lambda: freed + 3 * MiB)
    report = trainer.sleep()
    assert about(report.device_freed, freed + 3 * MiB)  # not the stash's bytes twice


def test_trainer_backup_grads_option():
    model, opt = make_trainer_state(layers=2)
    grads = [p.grad.clone() for p in model.parameters()]
    trainer = TorchTrainerMemory(model, opt, pool=cpu_host_pool(), device="cpu", backup_grads=True)
    report = trainer.sleep()
    assert about(report.bytes_to_host, 2 * 4 * 4 * MiB)
    assert trainer.offload_grad_buffer().noop
    trainer.wake_up()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize(
    "op, setup",
    [
        ("sleep", []),
        ("wake_up", ["sleep"]),
        ("offload_grad_buffer", []),
        ("clear_memory", []),
        ("load", []),
    ],
)
def test_trainer_operations_are_idempotent(op, setup, trainer_loader):
    trainer = TorchTrainerMemory(loader=lambda: trainer_loader(layers=2), pool=cpu_host_pool(), device="cpu")
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
    trainer = TorchTrainerMemory(loader=trainer_loader, pool=cpu_host_pool(), device="cpu")
    assert trainer.regions() == frozenset()
    for op in ("sleep", "wake_up", "offload_grad_buffer", "clear_memory"):
        assert getattr(trainer, op)().noop
    report = trainer.load()
    assert report.device_allocated > 0 and Region.TRAINER_STATE in trainer.regions()


def test_grad_buffer_then_sleep_then_wake():
    model, opt = make_trainer_state(layers=2)
    trainer = TorchTrainerMemory(model, opt, pool=cpu_host_pool(), device="cpu")
    g = trainer.offload_grad_buffer()
    assert g.device_freed == 2 * 4 * MiB and g.bytes_to_host == 0
    assert Region.TRAINER_GRADS not in trainer.regions()
    s = trainer.sleep()
    assert about(s.bytes_to_host, 2 * 3 * 4 * MiB)
    trainer.wake_up()
    assert Region.TRAINER_GRADS in trainer.regions()
    train_step(model, opt)


def test_trainer_needs_a_model_or_a_loader():
    with pytest.raises(ConfigError, match="model .*or a loader"):
        TorchTrainerMemory(pool=cpu_host_pool(), device="cpu")


def test_trainer_refuses_an_engine_operation(trainer_loader):
    trainer = TorchTrainerMemory(loader=trainer_loader, pool=cpu_host_pool(), device="cpu")
    assert list(trainer.state_tensors()) == []  # nothing before load()
    with pytest.raises(UnsupportedOperation, match="engine.offload_kv is not an operation of the trainer"):
        trainer.run(Op.ENGINE_OFFLOAD_KV)
