"""vLLM's sleep-mode mapping on this CPU machine, and ``colosync handoff-bench`` end to end."""

from __future__ import annotations

import importlib.util
import json

import pytest

from colosync.tools.cli import main
from colosync.handoff import SleepModeUnavailable, UnsupportedOperation


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_cpu_backend_has_no_sleep_mode():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks vLLM's CPU backend")
    from colosync.handoff.backends.torch_engine import VllmEngineMemory, vllm_sleep_support

    ok, why = vllm_sleep_support()
    assert not ok
    assert "CPU backend has no sleep mode" in why and "engine_offload=False" in why
    with pytest.raises(SleepModeUnavailable, match="CPU backend has no sleep mode"):
        VllmEngineMemory(object())


def test_tms_backend_explains_why_it_is_unavailable():
    from colosync.handoff.backends.tms_trainer import TmsTrainerMemory, tms_available

    ok, why = tms_available()
    if ok:
        pytest.skip("torch_memory_saver is usable here")
    assert "torch_memory_saver" in why
    with pytest.raises(UnsupportedOperation, match="torch_memory_saver"):
        TmsTrainerMemory()


def test_handoff_bench_cpu_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["handoff-bench", "--device", "cpu", "--size", "32MB", "--tensors", "8", "--repeats", "2",
               "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "torch" in table and "torch_memory_saver" in table
    data = json.loads(out.read_text())
    assert data["command"].startswith("colosync ") and "handoff-bench" in data["command"]
    assert data["machine"]["torch"] and data["date"] and data["device"] == "cpu"
    torch_row, tms_row = data["results"]
    assert torch_row["backend"] == "torch" and torch_row["verified"] is True
    assert torch_row["bytes"] == 32 * 10**6 // 8 // 2 * 2 * 8
    assert torch_row["sleep_gbps_median"] > 0 and torch_row["wake_gbps_median"] > 0
    assert len(torch_row["sleep_gbps"]) == 2 and torch_row["reference_pinned_copy"]["d2h_gbps"] > 0
    assert tms_row["backend"] == "torch_memory_saver" and tms_row["available"] is False and tms_row["reason"]
