"""Does GPU work cost more when it alternates between two processes?

A seed-lora sync is: the trainer reads 161 MiB on the GPU (its fingerprint), then the engine, in
another process, copies the same bytes out. The traced timelines show both taking 2-3x what the
same kernels take alone, with the SM clock at its 1980 MHz maximum throughout. This times the
same two steps, one after the other, three ways, with a pipe round trip as the only hand-off:

- ``one process``: both kernels in one process (one CUDA context);
- ``two processes``: the first kernel in the parent, the second in a child (two contexts, as
  trainer and engine are), the child told by a pipe and waiting on an interprocess event;
- ``pipe only``: the same pipe round trip with no GPU work, to subtract.

Measurement only. ``python benchmarks/two-contexts/two_contexts.py [--mib 161] [--repeats 200]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp


def _child(conn, x: torch.Tensor, y: torch.Tensor, handle: bytes) -> None:
    event = torch.cuda.Event.from_ipc_handle(x.device, handle)
    while True:
        what = conn.recv()
        if what == "stop":
            return
        if what == "gpu":
            while not event.query():
                pass
            y.copy_(x)
            torch.cuda.current_stream().synchronize()
        conn.send("done")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=161)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    n = args.mib << 20
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    acc = torch.zeros((), dtype=torch.int64, device="cuda")
    event = torch.cuda.Event(interprocess=True, blocking=False)

    def read() -> None:  # the trainer's fingerprint: a full read of the bytes
        torch.sum(x.view(torch.int64), dim=0, out=acc)

    def median_us(step) -> float:
        for _ in range(20):
            step()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    def one_process() -> None:
        read()
        event.record()
        while not event.query():
            pass
        y.copy_(x)
        torch.cuda.current_stream().synchronize()

    def read_alone() -> None:
        read()
        torch.cuda.current_stream().synchronize()

    def copy_alone() -> None:
        y.copy_(x)
        torch.cuda.current_stream().synchronize()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, x, y, event.ipc_handle()), daemon=True)
    proc.start()

    def two_processes() -> None:
        read()
        event.record()
        parent.send("gpu")
        parent.recv()

    def pipe_only() -> None:
        parent.send("pipe")
        parent.recv()

    result = {
        "mib": args.mib,
        "repeats": args.repeats,
        "read_alone_us": median_us(read_alone),
        "copy_alone_us": median_us(copy_alone),
        "one_process_us": median_us(one_process),
        "two_processes_us": median_us(two_processes),
        "pipe_only_us": median_us(pipe_only),
    }
    parent.send("stop")
    proc.join(10)
    result["two_processes_minus_pipe_us"] = result["two_processes_us"] - result["pipe_only_us"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
