"""A real vLLM engine (the CPU backend here) updated by colosync: a LoRA, then full weights."""

import os
import tempfile

from colosync import Sender
from colosync.engines.vllm import WORKER_EXTENSION, VllmEngine
from colosync.testing import greedy, load_model, make_tiny_llama, random_lora

if __name__ == "__main__":  # vLLM spawns worker processes: guard the entry point
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; else vLLM's CPU backend reserves most of the RAM
    from vllm import LLM, SamplingParams, TokensPrompt

    model_dir = make_tiny_llama(tempfile.mkdtemp() + "/tiny-llama", seed=0)  # head size 32: vLLM's CPU minimum
    peft_model = random_lora(load_model(model_dir), rank=8, seed=1)
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,  # the tiny model has no tokenizer: prompts are token ids
        dtype="float32",
        enable_lora=True,
        max_lora_rank=16,
        max_model_len=256,
        enforce_eager=True,
        worker_extension_cls=WORKER_EXTENSION,  # the one extra argument colosync needs
    )  # about 30 s to start on two CPU cores
    engine = VllmEngine(llm)  # checks every worker runs the extension
    with Sender(engine.link, transport="shm") as sender:  # keep it: the transport is reused
        report = sender.push_peft(peft_model)  # LoRA update: one transaction
        params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
        prompt = TokensPrompt(prompt_token_ids=[1, 5, 9])
        outs = llm.generate([prompt], params, lora_request=engine.lora_request)
        assert engine.version_of(outs[0]) == report.update_id  # the update these tokens came from
        assert list(outs[0].outputs[0].token_ids) == greedy(peft_model, [[1, 5, 9]], 8)[0][0]  # what PEFT computes
        merged = peft_model.merge_and_unload()
        report = sender.push(merged.named_parameters())  # full weights, same path; the adapter is dropped
        outs = llm.generate([prompt], params)  # no lora_request: the engine serves exactly the merged weights
        assert engine.version_of(outs[0]) == report.update_id
        assert list(outs[0].outputs[0].token_ids) == greedy(merged, [[1, 5, 9]], 8)[0][0]
        print(f"LoRA then full update {report.update_id}: {list(outs[0].outputs[0].token_ids)}")
