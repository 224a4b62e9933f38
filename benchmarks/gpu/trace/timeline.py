"""Where one sync's time goes, across the trainer and engine processes: a median timeline.

    COLOSYNC_TRACE_DIR=/tmp/t PYTHONPATH=benchmarks/gpu/trace:. \
        python3 -m colosync.tools.cli bench --workload seed-lora --transports cuda_ipc ...
    python3 benchmarks/gpu/trace/timeline.py /tmp/t [--last 20]

Reads the ``trace-<pid>.json`` files that ``trace/sitecustomize.py`` wrote, cuts the trainer's
records into pushes, takes every record (trainer or engine) inside each push, and prints the
median offset from the push's start of each event (the n-th occurrence of a label and phase
within a push is its own event), in time order.
"""

import argparse
import collections
import glob
import json
import os
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--last", type=int, default=20, help="the last N pushes (the timed ones)")
    args = ap.parse_args()
    traces = {}
    for path in glob.glob(os.path.join(args.folder, "trace-*.json")):
        pid = int(os.path.basename(path)[6:-5])
        with open(path) as f:
            traces[pid] = [tuple(r) for r in json.load(f)]
    trainer = next((pid for pid, recs in traces.items() if any(r[0] == "T.push" for r in recs)), None)
    if trainer is None:
        raise SystemExit(f"no trainer trace (no T.push record) in {args.folder}: did the traced run start?")
    pushes, depth, start = [], 0, None
    for label, phase, t, _ in traces[trainer]:
        if label != "T.push":
            continue
        if phase == "B":
            depth += 1
            if depth == 1:
                start = t
        else:
            depth -= 1
            if depth == 0:
                pushes.append((start, t))
    pushes = pushes[-args.last :]
    events = collections.defaultdict(list)
    for pid, recs in traces.items():
        who = "trainer" if pid == trainer else f"engine{pid % 1000}"
        for b, e in pushes:
            seen = collections.Counter()
            for label, phase, t, _tid in recs:
                if b <= t <= e:
                    key = (who, label, phase)
                    seen[key] += 1
                    events[(who, label, phase, seen[key])].append((t - b) / 1e3)
    rows = []
    for key, offsets in events.items():
        if len(offsets) >= len(pushes) // 2:
            rows.append((statistics.median(offsets), key, len(offsets)))
    rows.sort()
    total = statistics.median((e - b) / 1e3 for b, e in pushes)
    print(f"{len(pushes)} pushes, median {total:.0f} us; median offset from the push's start (us):")
    for offset, (who, label, phase, n), count in rows:
        print(
            f"{offset:9.1f}  {who:10s} {'  ' if phase == 'E' else ''}{label}{'' if n == 1 else f' #{n}'} {phase}"
            f"{'' if count == len(pushes) else f'  ({count}/{len(pushes)})'}"
        )


if __name__ == "__main__":
    main()
