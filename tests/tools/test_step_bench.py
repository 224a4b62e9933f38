"""``colosync bench-step``: the colocated step with a full sync at a given size, trainer and
engine in their own processes, every step checked for parity and every invariant measured.

On the CPU the sizes are tiny (what is checked is that every step runs, hands over, syncs
and serves exactly the trainer's weights); on CUDA (gpu marker) the sync must add at most
one bucket plus the transport's slots to the device, the bound the README states.
"""

from __future__ import annotations

import json

import pytest
import torch

from colosync.tools.bench import step as step_bench
from colosync.tools.bench.floors import AllocatorTimes
from colosync.tools.cli import main

MiB = 1 << 20


def _bench(capsys, tmp_path, *args: str) -> dict:
    out = tmp_path / "report.json"
    rc = main(["bench-step", "--steps", "3", "--report", str(out), *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    return json.loads(out.read_text())


def test_every_step_syncs_the_whole_model_and_charges_each_operation_its_allocations(capsys, tmp_path, monkeypatch):
    # The CPU has no CUDA allocator to time: the run is given its rates, and each operation's device
    # bytes allocated and freed (as the real participants report them) must be charged at them.
    times = AllocatorTimes(10**9, [3e-3, 2e-3, 1e-3], [5e-4, 4e-4, 6e-4])  # one GB: seconds are s/GB
    rates = {"allocate": 2e-3, "free": 5e-4}
    monkeypatch.setattr(step_bench, "allocator_times", lambda device, nbytes, repeats=3: times)
    args = ["--device", "cpu", "--weights", "6MB", "--kv", "2MB", "--tensor", "1MB", "--bucket", "1MB"]
    report = _bench(capsys, tmp_path, *args, "--optimizer-shards", "2")
    assert report["allocator_s_per_gb"] == pytest.approx(rates)  # the medians
    assert report["allocator_times"]["allocate_s"] == times.allocate_s  # every timed call is kept
    kv_gb = report["kv_bytes"] / 1e9
    for mode in report["modes"]:
        row = mode["rows"][-1]
        ops = row["op_allocator_s"]
        assert ops["rollout_to_train/engine.offload_kv"] == pytest.approx(kv_gb * rates["free"], rel=0.01)
        assert ops["train_to_rollout/engine.onload_kv"] == pytest.approx(kv_gb * rates["allocate"], rel=0.01)
        assert ops["rollout_to_train/trainer.wake_up"] > 0 and ops["train_to_rollout/trainer.sleep"] > 0
        if mode["peak_device"] == "gpu":  # the grad buffer went before the sleep: the sleep frees the state, once
            assert ops["train_to_rollout/trainer.sleep"] == pytest.approx(
                report["trainer_backup_bytes"] / 1e9 * rates["free"], rel=0.01
            )
        assert row["allocator_floor_s"] == pytest.approx(sum(ops.values()))
        summary = mode["summary"]
        assert summary["median_floor_with_allocator_s"] > summary["median_floor_s"]
    assert [m["peak_device"] for m in report["modes"]] == ["gpu", "cpu"]
    for mode in report["modes"]:
        rows = mode["rows"]
        assert [r["update_id"] for r in rows] == [2, 3, 4]  # the warm-up's is 1; then one per step
        assert all(r["sync_bytes"] == report["weight_bytes"] // (4096 * 2) * 4096 * 2 for r in rows)
        assert all(not r["violations"] for r in rows) and mode["summary"]["violations"] == 0
        assert mode["summary"]["steps"] == 3
    gpu, cpu = report["modes"]
    assert gpu["arena_bytes"] < cpu["arena_bytes"]  # one host copy at a time against both
    weights = report["weight_bytes"] // (4096 * 2) * 4096 * 2
    assert report["trainer_backup_bytes"] == weights + 2 * 2 * weights // 2  # moments of half the weights


LENT_OPS = (
    "rollout_to_train/engine.offload_kv",
    "rollout_to_train/trainer.wake_up",
    "train_to_rollout/trainer.sleep",
    "train_to_rollout/engine.onload_kv",
)


def test_with_the_kv_cache_lent_the_handoff_allocates_and_frees_nothing_for_it(capsys, tmp_path, monkeypatch):
    # engine and trainer in their own processes; the engine's KV cache block is shared memory the
    # trainer process maps and wakes up in: no operation that hands it over allocates or frees it
    times = AllocatorTimes(10**9, [2e-3] * 3, [5e-4] * 3)
    monkeypatch.setattr(step_bench, "allocator_times", lambda device, nbytes, repeats=3: times)
    args = ["--device", "cpu", "--weights", "6MB", "--kv", "40MB", "--tensor", "1MB", "--bucket", "1MB"]
    report = _bench(capsys, tmp_path, *args, "--optimizer-shards", "2", "--peak-device", "gpu", "--lend-kv")
    (mode,) = report["modes"]
    assert mode["lend_kv"] and mode["summary"]["violations"] == 0 and mode["summary"]["steps"] == 3
    assert [r["update_id"] for r in mode["rows"]] == [2, 3, 4]  # every step synced and served the trainer's weights
    for row in mode["rows"]:
        assert all(row["op_allocator_s"].get(op, 0.0) == 0.0 for op in LENT_OPS), row["op_allocator_s"]
        assert row["op_bytes"]["rollout_to_train/trainer.wake_up"] > 0  # the state was still copied in
    small = [*args[:4], "--kv", "4MB", *args[6:], "--peak-device", "gpu", "--lend-kv", "--steps", "1"]
    assert main(["bench-step", *small]) == 2  # a KV cache too small to lend into, refused before the run
    assert "do not fit the engine's KV cache" in " ".join(capsys.readouterr().out.split())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_trainer_wakes_up_in_the_lent_kv_cache(capsys, tmp_path):
    report = _bench(capsys, tmp_path, "--device", "cuda", "--weights", "2GB", "--kv", "16GB", "--peak-device", "gpu")
    plain = report["modes"][0]
    report = _bench(
        capsys, tmp_path, "--device", "cuda", "--weights", "2GB", "--kv", "16GB", "--peak-device", "gpu", "--lend-kv"
    )
    (lent,) = report["modes"]
    assert lent["lend_kv"] and lent["summary"]["violations"] == 0, lent["summary"]
    for row in lent["rows"]:
        assert all(row["op_allocator_s"].get(op, 0.0) == 0.0 for op in LENT_OPS), row["op_allocator_s"]
    assert any(plain["rows"][-1]["op_allocator_s"].get(op, 0.0) > 0 for op in LENT_OPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_sync_adds_at_most_one_bucket_and_the_slots(capsys, tmp_path):
    report = _bench(capsys, tmp_path, "--device", "cuda", "--weights", "2GB", "--kv", "4GB")
    for mode in report["modes"]:
        assert mode["summary"]["violations"] == 0
        bound = mode["bucket_and_slots_bytes"]
        assert mode["summary"]["max_sync_device_extra_bytes"] <= bound + 32 * MiB, mode["summary"]
    gpu = report["modes"][0]
    assert gpu["summary"]["host_copies_peak_bytes"] <= 1.05 * gpu["larger_copy_bytes"] + 64 * MiB
    assert report["allocator_s_per_gb"]["allocate"] > 0 and report["allocator_s_per_gb"]["free"] > 0
    assert len(report["allocator_times"]["allocate_s"]) == len(report["allocator_times"]["free_s"]) == 3
    assert gpu["summary"]["median_floor_with_allocator_s"] > gpu["summary"]["median_floor_s"]
