"""``shm`` specifics beyond the shared contract: the segment's name never outlives its sender; seals;
slot geometry and closed mappings."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

import colosync
from colosync.errors import ManifestError, TransportError
from colosync.transports import shm
from colosync.transports.shm import CHUNK_BYTES, ShmReceiver, ShmSender, _unlink
from colosync.wire.protocol import Stage

_MAKE = "import torch; from colosync.transports.shm import ShmSender; s = ShmSender(1 << 16, 2, torch.device('cpu'))"
CPU = torch.device("cpu")


def test_a_sender_closed_before_any_receiver_attached_unlinks_its_segment():
    sender = ShmSender(1 << 16, 2, torch.device("cpu"))
    name = sender._name
    assert name in os.listdir("/dev/shm")
    sender.close()
    assert name not in os.listdir("/dev/shm")
    sender.close()  # idempotent


# -- seals: the receiver waits for the sender's copy without the sender's host (see colosync.transports.shm).
# On a GPU the sender's copy stream writes the seal behind each chunk (tests/transports/test_cuda_ipc.py);
# here it is written by hand, as that stream would, to test the receiver's side on any host.


def _pair(slots: int = 2) -> tuple[ShmSender, ShmReceiver]:
    sender = ShmSender(1 << 16, slots, torch.device("cpu"))
    return sender, ShmReceiver.open(sender.handle(), torch.device("cpu"))


def test_a_receiver_reads_a_sealed_slot_only_once_its_seal_and_fingerprint_are_there():
    sender, receiver = _pair()
    try:
        sender._seals[1] = torch.tensor([42, 6])  # an earlier chunk's seal in the same slot
        stage = Stage(3, 0, 0, 100, 1, None, 7)
        landed = threading.Timer(0.2, sender._seals[1].copy_, (torch.tensor([-5, 7]),))
        start = time.monotonic()
        landed.start()
        receiver.ready(stage)
        assert time.monotonic() - start >= 0.19  # the older seal 6 did not pass for 7
        assert receiver.sent_fingerprint(stage).tolist() == [-5, 7]
        assert receiver.sent_fingerprint(Stage(3, 0, 0, 100, 1, 123)) is None  # unsealed: in the Stage
        receiver.ready(Stage(3, 0, 0, 100, 0, None))  # unsealed: nothing to wait for
    finally:
        receiver.close()
        sender.close()


def test_a_seal_that_never_comes_from_a_live_sender_is_refused_after_the_timeout(monkeypatch):
    monkeypatch.setattr(shm, "WAIT_TIMEOUT_S", 0.2)
    sender, receiver = _pair()
    try:
        with pytest.raises(TransportError, match="did not finish within"):
            receiver.ready(Stage(3, 0, 0, 100, 0, None, 1))
    finally:
        receiver.close()
        sender.close()


def test_a_receiver_waiting_for_a_seal_learns_at_once_that_its_sender_was_killed():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _MAKE + "; import sys; sys.stdout.buffer.write(s.handle().hex().encode() + b'\\n');"
            " sys.stdout.flush(); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(Path(colosync.__file__).parents[1])),
    )
    receiver = None
    try:
        assert child.stdout is not None
        receiver = ShmReceiver.open(bytes.fromhex(child.stdout.readline().decode()), torch.device("cpu"))
        waiting = threading.Timer(0.3, child.kill)  # SIGKILL while the receiver waits for slot 1's seal
        waiting.start()
        start = time.monotonic()
        with pytest.raises(TransportError, match="sender died before its copy into shm slot 1"):
            receiver.ready(Stage(3, 0, 0, 100, 1, None, 1))
        assert time.monotonic() - start < 2.0  # not the 30 s timeout
    finally:
        child.kill()
        child.wait()
        if receiver is not None:
            receiver.close()


def test_seal_numbers_are_copied_from_a_table_that_follows_them_across_refills():
    """(On a GPU the table is in device memory, so that a seal is a copy, never a kernel, behind its chunk.)"""
    numbers = shm.SealNumbers(torch.device("cpu"))
    for number in [1, 2, 3, shm.SEAL_NUMBERS, shm.SEAL_NUMBERS + 1, shm.SEAL_NUMBERS + 2, 3 * shm.SEAL_NUMBERS + 7]:
        row = numbers.row(number)
        assert row.tolist() == [number]


def test_a_sender_forked_before_it_died_does_not_keep_it_alive():
    """A forked child (a DataLoader worker, say) closes its copy of the locked descriptor at the fork."""
    code = (
        _MAKE + "; import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    time.sleep(30); os._exit(0)\n"
        "sys.stdout.write(f'{pid} {s.handle().hex()}\\n'); sys.stdout.flush(); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(Path(colosync.__file__).parents[1])),
    )
    receiver, grandchild = None, 0
    try:
        assert child.stdout is not None
        pid, handle = child.stdout.readline().decode().split()
        grandchild = int(pid)
        receiver = ShmReceiver.open(bytes.fromhex(handle), torch.device("cpu"))
        assert receiver._map.creator_alive()
        child.kill()
        child.wait()
        start = time.monotonic()
        with pytest.raises(TransportError, match="sender died"):
            receiver.ready(Stage(3, 0, 0, 100, 0, None, 1))
        assert time.monotonic() - start < 2.0  # the fork, still alive, does not hold the lock
    finally:
        child.kill()
        if grandchild:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
        if receiver is not None:
            receiver.close()


def test_a_sender_dropped_without_close_lets_go_of_its_segment():
    sender = ShmSender(1 << 20, 2, torch.device("cpu"))
    name = sender._name
    sender.attached()  # the name is gone: only the open descriptor and the mapping keep the memory
    assert any(name in target for target in _open_targets())
    del sender
    gc.collect()
    assert not any(name in target for target in _open_targets())


def _open_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return targets


def test_a_stage_naming_a_slot_past_the_last_is_refused_before_the_seals():
    sender, receiver = _pair(slots=2)
    try:
        with pytest.raises(ManifestError, match="shm slot 2 does not exist: the segment has 2"):
            receiver.ready(Stage(3, 0, 0, 100, 2, None, 1))
        with pytest.raises(ManifestError, match="shm slot 2 does not exist"):
            receiver.slot(2)
    finally:
        receiver.close()
        sender.close()


def test_a_segment_smaller_than_its_handle_says_is_refused_with_the_fix():
    sender = ShmSender(1 << 16, 2, torch.device("cpu"))
    try:
        bigger = msgspec.msgpack.encode(shm.ShmHandle(sender._name, 1 << 17, 2))
        with pytest.raises(TransportError, match="different colosync versions; upgrade both"):
            ShmReceiver.open(bigger, torch.device("cpu"))
    finally:
        sender.close()


# -- slot geometry, and what a closed segment leaves ----------------------------------------------


def test_shm_slots_on_the_cpu_are_whole_buckets_however_large():
    """Cutting a segment into chunk-sized slots pays only where a host->device copy can pipeline (CUDA);
    a CPU sender keeps one slot per bucket in flight, at the bucket's size."""
    for bucket in (CHUNK_BYTES // 2, CHUNK_BYTES, 4 * CHUNK_BYTES):
        assert ShmSender.geometry(bucket, 2, CPU) == (bucket, 2)
    assert ShmSender.geometry(4 * CHUNK_BYTES, 3, CPU) == (4 * CHUNK_BYTES, 3)


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


# -- the segment's name is Python's resource tracker's to clean up until a receiver has mapped it: a sender
# that dies first leaves nothing in /dev/shm, and one that closes cleanly leaves the tracker nothing to do.
# Both are checked in a fresh interpreter (its own resource tracker, which only ends with it); each also
# makes a sender in this process, so that per-test coverage of this process records ``ShmSender``.


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports this same colosync (the one under test, wherever it is)."""
    root = str(Path(colosync.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_a_sender_that_dies_before_any_receiver_mapped_its_segment_leaves_nothing_behind():
    ShmSender(1 << 16, 1, CPU).close()  # (in this process too: see the comment above)
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
    ShmSender(1 << 16, 1, CPU).close()  # (in this process too: see the comment above)
    child = _python(_MAKE + "; name = s._name; s.close(); print(name)")
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip().startswith("colosync-")
    assert "leaked" not in child.stderr and "Traceback" not in child.stderr, child.stderr
