"""Round trips through the engine channel (``colosync.control.channel``) to a real engine process.

A ``Status`` request is the cheapest thing the engine answers, so its round trip is the
channel's own cost: framing, the socket, waking the engine side and the reply. Run from the
repository root: ``python benchmarks/channel/roundtrip.py [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from colosync.engines.config import EngineConfig
from colosync.engines.process import EngineProcess
from colosync.tools.bench.machine import run_header
from colosync.wire.protocol import Status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--label", default="", help="what tree this is (recorded in the JSON)")
    args = parser.parse_args()
    with EngineProcess(EngineConfig(engine="sink", device="cpu")) as engine:
        link = engine.link
        for _ in range(200):  # warm-up
            link.call(Status())
        one, four = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            link.call(Status())
            one.append(time.perf_counter() - start)
            start = time.perf_counter()
            pending = [link.submit(Status()) for _ in range(4)]
            for p in pending:
                p.wait()
            four.append(time.perf_counter() - start)
    result = {
        **run_header(prog=("python", "benchmarks/channel/roundtrip.py"), device="cpu"),
        "label": args.label,
        "repeats": args.repeats,
        "status_round_trip_ms": {
            "median": statistics.median(one) * 1e3,
            "p90": statistics.quantiles(one, n=10)[-1] * 1e3,
        },
        "four_pipelined_ms": {
            "median": statistics.median(four) * 1e3,
            "p90": statistics.quantiles(four, n=10)[-1] * 1e3,
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("status_round_trip_ms", "four_pipelined_ms"):
            print(f"{name}: median {result[name]['median']:.3f}  p90 {result[name]['p90']:.3f}")


if __name__ == "__main__":
    main()
