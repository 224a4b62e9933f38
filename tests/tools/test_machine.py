"""The header every recorded benchmark carries: the exact command, the date, the code and the machine."""

from __future__ import annotations

import datetime as dt
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from colosync.tools.bench import machine
from colosync.tools.bench.machine import command_line, machine_info, run_header, source_commit

ROOT = Path(__file__).resolve().parents[2]


def test_header_names_the_exact_command_and_the_machine():
    header = run_header(["handoff-bench", "--size", "32MB", "--out", "my results/b.json"], device="cpu")
    assert set(header) == {"command", "date", "commit", "machine"}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if head.returncode == 0:  # a checkout: the commit of the tree that ran, marked when colosync/ differs from it
        assert header["commit"].removesuffix("+dirty") == head.stdout.strip()
    assert header["command"] == "colosync handoff-bench --size 32MB --out 'my results/b.json'"
    assert shlex.split(header["command"])[-1] == "my results/b.json"  # pasting it reproduces the run
    assert dt.datetime.fromisoformat(header["date"]).tzinfo is not None
    machine = header["machine"]
    assert machine["torch"] == str(torch.__version__) and machine["python"] == sys.version.split()[0]
    assert machine["hostname"] and machine["cpu_count"] >= 1 and machine["host_memory_bytes"] > 0
    assert "gpu" not in machine and "driver" not in machine  # a CPU run names no GPU


def test_command_of_a_script_and_of_this_process(monkeypatch):
    assert (
        command_line(["--mode", "gpu"], prog=("python", "benchmarks/handoff/gpu_handoff.py"))
        == "python benchmarks/handoff/gpu_handoff.py --mode gpu"
    )
    monkeypatch.setattr(sys, "argv", ["/usr/bin/colosync", "plan", "--workload", "k3-gb300"])
    assert command_line() == "colosync plan --workload k3-gb300"
    assert run_header()["command"] == "colosync plan --workload k3-gb300"


def test_machine_info_without_cuda_reports_no_gpu():
    if torch.cuda.is_available():
        info = machine_info()
        assert info["gpu"] and info["gpu_memory_bytes"] > 0 and info["driver"]
    else:
        assert "gpu" not in machine_info() and machine_info()["cuda"] is None


def test_an_mps_daemon_is_found_by_its_control_pipe_and_pid_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert machine.mps_daemon() is None  # the folder alone is not a daemon
    (tmp_path / "control").touch()
    assert machine.mps_daemon() is None  # the pipes a daemon told to quit leaves behind
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text("4242\n")
    assert machine.mps_daemon() == str(tmp_path)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    monkeypatch.setattr(machine, "MPS_PIPE_DEFAULT", str(tmp_path))
    assert machine.mps_daemon() == str(tmp_path)


def test_an_installed_copy_names_its_version(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(machine.subprocess, "run", no_git)
    from colosync import __version__

    assert source_commit() == f"colosync {__version__}"
