"""``colosync probe``: reports what the machine allows, with reasons, as a table or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from colosync.tools.probe import ProbeReport, pidfd_getfd, run_probe


def test_report_names_each_check_and_the_auto_pick():
    report = run_probe(spawn=False)
    names = {c.name for c in report.checks}
    assert {"CUDA", "allocator expandable_segments", "ptrace scope", "/dev/shm", "shm segment, pinned"} <= names
    assert "pidfd_getfd on itself" in names
    assert [v.name for v in report.transports][:1] == ["cuda_ipc"]
    works = [v.name for v in report.transports if v.works]
    assert report.auto == (works[0] if works else None)
    for verdict in report.transports:
        assert verdict.reason  # every verdict says why
    pinned = next(c for c in report.checks if c.name == "shm segment, pinned")
    assert pinned.ok is (None if not torch.cuda.is_available() else pinned.ok)  # never "ok" for memory not pinned
    assert ("not pinned" in pinned.detail) == (pinned.ok is not True)
    if not torch.cuda.is_available():
        assert report.auto == "shm"
        assert not next(v for v in report.transports if v.name == "cuda_ipc").works


def test_expandable_segments_setting_is_read(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    detail = next(c for c in run_probe(spawn=False).checks if c.name == "allocator expandable_segments").detail
    assert "expandable segments ON" in detail and "pidfd_getfd" in detail


def test_pidfd_getfd_on_self_and_on_a_dead_pid():
    ok, why = pidfd_getfd(os.getpid(), 1)
    assert ok in (True, False, None) and why
    ok, why = pidfd_getfd(2**22 + 12345, 1)  # no such process
    assert ok is False and "pidfd_open failed" in why


def test_cli_json(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "colosync.tools.cli", "probe", "--json", "--no-spawn"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode in (0, 1), out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= set(ProbeReport.__struct_fields__)
    assert data["auto"] in (None, "cuda_ipc", "shm")
