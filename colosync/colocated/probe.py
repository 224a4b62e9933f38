"""A trainer's proof of delivery: a fixed probe batch scored by the trainer's model as it is now.

A verified sync carries the trainer's own logprobs of a few fixed completions
(``colosync.wire.protocol.Probe``); the engine scores the same completions under the update
it installed and compares. What is scored must not depend on the step (or two steps could not
be compared) nor on sampling (or the engine could not reproduce it), so the batch is drawn
once, uniformly from the vocabulary, from a seed (``random_probe``), and scored in eval mode
without gradients (``scored``), the model's training mode restored after.
"""

from __future__ import annotations

import torch

from colosync.decoding import score
from colosync.wire.protocol import Probe


def random_probe(
    vocab_size: int, sequences: int = 1, prompt_tokens: int = 8, completion_tokens: int = 8, seed: int = 0
) -> Probe:
    """``sequences`` random prompts and completions of token ids below ``vocab_size`` (logprobs
    zero: ``scored`` fills them in)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (sequences, prompt_tokens), generator=gen)
    completions = torch.randint(0, vocab_size, (sequences, completion_tokens), generator=gen)
    return Probe(prompts.tolist(), completions.tolist(), [[0.0] * completion_tokens] * sequences)


def scored(model: torch.nn.Module, probe: Probe, tolerance: float) -> Probe:
    """``probe`` with ``model``'s logprobs under its current weights and ``tolerance``."""
    training = model.training
    model.eval()
    try:
        logprobs = score(model, probe.prompts, probe.completions)
    finally:
        model.train(training)
    return Probe(probe.prompts, probe.completions, logprobs, tolerance)


__all__ = ["random_probe", "scored"]
