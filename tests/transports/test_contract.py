"""The one public harness every transport passes: the contract, between two real processes.

Every case is parametrized over ``colosync.transports.names()``, so a new transport needs only
its line in the registry (``colosync/transports/__init__.py``) to be covered here.

The receiving side is an engine in its own process, so bytes really cross the transport;
each case compares what the engine committed with what was sent, byte for byte. Two engines
cover the Receiver's two paths: ``store`` (the Receiver allocates buffers and hands out views)
and ``sink`` (the engine lends its own tensors and each bucket is copied straight into them).
On a CUDA machine the same cases run with tensors and engine on the GPU (``gpu`` marker).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from colosync import transports
from colosync.control.channel import EngineAddress
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.engines.sink import Digest, tensor_digests
from colosync.engines.store import Fetch
from colosync.sync.sender import Sender
from colosync.wire.protocol import Status
from tests.wire.test_bucket import DTYPES, sample

ENGINES = [
    pytest.param(("cpu", "store"), id="cpu-store"),
    pytest.param(("cpu", "sink"), id="cpu-sink"),
    pytest.param(("cuda", "store"), id="cuda-store", marks=pytest.mark.gpu),
    pytest.param(("cuda", "sink"), id="cuda-sink", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    device, kind = request.param
    eng = EngineProcess(EngineConfig(engine=kind, device=device, timeout_s=30.0))
    yield eng, device
    eng.close()


@pytest.fixture(params=transports.names())
def transport(request, engine):
    eng, device = engine
    cls = transports.sender_class(request.param)
    ok, why = cls.available(torch.device(device))
    if not ok:
        pytest.skip(f"{request.param} unavailable here: {why}")
    if not cls.colocated and device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"{request.param} over NCCL needs the engine on a GPU of its own; this machine has one")
    return request.param


def fetch_all(eng: EngineProcess) -> dict[str, torch.Tensor]:
    if eng.config.engine == "sink":
        reply = eng.call(Digest())
        return {name: fp for name, fp in zip(reply.names, reply.fingerprints, strict=False)}
    reply = eng.call(Fetch())
    out = {}
    for t in reply.tensors:
        raw = torch.frombuffer(bytearray(t.data), dtype=torch.uint8) if t.data else torch.empty(0, dtype=torch.uint8)
        from colosync.wire.manifest import dtype_from_name

        out[t.name] = raw.view(dtype_from_name(t.dtype)).reshape(t.shape)
    return out


def assert_committed(eng: EngineProcess, named: list[tuple[str, torch.Tensor]]) -> None:
    got = fetch_all(eng)
    assert sorted(got) == sorted(n for n, _ in named)
    if eng.config.engine == "sink":  # compare fingerprints of every tensor's bytes
        assert [got[n] for n, _ in named] == tensor_digests([t.detach().cpu() for _, t in named])
        return
    for name, t in named:
        expect = t.detach().cpu().contiguous()
        assert got[name].dtype == expect.dtype and got[name].shape == expect.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), expect.reshape(-1).view(torch.uint8)), name


def push(eng, transport, device, named, bucket_bytes=1 << 16):
    with Sender(eng.connect(), transport=transport, bucket_bytes=bucket_bytes) as sender:
        return sender.push([(n, t.to(device)) for n, t in named])


def test_varied_dtypes(engine, transport):
    eng, device = engine
    named = [(f"{str(d)[6:]}.{len(s)}", sample(d, s, i)) for i, d in enumerate(DTYPES) for s in [(), (7,), (33, 5)]]
    report = push(eng, transport, device, named, bucket_bytes=512)
    assert report.transport == transport and report.tensors == len(named) and report.buckets > 1
    assert_committed(eng, named)


def test_empty_update(engine, transport):
    eng, device = engine
    before = eng.call(Status()).committed_update_id
    report = push(eng, transport, device, [])
    assert report.update_id == before + 1 and report.bytes == 0
    assert_committed(eng, [])


def test_tensor_larger_than_bucket_cap_streams_in_chunks(engine, transport):
    eng, device = engine
    named = [
        ("small", sample(torch.float32, (10,), 1)),
        ("big", sample(torch.bfloat16, (300, 1001), 2)),
        ("tail", sample(torch.int8, (5,), 3)),
    ]
    report = push(eng, transport, device, named, bucket_bytes=4096)
    assert report.buckets == 3
    assert_committed(eng, named)


def test_ten_thousand_tiny_tensors(engine, transport):
    eng, device = engine
    values = torch.randn(10_000)
    named = [(f"p{i}", values[i : i + 1].clone()) for i in range(10_000)]
    report = push(eng, transport, device, named, bucket_bytes=1 << 18)
    assert report.tensors == 10_000
    assert_committed(eng, named)


def test_twenty_sequential_updates(engine, transport):
    eng, device = engine
    with Sender(eng.connect(), transport=transport, bucket_bytes=8192) as sender:
        first = None
        for step in range(20):
            named = [("w", sample(torch.float32, (64, 64), step)), ("b", sample(torch.bfloat16, (64,), 100 + step))]
            report = sender.push([(n, t.to(device)) for n, t in named])
            first = first or report.update_id
            assert report.update_id == first + step
            assert_committed(eng, named)


def _killed_sender(address: bytes, kind: str, transport: str, device: str, ready) -> None:
    import msgspec

    from colosync.engines.process import connect

    link = connect(msgspec.msgpack.decode(address, type=EngineAddress), kind)
    specs = [(f"x{i}", (1024,), torch.float32) for i in range(8)]

    def slow_source():
        for i, (name, shape, _dtype) in enumerate(specs):
            if i == 4:
                ready.set()
                time.sleep(600)  # killed here, mid-update
            yield name, torch.full(shape, float(i), device=device)

    Sender(link, transport=transport, bucket_bytes=4096).push_stream(specs, slow_source())


def test_sender_killed_mid_update_changes_nothing(engine, transport):
    import msgspec

    from tests.conftest import shm_segments

    eng, device = engine
    previous = [("kept", sample(torch.float32, (16,), 7))]
    push(eng, transport, device, previous)
    committed = eng.call(Status()).committed_update_id
    segments_before = set(shm_segments())
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(
        target=_killed_sender, args=(msgspec.msgpack.encode(eng.address), eng.config.engine, transport, device, ready)
    )
    child.start()
    try:
        assert ready.wait(120), "sender never reached the middle of its update"
        deadline = time.monotonic() + 10
        while eng.call(Status()).in_flight_update_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.call(Status()).in_flight_update_id == committed + 1  # the update really was in flight
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    deadline = time.monotonic() + 10
    while eng.call(Status()).in_flight_update_id is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    status = eng.call(Status())
    assert status.in_flight_update_id is None and status.committed_update_id == committed
    assert_committed(eng, previous)
    # (only segments made meanwhile: other test sessions on this machine may hold their own)
    assert not set(shm_segments()) - segments_before, "the killed sender's segment outlived it"
