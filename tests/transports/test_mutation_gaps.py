"""Transport promises that the mutation run (benchmarks/mutation/) found no test holding.

The ``shm`` segment's name is Python's resource tracker's to clean up until a receiver has
mapped it: a sender that dies first leaves nothing in ``/dev/shm``, and one that closes
cleanly leaves the tracker nothing to do. Those two are checked in a fresh interpreter (its
own resource tracker, which only ends with it); each also makes a sender in this process,
which is what tells mutmut's per-test stats that the test exercises ``ShmSender``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import colosync
from colosync import transports
from colosync.errors import TransportError, TransportUnavailable
from colosync.transports.shm import CHUNK_BYTES, ShmReceiver, ShmSender, _unlink

CPU = torch.device("cpu")


def test_shm_slots_on_the_cpu_are_whole_buckets_however_large():
    """Cutting a segment into chunk-sized slots pays only where a host->device copy can pipeline (CUDA);
    a CPU sender keeps one slot per bucket in flight, at the bucket's size."""
    cpu = torch.device("cpu")
    for bucket in (CHUNK_BYTES // 2, CHUNK_BYTES, 4 * CHUNK_BYTES):
        assert ShmSender.geometry(bucket, 2, cpu) == (bucket, 2)
    assert ShmSender.geometry(4 * CHUNK_BYTES, 3, cpu) == (4 * CHUNK_BYTES, 3)


@pytest.mark.parametrize(("slot_bytes", "slots"), [(1 << 16, 0), (0, 1), (-8, 2), (1 << 16, -1)])
def test_a_segment_without_room_for_a_slot_is_refused_and_leaves_nothing(slot_bytes, slots):
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(TransportError, match="needs slot_bytes > 0 and slots > 0"):
        ShmSender(slot_bytes, slots, CPU)
    assert set(os.listdir("/dev/shm")) <= before


def test_a_closed_senders_slots_are_gone():
    """After ``close`` the mapping is released: a stale view request fails instead of reading freed memory."""
    sender = ShmSender(1 << 16, 2, CPU)
    assert sender.slot(1).numel() == 1 << 16
    sender.close()
    with pytest.raises(TransportError, match="segment is closed"):
        sender.slot(0)
    sender.close()  # idempotent


def test_a_receivers_closed_mapping_is_gone():
    sender = ShmSender(1 << 16, 1, CPU)
    try:
        receiver = ShmReceiver.open(sender.handle(), CPU)
        receiver.close()
        with pytest.raises(TransportError, match="segment is closed"):
            receiver.slot(0)
    finally:
        sender.close()


def test_a_sender_whose_name_someone_else_removed_still_closes():
    """A /dev/shm cleaner (or a second receiver's side) may unlink the name first; ``close`` must not fail."""
    sender = ShmSender(1 << 16, 1, CPU)
    _unlink(sender._name)  # the real unlink, from elsewhere
    assert sender._name not in os.listdir("/dev/shm")
    sender.close()
    _unlink(sender._name)  # and unlinking a name that is gone is a no-op


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports this same colosync (the mutated one under mutmut)."""
    root = str(Path(colosync.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


_MAKE = "import torch; from colosync.transports.shm import ShmSender; s = ShmSender(1 << 16, 2, torch.device('cpu'))"


def test_a_sender_that_dies_before_any_receiver_mapped_its_segment_leaves_nothing_behind():
    ShmSender(1 << 16, 1, CPU).close()  # (in this process too: see the module docstring)
    child = _python(_MAKE + "; import os; print(s._name, flush=True); os._exit(0)")  # dies without close()
    name = child.stdout.strip()
    assert name.startswith("colosync-"), child.stderr
    try:
        deadline = time.monotonic() + 30
        while name in os.listdir("/dev/shm") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert name not in os.listdir("/dev/shm"), "the dead sender's segment outlived it"
    finally:
        _unlink(name)


def test_a_sender_that_closes_leaves_the_resource_tracker_nothing_to_clean_up():
    ShmSender(1 << 16, 1, CPU).close()  # (in this process too: see the module docstring)
    child = _python(_MAKE + "; name = s._name; s.close(); print(name)")
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip().startswith("colosync-")
    assert "leaked" not in child.stderr and "Traceback" not in child.stderr, child.stderr


def test_auto_with_no_transport_the_engine_can_open_names_the_probe_command():
    """The engine may not see this /dev/shm (another container): each candidate is passed over, and the
    error says what to run to find out what the machine allows."""

    def engine_elsewhere(name: str, handle: bytes) -> object:
        if name != "shm":
            raise TransportError(f"{name} cannot be opened here")
        import msgspec

        from colosync.transports.shm import ShmHandle

        _unlink(msgspec.msgpack.decode(handle, type=ShmHandle).name)  # not in the engine's /dev/shm
        return ShmReceiver.open(handle, CPU)  # raises TransportError: cannot open

    with pytest.raises(TransportUnavailable, match=r"^no transport works here: .*'shm': .*cannot open") as info:
        transports.attach_first("auto", CPU, 1 << 16, 1, engine_elsewhere)
    assert str(info.value).endswith("; run `colosync probe` to see what this machine allows")
