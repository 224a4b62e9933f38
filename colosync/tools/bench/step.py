"""``colosync bench-step``: the whole colocated step at the size where memory matters.

The demo's model is tiny, so its handoff and sync say nothing about what a step costs when
the engine's weights are 16 GB and its KV cache fills the GPU. This runs the same topology
(engine and trainer in their own processes, this process the controller, one host arena,
the executor measuring every process and the device) with the synthetic engine and trainer
(``colosync.engines.synthetic``, ``colosync.colocated.synthetic``) at the sizes given: every step
the engine serves (it fingerprints every weight), the handoff gives the device to the
trainer, the trainer takes an Adam step (fp32 moments), and the handoff gives it back with
a full sync inside (staged in the arena, installed at commit). The engine's fingerprints
must then equal the trainer's, from the version the sync committed, or the run stops.

Reported per step and as medians: each phase's seconds against the pinned-copy floor of
the bytes it moved (the copy rates measured here, in the same run), the host copies' peak
against the plan and the larger copy, the device peak, the device memory the sync added,
and every broken invariant.

The copy floor leaves out the operations that copy nothing: dropping the KV cache and
allocating it again, the trainer's ``clear_memory``. They cost what the CUDA allocator's calls
cost, so the same run measures those too (``allocator_times``: a block the size of the KV cache
allocated and freed, before any participant starts). Each operation's device bytes allocated and
freed at those rates is its allocator floor, and the copy floor plus it is reported beside the
copy floor. It is an estimate from one block timed alone, not a bound: the driver defers work after
a large free (host-to-device copies into new memory run slower for a while), so an operation can
pay another's share (``benchmarks/colocated-step``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from colosync.errors import ColosyncError, ParityError
from colosync.tools.bench.floors import AllocatorTimes, allocator_floor, allocator_times, copy_floor, pinned_rates

TRAINER = "colosync.colocated.synthetic:SyntheticTrainer"
MARGIN = 8 << 30  # device memory left free at the rollout peak for CUDA contexts and temporaries


@dataclass
class StepBenchOptions:
    weight_bytes: int
    kv_bytes: int | None = None  # None: fill the device
    steps: int = 10
    modes: tuple[str, ...] = ("gpu", "cpu")
    device: str = "cuda"
    transport: str = "auto"
    bucket_bytes: int = 64 << 20
    tensor_bytes: int = 256 << 20
    optimizer_shards: int = 1
    host_scope: str = "processes"  # how the executor counts host memory (see HostSampler)
    trainer_backend: str = "torch"  # the trainer's sleep/wake: "torch" (the arena) or "tms" (torch_memory_saver)
    lend_kv: bool = False  # the trainer wakes up in the engine's KV cache block (HandoffConfig.lend_kv)
    seed: int = 0


@dataclass
class StepRow:
    step: int
    serve_s: float
    rollout_to_train_s: float
    train_s: float
    train_to_rollout_s: float  # the sync included
    sync_s: float
    sync_bytes: int
    sync_device_extra_bytes: int
    host_copies_peak_bytes: int
    plan_host_copies_bytes: int
    device_peak_bytes: int
    handoff_floor_s: float  # both handoffs' bytes at the measured pinned rates
    sync_floor_s: float  # the sync's bytes device -> host staging -> device
    allocator_floor_s: float  # both handoffs' device bytes allocated and freed, at the measured allocator rates
    update_id: int
    violations: list[str] = field(default_factory=list)
    op_seconds: dict[str, float] = field(default_factory=dict)  # "phase/op": seconds, both handoffs
    op_bytes: dict[str, int] = field(default_factory=dict)  # "phase/op": bytes copied (the sync's: 0)
    op_allocator_s: dict[str, float] = field(default_factory=dict)  # "phase/op": its allocator floor


@dataclass
class ModeReport:
    peak_device: str
    arena_bytes: int
    larger_copy_bytes: int
    bucket_and_slots_bytes: int
    init_s: float
    lend_kv: bool = False
    rows: list[StepRow] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    op_medians_s: dict[str, float] = field(default_factory=dict)  # "phase/op": median seconds


@dataclass
class StepBenchReport:
    header: dict[str, Any]
    weight_bytes: int
    kv_bytes: int
    trainer_resident_bytes: int
    trainer_backup_bytes: int
    copy_gbps: dict[str, float]  # pinned host <-> device, measured before the run
    allocator_s_per_gb: dict[str, float] = field(default_factory=dict)  # "allocate"/"free", before the run
    allocator_times: AllocatorTimes = field(default_factory=AllocatorTimes)  # each timed call behind those rates
    modes: list[ModeReport] = field(default_factory=list)
    error: str = ""  # what stopped the run early (a parity failure, a refused step), if anything


def run_step_bench(
    options: StepBenchOptions,
    console: Any,
    argv: list[str] | None = None,
    progress: Callable[[StepBenchReport], None] | None = None,
) -> StepBenchReport:
    """Run every mode of ``options``; ``progress(report)`` after each step (e.g. to save it)."""
    import torch

    from colosync.engines.synthetic import SyntheticModel
    from colosync.tools.bench.machine import run_header

    device = torch.device(options.device)
    rates = pinned_rates(device)
    kv = options.kv_bytes
    if kv is None:
        kv = _fill_kv(options, device)
    folder = Path(tempfile.mkdtemp(prefix="colosync-bench-step-"))
    SyntheticModel(options.weight_bytes, kv, options.tensor_bytes, seed=options.seed).save(folder)
    allocator = allocator_times(device, kv)  # the largest block a step allocates, while the device is empty
    s_per_gb = allocator.s_per_gb()
    report = StepBenchReport(
        run_header(argv, device=device), options.weight_bytes, kv, 0, 0, rates, s_per_gb, allocator
    )
    console.print(
        f"[bold]bench-step[/] weights {options.weight_bytes / 1e9:.1f} GB, KV {kv / 1e9:.1f} GB, "
        f"pinned copies {rates['to_device']:.1f} GB/s to the device, {rates['to_host']:.1f} GB/s to the host, "
        f"allocator {s_per_gb['allocate'] * 1e3:.2f} ms/GB to allocate, {s_per_gb['free'] * 1e3:.2f} ms/GB to free"
    )
    try:
        for mode in options.modes:
            _run_mode(options, mode, str(folder), rates, report, console, progress)
    except ColosyncError as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        if progress is not None:
            progress(report)  # the steps measured so far, with what stopped them
        raise
    return report


def _fill_kv(options: StepBenchOptions, device: Any) -> int:
    """A KV cache filling what the rollout leaves: the device's free memory less the engine's
    weights and a margin (the trainer holds nothing on the device while the engine serves)."""
    import torch

    if device.type != "cuda":
        return options.weight_bytes // 4
    free, _total = torch.cuda.mem_get_info(device)
    kv = free - options.weight_bytes - MARGIN
    if kv <= 0:
        raise ColosyncError(
            f"{options.weight_bytes / 1e9:.1f} GB of weights leave no room for a KV cache on a device with "
            f"{free / 1e9:.1f} GB free; pass a smaller --weights"
        )
    return kv


def _run_mode(
    options: StepBenchOptions,
    mode: str,
    folder: str,
    rates: dict[str, float],
    report: StepBenchReport,
    console: Any,
    progress: Callable[[StepBenchReport], None] | None,
) -> None:
    from colosync.colocated.cluster import Cluster
    from colosync.colocated.step import Colocated
    from colosync.engines.synthetic import Digest

    trainer_kwargs = dict(
        model_dir=folder,
        engine_name="synthetic",
        transport=options.transport,
        device=options.device,
        seed=options.seed,
        bucket_bytes=options.bucket_bytes,
        optimizer_shards=options.optimizer_shards,
        backend=options.trainer_backend,
    )
    cluster = Cluster(
        "process",
        engine="synthetic",
        model_dir=folder,
        device=options.device,
        threads=1 if options.device == "cpu" else 0,
        trainer_kwargs=trainer_kwargs,
        trainer_actor=TRAINER,
    )
    colo: Colocated | None = None
    lend = options.lend_kv
    try:
        colo = Colocated(cluster, mode, bucket_bytes=options.bucket_bytes, host_scope=options.host_scope, lend_kv=lend)
        assert colo.handoff is not None
        sizes, arena_bytes = colo.handoff.sizes, colo.arena_bytes
        report.trainer_resident_bytes = sizes.trainer_resident_bytes
        report.trainer_backup_bytes = sizes.trainer_backup_bytes
        bucket = min(sizes.sync_bucket_bytes, sizes.sync_bytes)
        started = time.perf_counter()
        init = colo.init()
        assert init is not None
        out = ModeReport(
            mode,
            arena_bytes,
            max(sizes.engine_weight_bytes, sizes.trainer_backup_bytes),
            bucket * (sizes.sync_slots + 1),
            time.perf_counter() - started,
            options.lend_kv,
        )
        if init.violations:
            console.print(f"[bold red]init:[/] {init.violations}")
        console.print(
            f"[bold]{mode}[/] mode{' (KV cache lent)' if options.lend_kv else ''}: arena {arena_bytes / 1e9:.1f} GB, "
            f"trainer {sizes.trainer_resident_bytes / 1e9:.1f} GB on the device "
            f"({sizes.trainer_backup_bytes / 1e9:.1f} GB backed up), init {out.init_s:.1f} s"
        )
        report.modes.append(out)
        for step in range(options.steps):
            out.rows.append(_step(step, cluster, colo, rates, report.allocator_s_per_gb, Digest))
            out.summary, out.op_medians_s = _summary(out), _op_medians(out)
            _print_row(out.rows[-1], console, header=step == 0)
            if progress is not None:
                progress(report)
    finally:
        try:
            if colo is not None:
                colo.close()
        finally:
            cluster.close()


def _step(
    step: int,
    cluster: Any,
    colo: Any,
    rates: dict[str, float],
    allocator_s_per_gb: dict[str, float],
    digest_request: Any,
) -> StepRow:
    """One ``Colocated.step``: the engine serves (reads every weight), the trainer steps, the
    full sync; then the engine's fingerprints must be the trainer's, from the synced version."""

    def train(_served: Any) -> tuple[float, list[int]]:  # the step, and what the trainer holds before its sleep
        return float(cluster.trainer.call("train_step")), cluster.trainer.call("digest")

    def check(trained: tuple[float, list[int]], sync: Any) -> None:
        want, served = trained[1], cluster.driver.call(digest_request())
        if served.update_id != sync.update_id or list(served.fingerprints) != list(want):
            wrong = sum(a != b for a, b in zip(served.fingerprints, want, strict=False)) + abs(
                len(served.fingerprints) - len(want)
            )
            raise ParityError(
                f"step {step}: the engine serves update {served.update_id} (the sync committed {sync.update_id}) "
                f"and {wrong} of {len(want)} weights differ from the trainer's"
            )

    # the rollout stand-in: the engine reads every weight it serves
    record = colo.step(lambda: cluster.driver.call(digest_request()), train, check=check)
    r2t, t2r, sync = record.rollout_to_train, record.train_to_rollout, record.sync
    handoff_floor = copy_floor(r2t.bytes_to_host + t2r.bytes_to_host, r2t.bytes_to_device + t2r.bytes_to_device, rates)
    phases = (r2t, t2r)

    def per_op(value: Callable[[Any, str], Any]) -> dict[str, Any]:  # "phase/op": value, both handoffs
        return {f"{p.phase}/{op}": value(p, op) for p in phases for op in p.op_seconds}

    op_allocator = per_op(
        lambda p, op: allocator_floor(
            p.op_device_allocated.get(op, 0), p.op_device_freed.get(op, 0), allocator_s_per_gb
        )
    )
    return StepRow(
        step=step,
        serve_s=record.rollout_s,
        rollout_to_train_s=r2t.seconds,
        train_s=record.trained[0],
        train_to_rollout_s=t2r.seconds,
        sync_s=record.sync_s,
        sync_bytes=sync.bytes,
        sync_device_extra_bytes=t2r.sync_device_extra_bytes,
        host_copies_peak_bytes=max(r2t.host_copies_peak_bytes, t2r.host_copies_peak_bytes),
        plan_host_copies_bytes=max(r2t.plan_host_copies_bytes, t2r.plan_host_copies_bytes),
        device_peak_bytes=max(r2t.device_peak_bytes, t2r.device_peak_bytes),
        handoff_floor_s=handoff_floor,
        sync_floor_s=copy_floor(sync.bytes, sync.bytes, rates),
        allocator_floor_s=sum(op_allocator.values()),
        update_id=sync.update_id,
        violations=record.violations,
        op_seconds=per_op(lambda p, op: p.op_seconds[op]),
        op_bytes=per_op(lambda p, op: p.op_bytes.get(op, 0)),
        op_allocator_s=op_allocator,
    )


def _summary(mode: ModeReport) -> dict[str, float]:
    rows = mode.rows[1:] if len(mode.rows) > 1 else mode.rows  # the first step pays one-time costs

    def med(get: Any) -> float:
        return statistics.median(get(r) for r in rows) if rows else 0.0

    handoff_sync = med(lambda r: r.rollout_to_train_s + r.train_to_rollout_s)
    floor = med(lambda r: r.handoff_floor_s + r.sync_floor_s)
    with_allocator = med(lambda r: r.handoff_floor_s + r.sync_floor_s + r.allocator_floor_s)
    host_peak = max((r.host_copies_peak_bytes for r in mode.rows), default=0)
    return {
        "steps": len(mode.rows),
        "median_serve_s": med(lambda r: r.serve_s),
        "median_rollout_to_train_s": med(lambda r: r.rollout_to_train_s),
        "median_train_s": med(lambda r: r.train_s),
        "median_train_to_rollout_s": med(lambda r: r.train_to_rollout_s),
        "median_sync_s": med(lambda r: r.sync_s),
        "median_handoff_plus_sync_s": handoff_sync,
        "median_floor_s": floor,
        "handoff_plus_sync_over_floor": handoff_sync / floor if floor else 0.0,
        "median_floor_with_allocator_s": with_allocator,
        "handoff_plus_sync_over_floor_with_allocator": handoff_sync / with_allocator if with_allocator else 0.0,
        "host_copies_peak_bytes": host_peak,
        "host_peak_over_larger_copy": host_peak / mode.larger_copy_bytes if mode.larger_copy_bytes else 0.0,
        "max_sync_device_extra_bytes": max((r.sync_device_extra_bytes for r in mode.rows), default=0),
        "device_peak_bytes": max((r.device_peak_bytes for r in mode.rows), default=0),
        "violations": sum(len(r.violations) for r in mode.rows),
    }


def _op_medians(mode: ModeReport) -> dict[str, float]:
    """Each handoff operation's median seconds over the steps after the first, in plan order."""
    rows = mode.rows[1:] if len(mode.rows) > 1 else mode.rows
    ops = rows[-1].op_seconds if rows else {}
    return {op: statistics.median(r.op_seconds.get(op, 0.0) for r in rows) for op in ops}


def _print_row(row: StepRow, console: Any, header: bool) -> None:
    if header:
        console.print(
            "step   serve  r->t   train  t->r (sync)      floor  host copies/plan GB  device GB  sync +dev MB  ok"
        )
    console.print(
        f"{row.step:>4} {row.serve_s:6.2f} {row.rollout_to_train_s:6.2f} {row.train_s:6.2f} "
        f"{row.train_to_rollout_s:6.2f} ({row.sync_s:5.2f}) {row.handoff_floor_s + row.sync_floor_s:8.2f}  "
        f"{row.host_copies_peak_bytes / 1e9:8.2f}/{row.plan_host_copies_bytes / 1e9:<8.2f}  "
        f"{row.device_peak_bytes / 1e9:9.1f}  {row.sync_device_extra_bytes / 1e6:12.0f}  "
        f"{'yes' if not row.violations else 'NO: ' + '; '.join(row.violations)}",
        highlight=False,
    )


def print_summary(report: StepBenchReport, console: Any) -> None:
    from rich.table import Table

    table = Table(title="bench-step: medians over steps 2.. (step 1 pays one-time costs)")
    for col in (
        "mode",
        "r->t s",
        "train s",
        "t->r s",
        "sync s",
        "handoff+sync / floor",
        "floor + allocator",
        "host peak / larger copy",
        "sync +device MB (bucket+slots)",
        "invariants broken",
    ):
        table.add_column(col)
    for m in report.modes:
        s = m.summary
        table.add_row(
            m.peak_device,
            f"{s['median_rollout_to_train_s']:.2f}",
            f"{s['median_train_s']:.2f}",
            f"{s['median_train_to_rollout_s']:.2f}",
            f"{s['median_sync_s']:.2f}",
            f"{s['median_handoff_plus_sync_s']:.2f} / {s['median_floor_s']:.2f} = "
            f"{s['handoff_plus_sync_over_floor']:.2f}x",
            f"{s['median_floor_with_allocator_s']:.2f} s: {s['handoff_plus_sync_over_floor_with_allocator']:.2f}x",
            f"{s['host_copies_peak_bytes'] / 1e9:.2f} / {m.larger_copy_bytes / 1e9:.2f} GB",
            f"{s['max_sync_device_extra_bytes'] / 1e6:.0f} ({m.bucket_and_slots_bytes / 1e6:.0f})",
            str(int(s["violations"])),
        )
    console.print(table)
    ops = Table(
        title="where the handoffs' time goes: median seconds per operation (GB and allocator floor: the last step's)"
    )
    for col in ("mode", "phase/operation", "s", "GB copied", "GB/s", "allocator floor s"):
        ops.add_column(col)
    for m in report.modes:
        last = m.rows[-1] if m.rows else None
        for op, sec in m.op_medians_s.items():
            nbytes = last.op_bytes.get(op, 0) if last else 0
            alloc = last.op_allocator_s.get(op, 0.0) if last else 0.0
            rate = f"{nbytes / sec / 1e9:.1f}" if sec and nbytes else ""
            ops.add_row(
                m.peak_device,
                op,
                f"{sec:.3f}",
                f"{nbytes / 1e9:.1f}" if nbytes else "",
                rate,
                f"{alloc:.3f}" if alloc else "",
            )
    console.print(ops)


# -- CLI ---------------------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    from colosync.tools.subcommand import parse_size

    p = sub.add_parser(
        "bench-step",
        help="the colocated step (handoff, train, handoff with a full sync) at a given size: synthetic "
        "engine and trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--weights", type=parse_size, default=parse_size("16GB"), help="engine weights (default 16GB)")
    p.add_argument("--kv", type=parse_size, default=None, help="KV cache (default: fill the device)")
    p.add_argument("--steps", type=int, default=10, help="steps per mode (default 10)")
    p.add_argument("--peak-device", choices=["cpu", "gpu"], action="append", help="mode(s) to run (default both)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--transport", default="auto")
    p.add_argument("--bucket", type=parse_size, default=64 << 20, help="the sender's bucket (default 64MiB)")
    p.add_argument("--tensor", type=parse_size, default=256 << 20, help="bytes per weight tensor (default 256MiB)")
    p.add_argument(
        "--optimizer-shards",
        type=int,
        default=1,
        help="the trainer holds the fp32 Adam moments of 1/N of the weights (one rank of a distributed "
        "optimizer over N); default 1: all of them",
    )
    p.add_argument(
        "--host-scope",
        choices=["processes", "node"],
        default="processes",
        help="host memory as the participants' processes (the shared arena counted once) or the node's "
        "anon+shmem (/proc/meminfo: every process on the node)",
    )
    p.add_argument(
        "--trainer-backend",
        choices=["torch", "tms"],  # synthetic.BACKENDS (not imported: it would load torch for every command)
        default="torch",
        help="the trainer's sleep/wake: torch (reusable chunks of the shared arena, default) or tms "
        "(torch_memory_saver with its CPU backup, side by side; needs torch_memory_saver)",
    )
    p.add_argument("--lend-kv", action="store_true", help="the trainer wakes up in the engine's KV cache's memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--report", type=Path, help="also write the JSON report to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=args.json, width=max(Console().width, 120))
    options = StepBenchOptions(
        weight_bytes=args.weights,
        kv_bytes=args.kv,
        steps=args.steps,
        modes=tuple(args.peak_device or ("gpu", "cpu")),
        device=args.device,
        transport=args.transport,
        bucket_bytes=args.bucket,
        tensor_bytes=args.tensor,
        optimizer_shards=args.optimizer_shards,
        host_scope=args.host_scope,
        trainer_backend=args.trainer_backend,
        lend_kv=args.lend_kv,
        seed=args.seed,
    )

    def save(report: StepBenchReport) -> None:  # after every step: a run cut short keeps what it measured
        if args.report:
            args.report.write_text(json.dumps(asdict(report), indent=2))

    try:
        report = run_step_bench(options, console, argv=sys.argv[1:], progress=save)
    except ColosyncError as exc:
        console.print(f"[bold red]bench-step failed:[/] {type(exc).__name__}: {exc}")
        return 2
    save(report)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print_summary(report, console)
    return 3 if any(m.summary.get("violations") for m in report.modes) else 0


__all__ = ["StepBenchOptions", "StepBenchReport", "run_step_bench"]
