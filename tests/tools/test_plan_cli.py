"""``colosync plan``: the simulator's comparison as tables, JSON or a PNG, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from colosync.tools.cli import main
from colosync.tools.subcommand import parse_size

GB = 10**9


@pytest.mark.parametrize(
    "text, value", [("140GB", 140 * GB), ("898GiB", 898 * 2**30), ("1.5e9", 1_500_000_000), ("512 MiB", 512 * 2**20)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_cli_plan_json(capsys):
    assert main(["plan", "--workload", "k3-gb300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] == "gpu"
    assert out["modes"]["cpu"]["fits_host"] is False
    assert out["modes"]["gpu"]["host_peak_bytes"] == pytest.approx(770 * GB, rel=0.01)
    assert out["workload_expect"]["gpu_mode_fits"] is True
    assert out["modes"]["gpu"]["timeline"][0]["phase"] == "start"


def test_cli_plan_table_and_plot(capsys, tmp_path):
    png = tmp_path / "k3.png"
    assert main(["plan", "--workload", "k3-gb300", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "peak_device=cpu" in text and "peak_device=gpu" in text
    assert "recommended: --peak-device gpu" in text
    assert "970.0" in text and "770.0" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_plan_from_flags_and_overrides(capsys):
    args = [
        "plan",
        "--engine-weights",
        "16GB",
        "--kv",
        "60GB",
        "--trainer-resident",
        "48GB",
        "--trainer-backup",
        "40GB",
        "--host-budget",
        "50GB",
        "--gpu-memory",
        "141GB",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] == "gpu" and out["modes"]["cpu"]["host_peak_bytes"] == 56 * GB
    # raising the budget through an override of the preset makes both fit
    assert main(["plan", "--workload", "k3-gb300", "--host-budget", "2TB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["modes"]["cpu"]["fits"] and out["modes"]["gpu"]["fits"]


def test_cli_plan_errors(capsys):
    assert main(["plan", "--engine-weights", "1GB"]) == 2
    assert "--kv" in capsys.readouterr().err
    assert main(["plan", "--workload", "k3-gb300", "--host-budget", "100GB", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] is None


def test_cli_plan_workload_errors_say_what_is_wrong(capsys, tmp_path):
    assert main(["plan", "--workload", str(tmp_path / "my-node.json")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "my-node.json" in err and "not a preset" not in err
    assert main(["plan", "--workload", "k3-gb301"]) == 2
    assert "no handoff workload preset named 'k3-gb301'; presets: ['k3-gb300']" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus_per_node": 4,')
    assert main(["plan", "--workload", str(bad)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_cli_plan_missing_file_exits_without_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "colosync.tools.cli", "plan", "--workload", "/nonexistent.json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 2
    assert "colosync plan: handoff workload file '/nonexistent.json': no such file" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_plan_takes_the_flag_it_recommends(capsys):
    """``plan`` recommends ``--peak-device X``; that is the flag it takes (``--mode`` stays an alias)."""
    assert main(["plan", "--workload", "k3-gb300"]) == 0
    recommended = capsys.readouterr().out
    assert "--peak-device gpu" in recommended
    for flag in ("--peak-device", "--mode"):
        assert main(["plan", "--workload", "k3-gb300", flag, "gpu", "--json"]) == 0
        assert list(json.loads(capsys.readouterr().out)["modes"]) == ["gpu"]


def test_cli_plan_with_the_sync_json(capsys):
    # A full sync stages on the host by default, as the hf and vLLM engines do: one bucket on the device.
    assert main(["plan", "--workload", "k3-gb300", "--sync", "full:16GB", "--peak-device", "gpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sizes"]["sync_staging"] == "host"
    sync = next(r for r in out["modes"]["gpu"]["timeline"] if r["step"] == "sync.weights")
    assert sync["device_peak"] - sync["device_before"] == 64 << 20
    full_on_device = ["--sync", "full:16GB", "--sync-staging", "device", "--peak-device", "gpu", "--json"]
    assert main(["plan", "--workload", "k3-gb300", *full_on_device]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sizes"]["sync_kind"] == "full" and out["sizes"]["sync_bytes"] == 16 * GB
    rows = out["modes"]["gpu"]["timeline"]
    sync = next(r for r in rows if r["step"] == "sync.weights")
    assert sync["phase"] == "train_to_rollout"
    assert sync["device_peak"] - sync["device_before"] == 32 * GB  # staging + prepared copy
    assert sync["host_peak"] - sync["host_before"] == 4 * 2 * (64 << 20)  # shm slots, 4 GPUs per node
    assert (
        main(["plan", "--workload", "k3-gb300", "--sync", "lora:169MB", "--sync-transport", "cuda_ipc", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    sync = next(r for r in out["modes"]["cpu"]["timeline"] if r["step"] == "sync.weights")
    assert sync["device_peak"] - sync["device_before"] == 2 * 169 * 10**6 + 2 * (64 << 20)
    assert sync["host_peak"] == sync["host_before"]


def test_cli_plan_with_the_sync_table_and_errors(capsys):
    assert main(["plan", "--workload", "k3-gb300", "--sync", "lora:169MB"]) == 0
    text = capsys.readouterr().out
    assert "sync.weights" in text and "sync (lora, 0.2 GB per GPU over shm)" in text
    with pytest.raises(SystemExit):
        main(["plan", "--workload", "k3-gb300", "--sync", "delta:1GB"])
    assert "not a sync; write lora:SIZE or full:SIZE" in capsys.readouterr().err
