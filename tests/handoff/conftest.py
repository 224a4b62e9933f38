"""Fixtures for the handoff tests: small real participants (tens of MB of CPU tensors).

Sizes are multiples of the pool chunk so pool rounding stays small, and large enough
(>= 4 MiB per tensor, ~50 MB per host copy) that host-memory sampling sees them clearly above
interpreter noise, yet small enough to stay fast on two shared cores.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

MiB = 1 << 20
CHUNK = 4 * MiB


def make_trainer_state(layers: int = 4, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``layers`` x 4 MiB fp32 weights, their grads and AdamW state (48 MiB backed up + 16 MiB grads)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return model, opt


def make_engine_state(layers: int = 3, width: int = 2048, kv_tensors: int = 2) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """``layers`` x 16 MiB weights (48 MiB) and ``kv_tensors`` x 16 MiB KV cache."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for p in model.parameters():
        p.requires_grad_(False)
    kv = [torch.ones(16 * MiB // 4) for _ in range(kv_tensors)]
    return model, kv


@pytest.fixture(scope="session", autouse=True)
def _warm_up() -> None:
    """Run one optimizer step before measuring: its first call imports modules (tens of MB of
    interpreter memory) that would otherwise look like a participant's allocation."""
    make_trainer_state(layers=1, width=64)


@pytest.fixture
def trainer_loader() -> Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]:
    return make_trainer_state
