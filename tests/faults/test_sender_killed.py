"""kill -9 of a sender at points spread across a push: the engine keeps serving exactly one version.

Each case starts a real trainer process (``tests/faults/killer.py``) that pushes a full update
switching the engine to the other of two versions and SIGKILLs itself at one point; for the
``BeginAgain`` points it first pushes the version the engine serves, so the dying push repeats
a layout. Before the Commit is on the wire (in the update's closing ``Batch``) the engine must
still serve the previous version; once it is sent either version may stand (the engine decides
alone), once its reply was read the new one must. In every case the abandoned update is
aborted within ``ABORT_WITHIN_S`` of the death (the connection's end tells the engine at once),
nothing stays in flight, no segment is left in ``/dev/shm`` and the engine's memory stays within
10% of its baseline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from colosync import transports
from tests.faults.conftest import ROOT

# (point, may the update have committed, must it have). Over the engine's socket the update's tail
# (the last Stage, Prepare and Commit) is one Batch, and a repeated manifest is begun with BeginAgain.
POINTS = [
    ("before:Begin:0", False, False),  # attached, nothing begun
    ("after:Begin:0", False, False),  # begun, no byte staged
    ("before:Stage:0", False, False),  # first bucket packed into the slot, not announced
    ("after:Stage:0", False, False),
    ("after:Stage:1", False, False),
    ("after:Stage:mid", False, False),
    ("before:Batch:0", False, False),  # every bucket packed, the last one not announced
    ("after:Batch:0", True, False),  # the last Stage, Prepare and Commit on the wire, no reply read
    ("replied:Batch:0", True, True),  # committed, killed before it could report
    ("before:BeginAgain:0", False, False),  # a second push of one layout, before its 40-byte Begin
    ("after:BeginAgain:0", False, False),  # begun again, no byte staged
]

CPU_TRANSPORTS = [
    name for name in transports.names() if transports.sender_class(name).available(torch.device("cpu"))[0]
]


def kill_at(fault_engine, transport: str, device: str, point: str, may_commit: bool, must_commit: bool) -> None:
    before = fault_engine.healthy({"base", "new"})
    target = "new" if before == "base" else "base"
    address = msgspec.msgpack.encode(fault_engine.engine.address).hex()
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.faults.killer",
            address,
            point,
            transport,
            fault_engine.model_dir,
            str(fault_engine.scales[target]),
            device,
            *([str(fault_engine.scales[before])] if "BeginAgain" in point else []),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
        capture_output=True,
        text=True,
        timeout=120,
    )
    died = time.monotonic()
    assert child.returncode == -9, (
        f"the child was not killed at {point} (exit {child.returncode}):\n{child.stderr[-2000:]}"
    )
    allowed = {before, target} if may_commit else {before}
    if must_commit:
        allowed = {target}
    fault_engine.healthy(allowed, since=died)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("point, may_commit, must_commit", POINTS, ids=[p for p, _, _ in POINTS])
def test_sender_killed_at(fault_engine, transport, point, may_commit, must_commit):
    kill_at(fault_engine, transport, "cpu", point, may_commit, must_commit)


@pytest.mark.gpu
@pytest.mark.parametrize("point, may_commit, must_commit", POINTS, ids=[p for p, _, _ in POINTS])
def test_sender_killed_at_on_the_gpu_through_cuda_ipc(fault_engine_cuda, point, may_commit, must_commit):
    kill_at(fault_engine_cuda, "cuda_ipc", "cuda", point, may_commit, must_commit)


@pytest.mark.gpu
@pytest.mark.parametrize("point, may_commit, must_commit", POINTS, ids=[p for p, _, _ in POINTS])
def test_sender_killed_at_on_the_gpu_through_shm(fault_engine_cuda, point, may_commit, must_commit):
    """Over shm from a GPU the Stages go out sealed: the engine may be waiting for a dead sender's seal."""
    kill_at(fault_engine_cuda, "shm", "cuda", point, may_commit, must_commit)
