"""Recorded run of the colocated handoff with real tensors.

One mode per process, so each starts from a clean host baseline:

    python benchmarks/handoff/gpu_handoff.py --mode gpu --out $OUT/handoff_gpu.json
    python benchmarks/handoff/gpu_handoff.py --mode cpu --out $OUT/handoff_cpu.json

Defaults: an engine with 16 GB of bf16 weights and a 64 GB KV cache, a trainer
with 10 GB of fp32 parameters + 10 GB of gradients + 20 GB of AdamW state (40 GB resident; the
30 GB of parameters and optimizer state are backed up, the gradient buffer is not). Host copies
are measured as the process's anon+shmem above a baseline taken after CUDA initialisation and
before any participant or host pool exists. ``--device cpu`` with small sizes is a dry run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from colosync.errors import HandoffInvariantError
from colosync.handoff import HandoffSizes, Region, build_plan, compare
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.handoff.runtime.sampling import HostSampler, trim_host_allocator
from colosync.tools.bench.machine import run_header
from colosync.tools.bench.synthetic import engine_state, trainer_state
from colosync.tools.handoff import parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["cpu", "gpu"], required=True)
    ap.add_argument("--engine-weights", type=parse_size, default=parse_size("16GB"))
    ap.add_argument("--kv", type=parse_size, default=parse_size("64GB"))
    ap.add_argument(
        "--trainer-params",
        type=parse_size,
        default=parse_size("10GB"),
        help="fp32 parameter bytes; resident state is 4x (params, grads, AdamW m and v)",
    )
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--chunk", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument(
        "--no-reserve",
        dest="reserve",
        action="store_false",
        help="grow the host pool on demand instead of reserving it up front "
        "(gpu mode: the larger copy, cpu mode: both copies)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, device=device)  # CUDA context (and its host memory) before the baseline
    # Warm up what the first optimizer step loads (Python modules, CUDA kernels): it is
    # interpreter and driver memory, not a host copy, and must sit inside the baseline.
    warm = trainer_state(4 << 20, device=device, tensor_bytes=1 << 20)
    del warm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    trim_host_allocator()
    baseline = HostSampler().sample()

    pool = HostPool(chunk_bytes=args.chunk, pin="auto" if device.type == "cuda" else "none")
    t0 = time.perf_counter()
    model, kv = engine_state(args.engine_weights, args.kv, device=device)
    engine = TorchEngineMemory(model, kv, pool=pool, device=device)
    trainer = TorchTrainerMemory(
        loader=lambda: trainer_state(args.trainer_params, device=device), pool=pool, device=device
    )
    build_s = time.perf_counter() - t0
    reserve_s = 0.0
    if args.reserve:
        mirror_est, backup_est = engine.region_bytes()[Region.ENGINE_MIRROR], 3 * args.trainer_params
        want = max(mirror_est, backup_est) if args.mode == "gpu" else mirror_est + backup_est
        reserve_s = pool.reserve(want)

    executor = HandoffExecutor(
        trainer, engine, baseline_host_bytes=baseline.value, watch_interval_s=0.002, fail_fast=False, pools=[pool]
    )
    plan = build_plan(peak_device=args.mode)
    t0 = time.perf_counter()
    error = None
    try:
        result = executor.run(plan, cycles=args.cycles)
    except HandoffInvariantError as exc:  # fail_fast=False: only a real error lands here
        error = str(exc)
        result = executor.result
    run_s = time.perf_counter() - t0
    if result is None:  # the error came before the first step: nothing was measured
        print(f"[{args.mode}] no step ran: {error}", file=sys.stderr)
        return 1

    sizes = {**engine.region_bytes(), **trainer.region_bytes()}
    mirror, backup = sizes[Region.ENGINE_MIRROR], sizes[Region.TRAINER_BACKUP]
    larger = max(mirror, backup)
    total_gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    abs_peak = baseline.value + result.host_peak
    sleeps = [r.report.gbps for r in result.records if r.step == "trainer.sleep"]
    wakes = [r.report.gbps for r in result.records if r.step == "trainer.wake_up"]
    predicted = compare(
        HandoffSizes(
            engine_weight_bytes=mirror,
            engine_kv_bytes=sizes[Region.ENGINE_KV],
            trainer_resident_bytes=backup + sizes[Region.TRAINER_GRADS],
            trainer_backup_bytes=backup,
            trainer_grad_buffer_bytes=sizes[Region.TRAINER_GRADS],
            trainer_load_host_bytes=0,
            host_baseline_bytes=baseline.value,
            gpu_bytes=total_gpu,
            name="recorded run",
        ),
        cycles=args.cycles,
    )
    if args.mode == "gpu":
        criteria = {
            "host_peak_within_5pct_of_larger_copy_plus_baseline": abs_peak <= 1.05 * (larger + baseline.value),
            "device_peak_within_gpu": total_gpu is None or result.device_peak <= total_gpu,
        }
    else:
        criteria = {"host_holds_both_copies_at_peak": result.host_peak >= 0.95 * (mirror + backup)}
    criteria["no_invariant_violations"] = not result.violations and error is None
    out = run_header(sys.argv[1:], prog=("python", "benchmarks/handoff/gpu_handoff.py"), device=device) | {
        "mode": args.mode,
        "device": str(device),
        "sizes_bytes": {r.value: n for r, n in sizes.items()},
        "host_pool": {
            "pin": pool.pin,
            "chunk_bytes": pool.chunk_bytes,
            "capacity_bytes": pool.capacity_bytes,
            "alloc_seconds": pool.alloc_seconds,
        },
        "baseline_host": baseline.__dict__,
        "summary": {
            "host_copies_peak_bytes": result.host_peak,
            "host_copies_peak_step": result.peak_step("host"),
            "host_abs_peak_bytes": abs_peak,
            "larger_single_copy_bytes": larger,
            "both_copies_bytes": mirror + backup,
            "host_peak_over_larger_copy": result.host_peak / larger if larger else None,
            "device_peak_bytes": result.device_peak,
            "device_peak_step": result.peak_step("device"),
            "gpu_total_bytes": total_gpu,
            "trainer_sleep_gbps": sleeps,
            "trainer_wake_gbps": wakes,
            "build_seconds": build_s,
            "pool_reserve_seconds": reserve_s,
            "run_seconds": run_s,
            "predicted_host_peak_bytes": predicted.simulations[args.mode].host_peak,
            "predicted_device_peak_bytes": predicted.simulations[args.mode].device_peak,
        },
        "criteria": criteria,
        "passed": all(criteria.values()),
        "error": error,
        "execution": result.to_dict(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    s = out["summary"]
    print(
        f"[{args.mode}] host copies peak {s['host_copies_peak_bytes'] / 1e9:.2f} GB at {s['host_copies_peak_step']} "
        f"(larger copy {larger / 1e9:.2f} GB, both {(mirror + backup) / 1e9:.2f} GB, baseline "
        f"{baseline.value / 1e9:.2f} GB); device peak {s['device_peak_bytes'] / 1e9:.2f} GB; trainer sleep "
        f"{', '.join(f'{x:.1f}' for x in sleeps)} GB/s, wake {', '.join(f'{x:.1f}' for x in wakes)} GB/s; "
        f"criteria {criteria}"
    )
    for v in result.violations[:5]:
        print("  violation:", v)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
