"""One hf engine process for the fault suite, with short deadlines, and a health check.

Every fault test ends with ``healthy(...)``: the engine process is alive, nothing is in
flight (an abandoned update was aborted within ``ABORT_WITHIN_S``), it serves exactly one of
the versions the test allows and its greedy tokens are that version's, no colosync segment is
left in ``/dev/shm``, and its resident memory is within 10% of the baseline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from tests.faults.updates import NEW_TOKENS, PROMPTS, reference_tokens, update_for

ABORT_WITHIN_S = 2.0
ROOT = Path(__file__).resolve().parents[2]


def shm_segments() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("colosync-"))


class FaultEngine:
    def __init__(self, engine, model_dir: str) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self.scales = {"base": 1.0, "new": 1.1}  # a full update to either: every push switches the served version
        self.updates = {version: update_for(model_dir, scale) for version, scale in self.scales.items()}
        self.tokens = {version: reference_tokens(model_dir, named) for version, named in self.updates.items()}
        assert self.tokens["base"] != self.tokens["new"], "the two versions must be told apart by their tokens"
        self.rss_baseline = 0

    def rss(self) -> int:
        proc = psutil.Process(self.engine.pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))

    def status(self):
        from colosync.wire.protocol import Status

        return self.engine.call(Status())

    def served(self) -> str:
        """Which version the engine's greedy tokens are ("base" or "new"); fails if neither."""
        from colosync.engines.config import Generate

        got = self.engine.call(Generate(PROMPTS, NEW_TOKENS)).tokens
        for version, tokens in self.tokens.items():
            if got == tokens:
                return version
        raise AssertionError(f"the engine serves tokens of no known version: {got}")

    def healthy(self, allowed: set[str], since: float | None = None) -> str:
        assert self.engine.is_alive(), "the engine process died"
        deadline = time.monotonic() + ABORT_WITHIN_S + 1.0
        while (status := self.status()).in_flight_update_id is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.in_flight_update_id is None, f"update {status.in_flight_update_id} still in flight"
        if since is not None:
            assert time.monotonic() - since <= ABORT_WITHIN_S + 1.0
        version = self.served()
        assert version in allowed, f"the engine serves {version!r}, expected one of {sorted(allowed)}"
        for _ in range(40):  # a dead sender's segment is unlinked by the engine's clean-up, give it a moment
            if not shm_segments():
                break
            time.sleep(0.05)
        assert not shm_segments(), f"leaked shared memory: {shm_segments()}"
        if self.rss_baseline:
            assert self.rss() <= 1.10 * self.rss_baseline, (self.rss(), self.rss_baseline)
        return version


def start_fault_engine(model_dir: str, device: str) -> FaultEngine:
    from colosync.engines.process import EngineConfig, EngineProcess
    from colosync.sync.sender import Sender

    config = EngineConfig(
        engine="hf",
        model_dir=model_dir,
        device=device,
        max_lora_rank=16,
        timeout_s=30.0,
        auth_timeout_s=1.0,
        message_timeout_s=1.0,
    )
    engine = EngineProcess(config)
    fault = FaultEngine(engine, model_dir)
    transport = "cuda_ipc" if device == "cuda" else "shm"
    with Sender(engine.connect("warm-up"), transport=transport) as sender:  # warm the allocator: RSS baseline after
        for version in ("new", "base"):
            sender.push([(n, t.to(device)) for n, t in fault.updates[version]])
    fault.served()  # and the serving path: a first generation loads kernels (~340 MB more RSS on CUDA)
    fault.rss_baseline = fault.rss()
    return fault


@pytest.fixture(scope="session")
def fault_engine(tiny_model_dir):
    fault = start_fault_engine(str(tiny_model_dir), "cpu")
    yield fault
    fault.engine.close()


@pytest.fixture(scope="session")
def fault_engine_cuda(tiny_model_dir):
    fault = start_fault_engine(str(tiny_model_dir), "cuda")
    yield fault
    fault.engine.close()
