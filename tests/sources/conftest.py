"""One long-lived world of 4 gloo ranks shared by the Megatron source tests (see ``World``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # megatron_helpers / megatron_workers, also in spawned ranks


@pytest.fixture(scope="package")  # torn down once tests/sources is done, not at session end
def cpu_world():
    pytest.importorskip("megatron.core")
    from megatron_helpers import World

    world = World(4, backend="gloo")
    yield world
    world.close()
