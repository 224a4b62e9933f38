"""Shared fixtures: one tiny local model, one hf engine process and one store engine per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def shm_segments() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("colosync-"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    before = set(shm_segments())
    yield
    leaked = set(shm_segments()) - before
    assert not leaked, f"colosync shared memory leaked: {sorted(leaked)}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from colosync.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def hf_engine(tiny_model_dir):
    from colosync.engines.process import EngineConfig, EngineProcess

    engine = EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lora_rank=16))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def store_engine():
    from colosync.engines.process import EngineConfig, EngineProcess

    engine = EngineProcess(EngineConfig(engine="store", timeout_s=30.0))
    yield engine
    engine.close()
