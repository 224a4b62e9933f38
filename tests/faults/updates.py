"""The updates the fault suite pushes, identical in the test process and in the killed child."""

from __future__ import annotations

import torch

BUCKET_BYTES = 64 << 10  # small buckets: a full update of the tiny model spans dozens of Stages
PROMPTS = [[1, 5, 9, 13], [2, 7, 11, 3]]
NEW_TOKENS = 6


def update_for(model_dir: str, scale: float = 1.1) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of the tiny model times ``scale``: a full update whose effect is visible."""
    from colosync.decoding import load_model

    model = load_model(model_dir)
    return [(name, (p.detach() * scale).contiguous()) for name, p in model.named_parameters()]


def reference_tokens(model_dir: str, named: list[tuple[str, torch.Tensor]] | None) -> list[list[int]]:
    """Greedy tokens of the tiny model, with ``named`` applied (None: as loaded)."""
    from colosync.decoding import greedy, load_model

    model = load_model(model_dir)
    if named is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in named:
                params[name].copy_(t)
    return greedy(model, PROMPTS, NEW_TOKENS)[0]
