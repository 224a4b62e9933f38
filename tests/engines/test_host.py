"""EngineHost and Receiver edge cases a review found, each replayed in process.

Scoring that raises, a commit whose structural count mismatches, a LoRA rolled back on top of
a failed-closed engine, a second revert, ``verify=`` on an engine that cannot score, and an
Attach whose transport cannot be opened: each must leave the engine either serving a
verified version or refusing to serve, and never owned by a client that attached nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from colosync.engines.config import Score, Scores
from colosync.engines.host import EngineHost
from colosync.engines.store import StoreEngine
from colosync.errors import TransactionStateError
from colosync.sync.receiver import Receiver
from colosync.sync.target import Changes
from colosync.transports.shm import ShmSender
from colosync.wire.bucket import fingerprint, plan_buckets
from colosync.wire.manifest import LoraSpec, UpdateManifest
from colosync.wire.protocol import (
    Abort,
    Ack,
    Attach,
    Batch,
    BatchReply,
    Begin,
    Commit,
    Failed,
    Prepare,
    Probe,
    Revert,
    Stage,
    Status,
)
from tests.helpers import pack_into

PROBE = Probe([[1, 2]], [[3]], [[-1.0]])
LORA = LoraSpec(4, 8.0, ("q_proj",))
NAMED = [
    ("base_model.model.m.q_proj.lora_A.weight", torch.ones(4, 8)),
    ("base_model.model.m.q_proj.lora_B.weight", torch.ones(8, 4)),
]


class Scoring(StoreEngine):
    """A store that serves Score (from ``scores``) and counts what it changes as it is told."""

    requests: ClassVar[tuple[type, ...]] = (Score,)
    replies: ClassVar[tuple[type, ...]] = (Scores,)

    def __init__(self) -> None:
        super().__init__()
        self.score_error: Exception | None = None
        self.changes: Changes | None = None
        self.revertible = True

    def handle(self, request: Any) -> Scores:
        if self.score_error is not None:
            raise self.score_error
        return Scores(self.committed_update_id, [[-1.0]])

    def commit(self, prepared: Any, update_id: int) -> Changes | None:
        super().commit(prepared, update_id)
        return self.changes

    def revert(self, update_id: int) -> bool:
        return self.revertible


@pytest.fixture
def rig():
    engine = Scoring()
    host = EngineHost(engine.transaction(None), engine)
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    assert not isinstance(host.handle(Attach("shm", transport.handle())), Failed)
    transport.attached()
    yield engine, host, transport
    host.close()
    transport.close()


def prepared(host: EngineHost, transport: ShmSender, kind: str = "lora") -> int:
    uid = host.handle(Status()).next_update_id()
    named = NAMED if kind == "lora" else [("w", torch.ones(4))]
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 16)
    host.handle(Begin(UpdateManifest(uid, kind, layout, LORA if kind == "lora" else None)))
    slot = transport.slot(0)[: layout.bucket_sizes[0]]
    pack_into(slot, layout.tensors, [t for _, t in named])
    host.handle(Stage(uid, 0, 0, layout.bucket_sizes[0], 0, fingerprint(slot)))
    host.handle(Prepare(uid))
    return uid


def test_scoring_that_raises_reverts_instead_of_serving_an_unverified_update(rig):
    engine, host, transport = rig
    engine.score_error = RuntimeError("CUDA out of memory while scoring")
    uid = prepared(host, transport)
    reply = host.handle(Commit(uid, probe=PROBE))
    assert isinstance(reply, Failed) and reply.error == "DeliveryError" and "CUDA out of memory" in reply.message
    assert host.handle(Status()).committed_update_id == uid - 1  # rolled back


def test_a_structural_mismatch_closes_the_serving_gate_at_once(rig):
    engine, host, transport = rig
    engine.changes, engine.revertible = Changes(1, 2), False
    uid = prepared(host, transport, kind="full")
    reply = host.handle(Commit(uid))
    assert isinstance(reply, Failed) and reply.error == "DeliveryError" and "changed 1" in reply.message
    other = host.open_session()
    refused = host.handle(Score([[1]], [[2]]), other)
    assert isinstance(refused, Failed) and refused.error == "FailedClosedError"


def test_a_rolled_back_lora_does_not_reopen_a_failed_closed_engine():
    engine = Scoring()
    receiver = Receiver(engine)
    host = EngineHost(receiver, engine)
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    try:
        host.handle(Attach("shm", transport.handle()))
        transport.attached()
        engine.revertible = False
        full = prepared(host, transport, kind="full")
        host.handle(Commit(full))
        host.handle(Revert(full, "did not verify"))
        assert not receiver.serving
        engine.revertible = True
        lora = prepared(host, transport)
        host.handle(Commit(lora))
        assert not receiver.serving  # a LoRA cannot repair unknown base weights
        host.handle(Revert(lora, "did not verify"))
        assert (receiver.committed_update_id, receiver.serving) == (full, False)
        with pytest.raises(TransactionStateError, match="already reverted"):
            receiver.revert(full, "twice")
        again = prepared(host, transport, kind="full")
        host.handle(Commit(again))
        assert receiver.serving  # a full update that commits replaces what failed
    finally:
        host.close()
        transport.close()


def test_nothing_to_revert_on_a_fresh_engine():
    with pytest.raises(TransactionStateError, match="only the last commit can be reverted"):
        Receiver(StoreEngine()).revert(0, "no commit yet")


def test_verify_on_an_engine_that_cannot_score_is_refused_before_commit(rig):
    _, host, transport = rig
    plain = EngineHost(host.transaction.applies)  # the same Receiver, served without an engine that scores
    plain.transaction.owner = plain.transaction.local
    uid = prepared(host, transport)
    reply = plain.handle(Commit(uid, probe=PROBE))
    assert isinstance(reply, Failed) and reply.error == "ConfigError" and "push without verify=" in reply.message
    assert host.handle(Status()).committed_update_id == uid - 1


def test_an_attach_that_cannot_open_its_transport_leaves_no_owner():
    host = EngineHost(Receiver(StoreEngine()))
    session = host.open_session()
    reply = host.handle(Attach("shm", b"\x93\xa4nope\x01\x01"), session)
    assert isinstance(reply, Failed) and host.transaction.owner is None


def test_a_takeover_that_cannot_open_its_transport_tells_the_old_owner_nothing():
    host = EngineHost(Receiver(StoreEngine()))
    owner, taker = host.open_session(), host.open_session()
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    try:
        assert not isinstance(host.handle(Attach("shm", transport.handle()), owner), Failed)
        failed = host.handle(Attach("shm", b"\x93\xa4nope\x01\x01", takeover=True), taker)
        assert isinstance(failed, Failed) and host.transaction.owner is owner  # a takeover that failed takes nothing
        reply = host.handle(Prepare(1), owner)  # refused as out of order, not for ownership
        assert isinstance(reply, Failed) and reply.error == "TransactionStateError", reply.message
        assert not isinstance(host.handle(Attach("shm", transport.handle(), takeover=True), taker), Failed)
        reply = host.handle(Prepare(1), owner)
        assert isinstance(reply, Failed) and "another sender took it over" in reply.message, reply.message
    finally:
        host.close()
        transport.close()


def test_a_batch_is_each_request_as_if_alone_and_a_bad_stage_commits_nothing(rig):
    """Stage, Prepare and Commit in one ``Batch``: a good one commits; in one whose Stage carries a
    wrong fingerprint the Stage is refused, Prepare and Commit are refused as they would be alone,
    and the engine keeps its previous version."""
    engine, host, transport = rig
    named = [("w", torch.arange(8, dtype=torch.float32))]
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 16)
    size = layout.bucket_sizes[0]
    served = None
    for bad in (False, True):
        uid = host.handle(Status()).next_update_id()
        assert not isinstance(host.handle(Begin(UpdateManifest(uid, "full", layout))), Failed)
        slot = transport.slot(0)[:size]
        pack_into(slot, layout.tensors, [t * uid for _, t in named])
        sent = fingerprint(slot) + (1 if bad else 0)
        reply = host.handle(Batch([Stage(uid, 0, 0, size, 0, sent), Prepare(uid), Commit(uid)]))
        assert isinstance(reply, BatchReply) and len(reply.replies) == 3
        if not bad:
            assert [type(r).__name__ for r in reply.replies] == ["Ack", "Ack", "Ack"]
            assert reply.replies[-1].committed_update_id == uid
            served = uid
            continue
        assert [r.error for r in reply.replies if isinstance(r, Failed)] == [
            "FingerprintMismatchError",
            "TransactionStateError",
            "TransactionStateError",
        ]
    assert host.handle(Status()).committed_update_id == served
    assert torch.equal(engine.tensors["w"], named[0][1] * served)


def test_a_batch_through_the_engine_process_is_answered_part_by_part():
    """Over the socket: ``SocketLink.submit_batch`` gets one reply per part, a refusal raised by its own part."""
    from colosync.engines.process import EngineConfig, EngineProcess
    from colosync.errors import EngineBusyError

    with EngineProcess(EngineConfig(engine="store", device="cpu")) as engine:
        parts = engine.link.submit_batch([Prepare(1), Commit(1)])  # no owner: each is refused by itself
        for part in parts:
            with pytest.raises(EngineBusyError, match="send Attach first"):
                part.wait()
        assert engine.call(Status()).committed_update_id == 0


class HostLink:
    """A link into an ``EngineHost`` in this process through its bytes, as a socket client has it:
    its own session, ``submit_batch``, and so ``BeginAgain`` from a Sender."""

    def __init__(self, host: EngineHost) -> None:
        from colosync.control.door import codecs

        self.host, self.session = host, host.open_session()
        self._codec, self._replies = codecs((), ())
        self.sent: list[str] = []

    def submit(self, request):
        from colosync.sync.link import Done, unwrap

        self.sent.append(type(request).__name__)
        reply = self._replies.decode(self.host.handle_bytes(self._codec.encode(request), self.session))
        try:
            return Done(unwrap(reply))
        except Exception as exc:
            return Done(error=exc)

    def submit_batch(self, requests):
        from colosync.sync.link import batch_parts

        return batch_parts(self.submit(Batch(requests)), len(requests))

    def close(self) -> None:
        pass


def test_a_sender_begins_a_repeated_layout_again_in_40_bytes_and_recovers_when_the_engine_lost_it():
    from colosync.sync.sender import Sender

    engine = StoreEngine()
    host = EngineHost(engine.transaction(None), engine)
    link = HostLink(host)
    named = [("w", torch.randn(6, 4)), ("b", torch.randn(6))]
    with Sender(link, transport="shm") as sender:
        for step in range(3):
            sender.push([(n, t + step) for n, t in named])
            assert torch.equal(engine.tensors["w"], named[0][1] + step)
        assert [m for m in link.sent if m.startswith("Begin")] == ["Begin", "BeginAgain", "BeginAgain"]
        link.session.begun = None  # as if the engine had lost what the sender refers to
        sender.push([(n, t * 3) for n, t in named])  # refused with UnknownLayoutError, then the full Begin
        assert [m for m in link.sent if m.startswith("Begin")][-2:] == ["BeginAgain", "Begin"]
        assert torch.equal(engine.tensors["w"], named[0][1] * 3)
        sender.push([("w", torch.zeros(2))])  # another layout: the full manifest
        assert [m for m in link.sent if m.startswith("Begin")][-1] == "Begin"
    host.close()


def test_begin_again_stands_only_for_this_connections_last_begin(rig):
    """Its digest must be the one of the manifest this connection began last: another connection's, a stale
    one, or none at all is refused with UnknownLayoutError and begins nothing."""
    from colosync.wire.manifest import manifest_digest
    from colosync.wire.protocol import BeginAgain

    engine, host, transport = rig
    owner = host.transaction.local  # the session that attached in ``rig``
    layout = plan_buckets([("w", (4,), torch.float32)], 1 << 16)
    uid = host.handle(Status()).next_update_id()
    first = UpdateManifest(uid, "full", layout)
    assert not isinstance(host.handle(BeginAgain(uid, manifest_digest(first))), Ack)  # nothing begun yet
    assert not isinstance(host.handle(Begin(first)), Failed)
    host.handle(Abort(uid, "test"))
    again = host.handle(BeginAgain(uid + 1, manifest_digest(first)))
    assert isinstance(again, Ack) and again.in_flight_update_id == uid + 1
    assert host.transaction.applies._inflight.manifest.layout is first.layout  # the same Layout object: its plans hit
    host.handle(Abort(uid + 1, "test"))
    other = UpdateManifest(uid, "full", plan_buckets([("v", (4,), torch.float32)], 1 << 16))
    refused = host.handle(BeginAgain(uid + 2, manifest_digest(other)))
    assert (
        isinstance(refused, Failed)
        and refused.error == "UnknownLayoutError"
        and "send the full Begin" in (refused.message)
    )
    stranger = host.open_session()
    assert host.handle(BeginAgain(uid + 3, manifest_digest(first)), stranger).error in (
        "UnknownLayoutError",
        "EngineBusyError",
    )
    assert host.handle(Status()).in_flight_update_id is None and owner.begun is not None


def test_an_equal_manifest_from_another_connection_gets_the_first_ones_layout_object(rig):
    """Per-layout state is keyed on the Layout object: a sender's new connection (an equal, distinct
    object) must find it by identity, not by comparing every tensor on every update."""
    engine, host, transport = rig
    specs = [("w", (4,), torch.float32), ("b", (2,), torch.float32)]
    uid = host.handle(Status()).next_update_id()
    host.handle(Begin(UpdateManifest(uid, "full", plan_buckets(specs, 1 << 16))))
    first = host.transaction.applies._inflight.manifest.layout
    host.handle(Abort(uid, "test"))
    again = UpdateManifest(uid + 1, "full", plan_buckets(specs, 1 << 16))  # equal, not the same object
    assert again.layout == first and again.layout is not first
    host.handle(Begin(again))
    assert host.transaction.applies._inflight.manifest.layout is first
    host.handle(Abort(uid + 1, "test"))
