"""Decoding and scoring of a Hugging Face causal LM: the hf engine's serving code.

The hf engine answers ``Generate`` and ``Score`` with these functions, and a trainer that
checks parity with an engine scores with the same ones, so both sides compute logprobs the
same way (fp32 log-softmax, no sampling at temperature 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def greedy(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuation of each prompt, with the logprob of every chosen token."""
    return generate(model, prompts, max_new_tokens)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[list[int]], list[list[float]]]:
    """Continue each prompt (greedy at temperature 0, else sampled from ``seed``).

    Prompts of equal length decode together as one batch with a KV cache. Returns the
    tokens and the logprob of each under the model's unscaled distribution.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(i)
    for rows in groups.values():
        ids = torch.tensor([list(prompts[i]) for i in rows], device=device)
        out = model(input_ids=ids, use_cache=True)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            if temperature > 0:
                probs = torch.softmax(logp.cpu() / temperature, dim=-1)
                picked = torch.multinomial(probs, 1, generator=gen).to(device)
            else:
                picked = logp.argmax(dim=-1, keepdim=True)
            chosen = logp.gather(1, picked).flatten().tolist()
            for row, token, lp in zip(rows, picked.flatten().tolist(), chosen, strict=True):
                tokens[row].append(token)
                logprobs[row].append(lp)
            out = model(input_ids=picked, past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def completion_logprobs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Logprob of each completion token given its prompt, one forward pass per sequence
    (differentiable: the policy-gradient loss uses it, ``score`` wraps it without grad)."""
    device = next(model.parameters()).device
    out = []
    for prompt, completion in zip(prompts, completions, strict=False):
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(prompt) - 1
        out.append(logp[start : start + len(completion)].gather(1, ids[0, len(prompt) :, None]).flatten())
    return out


@torch.no_grad()
def score(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> list[list[float]]:
    """Logprob of each completion token given its prompt, as plain floats."""
    return [lp.tolist() for lp in completion_logprobs(model, prompts, completions)]
