"""The bare cuda_ipc mechanism, the floor ``colosync bench`` shows beside the library, really moves and checks bytes."""

from __future__ import annotations

import pytest
import torch

from colosync.errors import EngineError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _named(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [
        ("a.lora_A", torch.randn(7, 33, device=device, generator=g).to(torch.bfloat16)),  # odd byte count
        ("a.lora_B", torch.randn(129, 7, device=device, generator=g)),
        ("b.bias", torch.arange(5, device=device, dtype=torch.int64)),
    ]


def test_the_engine_holds_the_trainers_tensors_after_each_push():
    from colosync.engines.sink import tensor_digests
    from colosync.tools.bench.mechanism import MechanismPath

    device = torch.device("cuda", torch.cuda.current_device())
    named = _named(device)
    path = MechanismPath(named, device)
    try:
        for step in range(3):
            named[1][1].add_(step)  # the trainer's tensors change in place between pushes
            assert path.push() > 0
            expect = dict(zip([n for n, _ in named], tensor_digests([t for _, t in named]), strict=True))
            assert path.digests() == expect
    finally:
        path.close()


def test_a_checksum_that_disagrees_is_refused():
    from colosync.tools.bench.mechanism import MechanismPath

    device = torch.device("cuda", torch.cuda.current_device())
    path = MechanismPath(_named(device), device)
    replay = path._graph.replay

    def corrupt() -> None:  # the packed bytes and the checksum the engine is told disagree
        replay()
        with torch.cuda.stream(path.stream):
            path.buffer[path.payload : path.payload + 8].view(torch.int64).add_(1)

    path._graph.replay = corrupt
    try:
        with pytest.raises(EngineError, match="checksum did not match"):
            path.push()
    finally:
        path.close()
