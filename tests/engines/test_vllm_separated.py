"""A vLLM engine as one engine of a set (separated mode): its workers join the trainer's gloo group.

The session's vLLM engine (CPU backend, tensor parallel where two CPUs are usable) and an hf
engine process over the same tiny model form one ``EngineSet``; LoRA and full updates reach
both through ``broadcast`` and ``p2p``, and both serve what PEFT/transformers compute here.
Every vLLM worker opens the handle, so the set counts the engine's workers (``receivers``).
The session's own Sender (``vllm_sender``) detaches first and attaches again on its next push.
"""

from __future__ import annotations

import pytest
import torch

from colosync.control.engine_set import EngineSet
from colosync.engines.config import EngineConfig, Generate
from colosync.engines.process import EngineProcess
from colosync.sync.sender import Sender
from colosync.testing import greedy, load_model

from .conftest import vllm_tensor_parallel_size
from .test_vllm import NEW, PROMPTS, adapter, assert_parity, max_diff, vllm_generate


@pytest.fixture(scope="module")
def hf_twin(vllm_model_dir):
    engine = EngineProcess(EngineConfig(engine="hf", model_dir=str(vllm_model_dir), max_lora_rank=16))
    yield engine
    engine.close()


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_lora_and_full_updates_reach_vllm_and_hf_alike(
    vllm_llm, vllm_engine, vllm_sender, vllm_model_dir, hf_twin, transport
):
    vllm_sender.close()  # one sender per engine: the session's reattaches on its next push
    assert vllm_engine.link.receivers == vllm_tensor_parallel_size()
    engines = EngineSet({"vllm": vllm_engine.link, "hf": hf_twin.connect("separated")}, join_timeout_s=30.0)
    assert engines.peers.receivers == vllm_tensor_parallel_size() + 1
    sender = Sender(engines, transport=transport, bucket_bytes=32 << 10)
    try:
        for seed in (301, 302):
            trainer = adapter(vllm_model_dir, rank=8, seed=seed)
            report = sender.push_peft(trainer)
            assert {o.committed_update_id for o in report.engines} == {report.update_id}
            ref_tokens, ref_logprobs = greedy(trainer, PROMPTS, NEW)
            _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
            assert_parity(tokens, logprobs, ref_tokens, ref_logprobs)
            twin = hf_twin.call(Generate(PROMPTS, NEW))
            assert twin.update_id == report.update_id and twin.tokens == ref_tokens
            assert max_diff(twin.logprobs, ref_logprobs) <= 1e-3

        model = load_model(vllm_model_dir)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.05)
        report = sender.push(model.named_parameters())  # full, and the adapter dropped
        ref_tokens, ref_logprobs = greedy(model, PROMPTS, NEW)
        _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS)
        assert_parity(tokens, logprobs, ref_tokens, ref_logprobs)
        assert hf_twin.call(Generate(PROMPTS, NEW)).tokens == ref_tokens
        sender.push(load_model(vllm_model_dir).named_parameters())  # the base again, as the session expects
    finally:
        sender.close()
        engines.close()
