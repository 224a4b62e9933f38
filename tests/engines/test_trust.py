"""Commits you can trust, on the hf engine in its own process.

Whole-adapter semantics (an empty or partial LoRA is refused with what is missing), proof of
delivery (a probe scored by the engine before it serves; a LoRA that does not match is rolled
back, a full update that does not match fails closed), tied embeddings (a ``state_dict()``
with ``lm_head.weight`` is accepted when it equals its tie), one owner per engine, and a
Sender that resynchronises a stale id once.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from colosync.engines.config import Generate, Score
from colosync.engines.host import EngineHost
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.engines.store import StoreEngine
from colosync.errors import (
    DeliveryError,
    EngineBusyError,
    FailedClosedError,
    IncompleteUpdateError,
    TiedWeightError,
    UnknownTensorError,
)
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors
from colosync.sync.transaction import Session
from colosync.testing import fill_lora, greedy, load_model, make_tiny_qwen2, random_lora, score
from colosync.wire.bucket import plan_buckets
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Abort, Begin, Probe, Status

PROMPTS = [[1, 17, 33, 250], [1, 99, 4]]
NEW = 6


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lora_rank=16))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def sender(engine):
    with Sender(engine.connect("trainer"), transport="shm") as s:
        yield s


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return random_lora(load_model(tiny_model_dir), rank=8, alpha=16, seed=3)


def probe_of(model, tolerance: float = 1e-4, shift: float = 0.0) -> Probe:
    completions = greedy(model, PROMPTS, NEW)[0]
    logprobs = [[lp + shift for lp in row] for row in score(model, PROMPTS, completions)]
    return Probe(PROMPTS, completions, logprobs, tolerance)


def served(engine) -> tuple[int, list[list[int]]]:
    gen = engine.call(Generate(PROMPTS, NEW))
    return gen.update_id, gen.tokens


# -- whole-update semantics -----------------------------------------------------------------
def test_an_empty_lora_update_is_refused(engine, sender, trainer):
    sender.push_peft(trainer)
    before = served(engine)
    with pytest.raises(IncompleteUpdateError, match="empty LoRA update would leave the engine with no adapter"):
        sender.push([], lora=peft_lora_spec(trainer))
    assert served(engine) == before


def test_a_lora_missing_modules_of_its_targets_is_refused_with_the_list(engine, sender, trainer):
    before = served(engine)
    named = peft_lora_tensors(trainer)
    one_pair = [(n, t) for n, t in named if ".layers.0.self_attn.q_proj." in n]
    assert len(one_pair) == 2 and len(named) == 28  # 14 modules, 2 halves each
    with pytest.raises(IncompleteUpdateError) as info:
        sender.push(one_pair, lora=peft_lora_spec(trainer))
    message = str(info.value)
    assert "sends 1 of the 14 modules" in message and "missing 13" in message
    assert "model.layers.0.self_attn.k_proj" in message and "replaces the whole adapter" in message
    assert served(engine) == before


def test_a_peft_models_wrapped_names_are_refused_with_what_to_push(engine, sender, trainer):
    before = served(engine)
    wrapped = [(n, p) for n, p in trainer.named_parameters() if "lora_" not in n]
    assert any(".base_layer." in n for n, _ in wrapped)
    with pytest.raises(
        UnknownTensorError,
        match=r"PEFT wrapper's name for 'model\..*merge_and_unload\(\)\.named_parameters\(\).*adapters='drop'",
    ):
        sender.push(wrapped)
    assert served(engine) == before


# -- proof of delivery ----------------------------------------------------------------------
def test_a_verified_lora_push_reports_its_deviation_and_what_changed(engine, sender, trainer):
    fill_lora(trainer, 21)
    report = sender.push_peft(trainer, verify=probe_of(trainer))
    assert report.delivery is not None and report.delivery.max_deviation <= 1e-5
    assert report.delivery.changed == report.delivery.expected == 14
    assert report.seconds["verify"] > 0
    assert served(engine) == (report.update_id, greedy(trainer, PROMPTS, NEW)[0])


def test_a_lora_that_does_not_verify_is_rolled_back(engine, sender, trainer):
    fill_lora(trainer, 22)
    good = sender.push_peft(trainer)
    before = served(engine)
    fill_lora(trainer, 23)
    lying = probe_of(trainer, shift=0.5)  # the trainer claims logprobs the engine cannot reproduce
    with pytest.raises(DeliveryError) as info:
        sender.push_peft(trainer, verify=lying)
    assert "max |engine - trainer logprob| 0.5" in str(info.value)
    assert f"rolled back to update {good.update_id}" in str(info.value)
    assert served(engine) == before
    assert engine.call(Status()).committed_update_id == good.update_id


def test_a_full_update_that_does_not_verify_fails_closed_until_a_good_one(tiny_model_dir):
    engine = EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir)))  # no adapter: base weights only
    sender = Sender(engine.connect("trainer"), transport="shm")
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    named = list(model.named_parameters())
    with pytest.raises(DeliveryError, match="fails closed"):
        sender.push(named, verify=probe_of(model, shift=-0.5))
    with pytest.raises(FailedClosedError, match="push a good update"):
        engine.call(Generate(PROMPTS, NEW))
    assert not engine.call(Status()).serving
    report = sender.push(named, verify=probe_of(model))
    assert report.delivery.max_deviation <= 1e-5 and engine.call(Status()).serving
    assert served(engine)[1] == greedy(model, PROMPTS, NEW)[0]
    sender.close()
    engine.close()


# -- tied embeddings ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = make_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "tied", seed=4)
    eng = EngineProcess(EngineConfig(engine="hf", model_dir=str(path)))
    yield eng, path
    eng.close()


def test_a_tied_state_dict_is_accepted_when_lm_head_equals_its_tie(tied):
    eng, path = tied
    model = load_model(path)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.1)
    state = model.state_dict()
    assert (
        "lm_head.weight" in state
        and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    )
    with Sender(eng.connect(), transport="shm") as sender:
        sender.push(list(state.items()))
        completions = greedy(model, PROMPTS, NEW)[0]
        got = eng.call(Score(PROMPTS, completions)).logprobs
        want = score(model, PROMPTS, completions)
        assert max(abs(a - b) for xs, ys in zip(got, want, strict=False) for a, b in zip(xs, ys, strict=False)) <= 1e-5
        state["lm_head.weight"] = state["lm_head.weight"] * 2  # no longer its tie
        with pytest.raises(TiedWeightError, match="differs from 'model.embed_tokens.weight'.*ties them"):
            sender.push(list(state.items()))
        with pytest.raises(TiedWeightError, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
            sender.push([("lm_head.weight", state["lm_head.weight"])])


# -- ownership and ids ----------------------------------------------------------------------
def test_a_second_sender_is_refused_with_the_owner_named(engine, sender, trainer):
    sender.push_peft(trainer)
    with pytest.raises(EngineBusyError, match=r"owned by another sender: pid \d+.*\(trainer\).*takeover=True"):
        Sender(engine.connect("intruder"), transport="shm").push_peft(trainer)


def test_an_owner_whose_process_died_is_released_by_the_clock():
    """The pid check, alone: a session whose process has exited loses the engine at the next tick."""
    host = EngineHost(Receiver(StoreEngine()))
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = host.open_session()
    owner.pid = dead.pid
    host.transaction.owner = owner
    layout = plan_buckets([("w", (4,), torch.float32)], 1 << 16)
    host.handle(Begin(UpdateManifest(1, "full", layout)), owner)
    assert host.transaction.status().in_flight_update_id == 1
    host.tick()
    assert host.transaction.owner is None and host.transaction.status().in_flight_update_id is None
    assert isinstance(Session(9, pid=dead.pid), Session) and not Session(9, pid=dead.pid).alive()


def test_a_stale_sender_resynchronises_once(engine, sender, trainer):
    sender.push_peft(trainer)
    cached = sender._next_id
    link = sender.link
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in peft_lora_tensors(trainer)], 1 << 20)
    for uid in range(cached, cached + 3):  # ids this Sender has not seen begin and end
        link.submit(Begin(UpdateManifest(uid, "lora", layout, peft_lora_spec(trainer)))).wait()
        link.submit(Abort(uid, "test")).wait()
    report = sender.push_peft(trainer)
    assert report.update_id == cached + 3


def test_probe_from_model_records_what_the_engine_scores(tiny_model_dir):
    from colosync.errors import ManifestError

    model = random_lora(load_model(tiny_model_dir), seed=4)
    model.train()
    probe = Probe.from_model(model, [[1, 5, 9], [1, 7]], max_new_tokens=5, tolerance=1e-4)
    assert model.training, "from_model must hand the model back in the mode it found it"
    assert [len(c) for c in probe.completions] == [5, 5] and probe.tolerance == 1e-4
    model.eval()
    scored = score(model, probe.prompts, probe.completions)
    assert (
        max(abs(a - b) for xs, ys in zip(scored, probe.logprobs, strict=True) for a, b in zip(xs, ys, strict=True))
        <= 1e-5
    )
    with pytest.raises(ManifestError, match="max_new_tokens must be >= 1"):
        Probe.from_model(model, [[1, 5]], max_new_tokens=0)
