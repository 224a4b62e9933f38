"""``colosync plan`` and ``colosync handoff-bench``.

``plan`` answers, before a job starts, "which handoff order fits this node?": it simulates
both orders for the given sizes (a shipped preset such as ``--workload k3-gb300``, a workload
JSON, or flags), prints the host and GPU timeline of each, and recommends a mode (``--json``
for machines, ``--plot FILE`` for a PNG). ``handoff-bench`` measures the sleep/wake
throughput of the trainer backends side by side and writes the figures with the command,
machine, torch version and date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colosync.tools.subcommand import parse_size

if TYPE_CHECKING:
    from rich.console import JustifyMethod


def parse_sync(text: str) -> tuple[str, int]:
    """``lora:169MB`` / ``full:16GB`` -> (kind, bytes)."""
    kind, sep, size = text.partition(":")
    if not sep or kind not in ("lora", "full"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a sync; write lora:SIZE or full:SIZE, e.g. lora:169MB")
    return kind, parse_size(size)


_SIZE_FLAGS = {
    "engine_weights": "engine_weight_bytes",
    "kv": "engine_kv_bytes",
    "trainer_resident": "trainer_resident_bytes",
    "trainer_backup": "trainer_backup_bytes",
    "grad_buffer": "trainer_grad_buffer_bytes",
    "load_host": "trainer_load_host_bytes",
    "host_baseline": "host_baseline_bytes",
    "host_budget": "host_budget_bytes",
    "gpu_memory": "gpu_bytes",
    "device_baseline": "device_baseline_bytes",
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="simulate the trainer<->engine memory handoff and recommend a peak-device mode",
        description="Simulate the colocated handoff (init, rollout->train, train->rollout) in 'cpu' and 'gpu' "
        "peak-device order for a node and say which fits. Host figures are per node, GPU per GPU.",
    )
    p.add_argument("--workload", help="preset name (e.g. k3-gb300) or a handoff workload .json")
    p.add_argument("--engine-weights", type=parse_size, help="engine weights per GPU (= host mirror size)")
    p.add_argument("--kv", type=parse_size, help="engine KV cache + CUDA graphs per GPU")
    p.add_argument("--trainer-resident", type=parse_size, help="awake trainer's device bytes per GPU")
    p.add_argument("--trainer-backup", type=parse_size, help="sleeping trainer's host bytes per GPU")
    p.add_argument("--grad-buffer", type=parse_size, help="no-backup gradient buffer per GPU (part of resident)")
    p.add_argument("--load-host", type=parse_size, help="host staging of the checkpoint load per GPU")
    p.add_argument("--host-baseline", type=parse_size, help="node host memory outside the copies")
    p.add_argument("--host-budget", type=parse_size, help="node host limit (e.g. cgroup)")
    p.add_argument("--gpu-memory", type=parse_size, help="memory of one GPU")
    p.add_argument("--device-baseline", type=parse_size, help="device memory outside both participants per GPU")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument(
        "--sync",
        type=parse_sync,
        metavar="KIND:SIZE",
        help="plan the weight sync inside train->rollout: lora:169MB or full:16GB (bytes per GPU)",
    )
    p.add_argument(
        "--sync-transport", choices=["shm", "cuda_ipc"], help="where the sync's slots live (default shm: host)"
    )
    p.add_argument(
        "--sync-staging",
        choices=["device", "host"],
        help="where a full sync waits for its commit: host (the default for a full sync, as the hf and vLLM "
        "engines do: staged in host memory or the arena, one bucket on the device) or device (staged + "
        "prepared on the engine's device, twice the update there)",
    )
    p.add_argument("--sync-bucket", type=parse_size, help="the sender's bucket (default 64MiB)")
    p.add_argument("--sync-slots", type=int, help="transport slots (default 2)")
    p.add_argument(
        "--peak-device",
        "--mode",  # 0.1's name, kept as an alias
        dest="mode",
        choices=["cpu", "gpu", "both"],
        default="both",
        help="where the handoff's overlap peaks: cpu (both host copies at once), gpu, or both to compare (default)",
    )
    p.add_argument("--cycles", type=int, default=1, help="train/rollout rounds after init (default 1)")
    p.add_argument("--no-engine-backup", action="store_true", help="engine releases weights without a host mirror")
    p.add_argument("--why", action="store_true", help="add a column saying why each step is where it is")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of host and GPU memory over the steps")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_plan)

    b = subparsers.add_parser(
        "handoff-bench",
        help="measure trainer sleep/wake throughput of the torch and torch_memory_saver backends",
    )
    b.add_argument("--size", type=parse_size, default=None, help="state size (default 40GB on CUDA, 256MB on CPU)")
    b.add_argument("--tensors", type=int, default=400)
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--backends", default="torch,tms", help="comma-separated: torch,tms")
    b.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    b.add_argument("--chunk", type=parse_size, default=None, help="host pool chunk size (default 1GiB)")
    b.add_argument("--out", metavar="FILE", help="also write the JSON result here")
    b.add_argument("--json", action="store_true", help="print JSON instead of a table")
    b.set_defaults(func=cmd_handoff_bench)


# ---------------------------------------------------------------------------------------------
# plan


def _sizes_from_args(args: argparse.Namespace) -> tuple[Any, dict[str, Any] | None]:
    """The sizes to simulate and the workload document they came from (None for flags only)."""
    import msgspec

    from colosync import workloads
    from colosync.errors import SizesError
    from colosync.handoff.model.simulator import HandoffSizes

    overrides = {field: getattr(args, flag) for flag, field in _SIZE_FLAGS.items() if getattr(args, flag) is not None}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.sync is not None:
        overrides["sync_kind"], overrides["sync_bytes"] = args.sync
        if args.sync[0] == "full" and args.sync_staging is None:
            overrides["sync_staging"] = "host"  # where colosync's engines stage a full update
    for flag, field in (
        ("sync_transport", "sync_transport"),
        ("sync_bucket", "sync_bucket_bytes"),
        ("sync_staging", "sync_staging"),
    ):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.sync_slots is not None:
        overrides["sync_slots"] = args.sync_slots
    if args.workload:
        doc = workloads.load(args.workload, kind="handoff")
        sizes = HandoffSizes.from_workload(doc)
        if overrides:
            sizes = msgspec.structs.replace(sizes, **overrides)
        return sizes, doc
    need = ["engine_weight_bytes", "engine_kv_bytes", "trainer_resident_bytes", "trainer_backup_bytes"]
    missing = [f"--{k.replace('_', '-')}" for k, v in _SIZE_FLAGS.items() if v in need and v not in overrides]
    if missing:
        raise SizesError(f"give --workload (presets: {workloads.names('handoff')}) or all of {missing}")
    return HandoffSizes(**overrides), None


def cmd_plan(args: argparse.Namespace) -> int:
    from colosync.errors import ConfigError, HandoffError
    from colosync.handoff.model.plans import HandoffConfig
    from colosync.handoff.model.simulator import compare

    try:
        sizes, doc = _sizes_from_args(args)
        modes = ("cpu", "gpu") if args.mode == "both" else (args.mode,)
        config = HandoffConfig(engine_weight_backup=not args.no_engine_backup)
        result = compare(sizes, cycles=args.cycles, modes=modes, config=config)
    except (ConfigError, HandoffError) as exc:
        print(f"colosync plan: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot_comparison(result, args.plot)
    if args.json:
        out = result.to_dict()
        if doc is not None and "expect" in doc:
            out["workload_expect"] = doc["expect"]
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, indent=2))
    else:
        print_comparison(result, why=args.why)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0 if result.recommended else 1


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:,.1f}"


_PHASE_SHORT = {
    "start": "start",
    "init": "init",
    "rollout_to_train": "rollout→train",
    "train_to_rollout": "train→rollout",
}


def _short_step(label: str) -> str:
    return label.replace("(backup=True)", " +mirror").replace("(backup=False)", " no mirror")


def _short_at(at: str) -> str:
    phase, _, step = at.partition(":")
    return f"{_PHASE_SHORT.get(phase, phase)}: {_short_step(step)}"


def print_comparison(result: Any, *, why: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    from colosync.handoff.model.ops import Region

    console = Console()
    if console.width < 132:
        console = Console(width=170 if why else 132)
    s = result.sizes
    budget = (
        f"{_gb(s.host_budget_bytes)} GB ({s.host_budget_bytes / 2**30:,.0f} GiB)" if s.host_budget_bytes else "none"
    )
    console.print(
        f"[bold]{s.name or 'handoff'}[/]: {s.gpus_per_node} GPU(s)/node; per GPU: engine weights "
        f"{_gb(s.engine_weight_bytes)} GB, KV {_gb(s.engine_kv_bytes)} GB, trainer resident "
        f"{_gb(s.trainer_resident_bytes)} GB, backup {_gb(s.trainer_backup_bytes)} GB; host baseline "
        f"{_gb(s.host_baseline_bytes)} GB, host budget {budget}, GPU {_gb(s.gpu_bytes)} GB"
    )
    if s.sync_bytes:
        sync = s.sync_region_bytes()
        console.print(
            f"sync ({s.sync_kind}, {_gb(s.sync_bytes)} GB per GPU over {s.sync_transport}): transport slots "
            f"{_gb(sync[Region.SYNC_TRANSPORT])} GB host, staging {_gb(sync[Region.SYNC_STAGING])} GB + prepared "
            f"{_gb(sync[Region.SYNC_PREPARED])} GB on the engine's device, host staging "
            f"{_gb(sync[Region.SYNC_HOST_STAGING])} GB, during train→rollout's sync.weights"
        )
    for mode, sim in result.simulations.items():
        table = Table(title=f"peak_device={mode}  (GB; host per node, GPU per device)", title_justify="left")
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("phase", "left"),
            ("#", "right"),
            ("step", "left"),
            ("host peak", "right"),
            ("host after", "right"),
            ("GPU peak", "right"),
            ("GPU after", "right"),
            ("host copies", "left"),
            ("why", "left"),
        )
        for col, justify in columns:
            if col == "why" and not why:
                continue
            table.add_column(col, justify=justify, no_wrap=col != "why", min_width=len(col))
        for row in sim.rows:
            host = f"[red]{_gb(row.host_peak)}[/]" if row.over_host else _gb(row.host_peak)
            dev = f"[red]{_gb(row.device_peak)}[/]" if row.over_device else _gb(row.device_peak)
            copies = " + ".join(c.split(".")[1] for c in row.host_copies)
            if len(row.host_copies) > 1:
                copies = f"[yellow]{copies}[/]"
            cells = [
                _PHASE_SHORT.get(row.phase, row.phase),
                str(row.index),
                _short_step(row.step),
                host,
                _gb(row.host_after),
                dev,
                _gb(row.device_after),
                copies,
            ]
            table.add_row(*cells, *([row.why] if why else []))
        console.print(table)
    summary = Table(title="summary (GB)", title_justify="left")
    for col in ("mode", "host peak", "first at", "GPU peak", "first at", "two host copies", "fits"):
        summary.add_column(col, no_wrap=True, min_width=len(col))
    for mode, sim in result.simulations.items():
        summary.add_row(
            mode,
            _gb(sim.host_peak),
            _short_at(sim.host_peak_step),
            _gb(sim.device_peak),
            _short_at(sim.device_peak_step),
            "yes" if sim.both_host_copies else "no",
            "[green]yes[/]" if sim.fits else "[red]no[/]",
        )
    console.print(summary)
    for mode, why in result.rejected.items():
        console.print(f"[yellow]{mode}[/]: {why}")
    if result.recommended:
        console.print(f"recommended: [bold green]--peak-device {result.recommended}[/] — {result.reason}")
    else:
        console.print(f"[bold red]{result.reason}[/]")


def plot_comparison(result: Any, path: str) -> None:
    """PNG of host (per node, top) and GPU (per device, bottom) memory over the steps, one
    column per mode; within a step the first half shows its peak, the second what remains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sims = result.simulations
    s = result.sizes
    cols = len(sims)
    steps = max(len(x.rows) for x in sims.values())
    fig, axes = plt.subplots(2, cols, figsize=(max(6.0, steps * 0.5) * cols, 7.5), sharey="row", squeeze=False)
    for c, (mode, sim) in enumerate(sims.items()):
        ax_host, ax_dev = axes[0][c], axes[1][c]
        xs: list[float] = []
        host: list[float] = []
        dev: list[float] = []
        for i, row in enumerate(sim.rows):
            xs += [i - 0.5, i]
            host += [row.host_peak / 1e9, row.host_after / 1e9]
            dev += [row.device_peak / 1e9, row.device_after / 1e9]
        xs.append(len(sim.rows) - 0.5)
        host.append(host[-1])
        dev.append(dev[-1])
        ax_host.step(xs, host, where="post", color="tab:blue")
        ax_host.fill_between(xs, host, step="post", alpha=0.15, color="tab:blue")
        ax_dev.step(xs, dev, where="post", color="tab:orange")
        ax_dev.fill_between(xs, dev, step="post", alpha=0.15, color="tab:orange")
        if s.host_budget_bytes:
            ax_host.axhline(s.host_budget_bytes / 1e9, color="red", linestyle="--", label="host budget")
        if s.gpu_bytes:
            ax_dev.axhline(s.gpu_bytes / 1e9, color="red", linestyle="--", label="GPU memory")
        verdict = "fits" if sim.fits else "does not fit"
        ax_host.set_title(
            f"peak_device={mode}: host peak {sim.host_peak / 1e9:.0f} GB, "
            f"GPU peak {sim.device_peak / 1e9:.0f} GB ({verdict})",
            fontsize=10,
        )
        labels = [
            "start" if r.phase == "start" else f"{_PHASE_SHORT.get(r.phase, r.phase)} {_short_step(r.step)}"
            for r in sim.rows
        ]
        ax_dev.set_xticks(range(len(labels)), labels, rotation=65, ha="right", fontsize=7)
        ax_host.set_xticks(range(len(labels)), [""] * len(labels))
        for ax in (ax_host, ax_dev):
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right", fontsize=8)
        if c == 0:
            ax_host.set_ylabel("host per node (GB)")
            ax_dev.set_ylabel("GPU per device (GB)")
    fig.suptitle(f"colocated handoff: {s.name or 'custom sizes'} — recommended: {result.recommended}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# handoff-bench


def cmd_handoff_bench(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from colosync.errors import ColosyncError
    from colosync.tools.bench.handoff import run_bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or (40 * 10**9 if device.startswith("cuda") else 256 * 10**6)
    console = Console(stderr=True)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    try:
        with console.status("handoff-bench") as status:
            result = run_bench(
                size_bytes=size,
                tensors=args.tensors,
                device=device,
                dtype=getattr(torch, args.dtype),
                repeats=args.repeats,
                backends=backends,
                chunk_bytes=args.chunk,
                progress=lambda m: status.update(m),
                argv=_bench_argv(args, size, device),
            )
    except ColosyncError as exc:
        print(f"colosync handoff-bench: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_bench(result)
    return 0


def _bench_argv(args: argparse.Namespace, size: int, device: str) -> list[str]:
    """The command line that reproduces this run (canonical, with defaults made explicit)."""
    argv = [
        "handoff-bench",
        "--device",
        device,
        "--size",
        str(size),
        "--tensors",
        str(args.tensors),
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--backends",
        args.backends,
    ]
    if args.chunk:
        argv += ["--chunk", str(args.chunk)]
    if args.out:
        argv += ["--out", args.out]
    return argv


def print_bench(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if console.width < 140:
        console = Console(width=140)
    table = Table(
        title=f"trainer sleep/wake on {result['device']} ({result['machine'].get('gpu', 'no GPU')})",
        title_justify="left",
    )
    for col in (
        "backend",
        "GB",
        "tensors",
        "sleep GB/s",
        "wake GB/s",
        "first cycle sleep / wake GB/s",
        "verified",
        "note",
    ):
        table.add_column(col)
    for r in result["results"]:
        if not r.get("available"):
            table.add_row(r["backend"], "-", "-", "-", "-", "-", "-", r.get("reason", ""))
            continue
        first = r.get("first_cycle") or {}
        first_s = f"{first['sleep_gbps']:.1f} / {first['wake_gbps']:.1f}" if first else "-"
        ref = r.get("reference_pinned_copy")
        note = (
            (
                f"pinned copy reference {ref['d2h_gbps']:.1f} / {ref['h2d_gbps']:.1f} GB/s; pool reserve "
                f"{r['pool_reserve_seconds']:.1f} s"
            )
            if ref
            else (f"v{r.get('version')}" if r.get("version") else "")
        )
        table.add_row(
            r["backend"],
            f"{r['bytes'] / 1e9:.1f}",
            str(r["tensors"]),
            f"{r['sleep_gbps_median']:.1f}",
            f"{r['wake_gbps_median']:.1f}",
            first_s,
            "yes" if r["verified"] else "[red]NO[/]",
            note,
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """``python -m colosync.tools.handoff plan|handoff-bench ...`` (same as ``colosync plan ...``),
    for hosts where the other ``colosync`` subcommands' dependencies are not installed."""
    import logging

    parser = argparse.ArgumentParser(prog="colosync")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level={0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
