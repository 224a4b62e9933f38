"""PlainSource: a single-process or DDP HF/PEFT model behind the same interface as the sharded sources."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from colosync.errors import ConfigError, ConversionError
from colosync.sources.base import EngineMap, Source
from colosync.sources.plain import PlainSource, engine_name, select
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors
from tests.sources.fsdp_workers import ddp_worker, references, shared_world, store_link, tiny_llama, with_lora

PROMPTS = [[5, 17, 33, 2, 101], [200, 7]]


@pytest.fixture(scope="module")
def peft_model():
    return with_lora(tiny_llama(seed=0))


def _push(source: PlainSource, bucket_bytes: int = 16 << 10):
    engine, receiver, link = store_link()
    with Sender(link, transport="shm", bucket_bytes=bucket_bytes) as sender:
        report = source.push(sender)
    receiver.close()
    return engine.tensors, report, receiver


def test_lora_is_what_push_peft_sends(peft_model):
    source = PlainSource(peft_model, "lora")
    assert isinstance(source, Source) and source.is_sender
    want = peft_lora_tensors(peft_model)
    assert [n for n, _, _ in source.specs()] == [n for n, _ in want]
    assert source.lora == peft_lora_spec(peft_model)
    got, report, receiver = _push(source)
    assert report is not None and report.kind == "lora" and report.update_id == receiver.committed_update_id
    assert list(got) == [n for n, _ in want] and all(torch.equal(got[n], t) for n, t in want)


def test_full_weights_of_a_peft_model_travel_under_hf_names(peft_model):
    want = references(peft_model)["full"]
    got, report, _ = _push(PlainSource(peft_model, "full"))
    assert report is not None and report.kind == "full"
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert not any("base_layer" in n or "lora_" in n or n.startswith("base_model") for n in got)


def test_compile_and_checkpoint_wrappers_are_stripped(peft_model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_llama(seed=0)
    want = [n for n, _ in model.named_parameters()]
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    compiled = torch.compile(model)  # wraps only; nothing compiles until it is called
    assert any("_checkpoint_wrapped_module" in n for n, _ in compiled.named_parameters())
    assert [e.name for e in select(compiled, "full")] == want
    bf16 = PlainSource(compiled, "full", dtype=torch.bfloat16)
    assert {d for _, _, d in bf16.specs()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for _, t in bf16.tensors())


def test_names_follow_the_engines_conventions():
    lora_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert (
        engine_name(lora_a, "lora", True, "default") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    assert engine_name(lora_a, "full", True, "default") is None
    assert engine_name(lora_a, "lora", True, "other") is None  # another adapter's weights stay home
    base = "base_model.model._orig_mod.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert engine_name(base, "full", True, "default") == "model.layers.0.self_attn.q_proj.weight"
    assert engine_name(base, "lora", True, "default") is None
    with pytest.raises(ConversionError, match="DoRA"):
        engine_name("base_model.model.x.q_proj.lora_magnitude_vector.default.weight", "lora", True, "default")


def test_refusals_name_the_fix(peft_model):
    with pytest.raises(ConversionError, match="kind='full'"):
        PlainSource(tiny_llama(seed=0), "lora")
    with pytest.raises(ConversionError, match="no adapter 'nope'"):
        PlainSource(peft_model, "lora", adapter="nope")
    with pytest.raises(ConfigError, match="kind must be 'lora' or 'full'"):
        PlainSource(peft_model, "merged")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="appear twice"):
        EngineMap((0, 0))
    with pytest.raises(ConfigError, match="at least one sending rank"):
        EngineMap(())
    with pytest.raises(ConfigError, match="pick senders among them"):
        PlainSource(peft_model, "lora", engines=EngineMap((1,)))  # one process: rank 1 does not exist
    assert EngineMap.first_of([[4, 5], [0, 1]]) == EngineMap((4, 0))
    source = PlainSource(peft_model, "lora")
    with pytest.raises(ConfigError, match="got sender=None"):
        source.push(None)


def test_plain_lora_into_the_hf_engine_generates_what_peft_generates(hf_engine, tiny_model_dir):
    from colosync.engines.config import Generate
    from colosync.testing import greedy

    model = with_lora(tiny_llama(str(tiny_model_dir)), seed=4)
    base = PlainSource(model, "full")  # the engine may hold another test's weights: reset the base first
    lora = PlainSource(model, "lora")
    with Sender(hf_engine.connect(), transport="shm") as sender:
        base.push(sender)
        report = lora.push(sender)
    got = hf_engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
    assert report is not None and got.update_id == report.update_id
    assert got.tokens == greedy(model, PROMPTS, 8)[0]


def test_ddp_two_engines_each_get_the_payload_once_and_a_refusal_raises_everywhere():
    rank0, rank1 = shared_world(2).run(ddp_worker)
    for result in (rank0, rank1):
        for kind in ("lora", "full"):
            assert result[kind]["mismatched"] == [] and result[kind]["update_id"] == 1, (kind, result)
        assert result["plain_on_fsdp"] == "ConversionError"
    assert (rank0["after_failure"], rank1["after_failure"]) == ("StaleUpdateError", "PeerFailedError")
