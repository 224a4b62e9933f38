"""``colosync demo``: a colocated RL loop that learns, hands memory over, syncs every step and proves parity.

A trainer and an engine share one device, each in its own process: Ray actors, or plain
processes where Ray is not installed (``--launcher``); this process drives them. The task:
count on from the prompt (``5 6 7`` -> ``8 9 10 ...``); reward = the share of tokens that
follow the token before them. Each step the engine samples a group of completions for each
of a few fresh prompts, the driver scores them, and the memory handoff gives the device to
the trainer (``rollout_to_train``: the engine's weights and KV cache out, the trainer awake);
the trainer takes a policy-gradient step on its LoRA (group-relative advantages per token, an
entropy bonus); the handoff gives the device back (``train_to_rollout``), and inside it
colosync pushes the LoRA to the engine as one transaction with a fresh update id. The
handoff runs as a plan (``--peak-device cpu|gpu``) through one shared host arena, every
invariant checked as measured across the processes. Then the step proves parity: the
engine's logprobs on a fixed probe batch must equal the trainer's, from the version the
engine says it served, or the run stops; and the engine answers the probe prompts greedily,
from that same version, so every step shows what the policy now says. vLLM's CPU backend has
no sleep mode: with it the handoff is skipped (and ``--handoff`` refused).
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

from colosync.errors import ConfigError, ParityError, UnsupportedOperation
from colosync.tools.bench.machine import run_header

log = logging.getLogger(__name__)

TRAINER = "colosync.demo.actors:TrainerActor"


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
    host_peak_mb: float  # resident memory of both process trees, sampled before and after the step
    gpu_peak_mb: float  # device memory in use (every process), sampled before and after the step
    step_s: float
    greedy: list[list[int]] = field(default_factory=list)  # the engine's greedy answers to the probe prompts
    generate_s: float = 0.0  # the rollout
    train_s: float = 0.0  # the policy-gradient step and the trainer's reference logprobs for the probe
    rollout_to_train_s: float = 0.0  # the handoff phases (0 without the handoff)
    train_to_rollout_s: float = 0.0  # ... including the sync
    sync_s: float = 0.0  # the sync (inside train_to_rollout with the handoff)
    host_copies_peak_mb: float = 0.0  # the handoff's host copies, measured over every process
    plan_host_copies_mb: float = 0.0  # ... and the most the plan expects at any of its steps
    device_peak_mb: float = 0.0  # the handoff's device peak
    handoff_ops: list[str] = field(default_factory=list)  # the operations both handoffs ran, in order
    violations: list[str] = field(default_factory=list)  # broken handoff invariants (none, or the run fails)


@dataclass
class DemoReport:
    engine: str
    transport: str
    device: str
    header: dict[str, Any] = field(default_factory=dict)  # command, date, commit, machine (run_header)
    launcher: str = ""
    handoff: bool = False
    handoff_note: str = ""  # why the handoff is off, when it is
    peak_device: str = ""
    arena_bytes: int = 0
    init: dict[str, Any] = field(default_factory=dict)  # the plan's init phase as it ran
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
    violations: int = 0  # broken handoff invariants over the whole run
    seconds: float = 0.0


@dataclass(frozen=True)
class DemoOptions:
    engine: str = "auto"
    transport: str = "auto"
    steps: int = 40
    seed: int = 0
    lr: float = 1e-2
    entropy_coef: float = 0.2
    ray_address: str | None = None
    device: str = "auto"
    launcher: str = "auto"
    peak_device: str = "cpu"
    handoff: bool | None = None  # None: on where the engine can hand its memory over


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a colocated RL loop (Ray actors or processes) with a memory handoff and a sync every step",
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
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when available")
    p.add_argument(
        "--launcher",
        choices=["auto", "ray", "process"],
        default="auto",
        help="Ray actors or plain processes for the engine and the trainer (auto: Ray when installed)",
    )
    p.add_argument(
        "--peak-device",
        choices=["cpu", "gpu"],
        default="cpu",
        help="handoff order: cpu lets both host copies coexist, gpu keeps one host copy at a time",
    )
    p.add_argument(
        "--handoff",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the memory handoff every step (default: on, except with vLLM on the CPU, which has no sleep mode)",
    )
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


def resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; run with --device cpu")
    return choice


def resolve_handoff(choice: bool | None, engine: str, device: str) -> tuple[bool, str]:
    """Whether the handoff runs, and the one-line reason when it does not."""
    if engine == "vllm" and device == "cpu":
        if choice:
            raise UnsupportedOperation(
                "--handoff with vLLM on the CPU: vLLM's CPU backend has no sleep mode, so its memory cannot be "
                "handed over; use --engine hf for the handoff on the CPU, or --no-handoff"
            )
        return False, "handoff skipped: vLLM's CPU backend has no sleep mode (--engine hf runs it on the CPU)"
    if choice is None:
        return True, ""
    return choice, "" if choice else "handoff off (--no-handoff)"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=args.json, width=max(Console().width, 110))
    options = DemoOptions(
        engine=args.engine,
        transport=args.transport,
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        entropy_coef=args.entropy_coef,
        ray_address=args.ray_address,
        device=args.device,
        launcher=args.launcher,
        peak_device=args.peak_device,
        handoff=args.handoff,
    )
    try:
        report = run_demo(options, console)
    except ParityError as exc:
        console.print(f"[bold red]parity failed:[/] {exc}")
        return 2
    except (ConfigError, UnsupportedOperation) as exc:
        console.print(f"[bold red]refused:[/] {exc}")
        return 2
    report.header = run_header()
    payload = json.dumps(asdict(report), indent=2)
    if args.report:
        args.report.write_text(payload)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(payload)
    else:
        print_report(report, console)
    return 3 if report.violations else 0


def run_demo(options: DemoOptions, console: Any) -> DemoReport:
    from colosync.colocated.cluster import Cluster
    from colosync.colocated.launch import resolve_launcher
    from colosync.colocated.step import Colocated
    from colosync.demo.tasks import CountTask
    from colosync.engines.config import Generate
    from colosync.testing import make_tiny_llama

    engine = resolve_engine(options.engine)
    device = resolve_device(options.device)
    launcher = resolve_launcher(options.launcher)
    handoff, note = resolve_handoff(options.handoff, engine, device)
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="colosync-demo-"))
    task = CountTask(seed=options.seed)
    # head size 32: vLLM's CPU minimum; the vocabulary is the task's numbers and three specials
    model_dir = str(make_tiny_llama(workdir / "tiny-llama", seed=options.seed, vocab_size=task.vocab_size))
    threads = 1 if device == "cpu" else 0  # two processes share the cores: one thread each beats contention
    tolerance = 1e-3 if engine == "vllm" else 1e-5
    if engine == "vllm":
        console.print(f"starting vLLM ({launcher}; about 30 s on 2 CPU cores)...")
    if note:
        console.print(note)
    trainer_kwargs = dict(
        model_dir=model_dir,
        engine_name=engine,
        transport=options.transport,
        rank=8,
        alpha=16.0,
        lr=options.lr,
        seed=options.seed,
        device=device,
        threads=threads,
        entropy_coef=options.entropy_coef,
        handoff=handoff,
    )
    cluster = Cluster(
        launcher,
        engine=engine,
        model_dir=model_dir,
        device=device,
        threads=threads,
        trainer_actor=TRAINER,
        trainer_kwargs=trainer_kwargs,
        ray_address=options.ray_address,
    )
    colo: Colocated | None = None
    try:
        prompts = task.probe_prompts
        # the demo checks parity itself once the engine serves the update (check=): no probe rides the push
        colo = None if handoff else Colocated(cluster, None, verify_every=0)
        first = colo.push() if colo is not None else None  # without the handoff: the first adapter from the start
        before = cluster.driver.call(Generate(prompts, task.max_new_tokens))
        if colo is None:  # the handoff's arena and executor, after the engine's first answers
            colo = Colocated(cluster, options.peak_device, verify_every=0)
        report = DemoReport(
            engine,
            first.transport if first is not None else "",
            device,
            launcher=launcher,
            handoff=handoff,
            handoff_note=note,
            peak_device=options.peak_device if handoff else "",
            task=f"count on from the prompt, modulo {task.numbers} (tokens {task.vocab_size - task.numbers}..)",
            prompts=prompts,
            targets=[task.target(p) for p in prompts],
            before=before.tokens,
            parity_tolerance=tolerance,
            arena_bytes=colo.arena_bytes,
        )
        report.before_greedy_reward = _mean_reward(task, prompts, before.tokens)
        init = colo.init()  # the engine's memory out, the trainer loaded and asleep, the engine back
        if init is not None:
            report.init = asdict(init)
            report.violations += len(init.violations)
        console.print(
            f"[bold]engine[/] {engine}  [bold]launcher[/] {launcher}  [bold]device[/] {device}  "
            f"[bold]handoff[/] {_handoff_label(report)}  "
            f"[bold]task[/] {report.task}; {task.prompts_per_step} fresh prompts x {task.group_size} samples a step"
        )
        for step in range(options.steps):
            row = _step(step, task, cluster, colo, options.seed, tolerance, before.tokens)
            report.steps.append(row)
            report.violations += len(row.violations)
            for v in row.violations:
                console.print(f"[bold red]invariant:[/] {v}", highlight=False)
            print_step(row, prompts[0], task, console, header=step == 0)
        report.after = report.steps[-1].greedy if report.steps else before.tokens
        if report.steps:
            report.transport = report.steps[0].transport
    finally:
        try:
            if colo is not None:
                colo.close()
        finally:
            cluster.close()
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


def _handoff_label(report: DemoReport) -> str:
    return f"{report.peak_device} peak, arena {report.arena_bytes / 2**20:.0f} MiB" if report.handoff else "off"


def _mean_reward(task: Any, prompts: list[list[int]], completions: list[list[int]]) -> float:
    return statistics.mean(task.reward(p, c) for p, c in zip(prompts, completions, strict=True))


def _step(
    step: int, task: Any, cluster: Any, colo: Any, seed: int, tolerance: float, probe_completions: list[list[int]]
) -> StepRow:
    """One RL step (``Colocated.step``): rollout -> handoff -> train -> handoff with the sync ->
    the parity probe. The probe batch (prompts + fixed completions) is scored by both sides:
    the trainer right after its step (it may be asleep once the handoff is done), the engine
    from the version it serves; the engine then answers the probe prompts greedily."""
    from colosync.engines.config import Generate, Score

    trainer, driver, prompts = cluster.trainer, cluster.driver, task.probe_prompts
    host0, dev0 = cluster.memory_now()
    batch = task.batch(step)

    def rollout() -> list[list[int]]:
        return driver.call(Generate(batch, task.max_new_tokens, temperature=1.0, seed=seed * 100_003 + step)).tokens

    def train(tokens: list[list[int]]) -> tuple[float, list[list[float]]]:
        loss = trainer.call("train_step", batch, tokens, task.advantages(batch, tokens))
        return loss, trainer.call("score", prompts, probe_completions)

    def check(trained: tuple[float, list[list[float]]], sync: Any) -> tuple[float, list[list[int]]]:
        probe = driver.call(Score(prompts, probe_completions))
        if probe.update_id != sync.update_id:
            raise ParityError(f"step {step}: engine served update {probe.update_id}, expected {sync.update_id}")
        pairs = zip(probe.logprobs, trained[1], strict=False)
        err = max(abs(a - b) for xs, ys in pairs for a, b in zip(xs, ys, strict=False))
        if not err <= tolerance:
            raise ParityError(f"step {step}: engine and trainer logprobs differ by {err:.3g} > {tolerance:g}")
        greedy = driver.call(Generate(prompts, task.max_new_tokens))
        if greedy.update_id != sync.update_id:
            raise ParityError(f"step {step}: engine answered from update {greedy.update_id}, expected {sync.update_id}")
        return err, greedy.tokens

    record = colo.step(rollout, train, check=check)
    (err, greedy), sync, phases = record.checked, record.sync, record.phases
    host1, dev1 = cluster.memory_now()
    mb = lambda get: max((get(p) for p in phases), default=0) / 2**20  # noqa: E731
    return StepRow(
        step,
        statistics.mean(task.reward(p, c) for p, c in zip(batch, record.rollout, strict=True)),
        _mean_reward(task, prompts, greedy),
        record.trained[0],
        sync.seconds["total"] * 1e3,
        sync.bytes,
        sync.transport,
        sync.update_id,
        err,
        max(host0, host1) / 2**20,
        max(dev0, dev1) / 2**20,
        record.seconds,
        greedy,
        generate_s=record.rollout_s,
        train_s=record.train_s,
        rollout_to_train_s=record.rollout_to_train.seconds if record.rollout_to_train else 0.0,
        train_to_rollout_s=record.train_to_rollout.seconds if record.train_to_rollout else 0.0,
        sync_s=record.sync_s,
        host_copies_peak_mb=mb(lambda p: p.host_copies_peak_bytes),
        plan_host_copies_mb=mb(lambda p: p.plan_host_copies_bytes),
        device_peak_mb=mb(lambda p: p.device_peak_bytes),
        handoff_ops=[op for p in phases for op in p.steps],
        violations=record.violations,
    )


_COLUMNS = "step  reward  greedy  gen s  r2t s  train s  t2r s  sync ms  update  parity  host/plan MB  dev MB  inv"


def _marked(task: Any, prompt: list[int], completion: list[int]) -> str:
    """``completion`` with each token green when it earned its reward, red when not."""
    rewards = task.token_rewards(prompt, completion)
    return " ".join(f"[{'green' if r else 'red'}]{t}[/]" for t, r in zip(completion, rewards, strict=True))


def print_step(row: StepRow, prompt: list[int], task: Any, console: Any, header: bool = False) -> None:
    """One line per step, as it finishes: the rewards, each part's seconds (the two handoffs
    and the sync inside the second), parity, the handoff's host copies against the plan and
    its device peak (without the handoff: the processes' resident memory and the device in
    use), the broken invariants, and the engine's greedy answer to the first probe prompt."""
    if header:
        shown = " ".join(map(str, prompt[1:]))
        console.print(f"[bold]{_COLUMNS}  greedy answer to [{shown}][/]", highlight=False)
    if row.rollout_to_train_s or row.train_to_rollout_s:
        memory = f"{row.host_copies_peak_mb:6.1f}/{row.plan_host_copies_mb:<6.1f}  {row.device_peak_mb:6.0f}"
        inv = "ok" if not row.violations else f"[red]{len(row.violations)}[/]"
    else:
        memory = f"{row.host_peak_mb:7.0f} rss    {row.gpu_peak_mb:6.0f}"
        inv = " -"
    console.print(
        f"{row.step:>4}  {row.reward:6.3f}  {row.greedy_reward:6.3f}  {row.generate_s:5.2f}  "
        f"{row.rollout_to_train_s:5.2f}  {row.train_s:7.2f}  {row.train_to_rollout_s:5.2f}  {row.sync_ms:7.1f}  "
        f"{row.update_id:>6}  {row.parity_err:6.0e}  {memory}  {inv:>3}  {_marked(task, prompt, row.greedy[0])}",
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
        f"median sync {report.median_sync_ms:.1f} ms; "
        + (
            f"handoff ({report.peak_device} peak, {report.launcher}): {report.violations} invariants broken; "
            if report.handoff
            else f"{report.handoff_note or 'no handoff'}; "
        )
        + f"{report.seconds:.0f} s in all",
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
