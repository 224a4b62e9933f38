"""The Sender's per-update shortcuts never change what arrives: plans, padding, slot sizing."""

from __future__ import annotations

import torch

from colosync.engines.sink import SinkEngine
from colosync.sync.link import LocalLink
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender


def test_plan_is_reused_and_padding_is_zeroed_in_the_slot():
    engine = SinkEngine()
    receiver = Receiver(engine, "cpu")
    with Sender(LocalLink(receiver), transport="shm", bucket_bytes=4096) as sender:
        named = [("a", torch.randn(3)), ("b", torch.ones(5, dtype=torch.bfloat16)), ("c", torch.arange(7))]
        sender.push(named)
        plan = sender._last_plan
        sender.transport.slot(0).fill_(0xFF)  # leftovers of some other layout
        named2 = [(n, t * 2) for n, t in named]
        sender.push(named2)
        assert sender._last_plan is plan  # same layout: planned once
        slot = sender.transport.slot(0)
        for start, end in plan.gaps[0]:
            assert not slot[start:end].any(), "padding must be zero so the engine's checks see clean runs"
        for name, t in named2:
            assert torch.equal(engine.tensors[name], t)
        sender.push([("a", torch.randn(4))])  # another layout
        assert sender._last_plan is not plan and list(engine.tensors) == ["a"]
    receiver.close()


def test_transport_is_no_bigger_than_the_first_update_needs():
    receiver = Receiver(SinkEngine(), "cpu")
    with Sender(LocalLink(receiver), transport="shm", bucket_bytes=64 << 20, slots=2) as sender:
        sender.push([("w", torch.zeros(1000))])
        assert sender.transport.slot_bytes * sender.transport.num_slots <= 1 << 16
        sender.push([("w", torch.zeros(100_000)), ("v", torch.zeros(10))])  # bigger later: chunked, still right
    receiver.close()
