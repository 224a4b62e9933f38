"""Where a trainer's wake-up spends its time, piece by piece, on one GPU.

A wake-up restores the trainer's state from the shared host arena into device memory that
another process (the engine, dropping its KV cache) has just freed, then brings the gradient
buffer back zeroed. This probe times each piece on its own (allocating, copying into memory
that already exists, zeroing) and a few orders of the whole, each right after a child
process ("the engine") has freed a large block, and once with no such free, so the cost of
an order can be told from the cost of the allocator.

    python3 benchmarks/colocated-step/wake_probe.py --out wake-probe.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

GB = 1e9


def _engine(conn: Any, device: str) -> None:
    """The child: allocate or free a block on command, report the seconds."""
    blocks: list[torch.Tensor] = []
    torch.cuda.init()
    torch.empty(1, device=device)
    while True:
        cmd, arg = conn.recv()
        t0 = time.perf_counter()
        if cmd == "alloc":
            blocks.append(torch.empty(arg, dtype=torch.uint8, device=device))
            torch.cuda.synchronize()
        elif cmd == "free":
            blocks.clear()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        elif cmd == "exit":
            conn.send(0.0)
            return
        conn.send(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-gb", type=float, default=32.1)
    ap.add_argument("--grad-gb", type=float, default=16.0)
    ap.add_argument("--engine-gb", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="wake-probe.json")
    args = ap.parse_args()

    from colosync.handoff.backends.arena import HostArena

    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)
    S = int(args.state_gb * GB) // 4096 * 4096
    G = int(args.grad_gb * GB) // 4096 * 4096
    E = int(args.engine_gb * GB)
    t0 = time.perf_counter()
    arena = HostArena.create(S, chunk_bytes=1 << 30)
    lease = arena.pool().lease("probe", S)
    print(f"arena {arena.nbytes / GB:.1f} GB pinned={arena.pinned} in {time.perf_counter() - t0:.1f} s", flush=True)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(child, "cuda:0"), daemon=True)
    proc.start()

    def engine(cmd: str, arg: int = 0) -> float:
        parent.send((cmd, arg))
        return float(parent.recv())

    results: dict[str, dict[str, list[float]]] = {}

    def sync() -> None:
        torch.cuda.synchronize(dev)

    copy_streams = [torch.cuda.Stream(dev) for _ in range(2)]
    spread = [False]  # the lease's chunks alternated between two streams instead of one

    def copy_into(flat: torch.Tensor) -> None:
        if not spread[0]:
            lease.read(0, flat[:S])
            return
        current = torch.cuda.current_stream(dev)
        for s in copy_streams:
            s.wait_stream(current)
        for i, (piece, a, b) in enumerate(lease.pieces(0, S)):
            with torch.cuda.stream(copy_streams[i % 2]):
                flat[a:b].copy_(piece, non_blocking=True)
        for s in copy_streams:
            current.wait_stream(s)

    def record(name: str, **pieces: float) -> None:
        slot = results.setdefault(name, {})
        for k, v in pieces.items():
            slot.setdefault(k, []).append(v)

    def fresh(after_free: bool, engine_bytes: int = E) -> None:
        """The trainer holds nothing; the engine allocates and frees (as offload_kv does)."""
        torch.cuda.empty_cache()
        sync()
        if after_free:
            a = engine("alloc", engine_bytes)
            f = engine("free")
            per_gb = GB / engine_bytes * 1e3
            record(
                f"engine({engine_bytes / GB:.0f} GB)",
                alloc_s=a,
                free_s=f,
                alloc_ms_per_gb=a * per_gb,
                free_ms_per_gb=f * per_gb,
            )

    # -- variants --------------------------------------------------------------------------
    def current() -> dict[str, float]:
        """What TensorStash.restore does: alloc state, copy, sync; alloc grads, zero, sync."""
        t0 = time.perf_counter()
        flat = torch.empty(S, dtype=torch.uint8, device=dev)
        t1 = time.perf_counter()
        copy_into(flat)
        sync()
        t2 = time.perf_counter()
        g = torch.empty(G, dtype=torch.uint8, device=dev)
        t3 = time.perf_counter()
        g.zero_()
        sync()
        t4 = time.perf_counter()
        del flat, g
        return dict(total_s=t4 - t0, alloc_state_s=t1 - t0, copy_s=t2 - t1, alloc_grad_s=t3 - t2, zero_s=t4 - t3)

    def prealloc() -> dict[str, float]:
        """Reserve everything first, then copy into it, then zero with the copies done."""
        t0 = time.perf_counter()
        flat = torch.empty(S, dtype=torch.uint8, device=dev)
        g = torch.empty(G, dtype=torch.uint8, device=dev)
        sync()
        t1 = time.perf_counter()
        copy_into(flat)
        sync()
        t2 = time.perf_counter()
        g.zero_()
        sync()
        t3 = time.perf_counter()
        del flat, g
        return dict(total_s=t3 - t0, alloc_s=t1 - t0, copy_s=t2 - t1, zero_s=t3 - t2)

    def copy_only() -> dict[str, float]:
        """The copies alone, into memory allocated outside the timing (still right after the
        previous variant's buffers were freed)."""
        flat = torch.empty(S, dtype=torch.uint8, device=dev)
        sync()
        t0 = time.perf_counter()
        copy_into(flat)
        sync()
        t1 = time.perf_counter()
        del flat
        return dict(total_s=t1 - t0, gbps=S / (t1 - t0) / GB)

    def to_host() -> dict[str, float]:
        """The other direction (an engine's offload_weights): device to the arena, fresh memory."""
        flat = torch.empty(S, dtype=torch.uint8, device=dev)
        t0 = time.perf_counter()
        lease.write(0, flat[:S])
        sync()
        t1 = time.perf_counter()
        del flat
        return dict(total_s=t1 - t0, gbps=S / (t1 - t0) / GB)

    def alloc_only() -> dict[str, float]:
        t0 = time.perf_counter()
        flat = torch.empty(S + G, dtype=torch.uint8, device=dev)
        sync()
        t1 = time.perf_counter()
        del flat
        torch.cuda.empty_cache()
        t2 = time.perf_counter()
        return dict(alloc_s=t1 - t0, free_s=t2 - t1, alloc_ms_per_gb=(t1 - t0) / (S + G) * GB * 1e3)

    def zero_only() -> dict[str, float]:
        g = torch.empty(G, dtype=torch.uint8, device=dev)
        sync()
        t0 = time.perf_counter()
        g.zero_()
        sync()
        t1 = time.perf_counter()
        del g
        return dict(zero_s=t1 - t0)

    def streams(n: int, fn: Callable[[], dict[str, float]]) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            spread[0] = n == 2
            try:
                return fn()
            finally:
                spread[0] = False

        return run

    one, two = (lambda fn: streams(1, fn)), (lambda fn: streams(2, fn))
    half, quarter = E // 2, E // 4
    variants: list[tuple[str, Callable[[], dict[str, float]], bool, int]] = [
        ("copy_only(1 stream)", one(copy_only), False, E),
        ("copy_only(2 streams)", two(copy_only), False, E),
        ("zero_only", zero_only, False, E),
        ("alloc_only(after engine free)", alloc_only, True, E),
        ("current(no engine free)", one(current), False, E),
        ("current", one(current), True, E),
        ("current(2 streams)", two(current), True, E),
        ("current(engine frees half)", one(current), True, half),
        ("current(engine frees a quarter)", one(current), True, quarter),
        ("prealloc", one(prealloc), True, E),
        ("prealloc(2 streams)", two(prealloc), True, E),
        ("to_host(no engine free)", to_host, False, E),
        ("to_host", to_host, True, E),
    ]
    for _name, fn, after_free, size in variants:  # one warm-up each
        fresh(after_free, size)
        fn()
    results.clear()
    for _ in range(args.repeats):
        for name, fn, after_free, size in variants:
            fresh(after_free, size)
            record(name, **fn())
    # how the cost fades with the time between the engine's free and the wake-up
    for _ in range(args.repeats):
        for delay in (0.25, 0.5, 1.0):
            for label, fn in (("", one(current)), (", 2 streams", two(current))):
                if label and delay != 1.0:
                    continue
                fresh(True)
                time.sleep(delay)
                record(f"current({delay:g} s after engine free{label})", **fn())
    engine("exit")
    proc.join(10)
    lease.release()
    arena.close()

    medians = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in results.items()}
    floor = medians["current(1 s after engine free)"]["copy_s"]
    print(
        f"state {S / GB:.2f} GB, grads {G / GB:.2f} GB, engine block {E / GB:.0f} GB; "
        f"the state's copy 1 s after a free {floor:.3f} s ({S / floor / GB:.1f} GB/s)"
    )
    for n, d in medians.items():
        rate = f"  {S / d['total_s'] / GB:5.1f} GB/s of state" if "total_s" in d else ""
        print(f"{n:34s} " + " ".join(f"{k}={v:.4f}" for k, v in d.items()) + rate)
    with open(args.out, "w") as fh:
        out = {"state_bytes": S, "grad_bytes": G, "engine_bytes": E, "medians": medians, "runs": results}
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
