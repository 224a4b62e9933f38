"""GPU time of the sync's kernels, alone, on the sync workloads (CUDA-graph replay, median).

    python3 benchmarks/kernels/kernels.py [--out kernels.json]

For seed-lora's one bucket (624 tensors, 169 MB) and llama8b-full's first 4 GiB bucket:
- trainer pack: ``_foreach_copy_`` + the fingerprint pass (the path before ``kernels.gather``),
  against the gather kernel at several block sizes, warp counts and chunk sizes;
- engine landing: ``fused.copy_check`` copy + fingerprint + NaN/Inf check, at several
  configurations, against a plain device copy of the same bytes (the floor of any landing).
Every variant's bytes and fingerprint are checked against the reference path first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import triton.testing

from colosync.kernels import fused, gather
from colosync.sync.plan import Plan, ViewKey
from colosync.tools.bench.machine import run_header
from colosync.tools.bench.sync import load_sync_workload, make_tensors
from colosync.wire.bucket import fingerprint_tensor


def bench(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))


def measure(workload: str, bucket_bytes: int, device: torch.device, rows: list) -> None:
    """Every pack and landing variant on the first bucket of ``workload``, appended to ``rows``."""
    _, specs, _ = load_sync_workload(workload)
    plan = Plan(specs, bucket_bytes)
    i0, i1 = plan.bounds[0]
    specs = specs[i0:i1]
    plan = Plan(specs, bucket_bytes)
    srcs = [t for _, t in make_tensors(specs, device)]
    size = plan.sizes[0]
    nbytes = plan.total
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    cell = torch.zeros(2, dtype=torch.int64, device=device)
    plan.pack(ViewKey(0, 0), dst, srcs)
    want_fp = int(fingerprint_tensor(dst))
    want = dst.clone()

    def old_pack() -> None:
        cell.zero_()
        plan.pack(ViewKey(0, 0), dst, srcs)
        fused.copy_check(dst, None, None, out=cell)

    def record(name: str, ms: float, moved: int) -> None:
        rows.append({"workload": workload, "path": name, "ms": round(ms, 4), "tbps": round(moved / ms / 1e9, 3)})
        print(f"{workload:13s} {name:44s} {ms:8.4f} ms  {moved / ms / 1e9:6.3f} TB/s", flush=True)

    record("pack: foreach_copy_ + fingerprint pass", bench(old_pack), 3 * nbytes)
    for chunk in (1 << 14, 1 << 16, 1 << 18):
        gather.CHUNK = chunk
        table = gather.GatherTable(plan.metas, device)
        assert table.bind(srcs)
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
            gather._BLOCK, gather._WARPS = block, warps

            def new_pack(table: gather.GatherTable = table) -> None:
                cell.zero_()
                plan.zero_gaps(0, dst)
                gather.launch(table.table, dst, cell)

            dst.fill_(0x77)
            new_pack()
            torch.cuda.synchronize()
            assert torch.equal(dst, want) and int(cell[0]) == want_fp, (chunk, block, warps)
            record(f"pack: gather chunk={chunk} block={block} warps={warps}", bench(new_pack), 2 * nbytes)
    gather.CHUNK, gather._BLOCK, gather._WARPS = 1 << 16, 1024, 4
    out = torch.empty_like(dst)
    segs = fused.segments(plan.metas, size)
    record("land: device copy (floor)", bench(lambda: out.copy_(dst)), 2 * size)
    for block, warps, waves in ((1024, 4, 4), (1024, 8, 4), (2048, 8, 4), (1024, 4, 8), (2048, 8, 8), (4096, 8, 4)):
        fused._BLOCK, fused._WARPS, fused._WAVES = block, warps, waves

        def land() -> None:
            cell.zero_()
            fused.copy_check(dst, out, segs, out=cell)

        out.zero_()
        land()
        torch.cuda.synchronize()
        assert torch.equal(out, dst) and int(cell[0]) == want_fp and int(cell[1]) == 0, (block, warps, waves)
        record(f"land: copy_check block={block} warps={warps} waves={waves}", bench(land), 2 * size)
    fused._BLOCK, fused._WARPS, fused._WAVES = 1024, 4, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    assert fused.enabled(device) and gather.enabled(device)
    rows = []
    for workload, bucket_bytes in (("seed-lora", 1 << 30), ("llama8b-full", 4 << 30)):
        measure(workload, bucket_bytes, device, rows)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            header = run_header(prog=("python3", "benchmarks/kernels/kernels.py"), device=device)
            json.dump(
                {**header, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
