"""Host sampling across processes that share an arena: without a page walk (``status`` and
``maps``, the arena counted once) it must agree with the proportional-set-size walk, and a
participant sampling itself must leave the arena to the controller.

Real processes: this one creates the arena, a spawned child maps it and holds private memory.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from colosync.handoff.backends.arena import HostArena
from colosync.handoff.runtime.sampling import HostSampler

MiB = 1 << 20


def _child(handle, conn) -> None:
    arena = HostArena.attach(handle, pin="none")  # maps every page, as pinning would
    private = bytearray(48 * MiB)  # anonymous memory of its own
    private[::4096] = b"\x01" * len(private[::4096])
    own = HostSampler(shared=True, arenas=[arena], count_arenas=False, pss_limit_bytes=0).sample()
    conn.send(own.by_pid[os.getpid()])
    conn.recv()  # hold everything until the parent has sampled
    arena.close()


def test_status_sampling_counts_the_arena_once_and_agrees_with_the_page_walk():
    ctx = mp.get_context("spawn")
    with HostArena.create(96 * MiB, chunk_bytes=8 * MiB, pin="none") as arena:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(arena.handle(), child))
        proc.start()
        try:
            self_sampled = parent.recv()
            # only this process and the child (the suite's other children share other memory)
            only = dict(roots=[proc.pid], children=False, shared=True)
            walk = HostSampler(**only).sample()
            fast = HostSampler(**only, arenas=[arena], pss_limit_bytes=0).sample()
            naive = HostSampler(roots=[proc.pid], children=False).sample()
            # the child's share is its own memory: the walk's less its half of the arena
            half = arena.mapped_bytes // 2
            assert abs(fast.by_pid[proc.pid] - (walk.by_pid[proc.pid] - half)) < 8 * MiB, (fast, walk)
            assert fast.by_pid[proc.pid] >= 48 * MiB
            assert abs(self_sampled - fast.by_pid[proc.pid]) < 8 * MiB
            # counted once: summing what each process maps counts the arena twice, once too many (the shared
            # part only: the test process's own anon memory moves between two samples, by 37 MB once in CI)
            assert abs((naive.shmem - fast.shmem) - arena.mapped_bytes) < 8 * MiB, (naive, fast)
            assert fast.by_pid[os.getpid()] >= arena.mapped_bytes  # to the controller
        finally:
            parent.send(None)
            proc.join(30)


def test_the_page_walk_stays_where_the_arenas_are_small():
    with HostArena.create(16 * MiB, chunk_bytes=8 * MiB, pin="none") as arena:
        assert not HostSampler(shared=True, arenas=[arena]).fast_shared  # below 1 GiB: PSS, exact
        assert HostSampler(shared=True, arenas=[arena], pss_limit_bytes=arena.mapped_bytes).fast_shared
        assert not HostSampler(arenas=[arena], pss_limit_bytes=0).fast_shared  # nothing shared to count
