"""The synthetic engine: a full update is staged in the handoff's host pool (the shared arena
in a colocated job), leased for one update and given back, and an update that finds no room
there is refused whole, the engine serving its previous weights.

Real processes: the engine in an ``EngineProcess``, the arena shared memory mapped by both.
"""

from __future__ import annotations

import pytest
import torch

from colosync.engines.config import EngineConfig
from colosync.engines.process import EngineProcess
from colosync.engines.synthetic import Digest, SyntheticModel, digest
from colosync.errors import ColosyncError, ConfigError
from colosync.handoff.backends.arena import HostArena
from colosync.sync.sender import Sender

MiB = 1 << 20


def test_layout_cuts_the_weights_into_pieces_and_refuses_a_model_smaller_than_a_row():
    spec = SyntheticModel(weight_bytes=5 * MiB, tensor_bytes=2 * MiB, dtype="float32")
    shapes = [shape for _, shape in spec.layout()]
    assert shapes == [(128, 4096), (128, 4096), (64, 4096)]
    assert sum(r * c * 4 for r, c in shapes) == 5 * MiB
    with pytest.raises(ConfigError, match="one row of 16384 bytes"):
        SyntheticModel(weight_bytes=100, dtype="float32")


def test_a_full_update_lands_in_the_arena_and_is_refused_whole_when_the_arena_is_full(tmp_path):
    spec = SyntheticModel(weight_bytes=3 * MiB, tensor_bytes=MiB, dtype="float32", seed=1).save(tmp_path)
    model = SyntheticModel.load(spec)
    start = digest(list(model.build("cpu").parameters()))
    new = model.build("cpu", seed=7)
    named = [(n, p.data) for n, p in new.named_parameters()]
    with (
        HostArena.create(4 * MiB, chunk_bytes=2 * MiB, pin="none") as arena,
        EngineProcess(EngineConfig(engine="synthetic", model_dir=str(spec))) as engine,
    ):
        engine.memory(arena=arena, pin="none")  # the engine maps the arena and stages there
        sender = Sender(engine.link, transport="shm", bucket_bytes=MiB)
        hog = arena.pool().lease("hog", arena.nbytes)  # nothing left for the update's staging
        try:
            with pytest.raises(ColosyncError, match="sync_staging"):
                sender.push(named)
            assert engine.call(Digest()).fingerprints == start  # the previous weights, whole
            assert engine.call(Digest()).update_id == 0
        finally:
            hog.release()
        report = sender.push(named)
        served = engine.call(Digest())
        assert served.update_id == report.update_id and served.fingerprints == digest(list(new.parameters()))
        assert served.fingerprints != start
        assert arena.leased_bytes == 0  # the staging lease went back after the commit
        sender.close()


def test_digest_tells_one_changed_element_apart():
    a = SyntheticModel(weight_bytes=MiB, dtype="float32").build("cpu")
    before = digest(list(a.parameters()))
    with torch.no_grad():
        next(a.parameters())[3, 5] += 1e-3
    assert digest(list(a.parameters())) != before
