"""The hf reference engine: exact parity with PEFT after pushes, and rejections that change nothing.

Every rejection test sends a bad update to the real engine process and then checks the
engine still serves the previous version: the same update id and the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from colosync.engines.hf import Generate
from colosync.errors import (
    DtypeError,
    FingerprintMismatchError,
    NonFiniteError,
    RankError,
    ShapeMismatchError,
    StaleUpdateError,
    TransactionStateError,
    UnknownTensorError,
)
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors
from colosync.testing import fill_lora, greedy, load_model, random_lora, score
from colosync.wire.bucket import fingerprint, plan_buckets
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Begin, Commit, Stage

PROMPTS = [[1, 17, 33, 250], [1, 99, 4], [1, 500, 501, 502, 7]]
NEW = 10


@pytest.fixture(scope="module")
def sender(hf_engine):
    with Sender(hf_engine.connect(), transport="shm", bucket_bytes=16 << 10) as s:
        yield s


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return random_lora(load_model(tiny_model_dir), rank=8, alpha=16, seed=1)


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b, strict=False) for x, y in zip(xs, ys, strict=False))


def test_lora_push_matches_peft_exactly(hf_engine, sender, trainer):
    for seed in (11, 12):
        fill_lora(trainer, seed)
        report = sender.push_peft(trainer)
        ref_tokens, ref_logprobs = greedy(trainer, PROMPTS, NEW)
        gen = hf_engine.call(Generate(PROMPTS, NEW))
        assert gen.update_id == report.update_id
        assert gen.tokens == ref_tokens
        assert max_diff(gen.logprobs, ref_logprobs) <= 1e-5
    with trainer.disable_adapter():
        base_tokens, _ = greedy(trainer, PROMPTS, NEW)
    assert gen.tokens != base_tokens, "the adapter must visibly change the output for this test to mean anything"


def test_full_weight_push_matches_reference(hf_engine, sender, tiny_model_dir):
    model = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    sender.push(model.named_parameters())
    # The engine may still hold the last LoRA; score the full update through a fresh, unwrapped push.
    fresh = random_lora(model, rank=8, seed=3)
    sender.push_peft(fresh)
    ref_tokens, ref_logprobs = greedy(fresh, PROMPTS, NEW)
    gen = hf_engine.call(Generate(PROMPTS, NEW))
    assert gen.tokens == ref_tokens and max_diff(gen.logprobs, ref_logprobs) <= 1e-5
    from colosync.engines.hf import Score

    probe = hf_engine.call(Score(PROMPTS, ref_tokens))
    assert max_diff(probe.logprobs, score(fresh, PROMPTS, ref_tokens)) <= 1e-5


@pytest.fixture
def served(hf_engine, sender, trainer):
    """Push a known adapter and return (update_id, generation) it serves."""
    fill_lora(trainer, 21)
    sender.push_peft(trainer)
    gen = hf_engine.call(Generate(PROMPTS, NEW))
    yield gen
    after = hf_engine.call(Generate(PROMPTS, NEW))
    assert (after.update_id, after.tokens, after.logprobs) == (gen.update_id, gen.tokens, gen.logprobs), (
        "a rejected update changed what the engine serves"
    )


def lora_with(trainer, edit):
    named = dict(peft_lora_tensors(trainer))
    edit(named)
    return list(named.items())


A = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
B = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


@pytest.mark.parametrize(
    "edit, spec_edit, error, needles",
    [
        (
            lambda n: n.__setitem__(
                "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", torch.zeros(8, 128)
            ),
            None,
            UnknownTensorError,
            ["layers.7.self_attn.q_proj", "no LoRA-capable module", "check the name"],
        ),
        (lambda n: n.__setitem__(B, torch.zeros(128, 9)), None, ShapeMismatchError, [B, "expected [128, 8]", "rank"]),
        (lambda n: n.__setitem__(A, n[A].to(torch.int32)), None, DtypeError, [A, "int32", "floating-point"]),
        (lambda n: n[B].view(-1).__setitem__(3, float("nan")), None, NonFiniteError, [B, "NaN", "reject_nonfinite"]),
        (lambda n: None, {"rank": 32}, RankError, ["rank 32", "max_lora_rank=16", "restart the engine"]),
        (lambda n: n.__delitem__(A), None, UnknownTensorError, ["k_proj", "no lora_A", "send both"]),
        (lambda n: None, {"target_modules": ("q_proj",)}, UnknownTensorError, ["not among", "target_modules"]),
    ],
    ids=["unknown-module", "bad-shape", "int-dtype", "nan", "rank-over-max", "half-missing", "untargeted"],
)
def test_bad_updates_are_rejected_and_change_nothing(sender, trainer, served, edit, spec_edit, error, needles):
    import msgspec

    named = lora_with(trainer, edit)
    spec = peft_lora_spec(trainer)
    if spec_edit:
        spec = msgspec.structs.replace(spec, **spec_edit)
        if "rank" in spec_edit:
            named = [
                (n, torch.zeros(spec.rank, t.shape[1]) if ".lora_A." in n else torch.zeros(t.shape[0], spec.rank))
                for n, t in named
            ]
    with pytest.raises(error) as info:
        sender.push(named, lora=spec)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} missing from: {info.value}"


def test_stale_update_id_is_rejected(sender, trainer, served):
    with pytest.raises(StaleUpdateError, match=f"not newer than the committed update {served.update_id}"):
        sender.push(peft_lora_tensors(trainer), lora=peft_lora_spec(trainer), update_id=served.update_id)


def test_corrupted_bytes_fail_the_fingerprint(hf_engine, sender, trainer, served):
    """Drive the protocol by hand: announce one fingerprint, deliver different bytes."""
    named = peft_lora_tensors(trainer)
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], sender.bucket_bytes)
    sizes = layout.bucket_sizes
    uid = served.update_id + 1
    link = sender.link
    link.submit(Begin(UpdateManifest(uid, "lora", layout, peft_lora_spec(trainer)))).wait()
    slot = sender._transport.slot(0)
    slot[: sizes[0]].random_(0, 255)
    wrong = fingerprint(slot[: sizes[0]]) + 1
    with pytest.raises(FingerprintMismatchError, match="bytes changed in transit"):
        link.submit(Stage(uid, 0, 0, sizes[0], 0, wrong)).wait()
    with pytest.raises(TransactionStateError, match="was aborted"):
        link.submit(Commit(uid)).wait()


def test_an_empty_update_commits_and_changes_nothing(hf_engine, sender, trainer):
    """An empty push attaches the transport before a measured window; it must commit, and with
    ``adapters="keep"`` it leaves the served adapter alone (the default drops it: test_adapters)."""
    fill_lora(trainer, 21)
    sender.push_peft(trainer)
    before = hf_engine.call(Generate(PROMPTS, NEW))
    report = sender.push([], adapters="keep")
    assert report.tensors == 0 and report.update_id > 0
    assert hf_engine.call(Generate(PROMPTS, NEW)).tokens == before.tokens


def test_a_rollback_leaves_no_peft_warning_for_the_user(tiny_model_dir, recwarn):
    """PEFT warns when the adapter it last activated is deleted, which a rollback does; the engine
    activates the served adapter per request, so the warning says nothing to its user."""
    import warnings

    from colosync.control.link import LocalLink
    from colosync.engines.hf import HFEngine
    from colosync.sync.receiver import ReceiverPolicy

    engine = HFEngine(load_model(tiny_model_dir), max_lora_rank=16)
    receiver = engine.transaction(ReceiverPolicy()).applies
    warnings.simplefilter("always")
    with Sender(LocalLink(receiver), transport="shm") as local:
        first = local.push_peft(random_lora(load_model(tiny_model_dir), seed=1)).update_id
        second = local.push_peft(random_lora(load_model(tiny_model_dir), seed=2)).update_id
        assert engine.handle(Generate(PROMPTS, 2)).update_id == second  # PEFT's active adapter is now this one
        ack = receiver.revert(second, "a probe failed")
        assert ack.committed_update_id == first and ack.adapter == first
        third = local.push_peft(random_lora(load_model(tiny_model_dir), seed=3)).update_id
        assert set(engine._peft.peft_config) == {f"u{first}", f"u{third}"}, "the served one and the one to revert to"
        local.drop_adapter()  # keeps the adapter it dropped, to revert to
        fifth = local.push_peft(random_lora(load_model(tiny_model_dir), seed=4)).update_id  # nothing served before it
        assert set(engine._peft.peft_config) == {f"u{fifth}"}, f"adapters leak: {sorted(engine._peft.peft_config)}"
    receiver.close()
    leaked = [str(w.message) for w in recwarn if "adapter" in str(w.message).lower()]
    assert not leaked, leaked
