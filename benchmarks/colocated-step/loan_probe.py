"""Does a wake-up copy at the pinned rate into device memory the engine lends instead of frees?

`wake_probe.py` found that the trainer's 32.1 GB restore runs at 55 GB/s into memory that
exists, but takes 0.82 s instead of 0.58 s when it starts right after the engine freed its
KV cache: the driver's work on the freed memory shares the device with the copies. This probe
tries the other way of handing memory over: the engine allocates one block L once
(``cudaMalloc`` outside torch's allocator, ``colosync.transports.cuda_ipc.allocate``),
exports it, and the trainer opens it once and keeps it mapped; nothing is freed between the
two. It times, each right after the engine's action named:

- ``fresh after engine free``: the path without a loan, as a baseline in the same run (wake_probe's
  ``current``): the engine allocates and frees a torch block of L bytes, the trainer
  allocates the state and the grads fresh, copies the state from the arena and zeroes the grads;
- ``loan``: the engine does nothing; the trainer copies the state from the arena into the
  loan's first bytes and zeroes the grads after them;
- ``loan, engine frees X just before``: the engine frees a second, ordinary torch block X
  (and empties its cache) just before: does another process's large free slow copies into
  memory that was never freed?
- ``loan to host``: the trainer copies the state from the loan back into the arena (a sleep);
- ``engine zeroes the loan``: the engine zeroes all of L and synchronizes, what re-onloading
  its KV cache into the lent memory would cost in place of re-allocating it.

The baseline runs first, before the loan exists (L, X and a torch block of L do not fit on
one GPU together); the loan variants run in the order of a step (wake, sleep, the engine
takes its memory back), each after ``--settle-s`` seconds so that one variant's work does
not spill into the next. One warm-up each, then ``--repeats``, medians.

    python3 benchmarks/colocated-step/loan_probe.py --out loan-probe.json
    python3 benchmarks/colocated-step/loan_probe.py --loan-gb 50 --spare-gb 12  # an 80 GB H100
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing as mp
import shlex
import statistics
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

GB = 1e9
ANSWER_S = 300.0  # the longest the trainer waits for one engine command


def _engine(conn: Any, index: int) -> None:
    """The child: lend a block, hold and free a spare block, zero the loan, report the seconds."""
    from colosync.transports.cuda_ipc import allocate, runtime

    dev = torch.device("cuda", index)
    torch.cuda.init()
    torch.empty(1, device=dev)
    blocks: list[torch.Tensor] = []  # the baseline's block of L bytes
    spare: list[torch.Tensor] = []  # X
    loan = None
    view: torch.Tensor | None = None

    def sync() -> None:
        torch.cuda.synchronize(dev)

    while True:
        cmd, arg = conn.recv()
        t0 = time.perf_counter()
        reply: Any = None
        try:
            if cmd == "alloc":
                blocks.append(torch.empty(arg, dtype=torch.uint8, device=dev))
                sync()
            elif cmd == "free":
                blocks.clear()
                torch.cuda.empty_cache()
                sync()
            elif cmd == "lend":
                loan = allocate(arg, index)
                view = loan.tensor()
                sync()
                reply = runtime().export(loan.ptr)
            elif cmd == "hold_spare":
                spare.append(torch.empty(arg, dtype=torch.uint8, device=dev))
                sync()
            elif cmd == "free_spare":
                spare.clear()
                torch.cuda.empty_cache()
                sync()
            elif cmd == "zero_loan":
                assert view is not None
                view.zero_()
                sync()
            elif cmd == "peek":  # what the trainer wrote, seen from here
                assert view is not None
                reply = int(view[:arg].sum().item())
            elif cmd == "exit":  # the trainer has closed its mapping by now
                blocks.clear()
                spare.clear()
                view = None
                loan = None  # the last reference: cudaFree
                gc.collect()
                torch.cuda.empty_cache()
                sync()
                conn.send((time.perf_counter() - t0, None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception:
            conn.send((None, traceback.format_exc()))
            continue
        conn.send((time.perf_counter() - t0, reply))


def _machine() -> str:
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    return (
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, driver {driver or '?'}, "
        f"torch {torch.__version__}"
    )


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-gb", type=float, default=32.1)
    ap.add_argument("--grad-gb", type=float, default=16.0)
    ap.add_argument("--loan-gb", type=float, default=100.0, help="L: the block the engine lends (its KV cache)")
    ap.add_argument("--spare-gb", type=float, default=24.0, help="X: an ordinary torch block the engine frees")
    ap.add_argument("--settle-s", type=float, default=0.5, help="idle time before each loan variant")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="loan-probe.json")
    args = ap.parse_args()

    from colosync.handoff.backends.arena import HostArena
    from colosync.transports.cuda_ipc import open_handle

    command = " ".join(shlex.quote(a) for a in ["python3", *sys.argv])
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)
    S = int(args.state_gb * GB) // 4096 * 4096
    G = int(args.grad_gb * GB) // 4096 * 4096
    L = int(args.loan_gb * GB) // 4096 * 4096
    X = int(args.spare_gb * GB) // 4096 * 4096
    if S + G > L:
        raise SystemExit(f"the loan ({L / GB:.1f} GB) must hold the state and the grads ({(S + G) / GB:.1f} GB)")
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"{_machine()}, {total / GB:.1f} GB; S={S / GB:.2f} G={G / GB:.2f} L={L / GB:.1f} X={X / GB:.1f} GB")
    t0 = time.perf_counter()
    arena = HostArena.create(S, chunk_bytes=1 << 30)
    lease = arena.pool().lease("probe", S)
    pinned = arena.pinned
    print(f"arena {arena.nbytes / GB:.1f} GB pinned={pinned} in {time.perf_counter() - t0:.1f} s", flush=True)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(child, 0), daemon=True)
    proc.start()

    def engine(cmd: str, arg: int = 0) -> tuple[float, Any]:
        parent.send((cmd, arg))
        if not parent.poll(ANSWER_S):
            raise RuntimeError(f"the engine did not answer {cmd!r} within {ANSWER_S:.0f} s")
        seconds, reply = parent.recv()
        if seconds is None:
            raise RuntimeError(f"the engine failed {cmd!r}:\n{reply}")
        return float(seconds), reply

    results: dict[str, dict[str, list[float]]] = {}
    setup: dict[str, float] = {}

    def sync() -> None:
        torch.cuda.synchronize(dev)

    def record(name: str, **pieces: float) -> None:
        slot = results.setdefault(name, {})
        for k, v in pieces.items():
            slot.setdefault(k, []).append(v)

    def measure() -> None:
        # -- the baseline: the path without a loan (wake_probe's fresh(True) then current) ---------------------
        def fresh_after_engine_free() -> dict[str, float]:
            torch.cuda.empty_cache()
            sync()
            a, _ = engine("alloc", L)
            f, _ = engine("free")
            t0 = time.perf_counter()
            flat = torch.empty(S, dtype=torch.uint8, device=dev)
            t1 = time.perf_counter()
            lease.read(0, flat)
            sync()
            t2 = time.perf_counter()
            g = torch.empty(G, dtype=torch.uint8, device=dev)
            t3 = time.perf_counter()
            g.zero_()
            sync()
            t4 = time.perf_counter()
            del flat, g
            return dict(
                total_s=t4 - t0,
                alloc_state_s=t1 - t0,
                copy_s=t2 - t1,
                alloc_grad_s=t3 - t2,
                zero_s=t4 - t3,
                engine_alloc_s=a,
                engine_free_s=f,
            )

        fresh_after_engine_free()  # warm-up
        for _ in range(args.repeats):
            record("fresh after engine free", **fresh_after_engine_free())
        torch.cuda.empty_cache()  # the trainer holds nothing from here on
        sync()

        # -- the loan -------------------------------------------------------------------------------
        setup["engine_lend_s"], handle = engine("lend", L)
        setup["engine_hold_spare_s"], _ = engine("hold_spare", X)
        t0 = time.perf_counter()
        buffer = open_handle(handle, 0, L)
        loan = buffer.tensor()
        sync()
        setup["trainer_open_s"] = time.perf_counter() - t0
        closed = weakref.ref(buffer)
        loan[:4096].fill_(1)
        sync()
        _, seen = engine("peek", 4096)
        if seen != 4096:
            raise RuntimeError(f"the engine sees {seen} where the trainer wrote 4096: not the same memory")
        print(
            f"lent {L / GB:.1f} GB: engine {setup['engine_lend_s']:.3f} s, trainer open {setup['trainer_open_s']:.3f} s"
        )
        views = {"state": loan[:S], "grads": loan[S : S + G]}  # cleared before the mapping closes

        def restore() -> dict[str, float]:
            t0 = time.perf_counter()
            lease.read(0, views["state"])
            sync()
            t1 = time.perf_counter()
            views["grads"].zero_()
            sync()
            t2 = time.perf_counter()
            return dict(total_s=t2 - t0, copy_s=t1 - t0, zero_s=t2 - t1)

        def on_loan() -> dict[str, float]:
            return restore()

        def on_loan_after_spare_free() -> dict[str, float]:
            f, _ = engine("free_spare")
            out = restore()
            out["engine_free_s"] = f
            out["engine_realloc_s"], _ = engine("hold_spare", X)  # after the timing
            return out

        def to_host() -> dict[str, float]:
            t0 = time.perf_counter()
            lease.write(0, views["state"])
            sync()
            return dict(total_s=time.perf_counter() - t0)

        def engine_zeroes() -> dict[str, float]:
            z, _ = engine("zero_loan")
            return dict(zero_s=z)

        variants: list[tuple[str, Callable[[], dict[str, float]]]] = [
            ("loan", on_loan),
            ("loan, engine frees X just before", on_loan_after_spare_free),
            ("loan to host", to_host),
            ("engine zeroes the loan", engine_zeroes),
        ]
        time.sleep(max(args.settle_s, 1.0))  # the baseline's last frees
        for _name, fn in variants:  # one warm-up each
            time.sleep(args.settle_s)
            fn()
        for _ in range(args.repeats):
            for name, fn in variants:
                time.sleep(args.settle_s)
                record(name, **fn())

        # -- close the mapping before the engine frees its memory -----------------------------------
        views.clear()
        del loan, buffer
        gc.collect()
        sync()
        if closed() is not None:
            print("warning: the loan's mapping is still referenced; closing it by hand", flush=True)
            b = closed()
            if b is not None and b._release is not None:
                b._release(b.ptr)
                b._release = None
        setup["engine_exit_s"], _ = engine("exit")
        proc.join(30)
        if proc.exitcode != 0:
            print(f"warning: the engine exited with {proc.exitcode}", flush=True)
        lease.release()
        arena.close()

    error = None
    try:
        measure()
    except Exception:
        error = traceback.format_exc()
        print(error, flush=True)
        if proc.is_alive():
            proc.terminate()  # the mapping may still be open: let the driver tear both down
            proc.join(30)
        lease.release()
        arena.close()

    medians = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in results.items()}
    print(f"S {S / GB:.2f} GB, G {G / GB:.2f} GB, L {L / GB:.1f} GB, X {X / GB:.1f} GB; medians of {args.repeats}")
    for n, d in medians.items():
        if "copy_s" in d:
            rate = f"  copy {S / d['copy_s'] / GB:5.1f} GB/s, total {S / d['total_s'] / GB:5.1f} GB/s of state"
        elif n == "loan to host":
            rate = f"  {S / d['total_s'] / GB:5.1f} GB/s"
        else:
            rate = f"  {L / d['zero_s'] / GB:7.1f} GB/s of the loan"
        print(f"{n:34s} " + " ".join(f"{k}={v:.4f}" for k, v in d.items()) + rate)
    with open(args.out, "w") as fh:
        out = {
            "command": command,
            "date": date,
            "commit": _commit(),
            "machine": _machine(),
            "device_total_bytes": total,
            "state_bytes": S,
            "grad_bytes": G,
            "loan_bytes": L,
            "spare_bytes": X,
            "settle_s": args.settle_s,
            "arena_pinned": pinned,
            "setup_s": setup,
            "medians": medians,
            "runs": results,
            "error": error,
        }
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
