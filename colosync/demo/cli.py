"""``colosync demo``: a colocated RL loop on Ray that learns, syncs every step and proves parity.

A trainer actor and an engine actor share one device. Each step the engine samples a group
of completions per prompt, the driver scores them (reward: share of tokens from a target
vocabulary), the trainer takes a group-relative policy-gradient step on its LoRA, and
colosync pushes the LoRA to the engine as one transaction with a fresh update id. Then the
step proves parity: the engine's logprobs on a fixed probe batch must equal the trainer's,
from the version the engine says it served, or the run stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from colosync.errors import ParityError

log = logging.getLogger(__name__)


@dataclass
class StepRow:
    step: int
    reward: float
    loss: float
    sync_ms: float
    bytes: int
    transport: str
    update_id: int
    parity_err: float
    host_peak_mb: float
    gpu_peak_mb: float
    step_s: float


@dataclass
class DemoReport:
    engine: str
    transport: str
    device: str
    steps: list[StepRow] = field(default_factory=list)
    before: list[list[int]] = field(default_factory=list)
    after: list[list[int]] = field(default_factory=list)
    first3_reward: float = 0.0
    last3_reward: float = 0.0
    parity_tolerance: float = 0.0
    max_parity_err: float = 0.0
    median_sync_ms: float = 0.0
    seconds: float = 0.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a colocated RL loop on Ray with a colosync sync every step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        choices=["auto", "vllm", "hf"],
        default="auto",
        help="rollout engine (auto: vLLM when installed, else the hf reference engine)",
    )
    p.add_argument("--transport", default="auto", help="colosync transport (auto picks the fastest that works)")
    p.add_argument("--steps", type=int, default=30, help="RL steps (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-2, help="LoRA learning rate (default 2e-2)")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    p.add_argument("--json", action="store_true", help="print the run report as JSON instead of tables")
    p.add_argument("--report", type=Path, help="also write the JSON run report to this file")
    p.add_argument("--plot", type=Path, help="write a PNG of reward and sync time per step")
    p.set_defaults(func=run)


def resolve_engine(choice: str) -> str:
    if choice != "auto":
        return choice
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=args.json, width=max(Console().width, 110))
    try:
        report = run_demo(args.engine, args.transport, args.steps, args.seed, args.lr, args.ray_address, console)
    except ParityError as exc:
        console.print(f"[bold red]parity failed:[/] {exc}")
        return 2
    payload = json.dumps(asdict(report), indent=2)
    if args.report:
        args.report.write_text(payload)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(payload)
    else:
        print_report(report, console)
    return 0


def run_demo(
    engine: str, transport: str, steps: int, seed: int, lr: float, ray_address: str | None, console: Any
) -> DemoReport:
    import msgspec
    import ray
    import torch
    from rich.progress import Progress

    from colosync.demo.models import make_tiny_llama
    from colosync.demo.rl import Task
    from colosync.engines.config import Generate
    from colosync.sync.sender import SyncReport

    engine = resolve_engine(engine)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="colosync-demo-"))
    model_dir = str(make_tiny_llama(workdir / "tiny-llama", seed=seed))  # head size 32: vLLM's CPU minimum
    task = Task.make(seed=seed)
    ray.init(
        address=ray_address,
        num_cpus=None if ray_address else 2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        ignore_reinit_error=True,
    )
    gpu = 0.5 if device == "cuda" else 0
    threads = 1 if device == "cpu" else 0  # two actors share the cores: one thread each beats contention
    try:
        engine_actor, tolerance = _start_engine(engine, model_dir, device, gpu, threads, console)
        from colosync.demo.actors import TrainerActor
        from colosync.engines.ray_actor import RayLink

        # Ray types an actor handle's methods as the class's plain functions, without ``.remote``.
        trainer: Any = ray.remote(num_cpus=1, num_gpus=gpu)(TrainerActor).remote(
            model_dir, engine_actor, engine, transport, 8, 16.0, lr, seed, device, threads
        )
        driver = RayLink(engine_actor, engine)
        first = msgspec.msgpack.decode(ray.get(trainer.push.remote()), type=SyncReport)
        before = driver.call(Generate(task.prompts, task.max_new_tokens))
        report = DemoReport(engine, first.transport, device, before=before.tokens, parity_tolerance=tolerance)
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("RL steps", total=steps)
            for step in range(steps):
                row = _step(step, task, driver, trainer, engine_actor, seed, tolerance, before.tokens)
                report.steps.append(row)
                progress.update(bar, advance=1, description=f"step {step}: reward {row.reward:.3f}")
        report.after = driver.call(Generate(task.prompts, task.max_new_tokens)).tokens
        ray.get(trainer.close.remote())
    finally:
        ray.shutdown()
    rewards = [r.reward for r in report.steps]
    report.first3_reward = statistics.mean(rewards[:3]) if rewards else 0.0
    report.last3_reward = statistics.mean(rewards[-3:]) if rewards else 0.0
    report.max_parity_err = max((r.parity_err for r in report.steps), default=0.0)
    report.median_sync_ms = statistics.median(r.sync_ms for r in report.steps) if report.steps else 0.0
    report.seconds = time.perf_counter() - started
    return report


def _start_engine(
    engine: str, model_dir: str, device: str, gpu: float, threads: int, console: Any
) -> tuple[Any, float]:
    """The engine actor (any registered engine, one actor class) and the parity tolerance."""
    import msgspec
    import ray

    from colosync.engines.config import EngineConfig
    from colosync.engines.ray_actor import EngineActor

    config = EngineConfig(engine=engine, model_dir=model_dir, device=device, max_lora_rank=16, threads=threads)
    # Any: Ray types an actor handle's methods as the class's plain functions, without ``.remote``.
    actor: Any = ray.remote(num_cpus=1, num_gpus=gpu)(EngineActor).remote(msgspec.msgpack.encode(config))
    if engine == "vllm":
        console.print("starting vLLM inside a Ray actor (about 30 s on 2 CPU cores)...")
    ray.get(actor.pid.remote())
    return actor, 1e-3 if engine == "vllm" else 1e-5


def _step(
    step: int,
    task: Any,
    driver: Any,
    trainer: Any,
    engine_actor: Any,
    seed: int,
    tolerance: float,
    probe_completions: list[list[int]],
) -> StepRow:
    """One RL step; the probe batch (prompts + fixed completions) is scored by both sides."""
    import msgspec
    import ray

    from colosync.engines.config import Generate, Score
    from colosync.sync.sender import SyncReport

    t0 = time.perf_counter()
    batch = task.batch()
    rollout = driver.call(Generate(batch, task.max_new_tokens, temperature=1.0, seed=seed * 100_003 + step))
    rewards = [task.reward(c) for c in rollout.tokens]
    samples = [ray.get(engine_actor.memory.remote()), ray.get(trainer.memory.remote())]
    loss = ray.get(trainer.train_step.remote(batch, rollout.tokens, task.advantages(rewards)))
    sync = msgspec.msgpack.decode(ray.get(trainer.push.remote()), type=SyncReport)
    probe = driver.call(Score(task.prompts, probe_completions))
    if probe.update_id != sync.update_id:
        raise ParityError(f"step {step}: engine served update {probe.update_id}, expected {sync.update_id}")
    reference = ray.get(trainer.score.remote(task.prompts, probe_completions))
    err = max(
        abs(a - b) for xs, ys in zip(probe.logprobs, reference, strict=False) for a, b in zip(xs, ys, strict=False)
    )
    if not err <= tolerance:
        raise ParityError(
            f"step {step}: engine and trainer logprobs differ by {err:.3g} > {tolerance:g} on update {sync.update_id}"
        )
    samples += [ray.get(engine_actor.memory.remote()), ray.get(trainer.memory.remote())]
    host_peak = max(samples[0]["host_rss"] + samples[1]["host_rss"], samples[2]["host_rss"] + samples[3]["host_rss"])
    gpu_peak = max(s["gpu_peak"] for s in samples)
    return StepRow(
        step,
        statistics.mean(rewards),
        loss,
        sync.seconds["total"] * 1e3,
        sync.bytes,
        sync.transport,
        sync.update_id,
        err,
        host_peak / 2**20,
        gpu_peak / 2**20,
        time.perf_counter() - t0,
    )


def print_report(report: DemoReport, console: Any) -> None:
    from rich.table import Table

    console.print(
        f"[bold]engine[/] {report.engine}  [bold]transport[/] {report.transport}  [bold]device[/] {report.device}"
    )
    console.print(f"greedy before: {report.before[0]}")
    table = Table(title="colocated RL steps")
    for col in ("step", "reward", "sync ms", "bytes", "transport", "update", "parity err", "host MB", "GPU MB"):
        table.add_column(col, justify="right")
    for r in report.steps:
        table.add_row(
            str(r.step),
            f"{r.reward:.3f}",
            f"{r.sync_ms:.1f}",
            f"{r.bytes:,}",
            r.transport,
            str(r.update_id),
            f"{r.parity_err:.0e}",
            f"{r.host_peak_mb:.0f}",
            f"{r.gpu_peak_mb:.0f}",
        )
    console.print(table)
    console.print(f"greedy after:  {report.after[0]}")
    gain = report.last3_reward - report.first3_reward
    console.print(
        f"reward {report.first3_reward:.3f} (first 3 steps) -> {report.last3_reward:.3f} (last 3), {gain:+.3f}; "
        f"parity held at every step (max |delta logprob| {report.max_parity_err:.1e} <= {report.parity_tolerance:g}); "
        f"median sync {report.median_sync_ms:.1f} ms; {report.seconds:.0f} s in all"
    )


def plot(report: DemoReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in report.steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r.reward for r in report.steps], color="tab:green", label="mean reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward", color="tab:green")
    ax2 = ax.twinx()
    ax2.plot(steps, [r.sync_ms for r in report.steps], color="tab:blue", marker=".", label="sync ms")
    ax2.set_ylabel("sync ms", color="tab:blue")
    ax.set_title(f"colosync demo: {report.engine} engine, {report.transport} transport")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    from colosync.tools.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
