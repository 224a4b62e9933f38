"""Fixtures for the handoff tests; the participants' states themselves are in ``tests.helpers``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.helpers import make_trainer_state


@pytest.fixture(scope="session", autouse=True)
def _warm_up() -> None:
    """Run one optimizer step before measuring: its first call imports modules (tens of MB of
    interpreter memory) that would otherwise look like a participant's allocation."""
    make_trainer_state(layers=1, width=64)


@pytest.fixture
def trainer_loader() -> Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]:
    return make_trainer_state
