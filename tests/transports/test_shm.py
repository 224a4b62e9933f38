"""``shm`` specifics beyond the shared contract: the segment's name never outlives its sender."""

from __future__ import annotations

import os

import torch

from colosync.transports.shm import ShmSender


def test_a_sender_closed_before_any_receiver_attached_unlinks_its_segment():
    sender = ShmSender(1 << 16, 2, torch.device("cpu"))
    name = sender._name
    assert name in os.listdir("/dev/shm")
    sender.close()
    assert name not in os.listdir("/dev/shm")
    sender.close()  # idempotent
