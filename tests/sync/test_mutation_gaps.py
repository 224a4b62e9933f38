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

    from colosync.sync.sender import peft_lora_spec, peft_lora_tensors
    from colosync.testing import load_model

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


def test_an_update_of_only_empty_tensors_is_delivered_even_as_a_senders_first():
    """Zero-size tensors (an empty buffer, a 0-row embedding) make a 0-byte bucket: the first push sizes the
    transport from it and must still get a usable slot; the bucket travels with fingerprint 0."""
    engine = SinkEngine()
    receiver, link = local(engine)
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
    receiver, link = local(engine)
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
    receiver, link = local(engine)
    try:
        with Sender(link, transport="shm") as sender:
            report = sender.push([("w", torch.randn(8)), ("b", torch.randn(2))])
            assert report.delivery is not None and (report.delivery.changed, report.delivery.expected) == (2, 2)
            assert "verify" not in report.seconds
            assert set(report.seconds) == {"pack", "transfer", "stage", "prepare", "commit", "total"}
    finally:
        receiver.close()


def test_push_hands_the_probe_to_the_engine(store_engine):
    """An engine that cannot score refuses ``push(..., verify=)`` before installing anything."""
    probe = Probe(prompts=[[1, 2]], completions=[[3]], logprobs=[[-0.5]])
    with Sender(store_engine.link, transport="shm") as sender:
        before = store_engine.link.submit(Status()).wait().committed_update_id
        with pytest.raises(ConfigError, match="cannot score a probe"):
            sender.push([("w", torch.randn(4, 4))], verify=probe)
        assert store_engine.link.submit(Status()).wait().committed_update_id == before


def test_a_host_staging_area_with_a_pool_is_a_lease_of_the_pools_chunks_given_back_when_the_update_ends():
    """``HostStaging(pool=...)``: a full update's staging takes the arena's pages (one contiguous lease,
    named for the sync, the buckets back to back inside it), and the lease goes back at ``done`` even when
    the area is kept."""
    from colosync.handoff.backends.arena import HostArena
    from colosync.sync.staging import HostStaging
    from colosync.wire.bucket import plan_buckets
    from colosync.wire.manifest import UpdateManifest

    with HostArena.create(1 << 18, chunk_bytes=1 << 16, pin="none") as arena:
        pool = arena.pool()
        area = HostStaging(keep=True, pin=False, pool=pool)
        specs = [("a", (3000,), torch.float32), ("b", (100,), torch.float32), ("c", (30000,), torch.float32)]
        manifest = UpdateManifest(1, "full", plan_buckets(specs, 1 << 14))
        staging = area.lend(manifest)
        assert set(pool.leases()) == {"engine.sync_staging"}
        flat = area._lease.flat  # (the lease the area holds: one run of chunks)
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
        assert hi - lo >= sum(manifest.bucket_sizes) and max(manifest.bucket_sizes) > arena.chunk_bytes
        for bucket in staging.buckets:
            assert lo <= bucket.data_ptr() and bucket.data_ptr() + bucket.numel() <= hi
        for t, (name, shape, dtype) in zip(staging.tensors, specs, strict=True):
            assert (tuple(t.shape), t.dtype) == (shape, dtype), name
        area.done()
        assert pool.leases() == {} and arena.leased_bytes == 0


def test_a_commit_after_a_failed_prepare_says_the_update_was_aborted_and_why():
    from colosync.errors import TiedWeightError, TransactionStateError
    from colosync.wire.protocol import Commit

    engine = TiedSink()
    receiver, link = local(engine)
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
    from colosync.wire.protocol import Ack, Codec

    engine = MiscountingSink()
    receiver, link = local(engine)
    codec = Codec(Ack)
    try:
        with Sender(link, transport="shm") as sender, pytest.raises(DeliveryError):
            sender.push([("w", torch.randn(8))])
        assert codec.decode(codec.encode(receiver.handle(Status()))).serving is False
    finally:
        receiver.close()


def test_a_lora_update_the_engine_miscounts_is_reported_in_modules():
    """The delivery error names the unit the engine counted: LoRA modules (full updates: parameters or layers)."""
    engine = MiscountingSink()
    receiver, link = local(engine)
    named = lora_named()
    try:
        with Sender(link, transport="shm") as sender:
            with pytest.raises(DeliveryError, match=r"the engine changed 0 modules where the manifest names 2\b"):
                sender.push(named, lora=LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",)))
            with pytest.raises(DeliveryError, match="the engine changed 0 parameters or layers where"):
                sender.push([("w", torch.randn(8))])
    finally:
        receiver.close()


def test_a_peft_adapter_on_full_module_paths_keeps_the_layers_it_was_configured_for(tiny_model_dir):
    """Targets given as full module paths are reported by leaf; ``layers_to_transform`` travels as configured."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from colosync.sync.sender import peft_lora_spec
    from colosync.testing import load_model

    torch.manual_seed(0)
    base = load_model(tiny_model_dir)
    layers = base.config.num_hidden_layers
    paths = [f"model.layers.{i}.self_attn.q_proj" for i in range(layers)]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=paths, layers_to_transform=list(range(layers)))
    spec = peft_lora_spec(get_peft_model(base, cfg))
    assert spec.target_modules == ("q_proj",) and spec.layers == tuple(range(layers))


def _attached_receiver(engine):
    from colosync.transports.shm import ShmSender
    from colosync.wire.protocol import Attach

    receiver = Receiver(engine, "cpu")
    transport = ShmSender(1 << 16, 1, torch.device("cpu"))
    receiver.handle(Attach("shm", transport.handle()))
    transport.attached()
    return receiver, transport


def test_an_empty_bucket_is_complete_only_once_its_stage_came():
    """A bucket of 0 bytes still needs its Stage: that is when its tensors reach the engine (a prepare
    without it would commit an update missing them)."""
    from colosync.engines.store import StoreEngine
    from colosync.errors import TransactionStateError
    from colosync.wire.bucket import plan_buckets
    from colosync.wire.manifest import UpdateManifest
    from colosync.wire.protocol import Begin, Commit, Prepare, Stage

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
    from colosync.errors import TransactionStateError
    from colosync.wire.bucket import plan_buckets
    from colosync.wire.manifest import UpdateManifest
    from colosync.wire.protocol import Abort, Begin, Commit, Prepare, Stage

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


def test_a_host_staging_area_pins_when_asked_and_by_default_exactly_when_cuda_is_present():
    from colosync.sync.staging import HostStaging

    assert HostStaging(keep=True, pin=True).pin is True
    assert HostStaging(keep=True, pin=False).pin is False
    assert HostStaging(keep=False).pin is torch.cuda.is_available()


def test_a_host_staging_area_that_lent_nothing_yet_owns_no_tensor():
    """An engine may ask before the first update whether its weights alias the area: they cannot."""
    from colosync.sync.staging import HostStaging

    area = HostStaging(keep=True, pin=False)
    weight = torch.randn(4)
    assert area.owns(weight) is False
    assert area.disown_if_aliased([weight]) is False


def test_a_receiver_on_cuda_where_there_is_none_is_refused_at_once():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available; use device='cpu'"):
        Receiver(SinkEngine(), "cuda")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        Receiver(SinkEngine(), "cuda:0")


def test_the_senders_staging_buffer_is_made_once_and_reused_by_later_buckets_and_updates():
    """A bucket larger than a slot is packed through the one staging buffer, allocated at the first such bucket."""
    engine = SinkEngine()
    receiver, link = local(engine)
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


def test_host_staging_packs_buckets_back_to_back_in_one_run_of_arena_chunks():
    """The buckets lie page-aligned, in order and without overlap, in one contiguous lease of as few
    chunks as hold them (a bucket may span chunks); an update without buckets leases nothing."""
    from colosync.handoff.backends.arena import HostArena
    from colosync.sync.staging import HostStaging
    from colosync.wire.manifest import Layout, TensorMeta, UpdateManifest

    def manifest(*sizes: int) -> UpdateManifest:
        metas = tuple(
            TensorMeta(name=f"t{b}", dtype="uint8", shape=(size,), bucket=b, offset=0, nbytes=size)
            for b, size in enumerate(sizes)
        )
        return UpdateManifest(1, "full", Layout(metas, sizes))

    chunk = 1 << 14
    with HostArena.create(8 * chunk, chunk_bytes=chunk, pin="none") as arena:
        pool = arena.pool()
        area = HostStaging(keep=False, pin=False, pool=pool)
        cases = [((4096, chunk - 4096), 1), ((12288, 12288, 12288), 3), ((64, 4096, 64), 1), ((40000,), 3), ((), 0)]
        for sizes, chunks in cases:
            staging = area.lend(manifest(*sizes))
            assert arena.leased_bytes == chunks * chunk, sizes
            flats = staging.buckets
            assert [f.numel() for f in flats] == list(sizes)
            if sizes:
                base = area._lease.flat.data_ptr()  # (the lease the area holds)
                starts = [f.data_ptr() - base for f in flats]
                assert all(s % 4096 == 0 for s in starts) and starts == sorted(starts), sizes
                assert all(a + n <= b for a, n, b in zip(starts, sizes, starts[1:], strict=False)), sizes
            area.done()
            assert arena.leased_bytes == 0


def test_host_staging_owns_exactly_the_bytes_of_its_buckets():
    """``owns``: a tensor inside a bucket is the area's; one that starts just past a bucket's end is not."""
    from colosync.handoff.backends.arena import HostArena
    from colosync.sync.staging import HostStaging
    from colosync.wire.bucket import plan_buckets
    from colosync.wire.manifest import UpdateManifest

    with HostArena.create(1 << 15, chunk_bytes=1 << 14, pin="none") as arena:
        area = HostStaging(keep=True, pin=False, pool=arena.pool())
        staging = area.lend(UpdateManifest(1, "full", plan_buckets([("w", (64,), torch.float32)], 1 << 14)))
        (flat,) = staging.buckets
        chunk = area._lease.flat
        start = flat.data_ptr() - chunk.data_ptr()
        assert area.owns(staging.tensors[0]) and area.owns(chunk[start + flat.numel() - 1 :])
        assert not area.owns(chunk[start + flat.numel() :]) and not area.owns(torch.empty(4))
        area.release()
