"""Push a LoRA, then merged full weights, into an engine in its own process; verify each and check what it serves."""

import tempfile

from colosync import Probe, Sender
from colosync.engines.config import Generate
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.testing import greedy, load_model, make_tiny_llama, random_lora

PROMPTS = [[1, 5, 9]]

if __name__ == "__main__":  # the engine is a spawned process: guard the entry point
    model_dir = make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0)  # a local model, nothing downloaded
    peft_model = random_lora(load_model(model_dir), seed=1)  # your trainer's PEFT model
    engine = EngineProcess(EngineConfig(engine="hf", model_dir=str(model_dir)))  # its own process, ~5 s to start
    with engine, Sender(engine.link, transport="auto") as sender:
        # LoRA: rank, alpha and targets travel in the manifest; the engine scores the probe before it serves
        report = sender.push_peft(peft_model, verify=Probe.from_model(peft_model, PROMPTS))
        print(f"update {report.update_id} via {report.transport}: {report.seconds['total'] * 1e3:.1f} ms")
        print("why this transport:", sender.transport_log)
        gen = engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))  # results name their version
        assert gen.update_id == report.update_id and gen.tokens == greedy(peft_model, PROMPTS, 8)[0]

        merged = peft_model.merge_and_unload()  # full weights travel the same way, by HF names
        # adapters="drop" (the default): the engine stops applying the LoRA, which is now inside the weights
        report = sender.push(merged.named_parameters(), verify=Probe.from_model(merged, PROMPTS))
        gen = engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
        assert gen.update_id == report.update_id and gen.tokens == greedy(merged, PROMPTS, 8)[0]
        print(f"update {report.update_id}: {report.bytes / 1e6:.1f} MB of full weights, verified")
