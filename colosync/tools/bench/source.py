"""``colosync bench-source``: FsdpSource's bucketed gathers against per-parameter ``full_tensor()``.

Spawns ``--world-size`` ranks (gloo on the CPU, NCCL with one GPU per rank), builds a synthetic
FSDP2 model of ``--size`` bytes (``--tensors`` matrices with an odd row count, so shards are
uneven, one ``fully_shard`` unit per four of them) and pushes it, update after update, into a
``sink`` engine in its own process from rank 0. In the same run, interleaved, it times:

* ``fsdp_source``: ``FsdpSource.push`` (one all-gather per bucket, two buckets in flight);
* ``full_tensor_stream``: ``DTensor.full_tensor()`` per parameter on every rank, rank 0
  streaming each gathered tensor into the Sender as it pulls (memory bounded, one collective
  per parameter);
* ``full_tensor_all``: the common pattern, every rank gathering every parameter with
  ``full_tensor()`` into a dict, then rank 0 pushing it (memory: the whole model);

each also without the push (``gather_s``), so gather and push can be told apart. A repeat
ends when every rank is done and the engine has committed. Reports median seconds, seconds
per GB, GB/s and the sending rank's peak memory above the model (FsdpSource: its live
buffers; the others: the gathered tensors it held; on CUDA also the allocator's peak), and
checks the engine's bytes against the unsharded tensors once. The JSON carries the command,
machine and date.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from colosync.errors import ColosyncError, ConfigError
from colosync.tools.bench.machine import run_header
from colosync.tools.subcommand import add_subcommand, parse_size

PATHS = ("fsdp_source", "full_tensor_stream", "full_tensor_all")


class BenchConfig(msgspec.Struct, frozen=True):
    world_size: int
    size_bytes: int
    tensors: int
    bucket_bytes: int
    dtype: str
    device: str
    transport: str
    repeats: int
    warmup: int
    paths: tuple[str, ...]


class PathResult(msgspec.Struct):
    path: str
    times_s: list[float]
    median_s: float
    min_s: float
    s_per_gb: float
    gbps: float
    gather_median_s: float
    gather_s_per_gb: float
    peak_sender_bytes: int  # bytes above the model the sending rank held at once
    peak_sender_device_bytes: int | None = None  # CUDA: the allocator's peak above the model
    verified: bool | None = None


class SourceBenchResult(msgspec.Struct):
    command: str
    date: str
    commit: str
    machine: dict[str, Any]
    config: BenchConfig
    payload_bytes: int
    results: list[PathResult]
    speedup: dict[str, float]  # fsdp_source's median against each other path's


# -- ranks ----------------------------------------------------------------------------------


def _model(cfg: BenchConfig, device: Any) -> tuple[Any, int]:
    """A synthetic FSDP2 model: ``cfg.tensors`` matrices (odd rows: uneven shards) in units of four."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dtype = getattr(torch, cfg.dtype)
    cols = 1024
    rows = max(1, cfg.size_bytes // cfg.tensors // (cols * dtype.itemsize)) | 1
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    blocks = []
    for b in range(math.ceil(cfg.tensors / 4)):
        block = torch.nn.Module()
        for i in range(min(4, cfg.tensors - 4 * b)):
            w = torch.randn(rows, cols, generator=gen).to(dtype)
            block.register_parameter(f"w{i}", torch.nn.Parameter(w.to(device), requires_grad=False))
        blocks.append(block)
    model.blocks = torch.nn.ModuleList(blocks)
    mesh = init_device_mesh(device.type, (cfg.world_size,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, rows * cols * dtype.itemsize * cfg.tensors


def _rank(rank: int, cfg_bytes: bytes, address_bytes: bytes, port: int, results: Any) -> None:
    try:
        results.put((rank, True, _rank_body(rank, cfg_bytes, address_bytes, port)))
    except BaseException as exc:
        import traceback

        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _rank_body(rank: int, cfg_bytes: bytes, address_bytes: bytes, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.engines.sink import Digest, tensor_digests
    from colosync.sources.fsdp import FsdpSource
    from colosync.sync.sender import Sender

    cfg = msgspec.msgpack.decode(cfg_bytes, type=BenchConfig)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=cfg.world_size)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model, payload = _model(cfg, device)
    named = list(model.named_parameters())
    source = FsdpSource(model, "full", bucket_bytes=cfg.bucket_bytes)
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), "sink") if rank == 0 else None
    sender = Sender(link, transport=cfg.transport, bucket_bytes=cfg.bucket_bytes) if link is not None else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    from torch.multiprocessing.reductions import StorageWeakRef

    held = {"bytes": 0}
    live: list[tuple[Any, int]] = []

    def full_tensors() -> Any:
        """Per-parameter ``full_tensor()``, counting the gathered bytes still alive at each step."""
        live.clear()
        for name, p in named:
            full = p.full_tensor()
            live.append((StorageWeakRef(full.untyped_storage()), full.numel() * full.element_size()))
            held["bytes"] = max(held["bytes"], sum(n for ref, n in live if not ref.expired()))
            yield name, full
            del full

    def run(path: str, push: bool) -> float:
        sync()
        t = time.perf_counter()
        if path == "fsdp_source":
            if push:
                source.push(sender)
            else:
                for _ in source.tensors():
                    pass
        elif path == "full_tensor_stream":
            stream = full_tensors()
            if push and sender is not None:
                sender.push_stream([(n, tuple(p.shape), p.dtype) for n, p in named], stream)
            for _ in stream:
                pass
        else:
            gathered = list(full_tensors())
            if push and sender is not None:
                sender.push(gathered)
            del gathered
        sync()
        return time.perf_counter() - t

    out: dict[str, Any] = {"payload": payload}
    try:
        if sender is not None:
            sender.push(list(full_tensors()))  # attach and warm the transport and the engine's buffers
        else:
            list(full_tensors())
        times: dict[str, list[float]] = {p: [] for p in cfg.paths}
        gathers: dict[str, list[float]] = {p: [] for p in cfg.paths}
        peaks: dict[str, int] = dict.fromkeys(cfg.paths, 0)
        device_peaks: dict[str, int] = dict.fromkeys(cfg.paths, 0)
        for repeat in range(cfg.warmup + cfg.repeats):
            for path in cfg.paths:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                held["bytes"] = 0
                seconds = run(path, push=True)
                if cuda:
                    device_peaks[path] = max(device_peaks[path], torch.cuda.max_memory_allocated() - before)
                peaks[path] = max(
                    peaks[path], source.stats.peak_buffer_bytes if path == "fsdp_source" else held["bytes"]
                )
                gather = run(path, push=False)
                if repeat >= cfg.warmup:
                    times[path].append(seconds)
                    gathers[path].append(gather)
        verified = None
        source.push(sender)  # the engine now holds fsdp_source's bytes: check them
        digests = tensor_digests([t for _, t in full_tensors()])
        if link is not None:
            verified = link.call(Digest()).fingerprints == digests
        out.update(times=times, gathers=gathers, peaks=peaks, device_peaks=device_peaks, verified=verified)
    finally:
        if sender is not None:
            sender.close()
        if link is not None:
            link.close()
        dist.destroy_process_group()
    return out


# -- driver ---------------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, argv: list[str] | None = None, timeout_s: float = 3600.0) -> SourceBenchResult:
    import multiprocessing as mp
    import socket

    from colosync.engines.config import EngineConfig
    from colosync.engines.process import EngineProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with EngineProcess(EngineConfig(engine="sink", device="cuda:0" if cfg.device == "cuda" else "cpu")) as engine:
        address = msgspec.msgpack.encode(engine.address)
        procs = [
            ctx.Process(target=_rank, args=(r, msgspec.msgpack.encode(cfg), address, port, results))
            for r in range(cfg.world_size)
        ]
        for p in procs:
            p.start()
        by_rank: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout_s
            while len(by_rank) < cfg.world_size:
                rank, ok, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
                if not ok:
                    raise ColosyncError(f"bench-source: rank {rank} failed: {payload}")
                by_rank[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    zero = by_rank[0]
    payload = int(zero["payload"])
    out = []
    for path in cfg.paths:
        times, gathers = zero["times"][path], zero["gathers"][path]
        med = statistics.median(times)
        gmed = statistics.median(gathers)
        out.append(
            PathResult(
                path=path,
                times_s=[round(t, 6) for t in times],
                median_s=med,
                min_s=min(times),
                s_per_gb=med / (payload / 1e9),
                gbps=payload / med / 1e9,
                gather_median_s=gmed,
                gather_s_per_gb=gmed / (payload / 1e9),
                peak_sender_bytes=int(zero["peaks"][path]),
                peak_sender_device_bytes=int(zero["device_peaks"][path]) if cfg.device == "cuda" else None,
                verified=zero["verified"] if path == "fsdp_source" else None,
            )
        )
    mine = next((r for r in out if r.path == "fsdp_source"), None)
    speedup = {r.path: r.median_s / mine.median_s for r in out if mine is not None and r is not mine}
    header = run_header(argv, device="cuda:0" if cfg.device == "cuda" else "cpu")
    return SourceBenchResult(
        header["command"], header["date"], header["commit"], header["machine"], cfg, payload, out, speedup
    )


def _table(result: SourceBenchResult) -> str:
    cfg = result.config
    lines = [
        f"bench-source: {result.payload_bytes / 1e6:.1f} MB in {cfg.tensors} tensors, world size {cfg.world_size} "
        f"({cfg.device}), {cfg.bucket_bytes >> 20} MiB buckets, {cfg.transport}, median of {cfg.repeats}",
        f"{'path':<20} {'push s/GB':>10} {'GB/s':>8} {'gather s/GB':>12} {'peak sender MB':>15}",
    ]
    for r in result.results:
        lines.append(
            f"{r.path:<20} {r.s_per_gb:>10.3f} {r.gbps:>8.3f} {r.gather_s_per_gb:>12.3f} "
            f"{r.peak_sender_bytes / 1e6:>15.1f}" + ("" if r.verified is None else f"  verified={r.verified}")
        )
    for path, x in result.speedup.items():
        lines.append(f"fsdp_source is {x:.2f}x faster than {path}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    try:
        unknown = [p for p in paths if p not in PATHS]
        if unknown or not paths:
            raise ConfigError(f"unknown path(s) {unknown or paths}; choose from {', '.join(PATHS)}")
        if args.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
        if device == "cuda" and args.world_size > torch.cuda.device_count():
            raise ConfigError(
                f"--world-size {args.world_size} needs one GPU per rank; this machine has {torch.cuda.device_count()}"
            )
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
        if args.tensors < 1 or args.repeats < 1 or args.warmup < 0 or args.bucket_mb <= 0:
            raise ConfigError("--tensors and --repeats must be >= 1, --warmup >= 0, --bucket-mb > 0")
        cfg = BenchConfig(
            world_size=args.world_size,
            size_bytes=args.size,
            tensors=args.tensors,
            bucket_bytes=int(args.bucket_mb * (1 << 20)),
            dtype=args.dtype,
            device=device,
            transport=args.transport or ("cuda_ipc" if device == "cuda" else "shm"),
            repeats=args.repeats,
            warmup=args.warmup,
            paths=paths,
        )
        result = run_bench(cfg, argv=args.argv)
    except ColosyncError as exc:
        print(f"colosync bench-source: {exc}", file=sys.stderr)
        return 2
    data = msgspec.json.format(msgspec.json.encode(result), indent=2)
    if args.out:
        Path(args.out).write_bytes(data + b"\n")
    print(data.decode() if args.json else _table(result))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers,
        "bench-source",
        doc=__doc__ or "",
        help="time FsdpSource's bucketed gathers against per-parameter full_tensor(), gather + push",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2; on CUDA one GPU each)")
    parser.add_argument("--size", type=parse_size, default=parse_size("200MB"), help="model bytes (default 200MB)")
    parser.add_argument("--tensors", type=int, default=64, help="parameters (default 64)")
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size in MiB (default 16)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="default float32")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default cuda if present")
    parser.add_argument("--transport", default=None, help="Sender transport (default cuda_ipc on CUDA, shm on CPU)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {', '.join(PATHS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per path (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repeats per path first (default 1)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    parser.set_defaults(func=main, argv=None)


__all__ = ["BenchConfig", "PathResult", "SourceBenchResult", "register", "run_bench"]
