"""A trainer served as bytes (what a Ray trainer actor's method does), driven through
``RemoteTrainerMemory``: the typed requests round-trip, errors come back as their own types."""

from __future__ import annotations

import pytest

from colosync.errors import ConfigError, HandoffError
from colosync.handoff import Region, build_plan
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.handoff.runtime.remote import BytesMemoryLink, MemoryService, RemoteTrainerMemory, serve_bytes
from colosync.wire.protocol import MemoryOp
from tests.helpers import CHUNK, make_engine_state, make_trainer_state


def test_a_trainer_behind_bytes_runs_a_plan():
    service = MemoryService(factory=lambda p: TorchTrainerMemory(loader=make_trainer_state, pool=p, device="cpu"))
    trainer = RemoteTrainerMemory(BytesMemoryLink(serve_bytes(service)), chunk_bytes=CHUNK, pin="none")
    model, kv = make_engine_state()
    engine = TorchEngineMemory(model, kv, pool=service.pool, device="cpu")  # one pool: same process here
    result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="gpu"), cycles=1)
    assert not result.violations
    assert trainer.regions() == {Region.TRAINER_BACKUP} and trainer.name == "trainer"
    sleep = next(r for r in result.records if r.step == "trainer.sleep")
    assert sleep.report.bytes_to_host >= 48 << 20 and trainer.region_bytes()[Region.TRAINER_BACKUP] >= 48 << 20
    assert trainer.state.sample.host_pids  # the serving side's own samples came back


def test_errors_come_back_typed():
    service = MemoryService(factory=lambda p: TorchTrainerMemory(loader=make_trainer_state, pool=p, device="cpu"))
    link = BytesMemoryLink(serve_bytes(service))
    with pytest.raises(ConfigError, match="not set up yet: send MemorySetup"):
        link.call(MemoryOp("trainer.sleep"))
    trainer = RemoteTrainerMemory(link, chunk_bytes=CHUNK, pin="none")
    with pytest.raises(HandoffError, match="unknown operation 'trainer.dance'"):
        link.call(MemoryOp("trainer.dance"))
    with pytest.raises(ConfigError, match="is a trainer, not a engine"):
        from colosync.handoff.runtime.remote import RemoteEngineMemory

        RemoteEngineMemory(link, chunk_bytes=CHUNK, pin="none")
    assert trainer.load().noop is False
