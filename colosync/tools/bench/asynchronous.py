"""``colosync bench-async``: generation while a trainer pushes, commits that pause vLLM beside commits that do not.

Asynchronous RL keeps its engine generating while the trainer syncs, so what a commit costs is
what generation loses, not only how long the push takes. This bench starts vLLM (the CPU backend
here) on a tiny local Llama made from a fixed seed, keeps ``--concurrency`` requests in it at all
times (``Rollouts``: continuous batching from one thread), and pushes a new LoRA version every
``--every`` finished requests, ``--pushes`` times, once per commit mode, in one run:

* ``wait``: vLLM's pause drains the running requests, the commit swaps the adapter, vLLM resumes
  (every request on one version, one adapter id);
* ``inflight``: the new version is installed beside the served one and handed to new requests,
  the running ones finish on theirs (``commit_mode="inflight"``).

For each mode: generated tokens per second over the pushing window, request latency (p50, p99),
push time (median, p99), and how many versions requests ran on; beside them, the same requests
with nothing pushed (the baseline). Every request's tokens are checked against PEFT's greedy
tokens for the version vLLM says produced them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from colosync.errors import ConfigError
from colosync.tools.bench.machine import run_header
from colosync.tools.bench.output import add_output_arguments, run_and_report
from colosync.tools.subcommand import add_subcommand

MODES = ("wait", "inflight")
BASELINE = "no pushes"  # the same requests with nothing pushed: what generation does undisturbed


class AsyncResult(msgspec.Struct):
    """One commit mode's run."""

    path: str  # the commit mode, or BASELINE
    kind: str  # "mode", or "floor" for the baseline
    requests: int
    tokens_per_s: float
    latency_ms_p50: float
    latency_ms_p99: float
    push_ms_median: float
    push_ms_p99: float
    versions_served: int  # distinct versions the requests ran on
    verified: bool  # every request's tokens are PEFT's for the version it reports


class AsyncBench(msgspec.Struct):
    command: str
    date: str
    commit: str
    machine: dict[str, Any]
    config: dict[str, Any]
    results: list[AsyncResult]
    notes: list[str] = []


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_async(args: argparse.Namespace, progress: Any = None) -> AsyncBench:
    from colosync.testing import make_tiny_llama

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise ConfigError(f"--modes takes {', '.join(MODES)}; got {unknown or 'none'}")
    if args.pushes < 1 or args.every < 1 or args.concurrency < 1:
        raise ConfigError("--pushes, --every and --concurrency must each be at least 1")
    task = progress.add_task("starting vLLM", total=len(modes) * args.pushes) if progress else None
    with tempfile.TemporaryDirectory(prefix="colosync-bench-async-") as tmp:
        model_dir = make_tiny_llama(Path(tmp) / "tiny-llama", seed=0, hidden_size=128, intermediate_size=256)
        llm = _start_llm(model_dir, args)
        try:
            results = [run_mode(llm, model_dir, mode, args, progress, task) for mode in [BASELINE, *modes]]
        finally:
            llm.llm_engine.engine_core.shutdown()
    header = run_header(args.argv)
    config = {
        "pushes": args.pushes,
        "every": args.every,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "model": "tiny llama (hidden 128, 2 layers), fp32, vLLM CPU backend, one worker",
    }
    return AsyncBench(
        command=header["command"],
        date=header["date"],
        commit=header["commit"],
        machine=header["machine"],
        config=config,
        results=results,
        notes=["tokens/s over the window: from the first rollout to the last one's end, every push inside it"],
    )


def _start_llm(model_dir: Path, args: argparse.Namespace) -> Any:
    from colosync.engines.config import EngineConfig
    from colosync.engines.vllm.serving import VllmServing

    config = EngineConfig(engine="vllm", model_dir=str(model_dir), max_lora_rank=args.rank, max_loras=2)
    return VllmServing.from_config(config).llm  # the engine the demo and an engine process serve


def run_mode(
    llm: Any, model_dir: Path, mode: str, args: argparse.Namespace, progress: Any = None, task: Any = None
) -> AsyncResult:
    """One commit mode (or ``BASELINE``: nothing pushed) on ``llm`` (built with colosync's worker extension, LoRA
    and ``max_loras >= 2``, serving no colosync adapter); leaves it on the base weights of ``model_dir``, serving
    no adapter, in "wait" mode."""
    import torch
    from vllm import SamplingParams

    from colosync.engines.vllm.client import VllmEngine
    from colosync.engines.vllm.rollouts import Rollouts
    from colosync.sync.sender import Sender
    from colosync.testing import LORA_TARGETS, fill_lora, greedy, load_model, random_lora

    if progress:
        progress.update(task, description=f"{mode}: pushing")
    g = torch.Generator().manual_seed(7)
    prompts = [[1, *torch.randint(3, 500, (n,), generator=g).tolist()] for n in (6, 11, 17, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    trainer = random_lora(load_model(model_dir), rank=args.rank, alpha=2.0 * args.rank, targets=LORA_TARGETS, seed=1)
    commit_mode = "wait" if mode == BASELINE else mode
    engine = VllmEngine(llm, commit_mode=commit_mode)  # type: ignore[arg-type]  # checked against MODES above
    refs: dict[int, list[list[int]]] = {}
    push_s: list[float] = []
    with Sender(engine.link, transport="shm") as sender:

        def push(seed: int) -> None:
            fill_lora(trainer, seed, scale=0.08)
            started = time.perf_counter()
            uid = sender.push_peft(trainer).update_id
            push_s.append(time.perf_counter() - started)
            refs[uid] = greedy(trainer, prompts, args.max_tokens)[0]

        push(100)
        push_s.clear()  # the first push only gives the engine an adapter
        rollouts = Rollouts(engine, prompts, params, concurrency=args.concurrency).start()
        try:
            window = time.perf_counter()
            for i in range(args.pushes):
                while len(rollouts.finished) < (i + 1) * args.every and rollouts.error is None:
                    time.sleep(0.002)  # (a rollout loop that died raises in stop())
                if mode != BASELINE:
                    push(101 + i)
                if progress:
                    progress.advance(task)
        finally:
            done = rollouts.stop()
        ended = max(r.finished for r in done)
        sender.push(load_model(model_dir).named_parameters())  # the base again, the adapter dropped
    llm.collective_rpc("colosync_keep_versions", args=(False,))
    timed = [r for r in done if r.started >= window]
    verified = all(r.version in refs and r.tokens == refs[r.version][r.prompt] for r in done)
    return AsyncResult(
        path=mode,
        kind="floor" if mode == BASELINE else "mode",
        requests=len(timed),
        tokens_per_s=round(sum(len(r.tokens) for r in timed) / (ended - window), 1),
        latency_ms_p50=round(statistics.median((r.finished - r.started) * 1e3 for r in timed), 2),
        latency_ms_p99=round(_pct([(r.finished - r.started) * 1e3 for r in timed], 0.99), 2),
        push_ms_median=round(statistics.median(push_s) * 1e3, 2) if push_s else 0.0,
        push_ms_p99=round(_pct(push_s, 0.99) * 1e3, 2) if push_s else 0.0,
        versions_served=len({r.version for r in done}),
        verified=verified,
    )


def print_table(result: AsyncBench, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = result.config
    table = Table(
        title=f"colosync bench-async: a LoRA push every {c['every']} requests, {c['pushes']} pushes, "
        f"{c['concurrency']} requests in vLLM at all times",
        caption=f"{result.command} | {result.commit} | {result.date}",
        title_justify="left",
        caption_justify="left",
    )
    cols = ("commit mode", "tokens/s", "latency p50 ms", "p99 ms", "push median ms", "p99 ms", "versions", "ok")
    for col in cols:
        table.add_column(col, justify="left" if col == "commit mode" else "right")
    for r in result.results:
        ok = "[green]yes[/]" if r.verified else "[red]NO[/]"
        pushed = r.kind != "floor"
        table.add_row(
            r.path,
            f"{r.tokens_per_s:.0f}",
            f"{r.latency_ms_p50:.1f}",
            f"{r.latency_ms_p99:.1f}",
            f"{r.push_ms_median:.1f}" if pushed else "-",
            f"{r.push_ms_p99:.1f}" if pushed else "-",
            str(r.versions_served),
            ok,
            style=None if pushed else "dim",
        )
    console.print(table)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")


def _run(args: argparse.Namespace) -> int:
    return run_and_report("bench-async", args, run_async, print_table)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers,
        "bench-async",
        doc=__doc__,
        help="generation throughput and latency on vLLM while LoRA versions are pushed, by commit mode",
    )
    modes = ",".join(MODES)
    parser.add_argument("--modes", default=modes, help=f"comma-separated commit modes (default {modes})")
    parser.add_argument("--pushes", type=int, default=8, help="LoRA pushes per mode (default 8)")
    parser.add_argument("--every", type=int, default=8, help="finished requests between pushes (default 8)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests kept in vLLM at all times (default 4)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens each request generates (default 48)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    add_output_arguments(parser, _run)
