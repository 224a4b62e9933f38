"""The node-wide host arena across two real processes: bytes cross, chunks are reused, the
size comes from the plan, and nothing stays in /dev/shm after a close or a kill."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from colosync.handoff import HostPoolExhausted, Region, build_plan
from colosync.handoff.backends.arena import PREFIX, HostArena
from colosync.handoff.backends.stash import TensorStash
from colosync.wire.protocol import ArenaHandle
from tests.helpers import CHUNK

MiB = 1 << 20
SIZES = {Region.ENGINE_MIRROR: 10 * MiB, Region.TRAINER_BACKUP: 6 * MiB}


def arenas() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(PREFIX))


def _writer(handle: ArenaHandle, fill: int, hold: bool, conn) -> None:
    """Child: map the arena, lease two chunks, fill them, report the chunk indices; then
    release and exit, or hold them until killed."""
    arena = HostArena.attach(handle, pin="none")
    lease = arena.pool().lease("engine.weights", 2 * CHUNK)
    lease.write(0, torch.full((2 * CHUNK,), fill, dtype=torch.uint8))
    conn.send(lease.indices)
    if hold:
        time.sleep(600)
    conn.recv()
    lease.release()
    arena.close()


def _creator(conn) -> None:
    """Child: create an arena, write into it, hand its handle over, and wait to be killed."""
    arena = HostArena.create(4 * CHUNK, chunk_bytes=CHUNK, pin="none")
    arena.chunk(0).fill_(7)
    conn.send(arena.handle())
    time.sleep(600)


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def test_arena_size_comes_from_the_plan():
    gpu = HostArena.for_plan(build_plan(peak_device="gpu"), SIZES, chunk_bytes=CHUNK, slack_bytes=0, pin="none")
    cpu = HostArena.for_plan(build_plan(peak_device="cpu"), SIZES, chunk_bytes=CHUNK, slack_bytes=0, pin="none")
    try:
        assert gpu.nbytes == 12 * MiB  # the larger copy (10 MiB) in whole 4 MiB chunks
        assert cpu.nbytes == 12 * MiB + 8 * MiB  # both copies at once
        # in the gpu-sized arena a second copy beside the first has no room: coexisting copies fail loudly
        pool = gpu.pool()
        first = pool.lease("engine.weights", SIZES[Region.ENGINE_MIRROR])
        with pytest.raises(HostPoolExhausted, match=r"'trainer.state' needs 2 chunk.*engine.weights \(pid"):
            pool.lease("trainer.state", SIZES[Region.TRAINER_BACKUP])
        first.release()
        again = pool.lease("trainer.state", SIZES[Region.TRAINER_BACKUP])
        assert again.indices == first.indices[:2]  # the backup takes the pages the mirror vacated
        again.release()
    finally:
        gpu.close()
        cpu.close()
    assert not arenas()


def test_bytes_written_by_one_process_are_read_by_the_other():
    arena = HostArena.create(4 * CHUNK, chunk_bytes=CHUNK, pin="none")
    proc, conn = _spawn(_writer, arena.handle(), 0xAB, False)
    try:
        indices = conn.recv()
        arena.seal()  # both processes map it: the name goes, the memory stays
        assert not arenas()
        for i in indices:
            assert bool((arena.chunk(i) == 0xAB).all())
        assert sum(arena.holders().values()) == 2 * CHUNK and "engine.weights" in next(iter(arena.holders()))
        conn.send("release")
        proc.join(60)
        assert proc.exitcode == 0
        # a stash in this process reuses the very chunks the other process released
        stash = TensorStash("trainer.state", "cpu", arena.pool())
        t = torch.arange(2 * CHUNK // 4, dtype=torch.float32)
        stash.offload([t], backup=True)
        assert stash._lease is not None and stash._lease.indices == indices
        stash.restore()
        assert torch.equal(t, torch.arange(2 * CHUNK // 4, dtype=torch.float32))
    finally:
        arena.close()
        proc.join(5)
    assert not arenas()


def test_no_leak_after_the_attacher_is_killed_holding_chunks():
    arena = HostArena.create(3 * CHUNK, chunk_bytes=CHUNK, pin="none")
    proc, conn = _spawn(_writer, arena.handle(), 0x11, True)
    try:
        held = conn.recv()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        # the dead process's chunks are reclaimed by the next lease that needs them
        lease = arena.pool().lease("trainer.state", 3 * CHUNK)
        assert set(held) <= set(lease.indices)
        lease.release()
    finally:
        arena.close()
    assert not arenas()


def test_no_leak_after_the_creator_is_killed():
    proc, conn = _spawn(_creator)
    handle = conn.recv()
    arena = HostArena.attach(handle, pin="none")
    try:
        assert handle.name in arenas()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert bool((arena.chunk(0) == 7).all())  # the survivor's mapping keeps the pages
    finally:
        arena.close()  # and its close drops the name
    assert handle.name not in arenas()
