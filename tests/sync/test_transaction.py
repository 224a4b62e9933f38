"""The engine's one owner of an update (``EngineTransaction``), in this process: ownership, and the
serving state it keeps when a commit fails, a switch breaks or the engine fails closed."""

from __future__ import annotations

import pytest
import torch

from colosync import LocalLink, Receiver, Sender
from colosync.control.door import Door
from colosync.engines.store import StoreEngine
from colosync.errors import DeliveryError, EngineBusyError, FailedClosedError, ManifestError
from colosync.sync.transaction import EngineTransaction
from colosync.wire.protocol import Ack, Failed, Probe, Revert, Status

PROBE = Probe([[1, 2]], [[3]], [[-1.0]], tolerance=1e-3)


class Scoring:
    """An engine's serving code: scores every probe token ``logprob``; ``broken`` breaks the switch after it applied."""

    def __init__(self, owner_of: list[EngineTransaction], logprob: float = -1.0) -> None:
        self.owner_of, self.logprob, self.broken = owner_of, logprob, False
        self.published: list[int] = []  # the commits the transaction told the engine to serve

    def switch(self, request, apply):
        ack = apply()
        if self.broken:
            raise RuntimeError("resuming the engine failed")
        return ack

    def score_probe(self, probe):
        return [[self.logprob] * len(c) for c in probe.completions], {self.owner_of[0].committed_update_id}

    def publish(self, ack):
        self.published.append(ack.committed_update_id)


def engine(logprob: float = -1.0) -> tuple[StoreEngine, Receiver, EngineTransaction, Scoring]:
    store = StoreEngine()  # a store cannot roll back: a full update that does not verify fails closed
    receiver = Receiver(store, "cpu")
    owner: list[EngineTransaction] = []
    scoring = Scoring(owner, logprob)
    owner.append(EngineTransaction(receiver, scoring))
    return store, receiver, owner[0], scoring


def test_a_sender_taken_over_in_this_process_is_refused_and_the_new_owners_update_stands():
    store, receiver, owner, _ = engine()
    with Sender(LocalLink(receiver), transport="shm") as first:
        first.push([("w", torch.full((4,), 2.0))])
        with Sender(LocalLink(receiver), transport="shm") as refused, pytest.raises(EngineBusyError, match="owned by"):
            refused.push([("w", torch.full((4,), 5.0))])
        with Sender(LocalLink(receiver), transport="shm", takeover=True) as taker:
            taker.push([("w", torch.full((4,), 3.0))])
            with pytest.raises(EngineBusyError, match="took it over"):
                first.push([("w", torch.full((4,), 9.0))])
            assert torch.equal(store.tensors["w"], torch.full((4,), 3.0))
    assert receiver.transaction is owner  # every LocalLink to this Receiver went through its one owner
    receiver.close()


def test_closing_a_local_link_releases_the_engine_its_sender_owned():
    store, receiver, _, _ = engine()
    link = LocalLink(receiver)
    Sender(link, transport="shm").push([("w", torch.ones(2))])  # never closed: still the owner
    with Sender(LocalLink(receiver), transport="shm") as other, pytest.raises(EngineBusyError):
        other.push([("w", torch.zeros(2))])
    link.close()  # its client is gone: the engine is free
    with Sender(LocalLink(receiver), transport="shm") as other:
        other.push([("w", torch.zeros(2))])
    assert torch.equal(store.tensors["w"], torch.zeros(2))
    receiver.close()


def test_a_failed_closed_engine_refuses_to_score_a_probe_and_so_to_verify_an_update():
    store, receiver, owner, scoring = engine(logprob=-2.0)  # computes something else than the trainer
    with Sender(LocalLink(owner), transport="shm") as sender:
        with pytest.raises(DeliveryError, match="fails closed"):
            sender.push([("w", torch.ones(2))], verify=PROBE)
        assert not owner.serving
        scoring.logprob = -1.0  # scoring would pass now, but nothing may be served, the probe included
        with pytest.raises(DeliveryError, match="refuses to score the probe"):
            sender.push([], verify=PROBE, adapters="keep")  # an empty update changes nothing, so cannot reopen it
        assert not owner.serving
        report = sender.push([("w", torch.full((2,), 4.0))], verify=PROBE)  # a full update that commits reopens it
        assert owner.serving and report.delivery is not None and report.delivery.max_deviation == 0.0
    receiver.close()


def test_a_commit_is_published_to_the_serving_code_only_once_it_stands():
    """An engine that serves a new version beside running requests (vLLM, ``commit_mode="inflight"``) hands it
    to new requests at ``publish``: after the probe passed, never for an update that failed verification."""
    store, receiver, owner, scoring = engine()
    with Sender(LocalLink(owner), transport="shm") as sender:
        plain = sender.push([("w", torch.ones(2))]).update_id
        verified = sender.push([("w", torch.full((2,), 2.0))], verify=PROBE).update_id
        assert scoring.published == [plain, verified]
        scoring.logprob = -3.0
        with pytest.raises(DeliveryError):
            sender.push([("w", torch.full((2,), 3.0))], verify=PROBE)
        assert scoring.published == [plain, verified]
    receiver.close()


def test_when_the_switch_breaks_after_a_revert_the_owner_knows_the_engine_failed_closed():
    store, receiver, owner, scoring = engine()
    with Sender(LocalLink(owner), transport="shm") as sender:
        report = sender.push([("w", torch.ones(2))])
        scoring.broken = True
        with pytest.raises(RuntimeError, match="resuming"):
            owner.handle(Revert(report.update_id, "checked by hand"), owner.owner)
        assert not owner.serving  # read back from the engine, not the state before the revert
        with pytest.raises(FailedClosedError):
            owner.refuse_unless_serving("generation")
    receiver.close()


def test_a_door_answers_a_refusal_even_when_reading_the_status_fails():
    def no_status() -> Ack:
        raise OSError("the engine's status is unreadable")

    def refuse(request):
        raise ManifestError("refused")

    door = Door(status=no_status)
    reply = door.answer(Status(), refuse)
    assert isinstance(reply, Failed) and reply.error == "ManifestError" and reply.status is None
