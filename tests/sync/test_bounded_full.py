"""``HostStaging``: a full update lands in host memory the engine lends, and nowhere else.

Driven through a real ``Receiver`` and real transports. On the CPU: the area's views are
the buckets' bytes, it is reused while the layout repeats, freed when not kept, handed to
the engine when its model aliases it, and the Receiver tells the engine (``unstage``) once
per update however it ends. On a GPU: a Receiver on CUDA lands device slots (``cuda_ipc``)
and host slots (``shm``) into the host area, whole or chunked, with the fingerprint and
NaN/Inf verdicts still read at ``prepare``, and the device holds no bucket of it.
"""

from __future__ import annotations

import pytest
import torch

from colosync.errors import FingerprintMismatchError, NonFiniteError
from colosync.sync.receiver import Receiver, ReceiverPolicy
from colosync.sync.staging import HostStaging
from colosync.sync.target import EngineTarget, ModelSpec, Staging
from colosync.wire.protocol import Abort, Begin, Commit, Prepare
from tests.helpers import pack_bucket, stage_bytes
from tests.sync.test_landing import MIXED, PAIR, assert_equal, attach, manifest, push, values


class HostStore(EngineTarget):
    """A tensor store that lends a ``HostStaging`` area for every update and records ``unstage``."""

    def __init__(self, keep: bool = True) -> None:
        self.host = HostStaging(keep=keep)
        self.tensors: dict[str, torch.Tensor] = {}
        self.unstaged: list[int] = []

    def model_spec(self) -> ModelSpec:
        return ModelSpec(params=None, lora_modules=None)

    def staging(self, manifest) -> Staging:
        return self.host.lend(manifest)

    def prepare(self, manifest, tensors):
        assert all(self.host.owns(t) for t in tensors.values()), "prepare must see the area's own tensors"
        return {name: t.clone() for name, t in tensors.items()}

    def commit(self, prepared, update_id):
        self.tensors = prepared

    def discard(self, prepared) -> None:
        prepared.clear()

    def unstage(self, manifest) -> None:
        self.unstaged.append(manifest.update_id)
        self.host.done()


def rig(keep=True, device="cpu", transport="shm"):
    engine = HostStore(keep)
    receiver = Receiver(engine, device, ReceiverPolicy(timeout_s=30.0))
    return engine, receiver, attach(receiver, 1 << 12, transport)


def test_the_area_is_the_buckets_bytes_and_is_reused_while_the_layout_repeats():
    engine, receiver, transport = rig(keep=True)
    try:
        m = manifest(1, MIXED, bucket_bytes=192)
        push(receiver, transport, m, values(1, MIXED))
        flats = [f.data_ptr() for f in engine.host._staging.buckets]
        assert engine.host.nbytes == sum(m.bucket_sizes) and len(flats) == len(m.bucket_sizes) > 1
        for t, meta in zip(engine.host._staging.tensors, m.tensors, strict=True):
            assert t.data_ptr() == engine.host._staging.buckets[meta.bucket].data_ptr() + meta.offset
        assert all(not f.is_cuda for f in engine.host._staging.buckets)
        assert all(f.is_pinned() == torch.cuda.is_available() for f in engine.host._staging.buckets)
        push(receiver, transport, manifest(2, None, layout=m.layout), values(2, MIXED))
        assert [f.data_ptr() for f in engine.host._staging.buckets] == flats
        assert_equal(engine.tensors, values(2, MIXED))
        assert receiver.buffer_bytes == 0, "lent flat buckets never bounce"
        push(receiver, transport, manifest(3, PAIR), values(3, PAIR))  # a new layout: a new area
        assert engine.host.nbytes == sum(manifest(3, PAIR).bucket_sizes)
        assert engine.unstaged == [1, 2, 3]
    finally:
        receiver.close()
        transport.close()


def test_unstage_follows_every_end_and_an_unkept_area_is_freed():
    engine, receiver, transport = rig(keep=False)
    try:
        m = manifest(1, MIXED, bucket_bytes=192)
        receiver.handle(Begin(m))
        assert engine.host.nbytes == sum(m.bucket_sizes)
        receiver.handle(Abort(1, "gave up"))  # before prepare
        assert engine.unstaged == [1] and engine.host.nbytes == 0
        receiver.handle(Begin(manifest(2, None, layout=m.layout)))
        receiver.handle(Begin(manifest(3, None, layout=m.layout)))  # supersedes 2
        assert engine.unstaged == [1, 2]
        bad = values(4, MIXED)
        bad["d"][3] = float("nan")
        with pytest.raises(NonFiniteError):
            for b in range(len(m.bucket_sizes)):
                stage_bytes(receiver, transport, 3, b, pack_bucket(m, b, bad))
        assert engine.unstaged == [1, 2, 3] and engine.host.nbytes == 0
        push(receiver, transport, manifest(4, None, layout=m.layout), values(4, MIXED))
        assert engine.unstaged == [1, 2, 3, 4] and engine.host.nbytes == 0
        assert_equal(engine.tensors, values(4, MIXED))
    finally:
        receiver.close()
        transport.close()


def test_an_area_the_model_aliases_is_handed_over():
    area = HostStaging(keep=True, pin=False)
    m = manifest(1, MIXED, bucket_bytes=192)
    lent = area.lend(m)
    assert area.owns(lent.tensors[2]) and not area.owns(torch.zeros(3))
    assert not area.disown_if_aliased([torch.zeros(3)]) and area.nbytes
    kept = lent.tensors[1]  # a loader that made a staged tensor its parameter
    assert area.disown_if_aliased([torch.zeros(3), kept])
    assert area.nbytes == 0
    fresh = area.lend(manifest(2, None, layout=m.layout))
    assert fresh.buckets[0].data_ptr() != lent.buckets[0].data_ptr(), "the next update must not land in the model"


GPU_TRANSPORTS = [pytest.param(t, marks=pytest.mark.gpu) for t in ("shm", "cuda_ipc")]


@pytest.mark.parametrize("transport", GPU_TRANSPORTS)
@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "chunks"])
def test_a_receiver_on_cuda_lands_in_host_memory_with_checks_at_prepare(transport, chunk):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine, receiver, sender = rig(keep=True, device="cuda", transport=transport)
    try:
        m = manifest(1, MIXED, bucket_bytes=192)
        for uid, seed in ((1, 5), (2, 6)):  # the second lands in the same (pinned) area
            push(receiver, sender, manifest(uid, None, layout=m.layout), values(seed, MIXED), chunk)
            assert_equal(engine.tensors, values(seed, MIXED))
            assert all(f.is_pinned() for f in engine.host._staging.buckets)
        assert receiver.buffer_bytes == 0
        p = manifest(3, PAIR)
        good = values(7, PAIR)
        bad = {**good, "b": good["b"].clone()}
        bad["b"][1] = float("inf")
        for uid, tensors, delta, error in ((3, good, 1, FingerprintMismatchError), (4, bad, 0, NonFiniteError)):
            receiver.handle(Begin(manifest(uid, None, layout=p.layout)))
            stage_bytes(receiver, sender, uid, 0, pack_bucket(p, 0, tensors), chunk, fingerprint_delta=delta)
            with pytest.raises(error):
                receiver.handle(Prepare(uid))
            assert receiver.in_flight is None
        receiver.handle(Begin(manifest(5, None, layout=p.layout)))
        stage_bytes(receiver, sender, 5, 0, pack_bucket(p, 0, good), chunk)
        receiver.handle(Prepare(5))
        receiver.handle(Commit(5))
        assert_equal(engine.tensors, good)
    finally:
        receiver.close()
        sender.close()
