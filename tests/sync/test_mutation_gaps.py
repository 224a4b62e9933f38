"""Sender promises that the mutation run (benchmarks/mutation/) found no fast test holding.

``push_stream`` (what the Megatron and FSDP sources call) carries the LoRA spec, the requested
update id and the probe exactly as ``push`` does; an arena's buffer is one update, not one per
slot; an error that reaches the sender after its commit landed says that the engine committed.
"""

from __future__ import annotations

import math

import pytest
import torch

from colosync.engines.sink import SinkEngine
from colosync.errors import ConfigError, DeliveryError
from colosync.sync.link import LocalLink
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender
from colosync.sync.target import Changes
from colosync.wire.manifest import LoraSpec, align_up
from colosync.wire.protocol import Probe, Status


class RecordingSink(SinkEngine):
    """The sink engine, keeping every manifest it prepared (what the engine was told)."""

    def __init__(self) -> None:
        super().__init__()
        self.manifests = []

    def prepare(self, manifest, tensors):
        self.manifests.append(manifest)
        return super().prepare(manifest, tensors)


class MiscountingSink(SinkEngine):
    """A sink whose commit reports that it changed nothing of a full update (while ``miscount``), and cannot revert."""

    miscount = True

    def commit(self, prepared, update_id):
        super().commit(prepared, update_id)
        expected = len(prepared[2])
        return Changes(changed=0 if self.miscount else expected, expected=expected)


def local(engine):
    receiver = Receiver(engine, "cpu")
    return receiver, LocalLink(receiver)


def lora_named(rank=4):
    g = torch.Generator().manual_seed(3)
    module = "model.layers.0.self_attn.q_proj"
    return [
        (f"base_model.model.{module}.lora_A.weight", torch.randn(rank, 16, generator=g)),
        (f"base_model.model.{module}.lora_B.weight", torch.randn(16, rank, generator=g)),
    ]


def test_push_stream_sends_the_lora_spec_and_the_requested_update_id():
    engine = RecordingSink()
    receiver, link = local(engine)
    named = lora_named()
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",))
    specs = [(n, tuple(t.shape), t.dtype) for n, t in named]
    try:
        with Sender(link, transport="shm") as sender:
            report = sender.push_stream(specs, iter(named), lora=spec, update_id=41)
            assert report.update_id == 41 and report.kind == "lora"
            (manifest,) = engine.manifests
            assert manifest.update_id == 41 and manifest.kind == "lora" and manifest.lora == spec
            assert receiver.committed_update_id == 41
            for name, t in named:
                assert torch.equal(engine.tensors[name], t)
    finally:
        receiver.close()


def test_push_stream_hands_the_probe_to_the_engine(store_engine):
    """An engine that cannot score refuses a probe before installing anything, stream or not."""
    probe = Probe(prompts=[[1, 2]], completions=[[3]], logprobs=[[-0.5]])
    named = [("w", torch.randn(4, 4))]
    with Sender(store_engine.link, transport="shm") as sender:
        before = store_engine.link.submit(Status()).wait().committed_update_id
        with pytest.raises(ConfigError, match="cannot score a probe"):
            sender.push_stream([("w", (4, 4), torch.float32)], iter(named), verify=probe)
        assert store_engine.link.submit(Status()).wait().committed_update_id == before


def test_an_arena_holds_one_update_not_one_per_slot():
    engine = SinkEngine()
    receiver, link = local(engine)
    specs = [("w", (256, 64), torch.float32), ("b", (64,), torch.float32)]
    total = sum(align_up(math.prod(s) * d.itemsize) for _, s, d in specs)
    try:
        with Sender(link, transport="shm", slots=4) as sender:
            sender.arena(specs, "cpu")
            transport = sender.transport
            assert transport.num_slots == 1
            assert transport.slot_bytes * transport.num_slots < 2 * max(total, 8192)
    finally:
        receiver.close()


def test_an_error_after_the_commit_landed_says_the_engine_committed_and_a_good_update_serves_again():
    """A full update the engine miscounts fails closed *after* committing: the sender's error must say so;
    the next full update that verifies lifts the fail-closed state."""
    engine = MiscountingSink()
    receiver, link = local(engine)
    try:
        with Sender(link, transport="shm") as sender:
            with pytest.raises(DeliveryError) as info:
                sender.push([("w", torch.randn(8))])
            uid = receiver.committed_update_id
            assert not receiver.serving and not link.submit(Status()).wait().serving  # what a Status caller sees
            assert any(f"engine did commit update {uid}" in note for note in getattr(info.value, "__notes__", []))
            # a good full update replaces what failed closed: the engine serves again
            engine.miscount = False
            report = sender.push([("w", torch.randn(8))])
            assert receiver.committed_update_id == report.update_id > uid
            assert receiver.serving and link.submit(Status()).wait().serving
    finally:
        receiver.close()


def test_tied_weights_are_found_so_an_update_of_one_name_reaches_both():
    """A model whose head shares the embedding's tensor reports the alias (engines untie through it)."""
    from colosync.sync.target import tied_parameters

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    assert tied_parameters(Tied()) == {"head.weight": "embed.weight"}
    assert tied_parameters(torch.nn.Linear(3, 3)) == {}


def test_a_second_peft_adapter_travels_with_its_own_spec_and_weights(tiny_model_dir):
    """``push_peft(model, adapter)``: the named adapter's rank, rslora, layers and weights, not the default's."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from colosync.demo.models import load_model
    from colosync.sync.sender import peft_lora_spec, peft_lora_tensors

    torch.manual_seed(0)
    model = get_peft_model(load_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    second = LoraConfig(
        r=2, lora_alpha=6, target_modules=["v_proj", "k_proj"], use_rslora=True, layers_to_transform=[1, 0]
    )
    model.add_adapter("second", second)
    spec = peft_lora_spec(model, "second")
    assert (spec.rank, spec.alpha, spec.target_modules) == (2, 6.0, ("k_proj", "v_proj"))
    assert spec.use_rslora and spec.layers == (0, 1)
    default = peft_lora_spec(model)
    assert (default.rank, default.use_rslora, default.layers) == (4, False, None)
    names = [n for n, _ in peft_lora_tensors(model, "second")]
    assert names and all(("k_proj" in n or "v_proj" in n) and "q_proj" not in n for n in names)
    assert {t.shape[0] for n, t in peft_lora_tensors(model, "second") if "lora_A" in n} == {2}


class TiedSink(SinkEngine):
    """A sink whose model ties ``head.weight`` to ``embed.weight`` (one tensor, two names)."""

    def model_spec(self):
        from colosync.sync.target import ModelSpec

        return ModelSpec(params=None, lora_modules=None, tied={"head.weight": "embed.weight"})


def test_a_tied_alias_is_checked_against_its_tie_and_then_dropped():
    from colosync.errors import TiedWeightError

    engine = TiedSink()
    receiver, link = local(engine)
    embed = torch.randn(10, 4)
    try:
        with Sender(link, transport="shm") as sender:
            report = sender.push([("embed.weight", embed), ("head.weight", embed.clone())])
            assert list(engine.tensors) == ["embed.weight"] and torch.equal(engine.tensors["embed.weight"], embed)
            with pytest.raises(TiedWeightError, match=r"update \d+: 'head.weight' differs from 'embed.weight'"):
                sender.push([("embed.weight", embed), ("head.weight", embed + 1)])
            assert receiver.committed_update_id == report.update_id
    finally:
        receiver.close()


def test_status_names_the_update_in_flight_until_it_ends():
    """A second process asking ``Status`` mid-update learns which update is in flight, and none after commit."""
    from colosync.engines.store import StoreEngine
    from colosync.transports.shm import ShmSender
    from colosync.wire.bucket import fingerprint, plan_buckets
    from colosync.wire.manifest import UpdateManifest
    from colosync.wire.protocol import Attach, Begin, Commit, Prepare, Stage
    from tests.helpers import pack_into

    receiver = Receiver(StoreEngine(), "cpu")
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    try:
        receiver.handle(Attach("shm", transport.handle()))
        transport.attached()
        named = [("a", torch.arange(6.0))]
        m = UpdateManifest(5, "full", plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 16))
        receiver.handle(Begin(m))
        assert receiver.handle(Status()).in_flight_update_id == 5
        slot = transport.slot(0)[: m.bucket_sizes[0]]
        pack_into(slot, m.tensors, [t for _, t in named])
        receiver.handle(Stage(5, 0, 0, m.bucket_sizes[0], 0, fingerprint(slot)))
        receiver.handle(Prepare(5))
        assert receiver.handle(Status()).in_flight_update_id == 5
        ack = receiver.handle(Commit(5))
        assert (ack.committed_update_id, ack.in_flight_update_id) == (5, None)
        assert receiver.handle(Status()).in_flight_update_id is None
    finally:
        receiver.close()
        transport.close()


def test_a_reports_phase_seconds_add_up_over_every_bucket():
    """``SyncReport.seconds[phase]`` is the time spent in that phase over the whole update, not its last bucket."""
    import time

    from colosync.sync.pipeline import PhaseTimer

    timer = PhaseTimer()
    timer.add("pack", time.perf_counter() - 1.0)  # one bucket spent a second packing
    timer.add("pack", time.perf_counter() - 2.0)  # the next, two
    assert timer.seconds["pack"] >= 3.0
