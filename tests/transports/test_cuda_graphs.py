"""CUDA-graph replay of the pack and the landing, and the interprocess event: never a stale replay.

The CPU cases check the pure parts: what a graph key depends on, the cache's eager ->
capture -> replay bookkeeping, and the cuda_ipc handle's new fields. The ``gpu`` cases push
real updates through real graphs and change, between two pushes of one layout, exactly one
thing a graph bakes in (the source tensors' storage or strides, the engine's destination
storage, the layout); each case first checks that graphs really were replayed, so it fails
if a stale graph is replayed and would not pass vacuously without graphs. Corrupted payloads
must still be caught under replay, and the engine's stream must wait for the trainer's
event rather than read a slot the trainer's GPU has not written yet.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from colosync.control.link import LocalLink
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.engines.sink import Digest, SinkEngine, tensor_digests
from colosync.errors import FingerprintMismatchError, NonFiniteError, TransportError
from colosync.kernels import fused
from colosync.sync.landing import LayoutPlan
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender
from colosync.sync.target import Staging
from colosync.transports import cuda_graphs
from colosync.transports.cuda_graphs import GraphCache, LayoutVersion
from colosync.transports.cuda_ipc import FINGERPRINT_CELLS, CudaIpcHandle
from colosync.wire.bucket import plan_buckets
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Attach, Begin, Commit, Prepare, Stage
from tests.helpers import pack_into


# -- CPU: keys, bookkeeping, handle ------------------------------------------------------------
@pytest.fixture(params=["torch", "python"])
def guard(request, monkeypatch):
    """Each way ``LayoutVersion`` compares layouts: torch's TensorGuards, and the Python fallback."""
    impl = cuda_graphs._torch_guard if request.param == "torch" else cuda_graphs._python_guard
    monkeypatch.setattr(cuda_graphs, "_guard_maker", lambda: impl)
    return request.param


def test_torchs_tensor_guards_pass_the_self_test_on_this_torch():
    """The fast comparison is the one in use: a torch that broke it would cost every sync 0.1-0.3 ms, silently."""
    assert cuda_graphs._guard_maker() is cuda_graphs._torch_guard


def test_a_layout_keeps_its_number_until_a_shape_stride_dtype_or_count_changes(guard):
    layouts = LayoutVersion()
    a, b = torch.randn(8, 8), torch.zeros(3, dtype=torch.int64)
    first = layouts.of([a, b])
    a.mul_(2)  # new values
    assert layouts.of([a, b]) == first
    assert layouts.of([torch.ones(8, 8), torch.ones(3, dtype=torch.int64)]) == first  # other memory, same layout
    seen = {first}
    for changed in (
        [a.t(), b],  # same shape, other strides
        [a.view(64), b],
        [a.view(4, 16), b],
        [a, b.int()],  # dtype
        [a, b, b],  # count
        [a],
    ):
        number = layouts.of(changed)
        assert number not in seen, changed
        assert layouts.of(changed) == number  # and it holds for as long as the layout does
        seen.add(number)
    c = torch.zeros(4, 4)
    before = layouts.of([c])
    c.data = c.data.t()  # the same tensor object, in place: the same address and shape, other strides
    assert layouts.of([c]) != before
    assert LayoutVersion().of([c]) not in seen | {before}  # numbers are unique across owners


def test_a_key_changes_with_the_memory_and_the_layout_not_with_values(guard):
    layouts = LayoutVersion()
    a = torch.randn(8, 8)
    key = layouts.key([a])
    a.mul_(2)  # new values, same memory: the same graph is right
    assert layouts.key([a]) == key
    assert layouts.key([a.clone()]) != key  # new storage
    assert layouts.key([a.t()]) != key  # same storage and shape, other strides
    assert layouts.key([a[1:]]) != layouts.key([a[:-1]])  # other offset
    assert layouts.key([a.view(torch.int32)]) != key  # dtype


def test_cache_is_eager_without_cuda():
    cache = GraphCache(torch.device("cpu"))
    ran = []
    for _ in range(3):
        assert cache.run("k", lambda: ran.append(1)) == "eager"
    assert len(ran) == 3 and cache.counts == {"eager": 3, "capture": 0, "replay": 0}


def test_cache_bookkeeping_first_eager_then_capture_then_replay_and_evicts():
    cache = GraphCache(torch.device("cpu"), capacity=2)
    cache.enabled = True  # the bookkeeping only: ``step`` runs nothing
    assert [cache.step("a"), cache.step("a"), cache.step("a")] == ["eager", "capture", "replay"]
    assert cache.step("b") == "eager"
    assert cache.step("c") == "eager"  # evicts "a", the least recently used
    assert cache.step("a") == "eager" and len(cache) == 2
    cache.clear()
    assert cache.step("b") == "eager"


def test_landing_graphs_are_dropped_when_a_transport_attaches():
    from colosync.sync.landing import Lander

    lander = Lander(torch.device("cpu"))
    layout = plan_buckets([("w", (4,), torch.float32)], 1 << 12)
    bucket = lander.plans.get(layout).buckets[0]
    first = bucket.graphs(torch.device("cpu"))
    assert bucket.graphs(torch.device("cpu")) is first
    lander.attached(1)
    assert bucket.graphs(torch.device("cpu")) is not first
    assert isinstance(lander.plans.get(layout), LayoutPlan)


def test_cuda_ipc_handle_carries_one_event_per_slot_and_the_cells():
    h = CudaIpcHandle(b"\0" * 64, "GPU-x", 1, 1000, 2, (b"\1" * 64, b"\2" * 64), FINGERPRINT_CELLS)
    assert h.cells_offset == 2000 and h.nbytes == 2000 + 16 * FINGERPRINT_CELLS
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=CudaIpcHandle) == h
    old = msgspec.msgpack.encode({"handle": b"\0" * 64, "device_uuid": "u", "pid": 1, "slot_bytes": 8, "slots": 1})
    legacy = msgspec.msgpack.decode(old, type=CudaIpcHandle)  # a sender that syncs its host
    assert legacy.events == () and legacy.fingerprint_cells == 0 and legacy.nbytes == 8
    with pytest.raises(TransportError, match="one 64-byte event handle per slot"):
        CudaIpcHandle(b"\0" * 64, "u", 1, 8, 2, (b"\1" * 64,))
    with pytest.raises(TransportError, match="fingerprint_cells"):
        CudaIpcHandle(b"\0" * 64, "u", 1, 8, 1, (), -1)


# -- GPU ---------------------------------------------------------------------------------------
def named(seed: int, n: int = 24, device: str = "cuda") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [(f"l{i}.w", torch.randn(32 + i, 64, device=device, generator=g).to(torch.bfloat16)) for i in range(n)] + [
        ("sq", torch.randn(48, 48, device=device, generator=g))
    ]


def served_digests(engine) -> dict[str, int]:
    if isinstance(engine, EngineProcess):
        reply = engine.call(Digest())
        return dict(zip(reply.names, reply.fingerprints, strict=True))
    names = list(engine.tensors)
    return dict(zip(names, tensor_digests([engine.tensors[n] for n in names]), strict=True))


def assert_served(engine, tensors: list[tuple[str, torch.Tensor]]) -> None:
    want = dict(zip([n for n, _ in tensors], tensor_digests([t for _, t in tensors]), strict=True))
    assert served_digests(engine) == want


def assert_nan_refused(engine, sender, tensors, index: int, where: tuple[int, int]) -> None:
    """A NaN put into ``tensors[index]`` at ``where`` fails the push, and the engine keeps what it served."""
    committed = engine.call(Digest()).update_id
    with torch.no_grad():
        tensors[index][1][where] = float("nan")
    with pytest.raises(NonFiniteError):
        sender.push(tensors)
    assert engine.call(Digest()).update_id == committed


class RelendingSink(SinkEngine):
    """A sink that can lend fresh storage (``relend``), or tensors only (``flat=False``).

    It keeps every set it lent alive, so fresh storage never reuses an old set's addresses.
    """

    def __init__(self, flat: bool = True) -> None:
        super().__init__("cuda")
        self.flat = flat
        self.relend = False
        self.lent: list[Staging] = []

    def staging(self, manifest: UpdateManifest) -> Staging:
        if self.relend:
            self._spare, self.relend = None, False
        lent = super().staging(manifest)
        self.lent.append(lent)
        return lent if self.flat else Staging(lent.tensors, None)


@pytest.fixture(scope="module")
def sink():
    engine = EngineProcess(EngineConfig(engine="sink", device="cuda", timeout_s=60.0))
    yield engine
    engine.close()


def in_process(flat: bool = True):
    engine = RelendingSink(flat)
    receiver = Receiver(engine, "cuda")
    return engine, receiver, Sender(LocalLink(receiver), transport="cuda_ipc")


@pytest.mark.gpu
def test_new_source_storage_lands_after_replays(sink):
    with Sender(sink.connect(), transport="cuda_ipc") as sender:
        first = named(1)
        for _ in range(3):
            sender.push(first)
        assert sender._streamer.graph_counts()["replay"] >= 1  # the pack really is a replayed graph
        with torch.no_grad():
            first[0][1].add_(1)  # same storage, new values: the replay reads them
        sender.push(first)
        assert_served(sink, first)
        second = named(2)  # same layout, new storage
        sender.push(second)
        assert_served(sink, second)
        # packed by the gather kernel, whose one graph reads the sources through its rows: rewritten, not re-keyed
        table = sender._plans.last.gather_table(0, torch.device("cuda", torch.cuda.current_device()))
        assert table.ptrs == tuple(t.data_ptr() for _, t in second)
        transposed = [*first[:-1], ("sq", first[-1][1].t())]  # same storage and shape, other strides
        sender.push(transposed)
        assert_served(sink, transposed)
        counts = sender._streamer.graph_counts()
        assert counts["replay"] >= 2 and counts["capture"] >= 1


@pytest.mark.gpu
def test_the_gather_into_the_staging_buffer_replays_and_follows_a_new_staging_buffer(sink):
    """Over shm a GPU bucket is gathered into a staging buffer before its chunks go to host memory; that
    launch replays as a graph keyed on the staging buffer. A bigger layout replaces the buffer; back on
    the first layout, a graph of the old buffer must not replay (it would pack into freed memory and the
    engine would serve, or refuse, stale bytes)."""
    with Sender(sink.connect(), transport="shm", bucket_bytes=1 << 20) as sender:
        small, big = named(40), named(41, n=200)
        for _ in range(4):
            with torch.no_grad():
                small[0][1].add_(1)  # new values each push, in place
            report = sender.push(small)
            assert report.buckets >= 1
            assert_served(sink, small)
        assert sender._streamer.graph_counts()["replay"] >= report.buckets  # the gather really replays
        old = sender._streamer._staging.tensors[0].data_ptr()
        sender.bucket_bytes = 4 << 20  # a new layout planned with bigger buckets: a bigger staging buffer
        sender.push(big)
        assert_served(sink, big)
        assert sender._streamer._staging.tensors[0].data_ptr() != old
        for seed in (42, 43, 44):  # new storage too: the gather table is rebound, the graph not re-keyed
            small = named(seed)
            sender.push(small)
            assert_served(sink, small)
        assert_nan_refused(sink, sender, small, 2, (0, 0))


@pytest.mark.gpu
def test_a_new_layout_and_back(sink):
    with Sender(sink.connect(), transport="cuda_ipc", bucket_bytes=64 << 10) as sender:
        a, b = named(3), named(4, n=9)
        for tensors in (a, a, a, b, b, b, a, b):
            sender.push(tensors)
            assert_served(sink, tensors)
        assert sender._streamer.graph_counts()["replay"] >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("flat", [True, False], ids=["lends-buckets", "lends-tensors"])
def test_new_destination_storage_gets_the_bytes(flat):
    engine, receiver, sender = in_process(flat)
    try:
        for step in range(6):  # the sink alternates two sets: each is captured, then replayed
            tensors = named(10 + step)
            sender.push(tensors)
            assert_served(engine, tensors)
        assert receiver._lander.plans.graph_counts()["replay"] >= 2
        before = {t.data_ptr() for s in engine.lent for t in s.tensors}
        engine.relend = True
        tensors = named(20)
        sender.push(tensors)
        assert not {t.data_ptr() for t in engine.tensors.values()} & before  # really new storage
        assert_served(engine, tensors)
        for step in range(4):  # and the new set replays correctly in turn
            tensors = named(30 + step)
            sender.push(tensors)
            assert_served(engine, tensors)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.gpu
def test_nan_is_caught_under_replay_end_to_end(sink):
    with Sender(sink.connect(), transport="cuda_ipc") as sender:
        tensors = named(5)
        for _ in range(5):
            sender.push(tensors)
        assert sender._streamer.graph_counts()["replay"] >= 3
        assert_nan_refused(sink, sender, tensors, 3, (2, 7))


@pytest.mark.gpu
def test_fingerprint_and_nan_checks_under_replayed_landing():
    """Drive the engine side by hand: its landing graph is replayed, and a bad fingerprint or a NaN still fails."""
    from colosync.transports.cuda_ipc import CudaIpcSender

    engine = SinkEngine("cuda")
    receiver = Receiver(engine, "cuda")
    link = LocalLink(receiver)
    specs = [("a", (300,), torch.float32), ("b", (17, 9), torch.bfloat16)]
    layout = plan_buckets(specs, 1 << 16)
    size = layout.bucket_sizes[0]
    transport = CudaIpcSender(1 << 16, 1, torch.device("cuda"))
    link.submit(Attach("cuda_ipc", transport.handle())).wait()
    cell = transport.fingerprint_cell(0)
    g = torch.Generator(device="cuda").manual_seed(9)
    try:
        for uid in range(1, 12):
            values = [torch.randn(s, device="cuda", generator=g).to(d) for _, s, d in specs]
            bad = uid in (7, 9, 10)
            if uid in (9, 10):
                values[uid - 9].view(-1)[5] = float("nan")  # a NaN in the float32 run, then in the bf16 one
            slot = transport.slot(0)[:size]
            slot.zero_()
            pack_into(slot, layout.tensors, values)
            cell.zero_()
            fused.copy_check(slot, None, None, out=cell)  # the sender's fingerprint, on the device
            if uid == 7:
                cell[0] += 1  # corrupted in transit
            seal = transport.written(0, torch.device("cuda"), cell)
            link.submit(Begin(UpdateManifest(uid, "full", layout))).wait()
            link.submit(Stage(uid, 0, 0, size, 0, None, seal)).wait()  # no fingerprint in the Stage: in the cell
            if bad:
                error = FingerprintMismatchError if uid == 7 else NonFiniteError
                with pytest.raises(error):
                    link.submit(Prepare(uid)).wait()
                continue
            link.submit(Prepare(uid)).wait()
            link.submit(Commit(uid)).wait()
            for (name, _, _), v in zip(specs, values, strict=True):
                assert torch.equal(engine.tensors[name], v), (uid, name)
            assert int(cell[0]) == 0  # read and zeroed by the engine
        assert receiver._lander.plans.graph_counts()["replay"] >= 5
        # a sender that writes no fingerprint after one that did: the zeroed cell fails closed
        link.submit(Begin(UpdateManifest(20, "full", layout))).wait()
        link.submit(Stage(20, 0, 0, size, 0, None, transport.written(0, torch.device("cuda")))).wait()
        with pytest.raises(FingerprintMismatchError):
            link.submit(Prepare(20)).wait()
    finally:
        receiver.close()
        transport.close()


@pytest.mark.gpu
def test_engine_waits_for_the_trainers_event_not_its_host(sink):
    """The trainer's GPU is kept busy before the pack: the Stage reaches the engine long before the
    bytes exist, so an engine that did not wait on the event would copy stale bytes."""
    with Sender(sink.connect(), transport="cuda_ipc") as sender:
        tensors = named(6)
        for _ in range(3):
            sender.push(tensors)
        fresh = named(7)
        for step in range(3):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream, queued, not waited for
            with torch.no_grad():
                for (_, t), (_, f) in zip(tensors, fresh, strict=True):
                    t.copy_(f + step)  # the new values exist only once the sleep is over
            sender.push(tensors)
            assert_served(sink, tensors)
        assert len(msgspec.msgpack.decode(sender.transport.handle(), type=CudaIpcHandle).events) == 1
