"""``colosync bench``: colosync's transports against the sync paths frameworks commonly use and the copy floor.

A workload (``seed-lora``, ``llama8b-full`` -- shipped in ``colosync/workloads`` -- or any JSON
file of the same format) is materialized as random tensors on one GPU in this process (the
trainer) and pushed, update after update, into a ``sink`` engine in a second process on the
same GPU; an update ends when its bytes are in engine-owned tensors and the engine has
committed it. In the same run it times those two paths (``colosync.tools.bench.refpaths``) into an
engine that also ends in its own tensors, and the pinned-memory copy floor (one device->host
and one host->device copy of the payload through pinned memory, one process). Every path's
result is checked: the engine's tensors must match the trainer's byte for byte.

Prints a table (median, min, GB/s, ratio to the PCIe floor and to each reference) and writes
JSON with the command line, GPU, driver, torch version and date.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from colosync import workloads
from colosync.errors import ConfigError
from colosync.tools.bench.machine import mps_daemon, run_header
from colosync.tools.bench.output import run_and_report
from colosync.tools.subcommand import add_subcommand

if TYPE_CHECKING:
    import torch
    from rich.console import JustifyMethod

    from colosync.wire.manifest import LoraSpec

DEFAULT_BUCKET_MB = {"cuda_ipc": 1024, "shm": 64}
DEFAULT_SLOTS = {"cuda_ipc": 2, "shm": 2}
REFERENCE_BUCKET_MB = 256
PICKLE_MAX_BYTES = 4 << 30  # the pickle path runs at ~0.2 GB/s: skip it above this unless asked


class Workload(msgspec.Struct):
    name: str
    kind: str
    tensors: int
    bytes: int
    description: str = ""


class PathResult(msgspec.Struct):
    path: str
    kind: str  # transport | reference | floor
    times_ms: list[float]
    median_ms: float
    min_ms: float
    gbps: float
    vs_floor: float | None = None
    speedup_vs: dict[str, float] = {}
    verified: bool | None = None
    config: dict[str, Any] = {}
    phases_ms: dict[str, float] = {}  # median time per Sender phase (see SyncReport)


class BenchResult(msgspec.Struct):
    command: str
    argv: list[str]
    date: str
    commit: str
    host: str
    gpu: str
    driver: str
    cuda: str
    torch: str
    python: str
    workload: Workload
    floor_ms: float | None
    results: list[PathResult]
    notes: list[str] = []
    mps: bool | None = None  # a CUDA MPS daemon's control pipe was there (None: no GPU); see ``mps_daemon``


# -- workloads -------------------------------------------------------------------------------
def load_sync_workload(
    name_or_path: str,
) -> tuple[Workload, list[tuple[str, tuple[int, ...], torch.dtype]], LoraSpec | None]:
    """A sync workload (a preset such as ``seed-lora``, or a JSON file): its summary, the
    ``(name, shape, dtype)`` of every tensor, and the LoRA spec of a ``lora`` workload."""
    from colosync.sync.target import parse_lora_name
    from colosync.wire.manifest import LoraSpec, dtype_from_name

    path = workloads.resolve(name_or_path, kind="sync")
    data = workloads.load(path)
    if not isinstance(data.get("tensors"), list):
        raise ConfigError(f"{path} has no 'tensors' list; a sync workload lists name, shape and dtype per tensor")
    specs = [(t["name"], tuple(int(d) for d in t["shape"]), dtype_from_name(t["dtype"])) for t in data["tensors"]]
    total = sum(math.prod(s) * d.itemsize for _, s, d in specs)
    if data.get("total_bytes") not in (None, total):
        raise ConfigError(
            f"{path}: total_bytes says {data['total_bytes']} but the tensors add up to {total}; fix or drop total_bytes"
        )
    lora: LoraSpec | None = None
    kind = data.get("kind", "full")
    if kind == "lora":
        spec = data.get("lora", {})
        targets = sorted({parse_lora_name(n)[0].rsplit(".", 1)[-1] for n, _, _ in specs})
        rank = int(spec.get("rank", 16))
        lora = LoraSpec(rank=rank, alpha=float(spec.get("alpha", rank)), target_modules=tuple(targets))
    return Workload(data.get("name", path.stem), kind, len(specs), total, data.get("description", "")), specs, lora


def make_tensors(specs: list, device) -> list:
    """Random tensors for ``specs`` on ``device`` (finite values; fixed seed)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, shape, dtype in specs:
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point and dtype.itemsize > 1:
            t.normal_(generator=gen)
        elif dtype.is_floating_point:
            t.copy_(torch.randn(shape, device=device, generator=gen).clamp_(-8, 8))
        elif dtype == torch.bool:
            t.copy_(torch.randint(0, 2, shape, device=device, generator=gen).bool())
        else:
            t.random_(0, 100, generator=gen)
        out.append((name, t))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return out


# -- measurements ----------------------------------------------------------------------------
def _stats(path: str, kind: str, seconds: list[float], nbytes: int, **extra: Any) -> PathResult:
    ms = [s * 1e3 for s in seconds]
    med = statistics.median(ms)
    return PathResult(
        path,
        kind,
        [round(v, 4) for v in ms],
        round(med, 4),
        round(min(ms), 4),
        round(nbytes / (med / 1e3) / 1e9, 2),
        **extra,
    )


def _timed(fn, warmup: int, repeats: int, tick=None) -> list[float]:
    for _ in range(warmup):
        fn()
        if tick:
            tick()
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            if tick:
                tick()
    finally:
        gc.enable()
    return times


def _bench_transport(
    engine,
    name: str,
    named,
    lora,
    bucket_bytes: int,
    warmup: int,
    repeats: int,
    tick,
    arena: bool = False,
    slots: int = 2,
) -> PathResult:
    import torch

    from colosync.engines.sink import Digest, tensor_digests
    from colosync.sync.sender import Sender

    sender = Sender(engine.connect(), transport=name, bucket_bytes=bucket_bytes, slots=slots)
    try:
        if arena:
            views = sender.arena([(n, tuple(t.shape), t.dtype) for n, t in named], named[0][1].device)
            with torch.no_grad():
                torch._foreach_copy_(views, [t for _, t in named])
            source = [(n, v) for (n, _), v in zip(named, views, strict=True)]
        else:
            source = named
        reports = []

        def push() -> None:
            reports.append(sender.push(source, lora=lora))

        times = _timed(push, warmup, repeats, tick)
        timed_reports = reports[-repeats:]
        phases = {
            k: round(statistics.median(r.seconds[k] for r in timed_reports) * 1e3, 4) for k in timed_reports[0].seconds
        }
        digest = engine.call(Digest())
        expect = dict(zip([n for n, _ in named], tensor_digests([t for _, t in named]), strict=True))
        verified = (
            digest.update_id == reports[-1].update_id
            and dict(zip(digest.names, digest.fingerprints, strict=False)) == expect
        )
        transport = sender.transport
        if transport is None:  # attached by the pushes above
            raise ConfigError("the bench's sender attached no transport")
        config = {
            "bucket_bytes": sender.bucket_bytes,
            "slot_bytes": transport.slot_bytes,
            "slots": transport.num_slots,
            "transport_bytes": transport.slot_bytes * transport.num_slots,
            "transport_memory": str(transport.slot(0).device),
            "buckets": reports[-1].buckets,
            "engine_bytes": digest.engine_bytes,
            "receiver_bytes": digest.receiver_bytes,
            "transport_log": sender.transport_log,
        }
        streamer = getattr(sender, "_streamer", None)  # how the pack ran: eager, captured or replayed graphs
        if streamer is not None and hasattr(streamer, "graph_counts"):
            config["pack_graphs"] = streamer.graph_counts()
        if hasattr(transport, "pinned"):
            config["pinned"] = transport.pinned
        total = reports[-1].bytes
    finally:
        sender.close()
    return _stats(
        name + ("+arena" if arena else ""),
        "transport",
        times,
        total,
        verified=verified,
        config=config,
        phases_ms=phases,
    )


def _bench_reference(mode: str, named, device, bucket_bytes: int, warmup: int, repeats: int, tick) -> PathResult:
    from colosync.engines.sink import tensor_digests
    from colosync.tools.bench.refpaths import ReferencePath
    from colosync.wire.bucket import plan_buckets

    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], bucket_bytes)
    metas, sizes = layout.tensors, layout.bucket_sizes
    buckets: list[list] = [[] for _ in sizes]
    for meta, item in zip(metas, named, strict=True):
        buckets[meta.bucket].append(item)
    ref = ReferencePath(mode, device, buckets)
    try:
        times = _timed(ref.push, warmup, repeats, tick)
        got = ref.digests()
        expect = dict(zip([n for n, _ in named], tensor_digests([t for _, t in named]), strict=True))
        verified = got == expect
    finally:
        ref.close()
    total = sum(t.nbytes for _, t in named)
    return _stats(
        f"ref:{mode}",
        "reference",
        times,
        total,
        verified=verified,
        config={"bucket_bytes": bucket_bytes, "buckets": len(sizes)},
    )


def _mechanism_room(nbytes: int, device) -> str | None:
    """Why the mechanism row cannot run beside the trainer's tensors on ``device`` (None: it can).

    It holds the payload twice more on the device (the exported buffer and the engine's copy),
    with the paths before it freed; a payload that does not fit would end its engine process
    mid-setup after every other row had been measured."""
    import torch

    torch.cuda.empty_cache()  # what the rows before left in this process's cache is free for it
    free, _ = torch.cuda.mem_get_info(device)
    need = 2 * nbytes + (1 << 30)  # and a GiB for the engine's CUDA context and graphs
    if free >= need:
        return None
    return f"it needs {need / 2**30:.1f} GiB free on {device} beside the trainer's tensors, {free / 2**30:.1f} GiB are"


def _bench_mechanism(named, device, warmup: int, repeats: int, tick) -> PathResult:
    """The bare ``cuda_ipc`` mechanism between two processes (``colosync.tools.bench.mechanism``)."""
    from colosync.engines.sink import tensor_digests
    from colosync.tools.bench.mechanism import MechanismPath

    path = MechanismPath(named, device)
    try:
        times = _timed(path.push, warmup, repeats, tick)
        expect = dict(zip([n for n, _ in named], tensor_digests([t for _, t in named]), strict=True))
        verified = path.digests() == expect
    finally:
        path.close()
    total = sum(t.nbytes for _, t in named)
    return _stats(
        "floor:ipc mechanism", "floor", times, total, verified=verified, config={"buffer_bytes": path.payload}
    )


def _bench_floors(nbytes: int, device, repeats: int) -> list[PathResult]:
    """Pinned-memory copy floors for ``nbytes``: D2H, H2D, both at once (two streams), D2D."""
    import torch

    piece = min(nbytes, 1 << 30)
    pieces = [min(piece, nbytes - o) for o in range(0, nbytes, piece)]
    src = torch.empty(piece, dtype=torch.uint8, device=device)
    dst = torch.empty(piece, dtype=torch.uint8, device=device)
    host_a = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def d2h() -> None:
        for n in pieces:
            host_a[:n].copy_(src[:n], non_blocking=True)
        torch.cuda.synchronize(device)

    def h2d() -> None:
        for n in pieces:
            dst[:n].copy_(host_b[:n], non_blocking=True)
        torch.cuda.synchronize(device)

    def duplex() -> None:
        for n in pieces:
            with torch.cuda.stream(s1):
                host_a[:n].copy_(src[:n], non_blocking=True)
            with torch.cuda.stream(s2):
                dst[:n].copy_(host_b[:n], non_blocking=True)
        torch.cuda.synchronize(device)

    def d2d() -> None:
        for n in pieces:
            dst[:n].copy_(src[:n])
        torch.cuda.synchronize(device)

    out: list[PathResult] = []
    for name, fn in (("d2h", d2h), ("h2d", h2d), ("d2h+h2d", None), ("duplex", duplex), ("d2d", d2d)):
        if fn is None:
            a, b = out[0], out[1]
            out.append(
                _stats(
                    "floor:pinned d2h then h2d",
                    "floor",
                    [(x + y) / 1e3 for x, y in zip(a.times_ms, b.times_ms, strict=False)],
                    nbytes,
                )
            )
            continue
        label = {
            "d2h": "floor:pinned d2h",
            "h2d": "floor:pinned h2d",
            "duplex": "floor:pinned d2h || h2d",
            "d2d": "floor:device copy",
        }[name]
        out.append(_stats(label, "floor", _timed(fn, 2, repeats), nbytes))
    return out


# -- the command -----------------------------------------------------------------------------
def _per_transport(spec: str | None, defaults: dict[str, int]) -> dict[str, int]:
    """``"256"`` (every transport) or ``"cuda_ipc=1024,shm=64"`` over ``defaults``."""
    values = dict(defaults)
    if spec:
        for part in str(spec).split(","):
            if "=" in part:
                name, value = part.split("=", 1)
                values[name.strip()] = int(float(value))
            else:
                values = {k: int(float(part)) for k in values} | {"*": int(float(part))}
    return values


def _bucket_bytes(spec: str | None) -> dict[str, int]:
    return {k: v << 20 for k, v in _per_transport(spec, DEFAULT_BUCKET_MB).items()}


def run_bench(args: argparse.Namespace, progress=None) -> BenchResult:
    import torch

    from colosync import transports as registry
    from colosync.engines.process import EngineConfig, EngineProcess

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "colosync bench needs a CUDA GPU (trainer and engine share one); see `colosync probe`, "
                "or pass --device cpu for a smoke test of the transports"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    workload, specs, lora = load_sync_workload(args.workload)
    colocated = [n for n in registry.names() if registry.sender_class(n).colocated]  # bench-separated: the others
    names = [t.strip() for t in args.transports.split(",")] if args.transports else colocated
    refs = [r.strip() for r in args.references.split(",") if r.strip()] if args.references != "none" else []
    buckets = _bucket_bytes(args.bucket_mb)
    slots = _per_transport(args.slots, DEFAULT_SLOTS)
    repeats = args.repeats or (10 if workload.bytes < (4 << 30) else 5)
    warmup = args.warmup
    notes: list[str] = []
    if device.type != "cuda":  # a smoke test of the transports on CPU: no GPU paths to compare
        refs, args.no_floor = [], True
        notes.append("device cpu: references and floors need a GPU and were skipped")
    elif mps_daemon() is None:
        notes.append(
            "no CUDA MPS daemon: trainer and engine are two CUDA contexts taking turns on the GPU, ~0.3 ms per "
            "sync on an H200; `nvidia-cuda-mps-control -d` before both start shares one (see the README)"
        )
    if "pickle" in refs and workload.bytes > PICKLE_MAX_BYTES and not args.force_pickle:
        refs.remove("pickle")
        notes.append(
            f"ref:pickle skipped: {workload.bytes / 1e9:.1f} GB at ~0.2 GB/s would take minutes "
            "per update (pass --force-pickle to run it)"
        )
    plan = [(n, "transport") for n in names] + ([("cuda_ipc+arena", "transport")] if args.arena else [])
    plan += [(f"ref:{r}", "reference") for r in refs]
    plan += [("floors", "floor"), ("floor:ipc mechanism", "floor")] if not args.no_floor else []
    task = progress.add_task("bench", total=len(plan) * (warmup + repeats)) if progress else None

    def tick() -> None:
        if progress:
            progress.advance(task)

    def status(text: str) -> None:
        if progress:
            progress.update(task, description=text)

    status("trainer tensors")
    named = make_tensors(specs, device)
    results: list[PathResult] = []
    engine = EngineProcess(EngineConfig(engine="sink", device=str(device), timeout_s=600.0, log_level="ERROR"))
    try:
        for name, kind in plan:
            if kind != "transport":
                continue
            base = name.split("+")[0]
            ok, why = registry.sender_class(base).available(device)
            if not ok:
                notes.append(f"{name} skipped: {why}")
                if progress:
                    progress.advance(task, warmup + repeats)
                continue
            status(f"{name} ({workload.name})")
            bucket = buckets.get(base, buckets.get("*", 64 << 20))
            results.append(
                _bench_transport(
                    engine,
                    base,
                    named,
                    lora,
                    bucket,
                    warmup,
                    repeats,
                    tick,
                    arena=name.endswith("+arena"),
                    slots=slots.get(base, slots.get("*", 2)),
                )
            )
    finally:
        engine.close()
    for ref in refs:
        status(f"ref:{ref} ({workload.name})")
        results.append(_bench_reference(ref, named, device, REFERENCE_BUCKET_MB << 20, warmup, repeats, tick))
    floor_ms = None
    if not args.no_floor:
        status("pinned copy floor")
        floors = _bench_floors(workload.bytes, device, max(repeats, 5))
        tick()
        results += floors
        by = {f.path: f for f in floors}
        floor_ms = max(by["floor:pinned d2h"].median_ms, by["floor:pinned h2d"].median_ms)
        room = _mechanism_room(workload.bytes, device)
        if room is None:
            status(f"floor:ipc mechanism ({workload.name})")
            results.append(_bench_mechanism(named, device, warmup, repeats, tick))
        else:
            notes.append(f"floor:ipc mechanism skipped: {room}")
    ref_medians = {r.path: r.median_ms for r in results if r.kind == "reference"}
    for r in results:
        if floor_ms:
            r.vs_floor = round(r.median_ms / floor_ms, 3)
        r.speedup_vs = {ref: round(med / r.median_ms, 2) for ref, med in ref_medians.items() if ref != r.path}
    header = run_header(args.argv, device=device)
    machine = header["machine"]
    return BenchResult(
        command=header["command"],
        argv=list(sys.argv),
        date=header["date"],
        commit=header["commit"],
        host=machine["hostname"],
        gpu=machine.get("gpu", "cpu"),
        driver=machine.get("driver", "none"),
        cuda=str(machine["cuda"]),
        torch=machine["torch"],
        python=machine["python"],
        workload=workload,
        floor_ms=floor_ms,
        results=results,
        notes=notes,
        mps=machine.get("mps"),
    )


def print_table(result: BenchResult, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    w = result.workload
    table = Table(
        title=f"colosync bench: {w.name} ({w.tensors} tensors, {w.bytes:,} bytes) on {result.gpu}",
        caption=f"{result.command} | driver {result.driver}, CUDA {result.cuda}, torch {result.torch} | {result.date}",
        title_justify="left",
        caption_justify="left",
    )
    refs = [r.path for r in result.results if r.kind == "reference"]
    columns: list[tuple[str, JustifyMethod]] = [
        ("path", "left"),
        ("median ms", "right"),
        ("min ms", "right"),
        ("GB/s", "right"),
        ("x PCIe floor", "right"),
    ]
    columns += [(f"faster than {r[4:]}", "right") for r in refs]
    columns += [("ok", "center")]
    for col, just in columns:
        table.add_column(col, justify=just)
    for r in result.results:
        row = [
            r.path,
            f"{r.median_ms:.3f}",
            f"{r.min_ms:.3f}",
            f"{r.gbps:.1f}",
            f"{r.vs_floor:.2f}" if r.vs_floor is not None else "-",
        ]
        row += [f"{r.speedup_vs[ref]:.1f}x" if ref in r.speedup_vs else "-" for ref in refs]
        row.append({True: "[green]yes[/]", False: "[red]NO[/]", None: ""}[r.verified])
        table.add_row(*row, style="dim" if r.kind == "floor" else None)
    console.print(table)
    if result.floor_ms:
        console.print(f"PCIe floor = the slower direction of one pinned copy: {result.floor_ms:.3f} ms")
    for r in result.results:
        if r.phases_ms:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in r.phases_ms.items())
            console.print(
                f"[dim]{r.path}: {phases} ms; bucket {r.config.get('bucket_bytes', 0) >> 20} MiB, "
                f"{r.config.get('slots')} x {r.config.get('slot_bytes', 0) >> 20} MiB slots in "
                f"{r.config.get('transport_memory')} memory[/]"
            )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")


def _run(args: argparse.Namespace) -> int:
    return run_and_report("bench", args, run_bench, print_table)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers,
        "bench",
        doc=__doc__,
        help="time each transport between two processes on one GPU against the common sync paths and the copy floor",
    )
    parser.add_argument(
        "--workload",
        default="seed-lora",
        help=f"a shipped workload ({', '.join(workloads.names('sync'))}) or a JSON file path (default seed-lora)",
    )
    parser.add_argument("--transports", default=None, help="comma-separated transports (default: every colocated one)")
    parser.add_argument(
        "--references",
        default="fresh_ipc,pickle",
        help="seed reference paths to time: fresh_ipc, pickle, or none (default both)",
    )
    parser.add_argument(
        "--arena",
        action="store_true",
        help="also time cuda_ipc with the trainer's tensors living in the exported buffer (no packing)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed updates per path (default 10; 5 above 4 GB)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates per path first (default 3)")
    parser.add_argument(
        "--bucket-mb",
        default=None,
        help="bucket size in MiB, for all transports or per transport "
        f"(e.g. 'cuda_ipc=256,shm=64'; default {DEFAULT_BUCKET_MB})",
    )
    parser.add_argument(
        "--slots",
        default=None,
        help=f"buckets in flight (Sender slots), for all or per transport (default {DEFAULT_SLOTS})",
    )
    parser.add_argument("--device", default="cuda", help="the GPU trainer and engine share (default cuda)")
    parser.add_argument(
        "--no-floor", action="store_true", help="skip the floors: the pinned copies and the bare cuda_ipc mechanism"
    )
    parser.add_argument("--force-pickle", action="store_true", help="run the pickle reference even above 4 GB")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    parser.set_defaults(func=_run, argv=None)
