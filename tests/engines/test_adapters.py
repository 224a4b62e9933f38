"""Several named adapters on one engine, each its own transaction (the hf engine, ``max_loras=3``).

A connection names its adapter (``engine.connect(adapter="policy")``); its Sender's updates are
that adapter's versions, with their own owner, verification and rollback, and a generation
names the adapter it wants (``Generate(adapter=...)``) and reports that adapter's version.
Every check compares the engine's tokens with PEFT's for the version the engine reports.
"""

from __future__ import annotations

import pytest

from colosync.engines.config import EngineConfig, Generate
from colosync.engines.process import EngineProcess
from colosync.errors import AdapterSlotsError, ConfigError, DeliveryError, EngineBusyError, ManifestError
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, greedy, load_model, random_lora
from colosync.wire.protocol import Probe, Stage, Status

PROMPTS = [[1, 5, 9, 13], [2, 7, 11, 3]]
NEW = 6


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lora_rank=16, max_loras=3)
    with EngineProcess(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def base_tokens(tiny_model_dir):
    return greedy(load_model(tiny_model_dir), PROMPTS, NEW)[0]


def served(engine, adapter: str = "") -> tuple[int, list[list[int]]]:
    gen = engine.call(Generate(PROMPTS, NEW, adapter=adapter))
    return gen.update_id, gen.tokens


def test_two_adapters_keep_their_own_versions_while_updated_in_turn(engine, tiny_model_dir, base_tokens):
    policy = random_lora(load_model(tiny_model_dir), rank=8, seed=1)
    ref = random_lora(load_model(tiny_model_dir), rank=4, seed=2)
    with (
        Sender(engine.connect("policy-trainer", adapter="policy"), transport="shm") as to_policy,
        Sender(engine.connect("ref-trainer", adapter="ref"), transport="shm") as to_ref,
    ):
        want: dict[str, tuple[int, list[list[int]]]] = {}
        for version in range(3):
            fill_lora(policy, 10 + version)
            want["policy"] = (to_policy.push_peft(policy).update_id, greedy(policy, PROMPTS, NEW)[0])
            assert {a: served(engine, a) for a in want} == want  # the other adapter untouched
            fill_lora(ref, 20 + version)
            want["ref"] = (to_ref.push_peft(ref).update_id, greedy(ref, PROMPTS, NEW)[0])
            assert {a: served(engine, a) for a in want} == want
        assert want["policy"][1] != want["ref"][1] != base_tokens, "the adapters must differ to prove anything"
        assert served(engine)[1] == base_tokens  # the default serves no adapter: the base model

        # one owner per adapter: a second sender for "policy" is refused; "ref" is not affected
        with (
            Sender(engine.connect("intruder", adapter="policy"), transport="shm") as intruder,
            pytest.raises(EngineBusyError, match="owned by"),
        ):
            intruder.push_peft(policy)
        fill_lora(ref, 30)
        want["ref"] = (to_ref.push_peft(ref).update_id, greedy(ref, PROMPTS, NEW)[0])
        assert {a: served(engine, a) for a in want} == want

        # a probe that fails rolls back that adapter alone
        fill_lora(policy, 40)
        good = Probe.from_model(policy, PROMPTS, max_new_tokens=4)
        lying = Probe(good.prompts, good.completions, [[lp - 1.0 for lp in row] for row in good.logprobs])
        with pytest.raises(DeliveryError):
            to_policy.push_peft(policy, verify=lying)
        assert {a: served(engine, a) for a in want} == want
        report = to_policy.push_peft(policy, verify=good)  # and a good one commits
        want["policy"] = (report.update_id, greedy(policy, PROMPTS, NEW)[0])
        assert {a: served(engine, a) for a in want} == want

        # a named adapter takes LoRA only
        with pytest.raises(ManifestError, match="takes LoRA updates only"):
            to_ref.push(list(load_model(tiny_model_dir).named_parameters())[:2])
        to_policy.drop_adapter()
        to_ref.drop_adapter()
    assert served(engine, "policy")[1] == served(engine, "ref")[1] == base_tokens


def test_slots_are_named_when_full_and_freed_by_a_drop(engine, tiny_model_dir):
    trainers = {name: random_lora(load_model(tiny_model_dir), rank=4, seed=i) for i, name in enumerate("abcd")}
    senders = {name: Sender(engine.connect(adapter=name), transport="shm") for name in "abcd"}
    try:
        ids = {name: senders[name].push_peft(trainers[name]).update_id for name in "abc"}
        with pytest.raises(AdapterSlotsError, match=rf"all 3 are held: a \(update {ids['a']}\), b .*, c "):
            senders["d"].push_peft(trainers["d"])
        assert engine.call(Status()).in_flight_update_id is None
        assert served(engine, "a")[1] == greedy(trainers["a"], PROMPTS, NEW)[0]  # nothing half-applied
        senders["b"].drop_adapter()
        senders["d"].push_peft(trainers["d"])
        assert served(engine, "d")[1] == greedy(trainers["d"], PROMPTS, NEW)[0]
    finally:
        for name, sender in senders.items():
            if name != "b":
                sender.drop_adapter()
            sender.close()


class ClosesAfter:
    """A link whose connection ends after two Stages, as a trainer's does when it dies mid-push."""

    def __init__(self, inner) -> None:
        self.inner, self.stages = inner, 0

    def submit(self, request):
        if isinstance(request, Stage):
            self.stages += 1
            if self.stages == 3:
                self.inner.close()
        return self.inner.submit(request)

    def close(self) -> None:
        self.inner.close()


def test_a_sender_gone_mid_push_leaves_every_adapter_serving(engine, tiny_model_dir):
    keep = random_lora(load_model(tiny_model_dir), rank=8, seed=5)
    other = random_lora(load_model(tiny_model_dir), rank=8, seed=6)
    with (
        Sender(engine.connect(adapter="steady"), transport="shm") as steady,
        Sender(engine.connect(adapter="flaky"), transport="shm", bucket_bytes=4 << 10) as flaky,
    ):
        steady.push_peft(keep)
        first = flaky.push_peft(other).update_id
        before = {a: served(engine, a) for a in ("steady", "flaky")}
        fill_lora(other, 7)
        gone = Sender(ClosesAfter(engine.connect(adapter="flaky")), transport="shm", bucket_bytes=4 << 10)
        flaky.close()  # its owner leaves; the next one takes "flaky" over and dies mid-push
        with pytest.raises(Exception):  # noqa: B017 - the connection's end, whatever error it surfaces as
            gone.push_peft(other)
        assert {a: served(engine, a) for a in ("steady", "flaky")} == before
        assert before["flaky"][0] == first
        steady.drop_adapter()
        with Sender(engine.connect(adapter="flaky"), transport="shm") as again:
            again.drop_adapter()


def test_an_engine_without_named_adapters_refuses_a_connection_that_names_one():
    with EngineProcess(EngineConfig(engine="store")) as store, pytest.raises(ConfigError, match="serves one adapter"):
        store.connect(adapter="policy")
