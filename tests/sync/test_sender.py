"""The Sender: its per-update shortcuts never change what arrives, its slot pipeline, attaching.

Plans, padding and slot sizing; ``SlotPipeline`` on its own (which slot each chunk takes and
which replies are read before a slot is reused); view caches dropped with their buffers; and
``transports.attach_first``, the one place a transport is picked.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from colosync import transports
from colosync.control.link import LocalLink
from colosync.engines.sink import SinkEngine
from colosync.errors import (
    ConfigError,
    DeliveryError,
    EngineBusyError,
    FingerprintMismatchError,
    TransportError,
    TransportUnavailable,
)
from colosync.sync.link import Done
from colosync.sync.pipeline import SlotPipeline
from colosync.sync.plan import STAGING, ViewKey
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender
from colosync.transports.base import SenderTransport
from colosync.wire.bucket import plan_buckets
from colosync.wire.manifest import LoraSpec, UpdateManifest, align_up
from colosync.wire.protocol import Abort, Ack, Attach, Begin, Commit, Detach, Prepare, Probe, Stage, Status
from tests.helpers import MiscountingSink, local_receiver, lora_named


@pytest.fixture
def sink():
    """A sink engine behind a Receiver in this process: ``(engine, link)``."""
    engine = SinkEngine()
    receiver = Receiver(engine, "cpu")
    yield engine, LocalLink(receiver)
    receiver.close()


def test_plan_is_reused_and_padding_is_zeroed_in_the_slot(sink):
    engine, link = sink
    with Sender(link, transport="shm", bucket_bytes=4096) as sender:
        named = [("a", torch.randn(3)), ("b", torch.ones(5, dtype=torch.bfloat16)), ("c", torch.arange(7))]
        sender.push(named)
        plan = sender._plans.last
        sender.transport.slot(0).fill_(0xFF)  # leftovers of some other layout
        named2 = [(n, t * 2) for n, t in named]
        sender.push(named2)
        assert sender._plans.last is plan  # same layout: planned once
        slot = sender.transport.slot(0)
        for start, end in plan.gaps[0]:
            assert not slot[start:end].any(), "padding must be zero so the engine's checks see clean runs"
        for name, t in named2:
            assert torch.equal(engine.tensors[name], t)
        sender.push([("a", torch.randn(4))])  # another layout
        assert sender._plans.last is not plan and list(engine.tensors) == ["a"]


def test_a_repeated_push_finds_its_plan_and_any_change_of_shape_dtype_or_name_makes_a_new_one():
    from colosync.sync.plan import Plans

    plans = Plans()
    names = ["a", "b"]
    first = plans.find(names, [torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)], 1 << 20)
    again = plans.find(list(names), [torch.ones(3, 4), torch.ones(5, dtype=torch.int64)], 1 << 20)
    assert again is first  # other tensors, same names, shapes and dtypes: the same plan
    reshaped = plans.find(names, [torch.zeros(4, 3), torch.zeros(5, dtype=torch.int64)], 1 << 20)
    assert reshaped is not first and reshaped.shapes == [(4, 3), (5,)]
    retyped = plans.find(names, [torch.zeros(4, 3), torch.zeros(5, dtype=torch.int32)], 1 << 20)
    assert retyped is not reshaped and retyped.dtypes == [torch.float32, torch.int32]
    renamed = plans.find(["a", "c"], [torch.zeros(4, 3), torch.zeros(5, dtype=torch.int32)], 1 << 20)
    assert renamed is not retyped and renamed.names == ["a", "c"]
    assert plans.find(names, [torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)], 1 << 20) is first  # kept
    arena = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)]
    first.arena = arena
    assert plans.find(names, arena, 1 << 20) is first  # its own arena tensors: names and identities
    resized = [arena[0], torch.zeros(6, dtype=torch.int64)]  # not the arena's: shapes are read again
    assert plans.find(names, resized, 1 << 20) is not first


def test_tensors_that_changed_shape_or_dtype_under_the_same_names_are_planned_again(sink, caplog):
    """A push with the last plan's names checks shapes bucket by bucket, after earlier buckets went out:
    a changed later bucket aborts that update and the next id carries the new layout, whole."""
    engine, link = sink
    with Sender(link, transport="shm", bucket_bytes=4096, slots=2) as sender:
        a, b = torch.randn(600), torch.randn(600)  # 2400 bytes each: one bucket each, b's second
        sender.push([("a", a), ("b", b)])
        sender.push([("a", a), ("b", b)])  # checked by names: the layouts that passed are remembered
        first = sender._plans.last
        assert len(first.sizes) == 2
        b.data = torch.randn(700)  # the same tensor object under the same name, a new shape
        with caplog.at_level(logging.INFO, logger="colosync.sync.sender"):
            report = sender.push([("a", a), ("b", b)])
        assert "changed shape or dtype" in caplog.text and "planning again" in caplog.text
        assert report.update_id == 4  # update 3 began and packed bucket 0, and was aborted at bucket 1's check
        assert sender._plans.last is not first and sender._plans.last.shapes == [(600,), (700,)]
        assert torch.equal(engine.tensors["a"], a) and torch.equal(engine.tensors["b"], b)
        b.data = b.data.double()  # dtype only
        sender.push([("a", a), ("b", b)])
        assert engine.tensors["b"].dtype == torch.float64 and torch.equal(engine.tensors["b"], b)
        b.data = torch.randn(650)
        assert sender.push([("a", a), ("b", b)], update_id=20).update_id == 20  # a chosen id is planned up front
        assert torch.equal(engine.tensors["b"], b)


def test_transport_is_no_bigger_than_the_first_update_needs(sink):
    _, link = sink
    with Sender(link, transport="shm", bucket_bytes=64 << 20, slots=2) as sender:
        sender.push([("w", torch.zeros(1000))])
        assert sender.transport.slot_bytes * sender.transport.num_slots <= 1 << 16
        sender.push([("w", torch.zeros(100_000)), ("v", torch.zeros(10))])  # bigger later: chunked, still right


# -- the slot pipeline, alone ------------------------------------------------------------------
class _Reply:
    """A pending reply that logs when it is read, and raises ``error`` then if given one."""

    def __init__(self, label: str, events: list, error: Exception | None = None) -> None:
        self.label, self.events, self.error = label, events, error

    def wait(self) -> Ack:
        self.events.append(("read", self.label))
        if self.error is not None:
            raise self.error
        return Ack(committed_update_id=0)


class _Engine:
    """Stands in for ``Link.submit``: logs what is sent and answers with ``_Reply``s."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.events: list[tuple] = []
        self.sent: list = []
        self.fail = fail or {}

    def submit(self, request) -> _Reply:
        label = f"S{request.bucket}" if isinstance(request, Stage) else type(request).__name__
        self.events.append(("send", label))
        self.sent.append(request)
        return _Reply(label, self.events, self.fail.get(label))


def _run_pipeline(slots: int, chunks: int, engine: _Engine) -> SlotPipeline:
    pipe = SlotPipeline(slots, engine.submit, Begin(UpdateManifest(1, "full", plan_buckets([], 1 << 16))))
    for chunk in range(chunks):  # one chunk per bucket, so Stage k is bucket k
        slot = pipe.acquire()
        engine.events.append(("slot", slot))
        pipe.put(Stage(1, chunk, 0, 64, slot, None))
    pipe.finish(Prepare(1), Commit(1))
    return pipe


def _ev(text: str) -> list[tuple]:
    """``"send:Begin slot:0 read:S0"`` -> ``[("send", "Begin"), ("slot", 0), ("read", "S0")]``."""
    out: list[tuple] = []
    for word in text.split():
        kind, what = word.split(":")
        out.append((kind, int(what) if kind == "slot" else what))
    return out


@pytest.mark.parametrize(
    ("slots", "chunks", "expected"),
    [
        # One slot: the reply to a chunk's own Stage frees its slot.
        (
            1,
            3,
            "send:Begin slot:0 send:S0 read:Begin read:S0 slot:0 send:S1 read:S1 slot:0 "
            "send:S2 send:Prepare send:Commit read:S2 read:Prepare read:Commit",
        ),
        # Two slots: reusing chunk u's slot needs the reply to Stage u + 1 (acknowledgements lag by one).
        (
            2,
            4,
            "send:Begin slot:0 slot:1 send:S0 send:S1 read:Begin read:S0 read:S1 slot:0 send:S2 read:S2 "
            "slot:1 send:S3 send:Prepare send:Commit read:S3 read:Prepare read:Commit",
        ),
        (
            3,
            5,
            "send:Begin slot:0 slot:1 send:S0 slot:2 send:S1 read:Begin read:S0 read:S1 slot:0 send:S2 "
            "read:S2 slot:1 send:S3 send:S4 send:Prepare send:Commit read:S3 read:S4 read:Prepare read:Commit",
        ),
    ],
    ids=["1-slot", "2-slots", "3-slots"],
)
def test_pipeline_reuses_slots_in_order_and_reads_replies_only_when_a_slot_is_reused(slots, chunks, expected):
    engine = _Engine()
    _run_pipeline(slots, chunks, engine)
    assert engine.events == _ev(expected)


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_pipeline_reads_exactly_the_replies_the_lag_rule_needs(slots):
    """Before chunk c reuses the slot chunk u wrote: replies through Stage u + lag read, none later."""
    engine = _Engine()
    _run_pipeline(slots, 11, engine)
    lag = 1 if slots >= 2 else 0
    read: list[str] = []
    last_use: dict[int, int] = {}
    chunk = 0
    for kind, what in engine.events:
        if kind == "read":
            read.append(what)
        elif kind == "slot":
            assert what == chunk % slots  # round robin
            if what in last_use:
                need = last_use[what] + lag
                assert read == ["Begin"] + [f"S{k}" for k in range(need + 1)], (chunk, read)
            else:
                assert read == [], "no reply is read before a slot must be reused"
            last_use[what] = chunk
            chunk += 1
    assert read == ["Begin"] + [f"S{k}" for k in range(11)] + ["Prepare", "Commit"]


def test_pipeline_publishes_each_chunk_at_once_and_holds_its_stage_back_until_the_next():
    engine = _Engine()
    published: list[tuple[int, int]] = []  # (messages sent by then, the chunk's bucket)
    pipe = SlotPipeline(
        2,
        engine.submit,
        Begin(UpdateManifest(1, "full", plan_buckets([], 1 << 16))),
        publish=lambda stage: published.append((len(engine.sent), stage.bucket)),
    )
    pipe.put(Stage(1, 0, 0, 64, pipe.acquire(), None), None, torch.tensor(1234))
    assert [type(r).__name__ for r in engine.sent] == ["Begin"]  # held until the next chunk is written
    assert published == [(1, 0)]  # but its bytes may start moving now
    pipe.put(Stage(1, 1, 0, 64, pipe.acquire(), None), None, 7)
    assert engine.sent[1].fingerprint == 1234 and published == [(1, 0), (1, 1)]
    pipe.finish(Prepare(1), Commit(1))
    assert engine.sent[2].fingerprint == 7 and published == [(1, 0), (1, 1)]
    assert set(pipe.timer.seconds) == {"pack", "transfer", "stage", "prepare", "commit"}


def test_with_a_batching_link_the_held_stages_prepare_and_commit_go_as_one_message():
    engine = _Engine(fail={"S2": FingerprintMismatchError("bucket 2 arrived corrupted")})
    batches: list[list[str]] = []

    def submit_batch(requests):
        batches.append([f"S{r.bucket}" if isinstance(r, Stage) else type(r).__name__ for r in requests])
        return [engine.submit(r) for r in requests]  # the engine sees each request as if alone

    pipe = SlotPipeline(
        2, engine.submit, Begin(UpdateManifest(1, "full", plan_buckets([], 1 << 16))), submit_batch=submit_batch
    )
    for chunk in range(3):
        pipe.put(Stage(1, chunk, 0, 64, pipe.acquire(), None), None, chunk + 10)
    assert batches == []  # chunks whose slot comes back during the update go out one by one
    with pytest.raises(FingerprintMismatchError, match="bucket 2"):  # each part's own failure, in order
        pipe.finish(Prepare(1), Commit(1))
    assert batches == [["S2", "Prepare", "Commit"]]
    assert engine.sent[3].fingerprint == 12  # the held Stage was made ready (fingerprint in) before batching


def test_pipeline_raises_the_first_failed_reply_when_it_must_read_it():
    engine = _Engine(fail={"S1": FingerprintMismatchError("bucket 1 arrived corrupted")})
    pipe = SlotPipeline(2, engine.submit, Begin(UpdateManifest(1, "full", plan_buckets([], 1 << 16))))
    for _ in range(2):
        pipe.put(Stage(1, pipe.chunks, 0, 64, pipe.acquire(), None))
    with pytest.raises(FingerprintMismatchError, match="bucket 1"):
        pipe.acquire()  # slot 0 again: needs the reply to Stage 1


class _FailingStageLink(LocalLink):
    """A real Receiver behind it, but the reply to Stage ``fail_at`` (counted from 0) fails."""

    def __init__(self, receiver: Receiver, fail_at: int) -> None:
        super().__init__(receiver)
        self.fail_at, self.stages, self.requests = fail_at, 0, []

    def submit(self, request):
        self.requests.append(request)
        if isinstance(request, Stage):
            self.stages += 1
            if self.stages - 1 == self.fail_at:
                return Done(error=TransportError("the engine lost slot 1"))
        return super().submit(request)


def test_a_failed_reply_aborts_the_update_and_reraises(sink):
    engine, local = sink
    link = _FailingStageLink(local.receiver, fail_at=1)
    named = [(f"t{i}", torch.full((1000,), float(i))) for i in range(6)]  # 6 buckets of 4 KiB
    with Sender(link, transport="shm", bucket_bytes=4096) as sender:
        with pytest.raises(TransportError, match="lost slot 1"):
            sender.push(named)
        aborts = [r for r in link.requests if isinstance(r, Abort)]
        assert len(aborts) == 1 and "lost slot 1" in aborts[0].reason
        assert not any(isinstance(r, Commit) for r in link.requests)  # failed before the end: no commit sent
        status = link.submit(Status()).wait()
        assert status.in_flight_update_id is None and status.committed_update_id == 0 and engine.tensors == {}
        link.fail_at = -1
        sender.push(named)  # the next update goes through
        assert torch.equal(engine.tensors["t5"], named[5][1])


# -- view caches: one key type, dropped when their buffer goes ------------------------------
def test_views_are_dropped_when_the_transport_is_replaced(sink):
    engine, link = sink
    named = [("a", torch.randn(10)), ("b", torch.arange(7))]
    with Sender(link, transport="shm", bucket_bytes=4096) as sender:
        sender.push(named)
        first, plan = sender.transport, sender._plans.last
        old_views = plan._views[ViewKey(0, 0)]
        sender.close()  # a new transport (new slots) on the next push
        named2 = [(n, t * 3) for n, t in named]
        sender.push(named2)  # stale views would pack into the old, unmapped slots
        assert sender.transport is not first and plan._views[ViewKey(0, 0)] is not old_views
        for name, t in named2:
            assert torch.equal(engine.tensors[name], t)


def test_staging_views_are_dropped_when_the_staging_buffer_grows(sink):
    engine, link = sink
    with Sender(link, transport="shm", bucket_bytes=1 << 20) as sender:
        sender.push([("tiny", torch.zeros(4))])  # the transport: one 64 KiB slot
        staged = [("x", torch.randn(10_000)), ("y", torch.randn(10_000))]  # one 80 KiB bucket: through staging
        sender.push(staged)
        plan = sender._plans.last
        assert ViewKey(0, STAGING) in plan._views
        big = torch.randn(700, 700).t()  # not contiguous and bigger than the staging buffer: it grows
        sender.push([("big", big)])
        assert torch.equal(engine.tensors["big"], big)
        assert ViewKey(0, STAGING) not in plan._views
        staged2 = [(n, t + 1) for n, t in staged]
        sender.push(staged2)  # stale views would pack into the old staging buffer
        for name, t in staged2:
            assert torch.equal(engine.tensors[name], t)


def test_a_cpu_arena_packs_nothing_and_guards_its_buffer(sink):
    engine, link = sink
    named = [("w", torch.randn(8, 8)), ("b", torch.randn(8))]
    with Sender(link, transport="shm") as sender:
        arena = sender.arena([(n, tuple(t.shape), t.dtype) for n, t in named], "cpu")
        with torch.no_grad():
            torch._foreach_copy_(arena, [t for _, t in named])
        weights = [(n, a) for (n, _), a in zip(named, arena, strict=True)]
        sender.push(weights)
        assert sender._plans.last._views == {}  # the tensors already lived in the slot: no views, no copy
        with torch.no_grad():
            arena[0].mul_(2)  # a training step, in place
        sender.push(weights)
        assert torch.equal(engine.tensors["w"], named[0][1] * 2)
        with pytest.raises(TransportError, match="arena"):
            sender.push([("other", torch.zeros(3))])


# -- attaching the first transport that works ---------------------------------------------------
class _Fake(SenderTransport):
    """A registry entry for these tests: ``create`` fails or not, the engine opens its handle or not."""

    name = "fake"
    fail_create = False
    made: list[_Fake] = []

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        return True, f"{cls.name} is fine here"

    @classmethod
    def create(cls, slot_bytes: int, slots: int, device: torch.device, peers=None) -> _Fake:
        if cls.fail_create:
            raise TransportError(f"{cls.name}: out of shared memory")
        return cls(slot_bytes, slots)

    def __init__(self, slot_bytes: int, slots: int) -> None:
        self._slot_bytes, self._slots = slot_bytes, slots
        self.closed = self.is_attached = False
        _Fake.made.append(self)

    slot_bytes = property(lambda self: self._slot_bytes)
    num_slots = property(lambda self: self._slots)

    def handle(self) -> bytes:
        return self.name.encode()

    def slot(self, index: int) -> torch.Tensor:
        return torch.zeros(self._slot_bytes, dtype=torch.uint8)

    def attached(self) -> None:
        self.is_attached = True

    def close(self) -> None:
        self.closed = True


class BrokenCreate(_Fake):
    name, fail_create = "broken", True


class Refused(_Fake):
    name = "refused"


class Works(_Fake):
    name = "works"


class Absent(_Fake):
    name = "absent"

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        return False, "absent needs hardware this machine lacks"


@pytest.fixture
def fake_registry(monkeypatch):
    """Registry lines, as a new transport would add them, for the fakes above."""
    here = __name__
    monkeypatch.setattr(
        transports,
        "_REGISTRY",
        {
            name: f"{here}:{cls}:{cls}"
            for name, cls in [
                ("absent", "Absent"),
                ("broken", "BrokenCreate"),
                ("refused", "Refused"),
                ("works", "Works"),
            ]
        },
    )
    _Fake.made.clear()
    yield


def _engine_opens(name: str, handle: bytes) -> Ack:
    if handle == b"refused":
        raise TransportError("cudaIpcOpenMemHandle failed: the engine cannot see this GPU")
    return Ack(committed_update_id=41)


def test_auto_passes_over_what_cannot_run_be_created_or_be_opened_and_says_why(fake_registry, caplog):
    caplog.set_level(logging.INFO, logger="colosync.transports")
    attached = transports.attach_first("auto", torch.device("cpu"), 4096, 2, attach=_engine_opens)
    assert isinstance(attached, transports.Attached)
    assert isinstance(attached.transport, Works) and attached.transport.is_attached
    assert attached.reply.next_update_id() == 42  # the callback's reply, handed back
    assert attached.log == [
        "picked 'works': works is fine here",
        "passed over 'absent': absent needs hardware this machine lacks",
        "passed over 'broken': broken: out of shared memory",
        "passed over 'refused': cudaIpcOpenMemHandle failed: the engine cannot see this GPU",
    ]
    refused = [t for t in _Fake.made if isinstance(t, Refused)]
    assert len(refused) == 1 and refused[0].closed and not refused[0].is_attached  # nothing leaks
    lines = {(r.levelno, r.getMessage()) for r in caplog.records}
    assert (logging.INFO, "transport auto: passed over 'absent': absent needs hardware this machine lacks") in lines
    assert (
        logging.WARNING,
        "transport auto: passed over 'broken': it could not be created: broken: out of shared memory",
    ) in lines
    assert (
        logging.WARNING,
        "transport auto: passed over 'refused': the engine could not open it: "
        "cudaIpcOpenMemHandle failed: the engine cannot see this GPU",
    ) in lines
    assert (logging.INFO, "transport auto: picked 'works' (works is fine here)") in lines


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("absent", TransportUnavailable, "cannot run here: absent needs hardware"),
        ("broken", TransportError, "out of shared memory"),
        ("refused", TransportError, "cudaIpcOpenMemHandle failed"),
    ],
)
def test_an_explicit_transport_raises_instead_of_falling_back(fake_registry, name, error, match):
    with pytest.raises(error, match=match):
        transports.attach_first(name, torch.device("cpu"), 4096, 2, attach=_engine_opens)
    assert all(t.closed for t in _Fake.made)


def test_auto_with_nothing_that_works_says_why_for_each(fake_registry, monkeypatch):
    monkeypatch.setattr(Works, "fail_create", True)
    with pytest.raises(TransportUnavailable, match="no transport works here: 'absent': .*'works': works: out of"):
        transports.attach_first("auto", torch.device("cpu"), 4096, 2, attach=_engine_opens)


def test_the_sender_attaches_through_the_registry_with_its_link(fake_registry, monkeypatch):
    """The Sender's callback submits ``Attach`` over its link; what it logs is the registry's log."""
    seen: list = []

    class _AttachOnly:
        def submit(self, request):
            seen.append(request)
            if isinstance(request, Attach):
                return Done(_engine_opens(request.transport, request.handle))
            return Done(Ack(committed_update_id=41))

    sender = Sender(_AttachOnly(), transport="auto", bucket_bytes=4096)
    streamer = sender._attach(torch.device("cpu"), None)
    assert isinstance(streamer.transport, Works) and sender.transport is streamer.transport
    assert [(r.transport, r.handle, r.takeover) for r in seen] == [
        ("refused", b"refused", False),
        ("works", b"works", False),
    ]
    assert sender.transport_log[0] == "picked 'works': works is fine here" and len(sender.transport_log) == 4
    assert sender._claim_update_id(None) == 42  # the Attach reply says where update ids continue
    sender.close()
    assert streamer.transport.closed and sender.transport is None
    assert isinstance(seen[-1], Detach)  # the engine is told first, then the slots are freed


def test_close_detaches_so_another_sender_may_attach_and_takeover_is_explicit(sink):
    engine, link = sink
    a = Sender(link, transport="shm", bucket_bytes=4096)
    a.push([("w", torch.ones(4))])
    with pytest.raises(EngineBusyError):
        Sender(link, transport="shm").push([("w", torch.zeros(4))])  # refused, not fallen back from
    a.close()  # detaches
    with Sender(link, transport="shm") as b:
        b.push([("w", torch.full((4,), 2.0))])
        with Sender(link, transport="shm", takeover=True) as c:
            c.push([("w", torch.full((4,), 3.0))])
    assert torch.equal(engine.tensors["w"], torch.full((4,), 3.0))


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        Sender(None, slots=0)


# -- push_stream, arenas, numbering and reports, through a sink engine in this process ---------------


class RecordingSink(SinkEngine):
    """The sink engine, keeping every manifest it prepared (what the engine was told)."""

    def __init__(self) -> None:
        super().__init__()
        self.manifests = []

    def prepare(self, manifest, tensors):
        self.manifests.append(manifest)
        return super().prepare(manifest, tensors)


class CountingSink(MiscountingSink):
    """A sink whose commit counts what it changed, correctly (so every commit's Ack carries a ``Delivery``)."""

    miscount = False


class CountingLink(LocalLink):
    """A LocalLink that keeps the type of every request it carried (what crossed to the engine)."""

    def __init__(self, receiver: Receiver) -> None:
        super().__init__(receiver)
        self.sent: list[str] = []

    def submit(self, request):
        self.sent.append(type(request).__name__)
        return super().submit(request)


def test_push_stream_sends_the_lora_spec_and_the_requested_update_id():
    engine = RecordingSink()
    receiver, link = local_receiver(engine)
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


def test_push_hands_the_probe_to_the_engine(store_engine):
    """An engine that cannot score refuses ``push(..., verify=)`` before installing anything."""
    probe = Probe(prompts=[[1, 2]], completions=[[3]], logprobs=[[-0.5]])
    with Sender(store_engine.link, transport="shm") as sender:
        before = store_engine.link.submit(Status()).wait().committed_update_id
        with pytest.raises(ConfigError, match="cannot score a probe"):
            sender.push([("w", torch.randn(4, 4))], verify=probe)
        assert store_engine.link.submit(Status()).wait().committed_update_id == before


def test_an_arena_holds_one_update_not_one_per_slot():
    engine = SinkEngine()
    receiver, link = local_receiver(engine)
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
    receiver, link = local_receiver(engine)
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


def test_an_update_of_only_empty_tensors_is_delivered_even_as_a_senders_first():
    """Zero-size tensors (an empty buffer, a 0-row embedding) make a 0-byte bucket: the first push sizes the
    transport from it and must still get a usable slot; the bucket travels with fingerprint 0."""
    engine = SinkEngine()
    receiver, link = local_receiver(engine)
    named = [("e", torch.empty(0)), ("f", torch.empty(0, 3, dtype=torch.bfloat16))]
    try:
        with Sender(link, transport="shm") as sender:
            report = sender.push(named)
            assert (report.buckets, report.bytes) == (1, 0)
            assert receiver.committed_update_id == report.update_id
            assert {n: (tuple(t.shape), t.dtype) for n, t in engine.tensors.items()} == {
                "e": ((0,), torch.float32),
                "f": ((0, 3), torch.bfloat16),
            }
            # and after a non-empty update, an empty one through the same slots
            sender.push([("w", torch.randn(4))])
            again = sender.push_stream([("e", (0,), torch.float32)], iter(named[:1]))
            assert receiver.committed_update_id == again.update_id and list(engine.tensors) == ["e"]
    finally:
        receiver.close()


def test_a_bucket_that_is_one_tensor_is_sent_from_its_own_bytes_even_when_larger_than_a_slot():
    """A tensor bigger than the bucket cap is its own bucket: it streams slot by slot out of the tensor itself,
    so the sender never allocates a second copy of it (no staging buffer)."""
    engine = SinkEngine()
    receiver, link = local_receiver(engine)
    small = torch.randn(64)
    big = torch.randn(256, 1024)  # 1 MiB, 16 slots of 64 KiB
    try:
        with Sender(link, transport="shm", bucket_bytes=1 << 16) as sender:
            sender.push([("small", small)])  # sizes the slots: 64 KiB
            assert sender.transport.slot_bytes == 1 << 16
            report = sender.push([("big", big), ("small", small)])
            assert report.buckets == 2 and torch.equal(engine.tensors["big"], big)
            assert sender._streamer._staging.tensors == []  # (the streamer's staging buffers: none was needed)
    finally:
        receiver.close()


def test_the_senders_staging_buffer_is_made_once_and_reused_by_later_buckets_and_updates():
    """A bucket larger than a slot is packed through the one staging buffer, allocated at the first such bucket."""
    engine = SinkEngine()
    receiver, link = local_receiver(engine)
    big = [(f"t{i}", torch.randn(64, 64)) for i in range(12)]  # 12 x 16 KiB: one 192 KiB bucket
    try:
        with Sender(link, transport="shm", bucket_bytes=1 << 20) as sender:
            sender.push([("s", torch.randn(64))])  # the first update sizes the slots: 64 KiB
            assert sender.transport.slot_bytes == 1 << 16
            assert sender._streamer._staging.tensors == []  # (the streamer's staging buffers: not needed yet)
            sender.push(big)
            (staging,) = sender._streamer._staging.tensors  # on the CPU, one buffer: its copies are in order
            assert staging.numel() >= 12 * (1 << 14)
            again = [(n, t + 1) for n, t in big]
            sender.push(again)
            assert len(sender._streamer._staging.tensors) == 1 and sender._streamer._staging.tensors[0] is staging
            for name, t in again:
                assert torch.equal(engine.tensors[name], t)
    finally:
        receiver.close()


def test_a_sender_numbers_its_updates_itself_after_attaching():
    """The engine's next id comes with the Attach reply; later pushes cost no Status round trip, and a
    requested id moves the sender's own numbering past it."""
    receiver = Receiver(SinkEngine(), "cpu")
    link = CountingLink(receiver)
    try:
        with Sender(link, transport="shm") as sender:
            ids = [sender.push([("w", torch.randn(4))]).update_id for _ in range(3)]
            assert ids == [ids[0], ids[0] + 1, ids[0] + 2]
            assert sender.push([("w", torch.randn(4))], update_id=ids[-1] + 5).update_id == ids[-1] + 5
            assert sender.push([("w", torch.randn(4))]).update_id == ids[-1] + 6
            assert "Status" not in link.sent, link.sent
    finally:
        receiver.close()


def test_a_report_carries_what_the_engine_counted_and_no_verify_time_without_a_probe():
    """``report.delivery`` is the engine's count of what it changed; ``seconds["verify"]`` exists only when
    the push was verified (it is the engine's share of "commit")."""
    engine = CountingSink()
    receiver, link = local_receiver(engine)
    try:
        with Sender(link, transport="shm") as sender:
            report = sender.push([("w", torch.randn(8)), ("b", torch.randn(2))])
            assert report.delivery is not None and (report.delivery.changed, report.delivery.expected) == (2, 2)
            assert "verify" not in report.seconds
            assert set(report.seconds) == {"pack", "transfer", "stage", "prepare", "commit", "total"}
    finally:
        receiver.close()
