"""An update that ends after ``prepare`` hands its prepared state back to the engine (``discard``).

Without it a prepared-but-never-committed update stays in the engine: for the hf engine, a
PEFT adapter ``u<id>`` beside the served one, for every abort, forever.
"""

from __future__ import annotations

import torch

from colosync.control.link import LocalLink
from colosync.engines.hf import HFEngine
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors
from colosync.sync.target import EngineTarget, ModelSpec
from colosync.testing import load_model, random_lora
from colosync.transports.shm import ShmSender
from colosync.wire.bucket import fingerprint, plan_buckets
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Abort, Attach, Begin, Prepare, Stage
from tests.helpers import pack_into


class Recording(EngineTarget):
    def __init__(self) -> None:
        self.discarded: list[object] = []

    def model_spec(self) -> ModelSpec:
        return ModelSpec(params=None, lora_modules=None)

    def prepare(self, manifest, tensors):
        return ("prepared", manifest.update_id)

    def commit(self, prepared, update_id):
        return None

    def discard(self, prepared) -> None:
        self.discarded.append(prepared)


def prepared_update(receiver: Receiver, transport: ShmSender, uid: int) -> None:
    named = [("w", torch.arange(8.0))]
    manifest = UpdateManifest(uid, "full", plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 16))
    receiver.handle(Begin(manifest))
    slot = transport.slot(0)[: manifest.bucket_sizes[0]]
    pack_into(slot, manifest.tensors, [t for _, t in named])
    receiver.handle(Stage(uid, 0, 0, manifest.bucket_sizes[0], 0, fingerprint(slot)))
    receiver.handle(Prepare(uid))


def test_abort_and_supersede_after_prepare_discard_what_was_prepared():
    target = Recording()
    receiver = Receiver(target)
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    try:
        receiver.handle(Attach("shm", transport.handle()))
        transport.attached()
        prepared_update(receiver, transport, 1)
        receiver.handle(Abort(1, "trainer gave up"))
        assert target.discarded == [("prepared", 1)]
        prepared_update(receiver, transport, 2)
        prepared_update(receiver, transport, 3)  # supersedes update 2 after its prepare
        assert target.discarded == [("prepared", 1), ("prepared", 2)]
        assert receiver.in_flight == 3
    finally:
        receiver.close()
        transport.close()
    assert target.discarded[-1] == ("prepared", 3)  # closing with an update in flight discards it too


def test_the_hf_engine_keeps_no_adapter_of_an_update_aborted_after_prepare(tiny_model_dir):
    engine = HFEngine(load_model(tiny_model_dir))
    receiver = Receiver(engine)
    trainer = random_lora(load_model(tiny_model_dir), seed=5)
    with Sender(LocalLink(receiver), transport="shm") as sender:
        served = sender.push_peft(trainer)
        named = peft_lora_tensors(trainer)
        uid = served.update_id + 1
        layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], sender.bucket_bytes)
        link = sender.link
        link.submit(Begin(UpdateManifest(uid, "lora", layout, peft_lora_spec(trainer)))).wait()
        for b, size in enumerate(layout.bucket_sizes):
            slot = sender.transport.slot(0)[:size]
            pack_into(slot, layout.bucket_tensors(b), [dict(named)[m.name] for m in layout.bucket_tensors(b)])
            link.submit(Stage(uid, b, 0, size, 0, fingerprint(slot))).wait()
        link.submit(Prepare(uid)).wait()
        assert f"u{uid}" in engine._peft.peft_config  # prepared beside the served adapter
        link.submit(Abort(uid, "trainer gave up")).wait()
    assert f"u{uid}" not in engine._peft.peft_config
    assert engine._lanes[""].served == f"u{served.update_id}"
    receiver.close()
