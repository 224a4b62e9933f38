"""Long-lived worlds of real ranks for the distributed source tests (Megatron, FSDP2, DDP).

Starting a rank costs seconds on two shared cores (torch, megatron-core, transformers imports),
so tests share a ``World`` of ``size`` processes joined by one process group and run each
scenario as a task on every rank: ``world.run(target, *args)`` calls ``target(rank, size,
*args)`` everywhere and returns each rank's plain-data result. A task that fails or times out
on any rank may leave the others inside a collective: the world is then torn down, and the
next ``run`` starts a fresh one. gloo worlds fork every rank from a forkserver that imported
``preload`` once; CUDA (NCCL) ranks are spawned, never forked from a process that may have
touched the driver.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

# Process groups a task makes (Megatron's parallel state, a 2-D DeviceMesh) outlive it, each
# with its own gloo threads, and they cannot be destroyed safely (a DeviceMesh made later may
# reuse one by name). In one CI run the ranks of a world reused across the source tests held
# ~1,400 threads each, enough to starve two cores (a 35-minute suite, vLLM timing out at start),
# so a world whose ranks pass this many threads is replaced by fresh ranks before its next task.
MAX_RANK_THREADS = 128


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(
    rank: int,
    size: int,
    port: int,
    backend: str,
    set_up: Callable[[], None] | None,
    after_task: Callable[[], None] | None,
    tasks: Any,
    results: Any,
) -> None:
    """A rank of a long-lived world: run each task it is given, report, repeat."""
    import torch
    import torch.distributed as dist

    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NCCL_NVLS_ENABLE="0",  # leave NVLink multicast off (the device notes say why)
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            NVSHMEM_DISABLE_NVLS="1",
        )
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if set_up is not None:
            set_up()
        dist.init_process_group(backend, rank=rank, world_size=size)
    except BaseException:
        results.put((rank, False, traceback.format_exc(), 0))
        return
    while (task := tasks.get()) is not None:
        target, args = task
        try:
            ok, payload = True, target(rank, size, *args)
        except BaseException:
            ok, payload = False, traceback.format_exc()
        finally:
            if after_task is not None:
                after_task()
        results.put((rank, ok, payload, len(os.listdir("/proc/self/task"))))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class World:
    """``size`` ranks joined by one process group, reused across tests (see the module docstring).

    ``set_up`` runs in each rank before the group is made, ``after_task`` after every task
    (both module-level functions: they travel to the ranks by reference).
    """

    def __init__(
        self,
        size: int,
        backend: str = "gloo",
        *,
        preload: Sequence[str] = ("torch",),
        set_up: Callable[[], None] | None = None,
        after_task: Callable[[], None] | None = None,
    ) -> None:
        self.size, self.backend = size, backend
        self.preload, self.set_up, self.after_task = list(preload), set_up, after_task
        self._procs: list[Any] = []

    def _start(self) -> None:
        if self.backend == "gloo":
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(self.preload)
        else:
            ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, self.size, port, self.backend, self.set_up, self.after_task, self._tasks[r], self._results),
            )
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()

    def run(self, target: Callable[..., Any], *args: Any, timeout_s: float = 240.0) -> list[Any]:
        """``target(rank, size, *args)`` on every rank; results by rank. Fails naming every failed rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close(kill=True)
            self._start()
        for q in self._tasks:
            q.put((target, args))
        results: dict[int, Any] = {}
        failures = []
        try:
            deadline = time.monotonic() + timeout_s
            threads = 0
            for _ in range(self.size):
                rank, ok, payload, rank_threads = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
                threads = max(threads, rank_threads)
                if ok:
                    results[rank] = payload
                else:  # the others may be stuck in a collective: give them a moment to report too
                    failures.append(f"rank {rank} failed:\n{payload}")
                    deadline = min(deadline, time.monotonic() + 5.0)
        except BaseException as exc:
            self.close(kill=True)
            missing = sorted(set(range(self.size)) - set(results))
            if failures:
                raise AssertionError("\n".join(failures)) from exc
            raise AssertionError(
                f"ranks {missing} did not finish within {timeout_s}s (hung?)\n" + "\n".join(failures)
            ) from exc
        if failures:
            self.close(kill=True)
            raise AssertionError("\n".join(failures))
        if threads > MAX_RANK_THREADS:
            self.close()  # the next run starts fresh ranks (see MAX_RANK_THREADS)
        return [results[r] for r in range(self.size)]

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self._procs, getattr(self, "_tasks", []), strict=False):
            if not kill and p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=1 if kill else 30)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self._procs = []
