"""``colosync bench-separated``: one trainer and N engine processes, each transport beside the bare group.

Separated mode's cost is the group's: the trainer's bytes must reach every engine. This bench
materializes a workload (``seed-lora``, ``llama8b-full`` or a JSON file) as random tensors in
this process and pushes it, update after update, into N ``sink`` engine processes as one
``EngineSet`` (an update ends when every engine has committed it), through each transport that
reaches several engines: ``broadcast`` and ``p2p`` over a torch.distributed group, and ``shm``
where every engine shares this host. In the same run it times the mechanism alone: N + 1
processes in a group of the same backend moving the same bytes, in the same bucket size, with
one ``broadcast`` (``raw:broadcast``) and with one ``send`` to each engine (``raw:p2p``), then a
barrier so every receiver has them -- nothing else. Every engine's tensors are checked against
the trainer's. GB/s is the payload over the time, i.e. what each engine receives.

On the CPU the group is gloo; with ``--device cuda`` it is NCCL, which needs N + 1 GPUs
(``benchmarks/gpu/separated-nccl.sh``).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import time
from typing import Any

import msgspec

from colosync import workloads
from colosync.errors import ConfigError
from colosync.tools.bench.machine import run_header
from colosync.tools.bench.output import add_output_arguments, run_and_report
from colosync.tools.bench.sync import PathResult, Workload, _stats, _timed, load_sync_workload, make_tensors
from colosync.tools.subcommand import add_subcommand

TRANSPORTS = ("broadcast", "p2p", "shm")


class SeparatedResult(msgspec.Struct):
    command: str
    date: str
    commit: str
    machine: dict[str, Any]
    workload: Workload
    engines: int
    device: str
    bucket_bytes: int
    results: list[PathResult]
    notes: list[str] = []


def run_separated(args: argparse.Namespace, progress: Any = None) -> SeparatedResult:
    import torch

    from colosync.control.engine_set import EngineSet
    from colosync.engines.process import EngineConfig, EngineProcess

    if args.engines < 1:
        raise ConfigError(f"--engines must be at least 1, got {args.engines}")
    device = torch.device(args.device)
    if device.type == "cuda" and torch.cuda.device_count() < args.engines + 1:
        raise ConfigError(
            f"NCCL needs a GPU per process: {args.engines} engines and the trainer need {args.engines + 1} GPUs, "
            f"this machine has {torch.cuda.device_count()}; pass --device cpu (gloo) or fewer --engines"
        )
    workload, specs, lora = load_sync_workload(args.workload)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    names = [t.strip() for t in args.transports.split(",")] if args.transports else list(TRANSPORTS)
    plan = names + ["raw:broadcast", "raw:p2p"]
    task = progress.add_task("bench-separated", total=len(plan) * (args.warmup + args.repeats)) if progress else None

    def tick() -> None:
        if progress:
            progress.advance(task)

    def status(text: str) -> None:
        if progress:
            progress.update(task, description=text)

    named = make_tensors(specs, device)
    results: list[PathResult] = []
    status(f"starting {args.engines} sink engines")
    engines = [
        EngineProcess(EngineConfig(engine="sink", device=_engine_device(device, i), timeout_s=120.0, threads=1))
        for i in range(args.engines)
    ]
    try:
        links = {f"engine{i}": e.connect("bench-separated") for i, e in enumerate(engines)}
        engine_set = EngineSet(links, join_timeout_s=120.0)
        try:
            for name in names:
                status(name)
                results.append(_bench_transport(engine_set, engines, name, named, lora, bucket_bytes, args, tick))
        finally:
            engine_set.close()
    finally:
        for engine in engines:
            engine.close()
    for mode in ("broadcast", "p2p"):
        status(f"raw:{mode}")
        seconds = _raw_group(mode, workload.bytes, bucket_bytes, args.engines, device, args.warmup, args.repeats)
        for _ in range(args.warmup + args.repeats):
            tick()
        results.append(_stats(f"raw:{mode}", "floor", seconds, workload.bytes))
    raw = {r.path[4:]: r.median_ms for r in results if r.kind == "floor"}
    results = [
        msgspec.structs.replace(r, speedup_vs={f"raw:{m}": round(raw[m] / r.median_ms, 3) for m in raw})
        if r.kind == "transport"
        else r
        for r in results
    ]
    header = run_header(args.argv, device=device)
    return SeparatedResult(
        command=header["command"],
        date=header["date"],
        commit=header["commit"],
        machine=header["machine"],
        workload=workload,
        engines=args.engines,
        device=str(device),
        bucket_bytes=bucket_bytes,
        results=results,
        notes=[f"{'gloo' if device.type == 'cpu' else 'NCCL'} group of {args.engines + 1} processes on one host"],
    )


def _engine_device(device: Any, index: int) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{index + 1}"  # the trainer keeps cuda:0


def _bench_transport(engine_set, engines, name: str, named, lora, bucket_bytes: int, args, tick) -> PathResult:
    from colosync.engines.sink import Digest, tensor_digests
    from colosync.sync.sender import Sender

    reports = []
    with Sender(engine_set, transport=name, bucket_bytes=bucket_bytes) as sender:

        def push() -> None:
            reports.append(sender.push(named, lora=lora))

        times = _timed(push, args.warmup, args.repeats, tick)
    expect = dict(zip([n for n, _ in named], tensor_digests([t for _, t in named]), strict=True))
    verified = True
    for engine in engines:
        digest = engine.call(Digest())
        got = dict(zip(digest.names, digest.fingerprints, strict=False))
        verified &= digest.update_id == reports[-1].update_id and got == expect
    timed = reports[-args.repeats :]
    phases = {k: round(statistics.median(r.seconds[k] for r in timed) * 1e3, 4) for k in timed[0].seconds}
    engine_s = {o.engine: round(o.seconds * 1e3, 3) for o in timed[-1].engines}
    config = {"bucket_bytes": bucket_bytes, "buckets": reports[-1].buckets, "last_update_engine_ms": engine_s}
    return _stats(name, "transport", times, reports[-1].bytes, verified=verified, config=config, phases_ms=phases)


# -- the bare mechanism --------------------------------------------------------------------
def _raw_group(mode: str, nbytes: int, chunk: int, peers: int, device: Any, warmup: int, repeats: int) -> list[float]:
    """Seconds per round of moving ``nbytes`` in ``chunk`` pieces from rank 0 to ``peers`` processes, then a barrier."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    args = (int(store.port), peers + 1, mode, nbytes, chunk, warmup + repeats, device.type)
    children = [ctx.Process(target=_raw_peer, args=(rank, *args), daemon=True) for rank in range(1, peers + 1)]
    for child in children:
        child.start()
    try:
        pg = _group(store, 0, peers + 1, device.type, timeout)
        payload = torch.ones(nbytes, dtype=torch.uint8, device=device)
        seconds = []
        for _ in range(warmup + repeats):
            start = time.perf_counter()
            works = []
            for offset in range(0, nbytes, chunk):
                piece = payload[offset : offset + chunk]
                if mode == "broadcast":
                    works.append(pg.broadcast([piece], _root()))
                else:
                    works += [pg.send([piece], rank, 0) for rank in range(1, peers + 1)]
            for work in works:
                work.wait()
            pg.barrier(dist.BarrierOptions()).wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    finally:
        for child in children:
            child.join(60)
    return seconds[warmup:]


def _raw_peer(
    rank: int, port: int, world: int, mode: str, nbytes: int, chunk: int, rounds: int, device_type: str
) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    device = torch.device("cpu" if device_type == "cpu" else f"cuda:{rank}")
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    pg = _group(store, rank, world, device_type, timeout, device)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(rounds):
        works = []
        for offset in range(0, nbytes, chunk):
            piece = buffer[offset : offset + chunk]
            works.append(pg.broadcast([piece], _root()) if mode == "broadcast" else pg.recv([piece], 0, 0))
        for work in works:
            work.wait()
        pg.barrier(dist.BarrierOptions()).wait()


def _group(store: Any, rank: int, world: int, device_type: str, timeout: Any, device: Any = None) -> Any:
    import torch
    import torch.distributed as dist

    if device_type == "cpu":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    torch.cuda.set_device(device if device is not None else 0)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


def _root() -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


# -- output --------------------------------------------------------------------------------
def print_table(result: SeparatedResult, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    w = result.workload
    table = Table(
        title=f"colosync bench-separated: {w.name} ({w.tensors} tensors, {w.bytes:,} bytes) to {result.engines} "
        f"engines ({result.device})",
        caption=f"{result.command} | {result.commit} | {result.date}",
        title_justify="left",
        caption_justify="left",
    )
    for col in ("path", "median ms", "min ms", "GB/s per engine", "x raw:broadcast", "x raw:p2p", "ok"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in result.results:
        ratios = [f"{r.speedup_vs[k]:.2f}" if k in r.speedup_vs else "-" for k in ("raw:broadcast", "raw:p2p")]
        ok = {True: "[green]yes[/]", False: "[red]NO[/]", None: ""}[r.verified]
        row = [r.path, f"{r.median_ms:.1f}", f"{r.min_ms:.1f}", f"{r.gbps:.2f}", *ratios, ok]
        table.add_row(*row, style="dim" if r.kind == "floor" else None)
    console.print(table)
    console.print("[dim]x raw: the bare group's median over the transport's (1.00 = as fast as the mechanism)[/]")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")


def _run(args: argparse.Namespace) -> int:
    return run_and_report("bench-separated", args, run_separated, print_table)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers,
        "bench-separated",
        doc=__doc__,
        help="time updates of several engine processes as one set, against the bare torch.distributed group",
    )
    parser.add_argument(
        "--workload",
        default="seed-lora",
        help=f"a shipped workload ({', '.join(workloads.names('sync'))}) or a JSON file path (default seed-lora)",
    )
    parser.add_argument("--engines", type=int, default=2, help="engine processes in the set (default 2)")
    parser.add_argument(
        "--transports", default=None, help=f"comma-separated transports (default {','.join(TRANSPORTS)})"
    )
    parser.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed updates per path (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates per path first (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, a GPU per process)")
    add_output_arguments(parser, _run)
