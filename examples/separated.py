"""Separated mode: one trainer updates several engines as one transaction (all commit, or none does).

Two hf engine processes stand in for engines on other GPUs or nodes; the bytes cross a
torch.distributed group (gloo here, NCCL between GPUs) and every engine must prepare the
update before any commits it. Engines on other hosts: give ``EngineSet(host=...)`` an address
they reach this process at, and reach them through links such as ``RayLink``.
"""

import tempfile

from colosync import EngineSet, Probe, Sender
from colosync.engines.config import EngineConfig, Generate
from colosync.engines.process import EngineProcess
from colosync.testing import greedy, load_model, make_tiny_llama, random_lora

PROMPTS = [[1, 5, 9, 13], [2, 7, 11]]

if __name__ == "__main__":
    model_dir = make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0)
    config = EngineConfig(engine="hf", model_dir=str(model_dir))
    with EngineProcess(config) as first, EngineProcess(config) as second:
        engines = EngineSet({"first": first.connect(), "second": second.connect()}, join_timeout_s=30)
        with Sender(engines, transport="p2p") as sender:  # or "broadcast": one collective for all
            peft_model = random_lora(load_model(model_dir), seed=1)
            report = sender.push_peft(peft_model, verify=Probe.from_model(peft_model, PROMPTS))
            for outcome in report.engines:  # what each engine serves now, and when it answered
                print(f"{outcome.engine}: update {outcome.committed_update_id} in {outcome.seconds * 1e3:.0f} ms")
            want = greedy(peft_model, PROMPTS, 8)[0]
            for engine in (first, second):
                gen = engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
                assert gen.update_id == report.update_id and gen.tokens == want
        engines.close()
