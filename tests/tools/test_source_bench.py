"""``colosync bench-source``: argument errors name the fix, and a tiny real run reports every path."""

from __future__ import annotations

import json

import pytest

from colosync.tools.cli import main


def test_bad_arguments_exit_2_naming_the_fix(capsys):
    assert main(["bench-source", "--device", "cpu", "--paths", "fsdp_source,nccl_magic"]) == 2
    assert "unknown path(s) ['nccl_magic']; choose from fsdp_source" in capsys.readouterr().err
    assert main(["bench-source", "--device", "cpu", "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err


def test_a_tiny_run_times_every_path_and_checks_the_bytes(tmp_path, capsys):
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path / "bench.json"
    argv = ["bench-source", "--device", "cpu", "--world-size", "1", "--size", "2MB", "--tensors", "24"]
    argv += ["--bucket-mb", "0.25", "--repeats", "1", "--warmup", "0", "--out", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "fsdp_source" in table and "faster than full_tensor_all" in table
    result = json.loads(out.read_text())
    assert result["command"].startswith("colosync") and result["machine"]["torch"]
    by_path = {r["path"]: r for r in result["results"]}
    assert set(by_path) == {"fsdp_source", "full_tensor_stream", "full_tensor_all"}
    assert by_path["fsdp_source"]["verified"] is True
    payload, bucket = result["payload_bytes"], result["config"]["bucket_bytes"]
    assert by_path["full_tensor_all"]["peak_sender_bytes"] == payload  # gathers everything before sending
    assert by_path["fsdp_source"]["peak_sender_bytes"] <= 2 * bucket + (64 << 10) < payload
    assert all(r["s_per_gb"] > 0 and r["gather_s_per_gb"] > 0 for r in result["results"])
