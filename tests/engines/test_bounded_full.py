"""A full update costs the hf engine one host copy of the payload and nothing on its device.

The engine lends the Receiver a host staging area (``HostStaging``) and copies from it into
its weights at commit; no staged or prepared copy of the model exists anywhere else. Each
test measures it (an accounting of every tensor the update handed to or built in
``prepare``, the Receiver's bounce buffer, and the process's resident memory on CPU; device
allocator deltas on CUDA) against one bucket plus the transport's slots above the area, so
a return of the old path (Receiver-owned buckets plus a prepared copy, 2x the payload) fails.
Failed updates -- a NaN in a late bucket, a sender that dies mid-push, a refusal at prepare --
must leave the served weights bit for bit as they were, also when the area is kept and
reused (as on a GPU) and so already holds the previous update.
"""

from __future__ import annotations

import gc

import pytest
import torch

from colosync.control.link import LocalLink
from colosync.engines.hf import HFEngine
from colosync.engines.host import EngineHost
from colosync.errors import NonFiniteError, TiedWeightError, TransportError
from colosync.sync.link import Done
from colosync.sync.receiver import ReceiverPolicy
from colosync.sync.sender import Sender
from colosync.testing import load_model, make_tiny_llama, make_tiny_qwen2
from colosync.wire.bucket import plan_buckets
from colosync.wire.protocol import Failed, Stage

BUCKET = 64 << 10
SLOTS = 2


class Measured(HFEngine):
    """The hf engine, sampling the process's resident memory when ``prepare`` has built the update."""

    rss_at_prepare = 0

    def prepare(self, manifest, tensors):
        import psutil

        prepared = super().prepare(manifest, tensors)
        self.rss_at_prepare = psutil.Process().memory_info().rss
        return prepared


def perturbed(model, seed, nan_in_last=False):
    """The trainer's next weights, in host memory."""
    g = torch.Generator().manual_seed(seed)
    named = [(n, p.detach().cpu() + torch.randn(p.shape, generator=g) * 0.02) for n, p in model.named_parameters()]
    if nan_in_last:
        named[-1][1].view(-1)[-1] = float("nan")
    return named


def weights(engine):
    return {n: p.detach().clone() for n, p in engine._base.items()}


def assert_serves(engine, expected):
    for name, p in engine._base.items():
        assert torch.equal(p.detach().cpu(), expected[name].cpu()), f"{name} changed"


def engine_on(model, keep=None, cls=HFEngine):
    engine = cls(model)
    if keep is not None:
        engine._host.keep = keep
    receiver = engine.transaction(ReceiverPolicy()).applies
    return engine, receiver


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # ~9 MB of fp32 weights: big enough for resident memory to tell one copy from two
    return make_tiny_llama(
        tmp_path_factory.mktemp("bounded") / "llama", seed=0, hidden_size=256, intermediate_size=1024, vocab_size=2048
    )


def test_a_full_update_holds_one_host_copy_and_nothing_else(llama_dir):
    engine, receiver = engine_on(load_model(llama_dir), cls=Measured)
    named = perturbed(engine.model, 1)
    payload = sum(t.numel() * t.element_size() for _, t in named)
    try:
        with Sender(LocalLink(receiver), transport="shm", bucket_bytes=BUCKET, slots=SLOTS) as sender:
            gc.collect()
            rss_before = __import__("psutil").Process().memory_info().rss
            report = sender.push(named)
        fp = engine.last_full
        assert fp is not None and fp.update_id == report.update_id
        biggest = max(plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], BUCKET).bucket_sizes)
        # the accounting: nothing of the update outside the host area, no device bytes, at most a bucket of bounce
        assert fp.outside_bytes == 0 and fp.device_bytes == 0, fp
        assert payload <= fp.host_staging_bytes <= payload + 64 * len(named), fp
        assert receiver.buffer_bytes <= biggest
        # resident memory at prepare: the area plus at most a bucket and the slots (the old path held 2x payload)
        grown = engine.rss_at_prepare - rss_before
        slots = SLOTS * biggest
        assert grown <= fp.host_staging_bytes + biggest + slots + payload // 16, (grown, payload)
        assert_serves(engine, dict(named))
        assert engine._host.nbytes == 0, "an engine on the CPU frees its area after the update"
    finally:
        receiver.close()


def test_the_kept_area_is_reused_and_a_late_nan_leaves_the_weights_bit_for_bit(llama_dir):
    engine, receiver = engine_on(load_model(llama_dir), keep=True)  # as on a GPU: the area outlives the update
    try:
        with Sender(LocalLink(receiver), transport="shm", bucket_bytes=BUCKET) as sender:
            first = perturbed(engine.model, 2)
            uid = sender.push(first).update_id
            area = [f.data_ptr() for f in engine._host._staging.buckets]
            served = weights(engine)
            assert_serves(engine, dict(first))
            with pytest.raises(NonFiniteError, match="NaN"):
                sender.push(perturbed(engine.model, 3, nan_in_last=True))  # lands over the area update `uid` came from
            assert receiver.committed_update_id == uid and receiver.in_flight is None
            assert_serves(engine, served)
            second = perturbed(engine.model, 4)
            sender.push(second)
            assert [f.data_ptr() for f in engine._host._staging.buckets] == area, "same layout, same area"
            assert_serves(engine, dict(second))
    finally:
        receiver.close()


class DiesAtStage:
    """A link whose sender process dies after ``stages`` Stages: nothing more reaches the engine.

    A fake of the death for an in-process engine (the engine side is real: its host ends the
    session as it does when a connection drops); ``tests/faults`` kills real sender processes.
    """

    def __init__(self, host, session, stages):
        self.host, self.session, self.left = host, session, stages

    def submit(self, request):
        if self.left <= 0:
            raise TransportError("the sender died")
        if isinstance(request, Stage):
            self.left -= 1
        reply = self.host.handle(request, self.session)
        return Done(error=reply.to_exception()) if isinstance(reply, Failed) else Done(reply)

    def close(self):
        pass


def test_a_sender_dying_mid_push_leaves_the_weights_bit_for_bit(llama_dir):
    engine, receiver = engine_on(load_model(llama_dir), keep=True)
    host = EngineHost(receiver, engine)
    try:
        with Sender(LocalLink(receiver), transport="shm", bucket_bytes=BUCKET) as sender:
            uid = sender.push(perturbed(engine.model, 5)).update_id
        served = weights(engine)
        session = host.open_session()
        sender = Sender(DiesAtStage(host, session, stages=3), transport="shm", bucket_bytes=BUCKET)
        with pytest.raises(Exception):  # noqa: B017 - whatever the dead link raises
            sender.push(perturbed(engine.model, 6))
        assert receiver.in_flight is not None, "the update must have been cut off mid-push"
        host.close_session(session, "connection closed")
        assert receiver.in_flight is None and receiver.committed_update_id == uid
        assert_serves(engine, served)
    finally:
        receiver.close()


def test_a_refusal_at_prepare_leaves_the_weights_bit_for_bit(tmp_path):
    engine, receiver = engine_on(load_model(make_tiny_qwen2(tmp_path / "qwen", seed=1)), keep=True)
    try:
        with Sender(LocalLink(receiver), transport="shm", bucket_bytes=16 << 10) as sender:
            good = perturbed(engine.model, 7)
            uid = sender.push(good).update_id
            served = weights(engine)
            bad = dict(perturbed(engine.model, 8))
            bad["lm_head.weight"] = bad["model.embed_tokens.weight"] + 1.0  # the model ties them: refused at prepare
            with pytest.raises(TiedWeightError, match="lm_head.weight"):
                sender.push(list(bad.items()))
            assert receiver.committed_update_id == uid and receiver.in_flight is None
            assert_serves(engine, served)
    finally:
        receiver.close()


def _big_llama(path):
    # ~190 MB of fp32 weights: several buckets, an embedding larger than one
    return make_tiny_llama(
        path,
        seed=0,
        hidden_size=1024,
        intermediate_size=2816,
        vocab_size=16384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.mark.gpu
def test_bounded_full_update_on_cuda_holds_no_device_copy(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    bucket = 32 << 20
    engine, receiver = engine_on(load_model(_big_llama(tmp_path / "big"), device))
    payload = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    try:
        with Sender(LocalLink(receiver), transport="shm", bucket_bytes=bucket, slots=SLOTS) as sender:
            for seed in (9, 10):  # the second update reuses the pinned area and the plans
                named = perturbed(engine.model, seed)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                alloc0, reserved0 = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
                torch.cuda.reset_peak_memory_stats(device)
                sender.push(named)
                torch.cuda.synchronize()
                peak_alloc = torch.cuda.max_memory_allocated(device) - alloc0
                peak_reserved = torch.cuda.max_memory_reserved(device) - reserved0
                after_alloc = torch.cuda.memory_allocated(device) - alloc0
                after_reserved = torch.cuda.memory_reserved(device) - reserved0
                print(
                    f"payload {payload / 1e6:.1f} MB bucket {bucket / 1e6:.1f} MB: device peak "
                    f"+{peak_alloc / 1e6:.2f} MB allocated / +{peak_reserved / 1e6:.2f} MB reserved, "
                    f"after commit +{after_alloc / 1e6:.2f} / "
                    f"+{after_reserved / 1e6:.2f} MB; host area {engine._host.nbytes / 1e6:.1f} MB pinned"
                )
                # the shm slots are host memory: the device bound is one bucket (bounce) + allocator granularity
                assert peak_alloc <= bucket, peak_alloc
                assert peak_reserved <= bucket + (4 << 20), peak_reserved
                assert after_reserved <= 4 << 20, "what the update used must go back to the driver"
                assert engine.last_full.outside_bytes == 0 and engine.last_full.device_bytes == 0
                assert all(f.is_pinned() for f in engine._host._staging.buckets)
                assert_serves(engine, dict(named))
    finally:
        receiver.close()
