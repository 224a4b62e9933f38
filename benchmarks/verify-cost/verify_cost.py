"""What proof of delivery costs: plain vs verified LoRA pushes into the hf engine process (CPU, tiny Llama).

Run: .venv/bin/python benchmarks/verify-cost/verify_cost.py [--out benchmarks/verify-cost/record.json]
(prints one line; with --out also the record, to which the commit measured is added by hand or by CI).
"""

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from colosync.engines.process import EngineConfig, EngineProcess
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, greedy, load_model, make_tiny_llama, random_lora, score
from colosync.tools.bench.machine import run_header
from colosync.wire.protocol import Probe

REPEATS = 12

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the record (JSON) here")
    args = parser.parse_args()
    header = run_header(prog=("python", "benchmarks/verify-cost/verify_cost.py"), device="cpu")
    d = make_tiny_llama(tempfile.mkdtemp() + "/m", seed=0)
    trainer = random_lora(load_model(d), seed=1)
    prompts = [[1, 17, 33, 250], [1, 99, 4], [1, 5, 9, 13], [2, 7, 11, 3]]
    with (
        EngineProcess(EngineConfig(engine="hf", model_dir=str(d))) as engine,
        Sender(engine.connect(), transport="shm") as s,
    ):
        plain, verified, verify = [], [], []
        for i in range(REPEATS):
            fill_lora(trainer, 100 + i)
            r = s.push_peft(trainer)
            plain.append(r.seconds["total"])
            comps = greedy(trainer, prompts, 8)[0]
            probe = Probe(prompts, comps, score(trainer, prompts, comps), 1e-4)
            r = s.push_peft(trainer, verify=probe)
            verified.append(r.seconds["total"])
            verify.append(r.seconds["verify"])
        result = {
            "push_ms_median": round(statistics.median(plain) * 1e3, 2),
            "verified_push_ms_median": round(statistics.median(verified) * 1e3, 2),
            "engine_verify_ms_median": round(statistics.median(verify) * 1e3, 2),
            "max_deviation": r.delivery.max_deviation,
            "changed": r.delivery.changed,
            "expected": r.delivery.expected,
        }
        print(
            f"tiny llama LoRA, 4 prompts x 8 tokens probe, median of {REPEATS}: "
            f"push {result['push_ms_median']:.2f} ms, "
            f"verified push {result['verified_push_ms_median']:.2f} ms, "
            f"engine verify {result['engine_verify_ms_median']:.2f} ms, "
            f"max deviation {r.delivery.max_deviation:.2g}, changed {r.delivery.changed}/{r.delivery.expected}"
        )
    if args.out:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        record = {
            **header,
            "commit": git.stdout.strip() or None,
            "commit_source": "HEAD when run",
            "workload": "tiny Llama, LoRA, probe of 4 prompts x 8 tokens, hf engine process, shm",
            "repeats": REPEATS,
            **result,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
