"""What proof of delivery costs: plain vs verified LoRA pushes into the hf engine process (CPU, tiny Llama).

Run: .venv/bin/python benchmarks/verify_cost.py  (prints one line; recorded in benchmarks/cpu-verify-cost.txt)
"""

import statistics
import tempfile

from colosync.engines.process import EngineConfig, EngineProcess
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, greedy, load_model, make_tiny_llama, random_lora, score
from colosync.wire.protocol import Probe

if __name__ == "__main__":
    d = make_tiny_llama(tempfile.mkdtemp() + "/m", seed=0)
    trainer = random_lora(load_model(d), seed=1)
    prompts = [[1, 17, 33, 250], [1, 99, 4], [1, 5, 9, 13], [2, 7, 11, 3]]
    with (
        EngineProcess(EngineConfig(engine="hf", model_dir=str(d))) as engine,
        Sender(engine.connect(), transport="shm") as s,
    ):
        plain, verified, verify = [], [], []
        for i in range(12):
            fill_lora(trainer, 100 + i)
            r = s.push_peft(trainer)
            plain.append(r.seconds["total"])
            comps = greedy(trainer, prompts, 8)[0]
            probe = Probe(prompts, comps, score(trainer, prompts, comps), 1e-4)
            r = s.push_peft(trainer, verify=probe)
            verified.append(r.seconds["total"])
            verify.append(r.seconds["verify"])
        print(
            f"tiny llama LoRA, 4 prompts x 8 tokens probe, median of 12: push {statistics.median(plain) * 1e3:.2f} ms, "
            f"verified push {statistics.median(verified) * 1e3:.2f} ms, "
            f"engine verify {statistics.median(verify) * 1e3:.2f} ms, "
            f"max deviation {r.delivery.max_deviation:.2g}, changed {r.delivery.changed}/{r.delivery.expected}"
        )
