"""``colosync handoff-bench`` end to end on the CPU: the table, the JSON and its header."""

from __future__ import annotations

import json

from colosync.tools.cli import main


def test_handoff_bench_cpu_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(
        ["handoff-bench", "--device", "cpu", "--size", "32MB", "--tensors", "8", "--repeats", "2", "--out", str(out)]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "torch" in table and "torch_memory_saver" in table
    assert "first cycle sleep / wake GB/s" in " ".join(table.split())  # every figure's column names its unit
    data = json.loads(out.read_text())
    assert data["command"].startswith("colosync ") and "handoff-bench" in data["command"]
    assert data["machine"]["torch"] and data["date"] and data["device"] == "cpu"
    torch_row, tms_row = data["results"]
    assert torch_row["backend"] == "torch" and torch_row["verified"] is True
    assert torch_row["bytes"] == 32 * 10**6 // 8 // 2 * 2 * 8
    assert torch_row["sleep_gbps_median"] > 0 and torch_row["wake_gbps_median"] > 0
    assert len(torch_row["sleep_gbps"]) == 2 and torch_row["reference_pinned_copy"]["d2h_gbps"] > 0
    assert tms_row["backend"] == "torch_memory_saver" and tms_row["available"] is False and tms_row["reason"]


def test_handoff_bench_unknown_backend_is_refused_before_any_work(capsys):
    assert main(["handoff-bench", "--device", "cpu", "--size", "1MB", "--backends", "torch,nvme"]) == 2
    assert "unknown backend(s) ['nvme']; choose from torch, tms" in capsys.readouterr().err
