"""How bytes land (``sync.landing``), on the CPU: each destination, chunked buckets, plans, checks.

Every landing strategy is driven through a real ``Receiver`` and shm transport, with an
engine that lends nothing, lends its tensors, or lends per-bucket flat buffers. Which path a
bucket took shows in what the Receiver keeps (``buffer_bytes``: the bounce buffer), in where
the staged bytes are before ``prepare`` and in the landing's plan.
"""

from __future__ import annotations

import pytest
import torch

from colosync import transports
from colosync.errors import FingerprintMismatchError, NonFiniteError, TransactionStateError
from colosync.kernels import fused
from colosync.sync.landing import BOUNCE, SLOT, Fence, Plans, RowMirror, ViewKey
from colosync.sync.receiver import Receiver, ReceiverPolicy
from colosync.sync.target import EngineTarget, ModelSpec, Staging
from colosync.transports.shm import ShmSender
from colosync.wire.bucket import plan_buckets, typed_views
from colosync.wire.manifest import UpdateManifest, decode_manifest, encode_manifest
from colosync.wire.protocol import Attach, Begin, Commit, Prepare
from tests.helpers import pack_bucket, stage_bytes

LENDS = [None, "tensors", "buckets"]
KINDS = {None: "owned", "tensors": "tensors", "buckets": "buckets"}


class LendingEngine(EngineTarget):
    """A tensor store that lends nothing, its own tensors, or per-bucket flat buffers (``lend``)."""

    def __init__(self, lend: str | None = None, short: int = 0, device: str = "cpu") -> None:
        self.lend, self.short, self.device = lend, short, device  # short: lend that many tensors too few
        self.tensors: dict[str, torch.Tensor] = {}
        self.lent: list[torch.Tensor] | Staging | None = None
        self.checks = 0

    def model_spec(self) -> ModelSpec:
        return ModelSpec(params=None, lora_modules=None)

    def check(self, manifest: UpdateManifest) -> None:
        self.checks += 1

    def staging(self, manifest: UpdateManifest):
        if self.lend is None:
            return None
        metas = manifest.tensors[: len(manifest.tensors) - self.short]
        if self.lend == "tensors":
            self.lent = [torch.zeros(m.shape, dtype=m.torch_dtype, device=self.device) for m in metas]
        else:
            flats = [torch.zeros(size, dtype=torch.uint8, device=self.device) for size in manifest.bucket_sizes]
            self.lent = Staging([typed_views(flats[m.bucket], [m])[0] for m in metas], flats)
        return self.lent

    def lent_tensors(self) -> list[torch.Tensor]:
        return self.lent.tensors if isinstance(self.lent, Staging) else self.lent

    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in tensors.items()}

    def commit(self, prepared: dict[str, torch.Tensor], update_id: int) -> None:
        self.tensors = prepared

    def discard(self, prepared: dict[str, torch.Tensor]) -> None:
        prepared.clear()


def open_rig(
    lend: str | None = None,
    policy: ReceiverPolicy | None = None,
    slot_bytes: int = 1 << 12,
    device: str = "cpu",
    transport: str = "shm",
):
    engine = LendingEngine(lend, device=device)
    receiver = Receiver(engine, device, policy or ReceiverPolicy(timeout_s=30.0))
    return engine, receiver, attach(receiver, slot_bytes, transport)


def attach(receiver: Receiver, slot_bytes: int = 1 << 12, kind: str = "shm"):
    transport = transports.sender_class(kind).create(slot_bytes, 2, receiver.device)
    receiver.handle(Attach(kind, transport.handle()))
    transport.attached()
    return transport


@pytest.fixture
def rigs():
    opened = []

    def make(lend=None, policy=None, slot_bytes=1 << 12, device="cpu", transport="shm"):
        rig = open_rig(lend, policy, slot_bytes, device, transport)
        opened.append(rig)
        return rig

    yield make
    for _, receiver, transport in opened:
        receiver.close()
        transport.close()


def values(seed: int, specs) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape, dtype in specs}


def manifest(uid: int, specs, bucket_bytes: int = 1 << 12, layout=None) -> UpdateManifest:
    return UpdateManifest(uid, "full", layout or plan_buckets(specs, bucket_bytes))


def push(receiver, transport, m: UpdateManifest, tensors, chunk: int | None = None, commit: bool = True) -> None:
    receiver.handle(Begin(m))
    for b in range(len(m.bucket_sizes)):
        stage_bytes(receiver, transport, m.update_id, b, pack_bucket(m, b, tensors), chunk)
    if commit:
        receiver.handle(Prepare(m.update_id))
        receiver.handle(Commit(m.update_id))


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


MIXED = [
    ("a", (3, 5), torch.float32),
    ("b", (7,), torch.bfloat16),
    ("c", (4, 4), torch.float16),
    ("d", (9,), torch.float32),
]  # several tensors, several dtypes, padding between them
WHOLE = [("w", (16, 8), torch.float32)]  # 512 bytes: a bucket that is exactly one tensor


@pytest.mark.parametrize("lend", LENDS)
@pytest.mark.parametrize("chunk", [None, 64, 128], ids=["whole", "chunks64", "chunks128"])
def test_every_landing_delivers_the_bytes_whole_or_in_chunks(rigs, lend, chunk):
    engine, receiver, transport = rigs(lend)
    m = manifest(1, MIXED, bucket_bytes=192)  # a bucket of three tensors (192 bytes), one of one
    assert len(m.bucket_sizes) > 1 and any(len(m.layout.bucket_tensors(b)) > 1 for b in range(len(m.bucket_sizes)))
    want = values(1, MIXED)
    push(receiver, transport, m, want, chunk, commit=False)
    assert receiver._inflight.landing.kind == KINDS[lend]
    receiver.handle(Prepare(1))
    receiver.handle(Commit(1))
    assert_equal(engine.tensors, want)
    assert receiver.in_flight is None and receiver.committed_update_id == 1


def test_owned_landing_hands_out_views_of_one_buffer_per_bucket(rigs):
    _, receiver, transport = rigs(None)
    m = manifest(1, MIXED, bucket_bytes=192)
    want = values(2, MIXED)
    push(receiver, transport, m, want, chunk=64, commit=False)
    landing = receiver._inflight.landing
    assert sorted(landing.buffers) == list(range(len(m.bucket_sizes)))
    for t in m.tensors:  # zero-copy views into the bucket's buffer, already holding the bytes
        buffer = landing.buffers[t.bucket]
        assert landing.tensors[t.name].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(landing.tensors[t.name], want[t.name])
    assert receiver.buffer_bytes == 0


def test_lent_tensors_are_filled_straight_from_the_slot(rigs):
    engine, receiver, transport = rigs("tensors")
    m = manifest(1, MIXED)  # one bucket of four tensors, one chunk
    want = values(3, MIXED)
    push(receiver, transport, m, want, commit=False)
    assert_equal(dict(zip(want, engine.lent_tensors(), strict=False)), want)  # landed before prepare
    assert receiver.buffer_bytes == 0  # no bounce buffer: copied out of the slot itself
    assert list(receiver._inflight.landing.plan.buckets[0].views) == [ViewKey(SLOT, 0)]


def test_a_lent_tensor_that_is_a_whole_bucket_lands_flat_even_in_chunks(rigs):
    engine, receiver, transport = rigs("tensors")
    m = manifest(1, WHOLE)
    assert m.bucket_sizes == (512,)
    want = values(4, WHOLE)
    push(receiver, transport, m, want, chunk=128, commit=False)
    assert torch.equal(engine.lent_tensors()[0], want["w"])
    assert receiver.buffer_bytes == 0  # chunks were copied into the tensor's bytes, not assembled first


def test_chunked_buckets_for_lent_tensors_go_through_one_kept_bounce_buffer(rigs):
    engine, receiver, transport = rigs("tensors")
    m = manifest(1, MIXED)
    size = m.bucket_sizes[0]
    push(receiver, transport, m, values(5, MIXED), chunk=64)
    assert receiver.buffer_bytes == size
    bounce = receiver._lander.bounce.tensor
    want = values(6, MIXED)
    push(receiver, transport, manifest(2, MIXED, layout=m.layout), want, chunk=64)
    assert_equal(engine.tensors, want)
    assert receiver._lander.bounce.tensor is bounce  # kept between updates, not reallocated
    assert list(receiver._lander.plans.get(m.layout).buckets[0].views) == [ViewKey(BOUNCE)]


def test_a_grown_bounce_buffer_drops_the_views_of_the_old_one(rigs):
    engine, receiver, transport = rigs("tensors")
    small = manifest(1, MIXED)
    push(receiver, transport, small, values(7, MIXED), chunk=64)
    big_specs = [("x", (100,), torch.float32), ("y", (100,), torch.float32)]
    push(receiver, transport, manifest(2, big_specs), values(8, big_specs), chunk=64)
    assert receiver.buffer_bytes > small.bucket_sizes[0]  # grown
    want = values(9, MIXED)
    push(receiver, transport, manifest(3, MIXED, layout=small.layout), want, chunk=64)
    assert_equal(engine.tensors, want)  # stale views would copy update 1's bytes out of the old buffer


def test_lent_bucket_buffers_receive_one_flat_copy_each(rigs):
    engine, receiver, transport = rigs("buckets")
    m = manifest(1, MIXED, bucket_bytes=192)
    want = values(10, MIXED)
    push(receiver, transport, m, want, chunk=64, commit=False)
    for b, flat in enumerate(engine.lent.buckets):
        assert torch.equal(flat, pack_bucket(m, b, want))  # the whole bucket, padding included
    assert receiver.buffer_bytes == 0  # chunks went straight into the engine's buffers
    assert not receiver._inflight.landing.buffers


def test_a_layout_reused_across_updates_reuses_its_plan(rigs):
    engine, receiver, transport = rigs("tensors")
    m = manifest(1, MIXED)
    push(receiver, transport, m, values(11, MIXED), commit=False)
    plan = receiver._inflight.landing.plan
    views = plan.buckets[0].views[ViewKey(SLOT, 0)]
    receiver.handle(Prepare(1))
    receiver.handle(Commit(1))
    again = decode_manifest(encode_manifest(manifest(2, MIXED, layout=m.layout)))  # equal, not identical
    push(receiver, transport, again, values(12, MIXED), commit=False)
    assert receiver._inflight.landing.plan is plan
    assert plan.buckets[0].views[ViewKey(SLOT, 0)] is views  # slot views built once
    assert engine.checks == 1  # the engine checked the layout once
    receiver.handle(Prepare(2))
    receiver.handle(Commit(2))


def test_only_the_most_recent_layouts_keep_a_plan(rigs):
    engine, receiver, transport = rigs(None)
    layouts = [plan_buckets([(f"t{i}", (4,), torch.float32)], 1 << 12) for i in range(10)]
    for uid, layout in enumerate(layouts, start=1):
        push(receiver, transport, manifest(uid, None, layout=layout), {f"t{uid - 1}": torch.ones(4)})
    plans = receiver._lander.plans
    assert len(plans) == plans.capacity == 8 and layouts[0] not in plans and layouts[-1] in plans
    assert engine.checks == 10
    push(receiver, transport, manifest(11, None, layout=layouts[0]), {"t0": torch.ones(4)})
    assert engine.checks == 11  # evicted: checked again
    push(receiver, transport, manifest(12, None, layout=layouts[-1]), {"t9": torch.ones(4)})
    assert engine.checks == 11


def test_plans_are_least_recently_used():
    plans = Plans(capacity=2)
    a, b, c = (plan_buckets([(name, (2,), torch.float32)], 1 << 12) for name in "abc")
    first = plans.get(a)
    plans.get(b)
    assert plans.get(a) is first  # a is now the most recent
    plans.get(c)
    assert a in plans and b not in plans and c in plans


def test_a_new_transport_voids_the_views_of_the_old_slots(rigs):
    engine, receiver, old = rigs("tensors")
    m = manifest(1, MIXED)
    push(receiver, old, m, values(13, MIXED))
    plan = receiver._lander.plans.get(m.layout)
    assert list(plan.buckets[0].views) == [ViewKey(SLOT, 0)]
    receiver.detach()  # one sender at a time: the old one leaves, a new one attaches
    new = attach(receiver)
    try:
        keys = list(plan.buckets[0].views)  # (never shown: views of an unmapped slot crash a reader)
        assert keys == []
        old.slot(0).fill_(0)  # what stale views would read
        want = values(14, MIXED)
        push(receiver, new, manifest(2, MIXED, layout=m.layout), want)
        assert_equal(engine.tensors, want)
    finally:
        receiver.close()
        new.close()


def test_one_slot_acknowledges_each_stage_two_slots_lag_one():
    fence = Fence(torch.device("cpu"))
    fence.staged()  # nothing to wait for off CUDA
    fence.drain()
    receiver = Receiver(LendingEngine(), "cpu")
    for slots, lag in ((1, False), (2, True)):
        transport = ShmSender(1 << 10, slots, torch.device("cpu"))
        receiver.handle(Attach("shm", transport.handle()))
        assert receiver._lander.fence.lag is lag
        receiver.close()
        transport.close()


# -- checks -------------------------------------------------------------------------------------
PAIR = [("a", (3,), torch.float32), ("b", (3,), torch.float32)]  # a: 12 bytes, then padding to 64


@pytest.mark.parametrize("lend", LENDS)
@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "chunks"])
def test_a_changed_fingerprint_is_refused_and_ends_the_update(rigs, lend, chunk):
    engine, receiver, transport = rigs(lend)
    m = manifest(1, MIXED)
    receiver.handle(Begin(m))
    with pytest.raises(FingerprintMismatchError, match="bytes changed in transit"):
        stage_bytes(receiver, transport, 1, 0, pack_bucket(m, 0, values(15, MIXED)), chunk, fingerprint_delta=1)
    assert receiver.in_flight is None
    with pytest.raises(TransactionStateError, match="was aborted"):
        receiver.handle(Prepare(1))
    assert engine.tensors == {}


@pytest.mark.parametrize("lend", LENDS)
def test_a_missing_fingerprint_is_refused(rigs, lend):
    _, receiver, transport = rigs(lend)
    m = manifest(1, PAIR)
    receiver.handle(Begin(m))
    with pytest.raises(FingerprintMismatchError, match="!= sent None"):
        stage_bytes(receiver, transport, 1, 0, pack_bucket(m, 0, values(16, PAIR)), send_fingerprint=False)


@pytest.mark.parametrize("lend", LENDS)
@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "chunks"])
def test_nan_in_a_tensor_is_refused_by_name(rigs, lend, chunk):
    engine, receiver, transport = rigs(lend)
    m = manifest(1, MIXED)
    bad = values(17, MIXED)
    bad["c"][1, 2] = float("nan")
    receiver.handle(Begin(m))
    with pytest.raises(NonFiniteError, match=r"tensors \['c'\] hold NaN"):
        stage_bytes(receiver, transport, 1, 0, pack_bucket(m, 0, bad), chunk)
    assert receiver.in_flight is None and engine.tensors == {}


@pytest.mark.parametrize("lend", LENDS)
def test_nan_bits_in_padding_alone_pass(rigs, lend):
    engine, receiver, transport = rigs(lend)
    m = manifest(1, PAIR)
    want = values(18, PAIR)
    data = pack_bucket(m, 0, want)
    data[16:20] = 0xFF  # a float32 NaN between a (12 bytes) and b (at 64)
    flagged = fused.copy_check(data, None, fused.segments(list(m.tensors), m.bucket_sizes[0]))
    assert flagged.tolist()[1] == 1  # the bucket-wide check does see it ...
    receiver.handle(Begin(m))
    stage_bytes(receiver, transport, 1, 0, data)
    receiver.handle(Prepare(1))
    receiver.handle(Commit(1))  # ... and the tensor-by-tensor recheck lets it through
    assert_equal(engine.tensors, want)


@pytest.mark.parametrize("lend", LENDS)
def test_nan_in_fp8_is_found_tensor_by_tensor(rigs, lend):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    engine, receiver, transport = rigs(lend)
    specs = [("q", (64,), torch.float8_e4m3fn), ("s", (4,), torch.float32)]
    m = manifest(1, specs)
    assert fused.segments(list(m.tensors), m.bucket_sizes[0]) is None  # no bucket-wide check for fp8
    raw = torch.zeros(64, dtype=torch.uint8)
    raw[5] = 0x7F  # e4m3fn NaN
    tensors = {"q": raw.view(torch.float8_e4m3fn), "s": torch.ones(4)}
    receiver.handle(Begin(m))
    with pytest.raises(NonFiniteError, match=r"tensors \['q'\]"):
        stage_bytes(receiver, transport, 1, 0, pack_bucket(m, 0, tensors))
    raw[5] = 0x38  # 1.0
    push(receiver, transport, manifest(2, specs, layout=m.layout), tensors)
    assert torch.equal(engine.tensors["q"].view(torch.uint8), raw)


@pytest.mark.parametrize("lend", LENDS)
def test_a_permissive_policy_checks_nothing(rigs, lend):
    engine, receiver, transport = rigs(lend, ReceiverPolicy(reject_nonfinite=False, verify_fingerprints=False))
    m = manifest(1, MIXED)
    bad = values(19, MIXED)
    bad["a"][0, 0] = float("inf")
    receiver.handle(Begin(m))
    stage_bytes(receiver, transport, 1, 0, pack_bucket(m, 0, bad), fingerprint_delta=5)
    receiver.handle(Prepare(1))
    receiver.handle(Commit(1))
    assert_equal(engine.tensors, bad)


@pytest.mark.parametrize("lend", ["tensors", "buckets"])
def test_staging_of_the_wrong_length_is_refused(lend):
    engine = LendingEngine(lend, short=1)
    receiver = Receiver(engine, "cpu")
    try:
        with pytest.raises(TransactionStateError, match="staging\\(\\) must return one per manifest tensor"):
            receiver.handle(Begin(manifest(1, MIXED)))
        assert receiver.in_flight is None
    finally:
        receiver.close()


# -- on a GPU: the same strategies, checks deferred to prepare ---------------------------------
GPU_RIGS = [pytest.param(("shm", lend), id=f"shm-{KINDS[lend]}", marks=pytest.mark.gpu) for lend in LENDS] + [
    pytest.param(("cuda_ipc", lend), id=f"cuda_ipc-{KINDS[lend]}", marks=pytest.mark.gpu) for lend in LENDS
]


def on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.cpu() for name, t in tensors.items()}


@pytest.mark.parametrize("rig", GPU_RIGS)
@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "chunks"])
def test_gpu_landings_deliver_the_bytes(rigs, rig, chunk):
    kind, lend = rig
    engine, receiver, transport = rigs(lend, device="cuda:0", transport=kind)
    m = manifest(1, MIXED, bucket_bytes=192)
    for uid, seed in ((1, 20), (2, 21)):  # the second update reuses plan, views and bounce buffer
        want = values(seed, MIXED)
        push(receiver, transport, manifest(uid, None, layout=m.layout), want, chunk)
        assert_equal(on_cpu(engine.tensors), want)
    direct = kind == "cuda_ipc" and chunk is None
    assert (receiver.buffer_bytes == 0) == (lend != "tensors" or direct)  # lent tensors from host: bounced


@pytest.mark.gpu
def test_a_receiver_on_cuda_without_an_index_copies_from_device_slots_directly(rigs):
    engine, receiver, transport = rigs("tensors", device="cuda", transport="cuda_ipc")
    want = values(23, MIXED)
    push(receiver, transport, manifest(1, MIXED), want)
    assert_equal(on_cpu(engine.tensors), want)
    assert receiver.buffer_bytes == 0


@pytest.mark.parametrize("rig", GPU_RIGS)
def test_gpu_checks_are_read_at_prepare(rigs, rig):
    kind, lend = rig
    engine, receiver, transport = rigs(lend, device="cuda", transport=kind)
    m = manifest(1, PAIR)
    good = values(22, PAIR)
    bad = {**good, "b": good["b"].clone()}
    bad["b"][1] = float("inf")
    for uid, tensors, delta, error in ((1, good, 1, FingerprintMismatchError), (2, bad, 0, NonFiniteError)):
        receiver.handle(Begin(manifest(uid, None, layout=m.layout)))
        stage_bytes(receiver, transport, uid, 0, pack_bucket(m, 0, tensors), fingerprint_delta=delta)
        assert receiver.in_flight == uid  # accepted for now: the verdict is on the device
        with pytest.raises(error):
            receiver.handle(Prepare(uid))
        assert receiver.in_flight is None
    data = pack_bucket(m, 0, good)
    data[16:20] = 0xFF  # NaN bits in padding only: flagged on the device, cleared by the recheck
    receiver.handle(Begin(manifest(3, None, layout=m.layout)))
    stage_bytes(receiver, transport, 3, 0, data)
    receiver.handle(Prepare(3))
    receiver.handle(Commit(3))
    assert_equal(on_cpu(engine.tensors), good)


@pytest.mark.parametrize("rig", GPU_RIGS)
def test_gpu_verdicts_are_read_only_once_their_copy_to_the_host_is_done(rigs, rig, monkeypatch):
    """The verdict rows reach pinned memory on a stream of their own (``RowMirror``). Here that stream
    is held up ~50 ms before each copy: a ``prepare`` that read the host rows without waiting for it
    would see the previous update's rows, refuse a good update and miss an Inf."""
    real = RowMirror.copy

    def late(self, dst, src):
        if self._stream is None:
            self._stream, self._done = torch.cuda.Stream(self.device), torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            torch.cuda._sleep(100_000_000)
        real(self, dst, src)

    monkeypatch.setattr(RowMirror, "copy", late)
    kind, lend = rig
    engine, receiver, transport = rigs(lend, device="cuda", transport=kind)
    m = manifest(1, MIXED, bucket_bytes=192)
    assert len(m.bucket_sizes) >= 2
    for uid, seed in ((1, 30), (2, 31), (3, 32)):  # new values each time: stale rows cannot match
        want = values(seed, MIXED)
        push(receiver, transport, manifest(uid, None, layout=m.layout), want)
        assert_equal(on_cpu(engine.tensors), want)
    assert receiver._lander.mirror._stream is not None  # the rows really went through the mirror
    bad = values(33, MIXED)
    bad["d"][4] = float("inf")
    with pytest.raises(NonFiniteError):
        push(receiver, transport, manifest(4, None, layout=m.layout), bad)
    assert receiver.committed_update_id == 3
