"""The trainer's side of a sync as the GPU saw it: when each launch was issued and when it ran.

    python3 benchmarks/gpu/gpu_timeline.py [--workload seed-lora] [--transport shm] [--pushes 20]

The CPU traces of ``trace/`` (``trace.sh``) say when the trainer issued work and when a fence
passed, not what the GPU did in between. This pushes a workload into a ``sink`` engine process
as ``colosync bench`` does, profiles the timed pushes with ``torch.profiler`` (CUPTI), and prints
for the k-th GPU operation of a push the median offsets from the push's start: when its launch
was called on the CPU, when it started and ended on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GPU = {"kernel", "gpu_memcpy", "gpu_memset"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="seed-lora")
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--pushes", type=int, default=20)
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile, record_function

    from colosync.engines.process import EngineConfig, EngineProcess
    from colosync.sync.sender import Sender
    from colosync.tools.bench.sync import load_sync_workload, make_tensors

    _, specs, lora = load_sync_workload(args.workload)
    named = make_tensors(specs, "cuda")
    engine = EngineProcess(EngineConfig(engine="sink", device="cuda", timeout_s=60.0))
    sender = Sender(engine.connect(), transport=args.transport, bucket_bytes=args.bucket_mb << 20, slots=2)
    try:
        for _ in range(10):
            sender.push(named, lora=lora)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            totals = []
            for i in range(args.pushes):
                with record_function(f"push#{i}"):
                    totals.append(sender.push(named, lora=lora).seconds["total"])
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
    finally:
        sender.close()
        engine.close()
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    pushes = sorted(  # the CPU's annotation (the GPU track has one too, named alike)
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("push#")),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    gpu = sorted((e for e in events if e.get("cat") in GPU), key=lambda e: e["ts"])
    rows: dict[int, list[tuple[str, float, float, float]]] = {}
    for p in pushes:
        t0, t1 = p["ts"], p["ts"] + p["dur"]
        ops = [e for e in gpu if t0 <= e["ts"] <= t1]
        for k, e in enumerate(ops):
            launch = launches.get(e.get("args", {}).get("correlation"))
            issued = launch["ts"] - t0 if launch else float("nan")
            rows.setdefault(k, []).append((short(e), issued, e["ts"] - t0, e["ts"] + e["dur"] - t0))
    print(
        f"{len(pushes)} pushes of {args.workload} over {args.transport}, "
        f"median {statistics.median(totals) * 1e6:.0f} us"
    )
    print("   k  issued   start     end   (us from the push's start, medians)  operation")
    for k in sorted(rows):
        got = rows[k]
        names = {g[0] for g in got}
        med = [statistics.median(g[i] for g in got) for i in (1, 2, 3)]
        print(
            f"{k:4d} {med[0]:7.0f} {med[1]:7.0f} {med[2]:7.0f}   ({len(got)}/{len(pushes)})  "
            f"{' | '.join(sorted(names))}"
        )


def short(e: dict) -> str:
    name = str(e.get("name", ""))
    if e.get("cat") == "kernel":
        return "kernel " + name.split("(")[0][:60]
    return name[:60]


if __name__ == "__main__":
    main()
