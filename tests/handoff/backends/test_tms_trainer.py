"""The optional torch_memory_saver trainer backend: it says why it cannot run here."""

from __future__ import annotations

import pytest

from colosync.handoff import UnsupportedOperation


def test_tms_backend_explains_why_it_is_unavailable():
    from colosync.handoff.backends.tms_trainer import TmsTrainerMemory, tms_available

    ok, why = tms_available()
    if ok:
        pytest.skip("torch_memory_saver is usable here")
    assert "torch_memory_saver" in why
    with pytest.raises(UnsupportedOperation, match="torch_memory_saver"):
        TmsTrainerMemory()


@pytest.mark.gpu
def test_tms_backend_loads_through_its_loader_and_keeps_values_across_sleep():
    import torch

    from colosync.handoff import Region
    from colosync.handoff.backends.tms_trainer import TmsTrainerMemory, tms_available

    ok, why = tms_available()
    if not ok:
        pytest.skip(why)
    held: dict[str, torch.Tensor] = {}

    def loader(memory: TmsTrainerMemory) -> None:
        with memory.state_region():
            held["w"] = torch.arange(64 << 20, dtype=torch.float32, device="cuda")
        with memory.grad_region():
            held["g"] = torch.ones(16 << 20, dtype=torch.float32, device="cuda")

    memory = TmsTrainerMemory(loader=loader, cache_bytes=1 << 20)
    assert memory.load().device_allocated >= 256 << 20
    assert memory.load().noop
    assert memory.region_bytes()[Region.TRAINER_CACHE] == 1 << 20
    expected = held["w"].sum().item()
    memory.sleep()
    assert memory.regions() == {Region.TRAINER_BACKUP}
    memory.wake_up()
    assert held["w"].sum().item() == expected  # the state came back from its CPU backup
