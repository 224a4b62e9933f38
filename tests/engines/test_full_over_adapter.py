"""What a full update does to a served LoRA adapter, on the real hf and vLLM engines.

The common RL pattern pushes a LoRA each step and, now and then, the merged weights
(``merge_and_unload()``) as a full update. Served on top of them, the old adapter would apply
twice and the engine would serve a model nobody trained, silently. So a full update says what
happens to the adapter (``adapters="drop"``, the default, or ``"keep"``); each test checks the
served tokens against the local reference of the model that choice must serve, and that a
verified push names the adapter when the choice was wrong. The drop is transactional: an
update that does not commit leaves the adapter served, and a drop that fails verification
rolls back to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from colosync import DeliveryError, FailedClosedError, NonFiniteError, Probe
from colosync.engines.config import Generate
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors
from colosync.testing import greedy, load_model, random_lora
from colosync.wire.protocol import Status

PROMPTS = [[1, 5, 9], [1, 17, 33, 250]]
NEW = 8
LORA = {"rank": 8, "alpha": 16.0, "seed": 1, "scale": 0.08}


@dataclass
class Served:
    """One engine and its sender, and what a test needs to ask it."""

    name: str
    sender: Sender
    model_dir: Any
    tolerance: float
    generate_with: Any  # (prompts, new) -> (update_id, tokens, logprobs), as the engine serves by default

    def generate(self) -> tuple[int, list[list[int]], list[list[float]]]:
        return self.generate_with(PROMPTS, NEW)

    def status(self):
        return self.sender.link.submit(Status()).wait()

    def assert_serves(self, model: torch.nn.Module, update_id: int) -> None:
        uid, tokens, logprobs = self.generate()
        ref_tokens, ref_logprobs = greedy(model, PROMPTS, NEW)
        assert uid == update_id
        assert tokens == ref_tokens, f"{self.name} serves {tokens}, the reference model {ref_tokens}"
        diff = max(
            abs(a - b) for xs, ys in zip(logprobs, ref_logprobs, strict=True) for a, b in zip(xs, ys, strict=True)
        )
        assert diff <= self.tolerance


def _hf(request) -> Served:
    engine = request.getfixturevalue("hf_engine")
    sender = Sender(engine.connect(), transport="shm", bucket_bytes=16 << 10)
    request.addfinalizer(sender.close)

    def generate(prompts, new):
        gen = engine.call(Generate(prompts, new))
        return gen.update_id, gen.tokens, gen.logprobs

    return Served("hf", sender, request.getfixturevalue("tiny_model_dir"), 1e-5, generate)


def _vllm(request) -> Served:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, engine = request.getfixturevalue("vllm_llm"), request.getfixturevalue("vllm_engine")
    sender = request.getfixturevalue("vllm_sender")

    def generate(prompts, new):
        params = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0, ignore_eos=True)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            params,
            lora_request=engine.link.default_lora(),  # the adapter the workers apply, or none
            use_tqdm=False,
        )
        [version] = {engine.version_of(o) for o in outs}
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [
            [s[t].logprob for s, t in zip(o.outputs[0].logprobs, tok, strict=True)]
            for o, tok in zip(outs, tokens, strict=True)
        ]
        return version, tokens, logprobs

    return Served("vllm", sender, request.getfixturevalue("vllm_model_dir"), 1e-3, generate)


@pytest.fixture(params=["hf", "vllm"])
def served(request):
    engine = {"hf": _hf, "vllm": _vllm}[request.param](request)
    original = load_model(engine.model_dir)
    yield engine
    engine.sender.push(original.named_parameters())  # leave the shared engine on its original weights, no adapter
    assert engine.status().adapter == 0


def models(model_dir):
    """The trainer's PEFT model, its merged weights, and merged weights with the same LoRA on top."""
    trainer = random_lora(load_model(model_dir), **LORA)
    merged = copy.deepcopy(trainer).merge_and_unload()
    twice = random_lora(copy.deepcopy(merged), **LORA)
    assert all(
        torch.equal(a, b) for (_, a), (_, b) in zip(peft_lora_tensors(trainer), peft_lora_tensors(twice), strict=True)
    )
    assert greedy(twice, PROMPTS, NEW)[0] != greedy(merged, PROMPTS, NEW)[0], "the LoRA must change what is served"
    return trainer, merged, twice


def test_a_full_update_drops_the_served_adapter_by_default(served):
    trainer, merged, _ = models(served.model_dir)
    lora = served.sender.push_peft(trainer)
    assert served.status().adapter == lora.update_id
    report = served.sender.push(merged.named_parameters())
    assert served.status().adapter == 0
    served.assert_serves(merged, report.update_id)  # the trained model, once


def test_adapters_keep_applies_the_adapter_on_the_new_weights(served):
    trainer, merged, twice = models(served.model_dir)
    lora = served.sender.push_peft(trainer)
    report = served.sender.push(merged.named_parameters(), adapters="keep")
    assert served.status().adapter == lora.update_id
    served.assert_serves(twice, report.update_id)


def test_a_verified_merged_push_passes_with_drop_and_names_the_adapter_with_keep(served):
    trainer, merged, _ = models(served.model_dir)
    lora = served.sender.push_peft(trainer)
    probe = Probe.from_model(merged, PROMPTS, NEW, tolerance=served.tolerance)
    with pytest.raises(DeliveryError, match=rf"still applies the LoRA adapter of update {lora.update_id}") as failed:
        served.sender.push(merged.named_parameters(), verify=probe, adapters="keep")
    assert "adapters='drop'" in str(failed.value) and "fails closed" in str(failed.value)
    status = served.status()
    assert not status.serving and status.adapter == lora.update_id
    with pytest.raises(FailedClosedError):  # hf refuses Generate; vLLM refuses its lora_request
        served.generate()
    report = served.sender.push(merged.named_parameters(), verify=probe)  # drop: exactly the pushed weights
    assert report.delivery.max_deviation <= served.tolerance
    assert report.delivery.changed == report.delivery.expected  # the dropped adapter counted as one change
    assert served.status().serving and served.status().adapter == 0
    served.assert_serves(merged, report.update_id)


def test_drop_adapter_serves_the_base_and_rolls_back_when_it_does_not_verify(served):
    trainer, _, _ = models(served.model_dir)
    lora = served.sender.push_peft(trainer)
    base = trainer.get_base_model()
    with trainer.disable_adapter():
        right = Probe.from_model(base, PROMPTS, NEW, tolerance=served.tolerance)
    wrong = Probe(
        right.prompts, right.completions, [[x - 0.5 for x in row] for row in right.logprobs], served.tolerance
    )
    with pytest.raises(DeliveryError, match=rf"rolled back to update {lora.update_id}"):
        served.sender.drop_adapter(verify=wrong)
    assert served.status().adapter == lora.update_id and served.status().serving
    served.assert_serves(trainer, lora.update_id)  # the adapter again, under its own update id
    report = served.sender.drop_adapter(verify=right)
    assert report.tensors == 0 and report.delivery.changed == report.delivery.expected == 1
    assert served.status().adapter == 0
    with trainer.disable_adapter():
        served.assert_serves(trainer, report.update_id)


def test_a_full_update_that_does_not_commit_keeps_the_adapter(served):
    trainer, merged, _ = models(served.model_dir)
    lora = served.sender.push_peft(trainer)
    named = [(n, p.detach().clone()) for n, p in merged.named_parameters()]
    named[-1][1].view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError):
        served.sender.push(named)
    assert served.status().adapter == lora.update_id and served.status().committed_update_id == lora.update_id
    served.assert_serves(trainer, lora.update_id)


def test_adapters_is_checked_before_anything_moves(served):
    trainer, merged, _ = models(served.model_dir)
    before = served.status()
    with pytest.raises(ValueError, match="adapters must be 'drop' or 'keep'"):
        served.sender.push(merged.named_parameters(), adapters="merge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="adapters='keep' is for full updates"):
        served.sender.push(peft_lora_tensors(trainer), lora=peft_lora_spec(trainer), adapters="keep")
    assert served.status() == before
