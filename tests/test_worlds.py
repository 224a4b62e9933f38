"""The shared test worlds replace ranks that piled up threads (``tests.worlds.MAX_RANK_THREADS``)."""

from __future__ import annotations

import os
import threading

from tests.worlds import MAX_RANK_THREADS, World

_PARKED = threading.Event()  # per rank process: what the parked threads wait on


def _pid(rank: int, size: int) -> int:
    return os.getpid()


def _pile_up_threads(rank: int, size: int) -> int:
    for _ in range(MAX_RANK_THREADS):
        threading.Thread(target=_PARKED.wait, daemon=True).start()
    return os.getpid()


def test_a_world_whose_ranks_piled_up_threads_gets_fresh_ranks():
    world = World(2)
    try:
        first = world.run(_pid)
        assert world.run(_pid) == first  # an ordinary task keeps the ranks
        assert world.run(_pile_up_threads) == first
        fresh = world.run(_pid)
        assert not set(fresh) & set(first), (first, fresh)
    finally:
        world.close(kill=True)
