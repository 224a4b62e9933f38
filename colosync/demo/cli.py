"""``colosync demo``: a colocated RL loop on Ray that learns, syncs every step and proves parity.

A trainer actor and an engine actor share one device. The task: count on from the prompt
(``5 6 7`` -> ``8 9 10 ...``); reward = the share of tokens that follow the token before
them. Each step the engine samples a group of completions for each of a few fresh prompts,
the driver scores them, the trainer takes a policy-gradient step on its LoRA (group-relative
advantages per token, an entropy bonus), and colosync pushes the LoRA to the engine as one
transaction with a fresh update id. Then the step proves parity: the engine's logprobs on a
fixed probe batch must equal the trainer's, from the version the engine says it served, or
the run stops; and the engine answers the probe prompts greedily, from that same version,
so every step shows what the policy now says.
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
    reward: float  # mean reward of the step's sampled rollouts (before the step trained)
    greedy_reward: float  # mean reward of the greedy answers to the probe prompts (after the update)
    loss: float
    sync_ms: float
    bytes: int
    transport: str
    update_id: int
    parity_err: float
    host_peak_mb: float
    gpu_peak_mb: float
    step_s: float
    greedy: list[list[int]] = field(default_factory=list)  # the engine's greedy answers to the probe prompts


@dataclass
class DemoReport:
    engine: str
    transport: str
    device: str
    task: str = ""
    prompts: list[list[int]] = field(default_factory=list)  # the probe prompts
    targets: list[list[int]] = field(default_factory=list)  # their right answers
    steps: list[StepRow] = field(default_factory=list)
    before: list[list[int]] = field(default_factory=list)  # greedy answers before training
    after: list[list[int]] = field(default_factory=list)  # ... and after the last step
    window: int = 5  # steps averaged in first_reward and last_reward
    first_reward: float = 0.0
    last_reward: float = 0.0
    before_greedy_reward: float = 0.0
    after_greedy_reward: float = 0.0
    after_distinct_tokens: float = 0.0  # distinct tokens per greedy answer, averaged over the probe prompts
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
    p.add_argument("--steps", type=int, default=40, help="RL steps (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the LoRA, the prompts and the sampling")
    p.add_argument("--lr", type=float, default=1e-2, help="LoRA learning rate (default 1e-2)")
    p.add_argument("--entropy-coef", type=float, default=0.2, help="entropy bonus (default 0.2; 0 lets it collapse)")
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
        report = run_demo(
            args.engine,
            args.transport,
            args.steps,
            args.seed,
            args.lr,
            args.ray_address,
            console,
            entropy_coef=args.entropy_coef,
        )
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
    engine: str,
    transport: str,
    steps: int,
    seed: int,
    lr: float,
    ray_address: str | None,
    console: Any,
    entropy_coef: float = 0.2,
) -> DemoReport:
    import msgspec
    import ray
    import torch

    from colosync.demo.models import make_tiny_llama
    from colosync.demo.tasks import CountTask
    from colosync.engines.config import Generate
    from colosync.sync.sender import SyncReport

    engine = resolve_engine(engine)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="colosync-demo-"))
    task = CountTask(seed=seed)
    # head size 32: vLLM's CPU minimum; the vocabulary is the task's numbers and three specials
    model_dir = str(make_tiny_llama(workdir / "tiny-llama", seed=seed, vocab_size=task.vocab_size))
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
            model_dir, engine_actor, engine, transport, 8, 16.0, lr, seed, device, threads, entropy_coef
        )
        driver = RayLink(engine_actor, engine)
        first = msgspec.msgpack.decode(ray.get(trainer.push.remote()), type=SyncReport)
        prompts = task.probe_prompts
        before = driver.call(Generate(prompts, task.max_new_tokens))
        report = DemoReport(
            engine,
            first.transport,
            device,
            task=f"count on from the prompt, modulo {task.numbers} (tokens {task.vocab_size - task.numbers}..)",
            prompts=prompts,
            targets=[task.target(p) for p in prompts],
            before=before.tokens,
            parity_tolerance=tolerance,
        )
        report.before_greedy_reward = _mean_reward(task, prompts, before.tokens)
        console.print(
            f"[bold]engine[/] {engine}  [bold]transport[/] {first.transport}  [bold]device[/] {device}  "
            f"[bold]task[/] {report.task}; {task.prompts_per_step} fresh prompts x {task.group_size} samples a step"
        )
        for step in range(steps):
            row = _step(step, task, driver, trainer, engine_actor, seed, tolerance, before.tokens)
            report.steps.append(row)
            print_step(row, prompts[0], task, console, header=step == 0)
        report.after = report.steps[-1].greedy if report.steps else before.tokens
        ray.get(trainer.close.remote())
    finally:
        ray.shutdown()
    rewards = [r.reward for r in report.steps]
    k = report.window
    report.first_reward = statistics.mean(rewards[:k]) if rewards else 0.0
    report.last_reward = statistics.mean(rewards[-k:]) if rewards else 0.0
    report.after_greedy_reward = _mean_reward(task, report.prompts, report.after)
    report.after_distinct_tokens = statistics.mean(len(set(c)) for c in report.after) if report.after else 0.0
    report.max_parity_err = max((r.parity_err for r in report.steps), default=0.0)
    report.median_sync_ms = statistics.median(r.sync_ms for r in report.steps) if report.steps else 0.0
    report.seconds = time.perf_counter() - started
    return report


def _mean_reward(task: Any, prompts: list[list[int]], completions: list[list[int]]) -> float:
    return statistics.mean(task.reward(p, c) for p, c in zip(prompts, completions, strict=True))


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
    batch = task.batch(step)
    rollout = driver.call(Generate(batch, task.max_new_tokens, temperature=1.0, seed=seed * 100_003 + step))
    rewards = [task.reward(p, c) for p, c in zip(batch, rollout.tokens, strict=True)]
    advantages = task.advantages(batch, rollout.tokens)
    samples = [ray.get(engine_actor.memory.remote()), ray.get(trainer.memory.remote())]
    loss = ray.get(trainer.train_step.remote(batch, rollout.tokens, advantages))
    sync = msgspec.msgpack.decode(ray.get(trainer.push.remote()), type=SyncReport)
    prompts = task.probe_prompts
    probe = driver.call(Score(prompts, probe_completions))
    if probe.update_id != sync.update_id:
        raise ParityError(f"step {step}: engine served update {probe.update_id}, expected {sync.update_id}")
    reference = ray.get(trainer.score.remote(prompts, probe_completions))
    err = max(
        abs(a - b) for xs, ys in zip(probe.logprobs, reference, strict=False) for a, b in zip(xs, ys, strict=False)
    )
    if not err <= tolerance:
        raise ParityError(
            f"step {step}: engine and trainer logprobs differ by {err:.3g} > {tolerance:g} on update {sync.update_id}"
        )
    greedy = driver.call(Generate(prompts, task.max_new_tokens))
    if greedy.update_id != sync.update_id:
        raise ParityError(f"step {step}: engine answered from update {greedy.update_id}, expected {sync.update_id}")
    samples += [ray.get(engine_actor.memory.remote()), ray.get(trainer.memory.remote())]
    host_peak = max(samples[0]["host_rss"] + samples[1]["host_rss"], samples[2]["host_rss"] + samples[3]["host_rss"])
    gpu_peak = max(s["gpu_peak"] for s in samples)
    return StepRow(
        step,
        statistics.mean(rewards),
        _mean_reward(task, prompts, greedy.tokens),
        loss,
        sync.seconds["total"] * 1e3,
        sync.bytes,
        sync.transport,
        sync.update_id,
        err,
        host_peak / 2**20,
        gpu_peak / 2**20,
        time.perf_counter() - t0,
        greedy.tokens,
    )


_COLUMNS = "step  reward  greedy  sync ms     bytes  update  parity  host MB  GPU MB"


def _marked(task: Any, prompt: list[int], completion: list[int]) -> str:
    """``completion`` with each token green when it earned its reward, red when not."""
    rewards = task.token_rewards(prompt, completion)
    return " ".join(f"[{'green' if r else 'red'}]{t}[/]" for t, r in zip(completion, rewards, strict=True))


def print_step(row: StepRow, prompt: list[int], task: Any, console: Any, header: bool = False) -> None:
    """One line per step, as it finishes: the rewards, the sync, parity, memory, and the
    engine's greedy answer to the first probe prompt under the update it just committed."""
    if header:
        shown = " ".join(map(str, prompt[1:]))
        console.print(f"[bold]{_COLUMNS}  greedy answer to [{shown}][/]", highlight=False)
    console.print(
        f"{row.step:>4}  {row.reward:6.3f}  {row.greedy_reward:6.3f}  {row.sync_ms:7.1f}  {row.bytes:>8,}  "
        f"{row.update_id:>6}  {row.parity_err:6.0e}  {row.host_peak_mb:7.0f}  {row.gpu_peak_mb:6.0f}  "
        f"{_marked(task, prompt, row.greedy[0])}",
        highlight=False,
    )


def print_report(report: DemoReport, console: Any) -> None:
    from rich.table import Table

    from colosync.demo.tasks import CountTask

    task = CountTask()  # token_rewards needs only the alphabet, which every seed shares
    table = Table(title="greedy answers to the probe prompts (green: counts on from the token before)")
    for col in ("prompt", "before training", "after", "right"):
        table.add_column(col)
    for prompt, before, after, target in zip(report.prompts, report.before, report.after, report.targets, strict=True):
        right = sum(a == t for a, t in zip(after, target, strict=True))
        table.add_row(
            " ".join(map(str, prompt[1:])),
            _marked(task, prompt, before),
            _marked(task, prompt, after),
            f"{right}/{len(target)}",
        )
    console.print(table)
    gain = report.last_reward - report.first_reward
    k = report.window
    console.print(
        f"reward {report.first_reward:.3f} (first {k} steps) -> {report.last_reward:.3f} (last {k}), {gain:+.3f}; "
        f"greedy {report.before_greedy_reward:.3f} -> {report.after_greedy_reward:.3f}, "
        f"{report.after_distinct_tokens:.1f} distinct tokens per answer; "
        f"parity held at every step (max |delta logprob| {report.max_parity_err:.1e} <= {report.parity_tolerance:g}); "
        f"median sync {report.median_sync_ms:.1f} ms; {report.seconds:.0f} s in all",
        highlight=False,
    )


def plot(report: DemoReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in report.steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r.reward for r in report.steps], color="tab:green", label="sampled")
    ax.plot(steps, [r.greedy_reward for r in report.steps], color="tab:olive", linestyle="--", label="greedy")
    ax.legend(loc="upper left")
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
