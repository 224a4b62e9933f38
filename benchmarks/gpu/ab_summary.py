"""Medians per path of the runs ab.sh wrote: python3 benchmarks/gpu/ab_summary.py DIR [--json FILE]."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    meta = {}
    for path in sorted(folder.glob("*-*.json")):
        side = path.stem.split("-")[0]
        if side not in runs:
            continue
        doc = json.loads(path.read_text())
        meta = {k: doc[k] for k in ("gpu", "driver", "cuda", "torch", "date", "mps") if k in doc}
        runs[side].append({r["path"]: r["median_ms"] for r in doc["results"]})  # the floors included
    paths = [p for p in runs["new"][0] if all(p in r for side in runs.values() for r in side)] if runs["new"] else []
    table = {p: {side: [r[p] for r in rs] for side, rs in runs.items()} for p in paths}
    print(f"{'path':28} {'old (ms, each run)':34} {'new (ms, each run)':34} median old/new")
    for p, sides in table.items():
        old, new = sides["old"], sides["new"]
        ratio = statistics.median(old) / statistics.median(new) if old and new else float("nan")
        print(f"{p:28} {' '.join(f'{x:7.3f}' for x in old):34} {' '.join(f'{x:7.3f}' for x in new):34} {ratio:.3f}")
    if len(sys.argv) > 3 and sys.argv[2] == "--json":
        doc = {"command": "bash benchmarks/gpu/ab.sh", "date": meta.get("date"), "machine": meta, "medians_ms": table}
        Path(sys.argv[3]).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
