"""The Receiver's state machine in one process: ordering, timeouts, superseding, freeing."""

from __future__ import annotations

import time

import pytest
import torch

from colosync.control.link import LocalLink
from colosync.engines.store import StoreEngine
from colosync.errors import (
    ManifestError,
    StaleUpdateError,
    TransactionStateError,
    TransportError,
    UnknownTensorError,
    UpdateTimeoutError,
)
from colosync.sync.receiver import Receiver, ReceiverPolicy
from colosync.sync.sender import Sender
from colosync.transports.shm import ShmSender
from colosync.wire.bucket import fingerprint, plan_buckets
from colosync.wire.manifest import LoraSpec, UpdateManifest
from colosync.wire.protocol import Abort, Attach, Begin, Commit, Prepare, Stage
from tests.helpers import pack_into


@pytest.fixture
def rig():
    store = StoreEngine()
    receiver = Receiver(store, "cpu", ReceiverPolicy(timeout_s=5.0))
    transport = ShmSender(1 << 16, 2, torch.device("cpu"))
    receiver.handle(Attach("shm", transport.handle()))  # the Receiver itself: no owner in front of it
    transport.attached()
    yield store, receiver, transport
    receiver.close()
    transport.close()


def manifest(uid: int, named) -> UpdateManifest:
    return UpdateManifest(uid, "full", plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 16))


def stage_all(receiver, transport, m, named):
    slot = transport.slot(0)[: m.bucket_sizes[0]]
    pack_into(slot, m.tensors, [t for _, t in named])
    receiver.handle(Stage(m.update_id, 0, 0, m.bucket_sizes[0], 0, fingerprint(slot)))


NAMED = [("a", torch.arange(6.0)), ("b", torch.ones(3, dtype=torch.bfloat16))]


def begin_and_stage(receiver, transport, uid: int = 1, named=NAMED) -> UpdateManifest:
    m = manifest(uid, named)
    receiver.handle(Begin(m))
    stage_all(receiver, transport, m, named)
    return m


def test_full_cycle_then_state_is_clean(rig):
    store, receiver, transport = rig
    begin_and_stage(receiver, transport)
    receiver.handle(Prepare(1))
    assert store.tensors == {}  # prepared is not served
    ack = receiver.handle(Commit(1))
    assert ack.committed_update_id == 1 and ack.in_flight_update_id is None
    assert torch.equal(store.tensors["a"], NAMED[0][1])


def test_out_of_order_steps_are_refused(rig):
    _, receiver, transport = rig
    with pytest.raises(TransactionStateError, match="send Begin first"):
        receiver.handle(Prepare(1))
    m = manifest(1, NAMED)
    receiver.handle(Begin(m))
    with pytest.raises(TransactionStateError, match="commit before prepare"):
        receiver.handle(Commit(1))
    with pytest.raises(ManifestError, match="chunks must arrive in order"):
        receiver.handle(Stage(1, 0, 64, 64, 0, None))
    with pytest.raises(TransactionStateError, match=r"prepare before buckets \[0\] arrived"):
        receiver.handle(Prepare(1))
    assert receiver.in_flight is None  # a failed prepare ends the update


def test_repeated_and_stale_ids(rig):
    _, receiver, transport = rig
    m = manifest(3, NAMED)
    receiver.handle(Begin(m))
    with pytest.raises(StaleUpdateError, match="repeats or precedes the in-flight update 3"):
        receiver.handle(Begin(m))
    stage_all(receiver, transport, m, NAMED)
    receiver.handle(Prepare(3))
    receiver.handle(Commit(3))
    with pytest.raises(StaleUpdateError, match="not newer than the committed update 3"):
        receiver.handle(Begin(manifest(2, NAMED)))


def test_newer_update_supersedes_an_abandoned_one(rig):
    store, receiver, transport = rig
    receiver.handle(Begin(manifest(1, NAMED)))
    m2 = manifest(2, NAMED)
    receiver.handle(Begin(m2))
    with pytest.raises(TransactionStateError, match="update 1 was aborted \\(superseded by update 2\\)"):
        receiver.handle(Prepare(1))
    stage_all(receiver, transport, m2, NAMED)
    receiver.handle(Prepare(2))
    receiver.handle(Commit(2))
    assert receiver.committed_update_id == 2


def test_silent_sender_times_out_and_frees(rig):
    store, receiver, transport = rig
    m = manifest(1, NAMED)
    receiver.handle(Begin(m))
    stage_all(receiver, transport, m, NAMED)
    tx = receiver._inflight.landing
    assert tx.buffers and tx.tensors
    receiver.check_timeout(now=time.monotonic() + 6.0)
    assert receiver.in_flight is None and not tx.buffers and not tx.tensors
    with pytest.raises(UpdateTimeoutError, match="sender was silent"):
        receiver.handle(Prepare(1))
    assert store.tensors == {} and receiver.committed_update_id == 0


def test_abort_discards_a_prepared_update_and_is_idempotent(rig):
    store, receiver, transport = rig
    begin_and_stage(receiver, transport)
    receiver.handle(Prepare(1))
    receiver.handle(Abort(1, "changed my mind"))
    receiver.handle(Abort(1, "again"))
    receiver.handle(Abort(99))
    assert receiver.in_flight is None and store.tensors == {}


def test_sender_aborts_when_its_source_fails(rig):
    store, receiver, _ = rig

    def broken():
        yield "a", NAMED[0][1]
        raise RuntimeError("trainer crashed while gathering")

    receiver.detach()  # the rig's hand-attached transport makes way for a Sender
    with Sender(LocalLink(receiver), transport="shm") as sender, pytest.raises(RuntimeError, match="gathering"):
        sender.push_stream([(n, tuple(t.shape), t.dtype) for n, t in NAMED], broken())
    assert receiver.in_flight is None and receiver.committed_update_id == 0 and store.tensors == {}


def test_an_invalid_begin_leaves_the_update_in_flight_alone(rig):
    _, receiver, transport = rig
    m = manifest(1, NAMED)
    receiver.handle(Begin(m))
    bad = UpdateManifest(2, "lora", m.layout, LoraSpec(4, 8.0, ("q_proj",)))
    with pytest.raises(UnknownTensorError):
        receiver.handle(Begin(bad))
    assert receiver.in_flight == 1
    stage_all(receiver, transport, m, NAMED)
    receiver.handle(Prepare(1))
    assert receiver.handle(Commit(1)).committed_update_id == 1


def test_ids_of_aborted_updates_are_never_reused(rig):
    _, receiver, transport = rig
    receiver.handle(Begin(manifest(7, NAMED)))
    ack = receiver.handle(Abort(7))
    assert ack.highest_update_id == 7 and ack.next_update_id() == 8
    for uid in (7, 3):
        with pytest.raises(StaleUpdateError, match="ids are never reused"):
            receiver.handle(Begin(manifest(uid, NAMED)))
    receiver.handle(Begin(manifest(8, NAMED)))


def test_a_restarted_sender_does_not_join_an_abandoned_update(rig):
    store, receiver, transport = rig
    m = manifest(1, NAMED)
    receiver.handle(Begin(m))  # a sender that began, staged and vanished (no disconnect signal here)
    stage_all(receiver, transport, m, [(n, torch.zeros_like(t)) for n, t in NAMED])
    sevens = [(n, torch.full_like(t, 7)) for n, t in NAMED]
    receiver.detach()  # the rig's hand-attached transport makes way for a Sender
    with Sender(LocalLink(receiver), transport="shm") as sender:
        report = sender.push(sevens)
    assert report.update_id == 2 and receiver.committed_update_id == 2
    assert all(torch.equal(store.tensors[n], t) for n, t in sevens)


def test_stage_is_refused_past_a_complete_bucket_or_a_slot(rig):
    _, receiver, transport = rig
    m = manifest(1, NAMED)
    receiver.handle(Begin(m))
    with pytest.raises(ManifestError, match="exceeds transport slot"):
        receiver.handle(Stage(1, 0, 0, transport.slot_bytes + 64, 0, None))
    receiver.handle(Begin(m2 := manifest(2, NAMED)))
    stage_all(receiver, transport, m2, NAMED)
    with pytest.raises(ManifestError, match="already complete"):
        receiver.handle(Stage(2, 0, m2.bucket_sizes[0], 0, 0, None))


def test_an_arena_sender_refuses_to_overwrite_its_arena(rig):
    _, receiver, _ = rig
    receiver.detach()  # the rig's hand-attached transport makes way for a Sender
    with Sender(LocalLink(receiver), transport="shm") as sender:
        [a] = sender.arena([("a", (4,), torch.float32)], "cpu")
        a.fill_(1.0)
        with pytest.raises(TransportError, match="arena"):
            sender.push([("other", torch.full((8,), 9.0))])
        assert torch.equal(a, torch.ones(4))
        sender.push([("a", a)])


# -- Status mid-update, messages for updates not in flight, failed-closed and miscounted commits -----


def _attached_receiver(engine):
    """A CPU Receiver for ``engine`` with a one-slot ``shm`` transport attached by hand: ``(receiver, transport)``."""
    receiver = Receiver(engine, "cpu")
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    receiver.handle(Attach("shm", transport.handle()))
    transport.attached()
    return receiver, transport


def test_status_names_the_update_in_flight_until_it_ends():
    """A second process asking ``Status`` mid-update learns which update is in flight, and none after commit."""
    from colosync.wire.protocol import Status

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


def test_an_empty_bucket_is_complete_only_once_its_stage_came():
    """A bucket of 0 bytes still needs its Stage: that is when its tensors reach the engine (a prepare
    without it would commit an update missing them)."""
    engine = StoreEngine()
    receiver, transport = _attached_receiver(engine)
    try:
        layout = plan_buckets([("e", (0,), torch.float32)], 1 << 16)
        receiver.handle(Begin(UpdateManifest(5, "full", layout)))
        with pytest.raises(TransactionStateError, match=r"prepare before buckets \[0\] arrived"):
            receiver.handle(Prepare(5))
        receiver.handle(Begin(UpdateManifest(6, "full", layout)))
        receiver.handle(Stage(6, 0, 0, 0, 0, 0))
        receiver.handle(Prepare(6))
        receiver.handle(Commit(6))
        assert receiver.committed_update_id == 6 and list(engine.tensors) == ["e"]
    finally:
        receiver.close()
        transport.close()


def test_a_message_for_an_update_that_is_not_in_flight_says_which_step_and_why():
    """A late message names its step; for an aborted update, the reason it was aborted (the sender's, or
    'aborted by sender' when it gave none)."""
    from colosync.engines.sink import SinkEngine

    receiver, transport = _attached_receiver(SinkEngine())
    try:
        with pytest.raises(TransactionStateError, match=r"^stage for update 9, but the update in flight is none"):
            receiver.handle(Stage(9, 0, 0, 8, 0, None))
        with pytest.raises(TransactionStateError, match=r"^prepare for update 9, but the update in flight is none"):
            receiver.handle(Prepare(9))
        layout = plan_buckets([("w", (4,), torch.float32)], 1 << 16)
        receiver.handle(Begin(UpdateManifest(10, "full", layout)))
        receiver.handle(Abort(10))
        with pytest.raises(TransactionStateError, match=r"update 10 was aborted \(aborted by sender\)"):
            receiver.handle(Commit(10))
        receiver.handle(Begin(UpdateManifest(11, "full", layout)))
        receiver.handle(Abort(11, reason="trainer preempted"))
        with pytest.raises(TransactionStateError, match=r"update 11 was aborted \(trainer preempted\)"):
            receiver.handle(Commit(11))
    finally:
        receiver.close()
        transport.close()


def test_a_commit_after_a_failed_prepare_says_the_update_was_aborted_and_why():
    from colosync.errors import TiedWeightError
    from tests.helpers import TiedSink, local_receiver

    engine = TiedSink()
    receiver, link = local_receiver(engine)
    embed = torch.randn(10, 4)
    try:
        with Sender(link, transport="shm") as sender:
            good = sender.push([("embed.weight", embed), ("head.weight", embed.clone())])
            with pytest.raises(TiedWeightError):
                sender.push([("embed.weight", embed), ("head.weight", embed + 1)])
            failed = good.update_id + 1
            with pytest.raises(TransactionStateError, match=rf"update {failed} was aborted \(prepare failed: "):
                receiver.handle(Commit(failed))
    finally:
        receiver.close()


def test_an_engine_that_failed_closed_says_so_in_a_status_that_crosses_the_wire():
    """``serving`` is a bool on the wire: a Status after a full update failed closed decodes as False."""
    from colosync.errors import DeliveryError
    from colosync.wire.protocol import Ack, Codec, Status
    from tests.helpers import MiscountingSink, local_receiver

    engine = MiscountingSink()
    receiver, link = local_receiver(engine)
    codec = Codec(Ack)
    try:
        with Sender(link, transport="shm") as sender, pytest.raises(DeliveryError):
            sender.push([("w", torch.randn(8))])
        assert codec.decode(codec.encode(receiver.handle(Status()))).serving is False
    finally:
        receiver.close()


def test_a_lora_update_the_engine_miscounts_is_reported_in_modules():
    """The delivery error names the unit the engine counted: LoRA modules (full updates: parameters or layers)."""
    from colosync.errors import DeliveryError
    from tests.helpers import MiscountingSink, local_receiver, lora_named

    engine = MiscountingSink()
    receiver, link = local_receiver(engine)
    named = lora_named()
    try:
        with Sender(link, transport="shm") as sender:
            with pytest.raises(DeliveryError, match=r"the engine changed 0 modules where the manifest names 2\b"):
                sender.push(named, lora=LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",)))
            with pytest.raises(DeliveryError, match="the engine changed 0 parameters or layers where"):
                sender.push([("w", torch.randn(8))])
    finally:
        receiver.close()


def test_a_receiver_on_cuda_where_there_is_none_is_refused_at_once():
    from colosync.engines.sink import SinkEngine
    from colosync.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available; use device='cpu'"):
        Receiver(SinkEngine(), "cuda")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        Receiver(SinkEngine(), "cuda:0")
