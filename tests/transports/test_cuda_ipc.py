"""On a CUDA host: cuda_ipc for real, pinned chunked shm, the arena, probe and bench end to end.

Run with ``pytest -m gpu``; skipped without CUDA (see ``tests/conftest.py``). The transport
contract suite (``tests/transports/test_contract.py``) runs its ``cuda`` cases on such a host too.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from colosync.control.link import LocalLink
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.engines.sink import Digest, SinkEngine, tensor_digests
from colosync.errors import FingerprintMismatchError, NonFiniteError
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender
from colosync.transports import cuda_ipc
from colosync.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from colosync.transports.shm import CHUNK_BYTES
from colosync.wire.bucket import fingerprint, plan_buckets
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Attach, Begin, Commit, Prepare, Stage
from tests.helpers import pack_into

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sink():
    engine = EngineProcess(EngineConfig(engine="sink", device="cuda", timeout_s=60.0))
    yield engine
    engine.close()


def named_tensors(seed: int, n: int = 40) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = [(f"layer{i}.w", torch.randn(64 + i, 96, device="cuda", generator=g).to(torch.bfloat16)) for i in range(n)]
    out.append(("big", torch.randn(3 << 20, device="cuda", generator=g)))  # 12 MiB: a bucket of its own
    return out


def assert_served(engine: EngineProcess, named) -> None:
    reply = engine.call(Digest())
    assert dict(zip(reply.names, reply.fingerprints, strict=False)) == dict(
        zip([n for n, _ in named], tensor_digests([t for _, t in named]), strict=True)
    )


def test_buffer_is_outside_the_caching_allocator_and_shared_in_process():
    before = torch.cuda.memory_allocated()
    sender = CudaIpcSender(1 << 20, 2, torch.device("cuda"))
    assert torch.cuda.memory_allocated() == before  # cudaMalloc'd by us, not by PyTorch's pools
    receiver = CudaIpcReceiver.open(sender.handle(), torch.device("cuda"))
    sender.slot(1).fill_(3)
    assert receiver.slot(1).data_ptr() == sender.slot(1).data_ptr() and int(receiver.slot(1)[0]) == 3
    receiver.close()
    sender.close()


def test_auto_picks_cuda_ipc_and_moves_bytes(sink):
    with Sender(sink.connect(), bucket_bytes=1 << 20) as sender:
        for step in range(3):
            named = named_tensors(step)
            report = sender.push(named)
            assert report.transport == "cuda_ipc" and report.buckets >= 2
            assert_served(sink, named)
        handle = sender.transport.handle()
        sender.push(named_tensors(7))
        assert sender.transport.handle() == handle  # one export for the whole run
    assert sink.call(Digest()).receiver_bytes == 0  # no engine-side buffer for whole-slot buckets


def test_real_ipc_open_failure_falls_back_to_shm(sink, monkeypatch, caplog):
    real = CudaIpcSender.handle

    def corrupted(self) -> bytes:
        h = cuda_ipc.msgspec.msgpack.decode(real(self), type=cuda_ipc.CudaIpcHandle)
        bad = bytes(b ^ 0x5A for b in h.handle)
        return cuda_ipc.msgspec.msgpack.encode(cuda_ipc.msgspec.structs.replace(h, handle=bad))

    monkeypatch.setattr(CudaIpcSender, "handle", corrupted)
    caplog.set_level(logging.INFO, logger="colosync.transports")
    with Sender(sink.connect(), bucket_bytes=1 << 20) as sender:
        named = named_tensors(11)
        assert sender.push(named).transport == "shm"
    assert_served(sink, named)
    reasons = [r.getMessage() for r in caplog.records if "passed over 'cuda_ipc'" in r.getMessage()]
    assert reasons and "cudaIpcOpenMemHandle failed" in reasons[0]


def test_shm_on_gpu_is_pinned_chunked_and_bounded(sink):
    bucket = 64 << 20
    with Sender(sink.connect(), transport="shm", bucket_bytes=bucket) as sender:
        named = [("x", torch.randn(40 << 20, device="cuda")), ("y", torch.randn(1000, device="cuda"))]
        sender.push(named)
        t = sender.transport
        assert t.pinned and t.slot_bytes == CHUNK_BYTES and t.num_slots >= 2
        assert t.slot_bytes * t.num_slots <= 2 * bucket  # host shared memory: at most two buckets
        assert_served(sink, named)
    assert sink.call(Digest()).receiver_bytes <= bucket  # engine side: at most one bucket


def test_shm_on_gpu_carries_buckets_across_chunk_boundaries(sink, monkeypatch):
    """Buckets larger than a chunk, odd-sized tensors straddling every cut: the engine serves exactly the bytes."""
    from colosync.sync import pipeline

    sent: list[tuple[int, int]] = []
    put = pipeline.SlotPipeline.put

    def spy(self, stage, fence=None, fingerprint=None):
        sent.append((stage.bucket, stage.nbytes))
        return put(self, stage, fence, fingerprint)

    monkeypatch.setattr(pipeline.SlotPipeline, "put", spy)
    g = torch.Generator(device="cuda").manual_seed(5)
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
    named = [  # odd sizes: padding between tensors, tensors straddling the 16 MiB chunk boundaries
        (f"t{i}", torch.randn(1000 + 37 * i, 97 + i % 5, device="cuda", generator=g).to(dtypes[i % 4]))
        for i in range(120)
    ]
    bucket = 40 << 20
    with Sender(sink.connect(), transport="shm", bucket_bytes=bucket) as sender:
        for step in range(3):  # the second and third reuse the staging buffer and the gather tables
            if step:
                with torch.no_grad():
                    for _, t in named:
                        t.add_(1)
            sent.clear()
            report = sender.push(named)
            assert report.buckets >= 2 and sender.transport.slot_bytes == CHUNK_BYTES < bucket
            assert [b for b, _ in sent].count(0) >= 3 and max(n for _, n in sent) == CHUNK_BYTES
            assert_served(sink, named)


def test_shm_on_gpu_copies_a_bucket_out_only_once_it_is_packed(sink):
    """Over shm, buckets are packed on the trainer's stream and copied to host memory on another, from two
    staging buffers in turn. The trainer's stream is kept busy before each push, so the pack runs late: a
    copy that did not wait for it would send the previous push's bytes (and the engine would refuse them)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    named = [(f"t{i}", torch.randn(512, 1024, device="cuda", generator=g)) for i in range(40)]  # 2 MiB each
    with Sender(sink.connect(), transport="shm", bucket_bytes=16 << 20) as sender:
        sender.push(named)
        assert_served(sink, named)
        streamer = sender._streamer
        assert sender.push(named).buckets >= 4 and len(streamer._staging.tensors) == 2  # both buffers in turn
        for step in range(3):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on this stream, queued, not waited for
            with torch.no_grad():
                for _, t in named:
                    t.add_(step + 1)  # the new values exist only once the sleep is over
            sender.push(named)
            assert_served(sink, named)


def test_shm_on_gpu_fingerprints_of_single_tensor_buckets_in_a_row_stay_their_own(sink):
    """A bucket that is one tensor is fingerprinted into a fresh result on the trainer's stream and read on the
    copy stream behind the bucket's chunks; the next bucket's result must not take its memory before then."""
    g = torch.Generator(device="cuda").manual_seed(12)
    named = [(f"w{i}", torch.randn(6 << 20, device="cuda", generator=g)) for i in range(4)]  # 24 MiB each
    with Sender(sink.connect(), transport="shm", bucket_bytes=16 << 20) as sender:
        for step in range(5):
            with torch.no_grad():
                for _, t in named:
                    t.add_(step)
            assert sender.push(named).buckets == 4  # each tensor its own bucket, sent from its own bytes
            assert_served(sink, named)
        assert sender._streamer._staging.tensors == []


def test_shm_staging_views_follow_their_buffer_when_a_bucket_moves_between_devices(sink):
    """Bucket 1 is packed into the second staging buffer from a GPU and into the first from the CPU; its cached
    views must belong to the buffer it is packed into now, or the GPU push would ship the older bytes."""
    g = torch.Generator().manual_seed(13)
    host = [("big", torch.randn(1 << 18, generator=g))]  # 1 MiB: a bucket of its own, sent from its own bytes
    host += [(f"t{i}", torch.randn(101, 333, generator=g).to(torch.bfloat16)) for i in range(4)]  # odd sizes
    with Sender(sink.connect(), transport="shm", bucket_bytes=512 << 10) as sender:
        sender.push([("s", torch.randn(64))])  # the first update sizes the slots: 64 KiB, less than a bucket
        for step, device in enumerate(["cuda", "cpu", "cuda"]):
            named = [(n, (t + step).to(device)) for n, t in host]
            assert sender.push(named).buckets == 2
            assert_served(sink, named)
        assert [t.device.type for t in sender._streamer._staging.tensors] == ["cpu", "cuda"]


class _StagesSeen(LocalLink):
    """A LocalLink that notes each Stage it carries."""

    def __init__(self, receiver: Receiver) -> None:
        super().__init__(receiver)
        self.stages: list[Stage] = []

    def submit(self, request):
        if isinstance(request, Stage):
            self.stages.append(request)
        return super().submit(request)


def test_shm_on_gpu_sends_each_stage_sealed_and_the_engine_waits_for_the_seal():
    """Over shm from a GPU every Stage goes out sealed, its fingerprint with the seal: with the trainer's
    stream held up, an engine that read a slot before its seal landed would take the bytes (and the
    fingerprint) of the push before, and fail it or commit stale weights."""
    engine = SinkEngine("cuda")
    receiver = Receiver(engine, "cuda")
    link = _StagesSeen(receiver)
    g = torch.Generator(device="cuda").manual_seed(14)
    named = [(f"t{i}", torch.randn(512, 1024, device="cuda", generator=g)) for i in range(24)]  # 2 MiB each
    try:
        with Sender(link, transport="shm", bucket_bytes=16 << 20) as sender:
            for step in range(3):
                link.stages.clear()
                torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on this stream, queued, not waited for
                with torch.no_grad():
                    for _, t in named:
                        t.add_(step + 1)  # the new values exist only once the sleep is over
                sender.push(named)
                for name, t in named:
                    assert torch.equal(engine.tensors[name], t), (step, name)
                seals = [stage.seal for stage in link.stages]
                assert len(seals) >= 3 and all(seals) and seals == sorted(set(seals)), seals  # fresh, growing
                assert all(stage.fingerprint is None for stage in link.stages)  # they came with the seals
    finally:
        receiver.close()


def test_shm_on_gpu_copies_out_of_a_sources_temporaries_before_their_memory_is_reused(sink):
    """A source that makes each tensor on the fly (a cast, a gather) frees it once its bucket is queued; a
    bucket that is one tensor is copied out of that memory, on the copy stream, while the Sender (which
    never waits on its host) already makes the next ones. Their memory must not be handed out before: the copy
    stream is held up here, so copies that read reused memory would ship a later tensor's bytes."""
    g = torch.Generator(device="cuda").manual_seed(15)
    base = [(f"w{i}", torch.randn(3 << 19, device="cuda", generator=g)) for i in range(12)]  # 3 MiB in bf16
    specs = [(n, tuple(t.shape), torch.bfloat16) for n, t in base]
    # 2 MiB slots, 16 of them: the first 16 chunks (8 buckets) of a push wait for no reply
    with Sender(sink.connect(), transport="shm", bucket_bytes=2 << 20, slots=16) as sender:
        for step in range(4):

            def made(step: int = step):
                for name, t in base:
                    yield name, (t + step).to(torch.bfloat16)  # a temporary, freed once the next is made

            if step:  # ~50 ms of GPU time queued on the copy stream: the trainer's stream runs far ahead of it
                with torch.cuda.stream(sender._streamer._staging.copier(torch.device("cuda", 0))):
                    torch.cuda._sleep(100_000_000)
            assert sender.push_stream(specs, made()).buckets == len(base)  # each a bucket of its own
            assert_served(sink, [(n, (t + step).to(torch.bfloat16)) for n, t in base])


def test_arena_updates_need_no_packing(sink):
    named = named_tensors(3)
    with Sender(sink.connect(), transport="cuda_ipc") as sender:
        arena = sender.arena([(n, tuple(t.shape), t.dtype) for n, t in named], "cuda")
        with torch.no_grad():
            torch._foreach_copy_(arena, [t for _, t in named])
        weights = [(n, a) for (n, _), a in zip(named, arena, strict=True)]
        sender.push(weights)
        assert_served(sink, named)
        with torch.no_grad():
            arena[0].mul_(2)  # a training step, in place
        sender.push(weights)
        assert_served(sink, weights)


def test_gpu_checks_run_on_device_and_reject_at_prepare():
    engine = SinkEngine("cuda")
    receiver = Receiver(engine, "cuda")
    transport = CudaIpcSender(1 << 16, 2, torch.device("cuda"))
    link = LocalLink(receiver)
    link.submit(Attach("cuda_ipc", transport.handle())).wait()
    named = [("a", torch.randn(100, device="cuda")), ("b", torch.randn(7, 3, device="cuda"))]
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 16)
    sizes = layout.bucket_sizes
    for uid, (corrupt, error) in enumerate([(False, FingerprintMismatchError), (True, NonFiniteError)], start=1):
        m = UpdateManifest(uid, "full", layout)
        slot = transport.slot(0)[: sizes[0]]
        pack_into(slot, m.tensors, [t for _, t in named])
        fp = fingerprint(slot)
        if corrupt:
            slot[:4].copy_(torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8))  # a float32 NaN, fingerprinted
            fp = fingerprint(slot)
        else:
            fp += 1
        link.submit(Begin(m)).wait()
        link.submit(Stage(uid, 0, 0, sizes[0], 0, fp)).wait()  # accepted: checked on the device
        with pytest.raises(error):
            link.submit(Prepare(uid)).wait()
        with pytest.raises(Exception, match="was aborted"):
            link.submit(Commit(uid)).wait()
    assert receiver.committed_update_id == 0 and engine.tensors == {}
    receiver.close()
    transport.close()


def test_probe_tests_ipc_between_two_processes():
    from colosync.tools.probe import run_probe

    report = run_probe("cuda")
    ipc = next(c for c in report.checks if c.name == "CUDA IPC between two processes")
    assert ipc.ok, ipc.detail
    assert report.auto == "cuda_ipc"


def test_bench_end_to_end(tmp_path):
    import argparse

    from colosync.tools.bench.sync import run_bench

    workload = tmp_path / "tiny.json"
    workload.write_text(
        json.dumps(
            {
                "name": "tiny",
                "kind": "full",
                "tensors": [{"name": f"t{i}", "shape": [256, 512], "dtype": "bfloat16"} for i in range(32)],
            }
        )
    )
    args = argparse.Namespace(
        workload=str(workload),
        transports=None,
        references="fresh_ipc,pickle",
        arena=True,
        repeats=2,
        warmup=1,
        bucket_mb=None,
        slots=None,
        device="cuda",
        no_floor=False,
        force_pickle=False,
        json=True,
        out=None,
        argv=["bench", "--workload", str(workload)],
    )
    result = run_bench(args)
    paths = {r.path: r for r in result.results}
    assert {"cuda_ipc", "shm", "cuda_ipc+arena", "ref:fresh_ipc", "ref:pickle", "floor:pinned d2h"} <= set(paths)
    assert all(r.verified is not False for r in result.results)
    assert result.floor_ms and paths["cuda_ipc"].speedup_vs["ref:pickle"] > 1
