"""``colosync bench``'s workloads (``load_sync_workload``) and its errors, without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from colosync.errors import ConfigError
from colosync.tools.bench.sync import load_sync_workload
from colosync.tools.cli import main


def test_seed_lora_preset():
    workload, specs, lora = load_sync_workload("seed-lora")
    assert workload.name == "seed-lora" and workload.kind == "lora" and workload.tensors == len(specs) == 624
    assert workload.bytes == 169_417_728
    assert all(dtype == torch.bfloat16 for _, _, dtype in specs)
    assert lora is not None and lora.rank > 0 and lora.target_modules


def test_a_workload_file(tmp_path):
    path = tmp_path / "two.json"
    path.write_text(
        json.dumps(
            {
                "tensors": [
                    {"name": "a", "shape": [2, 3], "dtype": "float32"},
                    {"name": "b", "shape": [4], "dtype": "bfloat16"},
                ]
            }
        )
    )
    workload, specs, lora = load_sync_workload(str(path))
    assert (workload.name, workload.kind, workload.tensors, workload.bytes) == ("two", "full", 2, 32)
    assert specs[0] == ("a", (2, 3), torch.float32) and lora is None


def test_workload_errors_name_the_fix(tmp_path):
    no_tensors = tmp_path / "empty.json"
    no_tensors.write_text("{}")
    with pytest.raises(ConfigError, match="has no 'tensors' list"):
        load_sync_workload(str(no_tensors))
    wrong_total = tmp_path / "total.json"
    wrong_total.write_text(json.dumps({"total_bytes": 5, "tensors": [{"name": "a", "shape": [1], "dtype": "float32"}]}))
    with pytest.raises(ConfigError, match="total_bytes says 5 but the tensors add up to 4; fix or drop total_bytes"):
        load_sync_workload(str(wrong_total))
    with pytest.raises(ConfigError, match="'k3-gb300' is a handoff workload, not a sync workload"):
        load_sync_workload("k3-gb300")


def test_cli_bench_unknown_workload_exits_2(capsys):
    assert main(["bench", "--device", "cpu", "--workload", "seed-lor"]) == 2
    assert "colosync bench: no sync workload preset named 'seed-lor'" in capsys.readouterr().err


def test_the_mechanism_row_is_skipped_with_its_reason_where_the_device_cannot_hold_it(monkeypatch):
    """A payload the device cannot hold twice more would end the mechanism's engine process after every other
    row had been measured; the row is left out instead, and the note says how much it needed."""
    from colosync.tools.bench import sync

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 << 30, 80 << 30))
    assert sync._mechanism_room(169_417_728, "cuda:0") is None  # seed-lora: room to spare
    why = sync._mechanism_room(16_060_522_496, "cuda:0")  # llama8b-full: 2 x 15 GiB + 1
    assert why is not None and "30.9 GiB free on cuda:0" in why and "20.0 GiB are" in why
