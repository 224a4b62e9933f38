"""End to end on CPU: Megatron weights gathered at TP=2 (EP=2 for Qwen3-MoE), pushed through the
Sender into the ``hf`` engine process, generate the same greedy tokens as the HF / PEFT reference:
a LoRA for Llama, then for every architecture a full update followed by a LoRA."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_helpers import ALL_TARGETS, Geometry, share_fused_lora_a
from megatron_workers import engine_worker, full_then_lora_through_engine

RANK, ALPHA = 4, 10.0
PROMPTS = [[5, 17, 33, 2, 101], [200, 7], [64, 64, 9, 13]]


def test_tp2_megatron_lora_through_sender_matches_peft_greedy(cpu_world, tmp_path):
    from peft import get_peft_model_state_dict

    from colosync.engines.hf import Generate
    from colosync.engines.process import EngineConfig, EngineProcess
    from colosync.testing import greedy, load_model, make_tiny_llama, random_lora

    geom = Geometry(num_layers=2)
    model_dir = make_tiny_llama(
        tmp_path / "llama",
        seed=4,
        vocab_size=geom.vocab_size,
        hidden_size=geom.hidden_size,
        num_hidden_layers=geom.num_layers,
        num_attention_heads=geom.num_heads,
        num_key_value_heads=geom.num_query_groups,
        intermediate_size=geom.ffn_hidden_size,
    )
    model = load_model(model_dir)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    base_tokens, _ = greedy(model, PROMPTS, 8)
    peft_model = random_lora(model, rank=RANK, alpha=ALPHA, targets=ALL_TARGETS, seed=9, scale=0.2)
    share_fused_lora_a(peft_model)
    want_tokens, want_logprobs = greedy(peft_model, PROMPTS, 8)
    assert want_tokens != base_tokens, "the adapter must change the generations for the test to mean anything"
    ref_path = tmp_path / "reference.pt"
    torch.save({"full": full, "lora": get_peft_model_state_dict(peft_model), "rank": RANK, "alpha": ALPHA}, ref_path)

    with EngineProcess(EngineConfig(engine="hf", model_dir=str(model_dir), max_lora_rank=16)) as engine:
        assert engine.call(Generate(prompts=PROMPTS, max_new_tokens=8)).tokens == base_tokens
        ranks = cpu_world.run(
            engine_worker, 2, str(ref_path), msgspec.msgpack.encode(engine.address), dataclasses.asdict(geom)
        )
        senders = [r for r in ranks if r["is_sender"]]
        assert len(senders) == 1, "one rank per engine sends"
        assert all(r["yielded"] == 0 for r in ranks if not r["is_sender"])
        got = engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
    assert got.update_id == senders[0]["update_id"]
    assert got.tokens == want_tokens
    for got_lp, want_lp in zip(got.logprobs, want_logprobs, strict=False):
        assert got_lp == pytest.approx(want_lp, abs=1e-4)


ENGINE_CASES = {
    "llama-tp2": ("llama", 2, 1),
    "qwen2-tied-tp2": ("qwen2", 2, 1),
    "qwen3-tp2": ("qwen3", 2, 1),
    "qwen3moe-tp2-ep2": ("qwen3_moe", 2, 2),
    "qwen3_5-gdn-tp2": ("qwen3_5", 2, 1),  # layer 0 Gated-DeltaNet (LoRA on in_proj), layer 1 gated attention
    "qwen3next-gdn-tp2-ep2": ("qwen3_next", 2, 2),  # the same hybrid with routed + gated shared experts
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_full_then_lora_pushes_match_hf_and_peft_greedy(cpu_world, tmp_path, case):
    """The engine starts from one checkpoint; the trainer holds other weights (and a LoRA).
    A full push must make the engine generate what HF generates with the trainer's weights;
    the LoRA push after it what PEFT generates with that adapter on them."""
    from megatron_helpers import GEOMETRIES

    arch, tp, ep = ENGINE_CASES[case]
    geom = dataclasses.replace(GEOMETRIES[arch], num_layers=2)
    full_then_lora_through_engine(cpu_world, tmp_path, "hf", geom, tp, ep, tolerance=1e-4)
