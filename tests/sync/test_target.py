"""What an engine exposes to the Receiver: tied weights found on a model, and an alias checked against its tie."""

from __future__ import annotations

import pytest
import torch

from colosync.errors import TiedWeightError
from colosync.sync.sender import Sender
from colosync.sync.target import tied_parameters
from tests.helpers import TiedSink, local_receiver


def test_tied_weights_are_found_so_an_update_of_one_name_reaches_both():
    """A model whose head shares the embedding's tensor reports the alias (engines untie through it)."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    assert tied_parameters(Tied()) == {"head.weight": "embed.weight"}
    assert tied_parameters(torch.nn.Linear(3, 3)) == {}


def test_a_tied_alias_is_checked_against_its_tie_and_then_dropped():
    engine = TiedSink()
    receiver, link = local_receiver(engine)
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
