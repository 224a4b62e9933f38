"""A toy RL task and a group-relative policy-gradient learner for the demo.

The task is small enough to learn in a minute on two CPU cores and plain enough to read:
the policy is rewarded for speaking a *target vocabulary* (token ids below
``TARGET_VOCAB``), reward = the share of completion tokens drawn from it. Each prompt gets a
group of sampled completions; advantages are rewards normalised within the group (GRPO),
and the LoRA takes one on-policy step on ``-advantage * logprob``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colosync.demo.models import completion_logprobs
from colosync.errors import ConfigError

TARGET_VOCAB = 64


@dataclass(frozen=True)
class Task:
    prompts: list[list[int]]
    group_size: int
    max_new_tokens: int
    target_vocab: int = TARGET_VOCAB

    @classmethod
    def make(
        cls, num_prompts: int = 4, group_size: int = 8, max_new_tokens: int = 12, seed: int = 0, vocab_size: int = 512
    ) -> Task:
        g = torch.Generator().manual_seed(seed)
        prompts = [[1, *torch.randint(3, vocab_size, (4,), generator=g).tolist()] for _ in range(num_prompts)]
        return cls(prompts, group_size, max_new_tokens)

    def reward(self, completion: Sequence[int]) -> float:
        return sum(t < self.target_vocab for t in completion) / max(len(completion), 1)

    def batch(self) -> list[list[int]]:
        """Every prompt repeated ``group_size`` times, grouped."""
        return [p for p in self.prompts for _ in range(self.group_size)]

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        r = torch.tensor(rewards, dtype=torch.float64).view(len(self.prompts), self.group_size)
        adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)
        return adv.flatten().tolist()


def policy_gradient_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    advantages: Sequence[float],
) -> float:
    """One on-policy GRPO step (ratio 1, no clipping needed); returns the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logps = completion_logprobs(model, prompts, completions)
    tokens = sum(len(c) for c in completions)
    loss = -sum(a * lp.sum() for a, lp in zip(advantages, logps, strict=False)) / max(tokens, 1)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError("a GRPO step needs at least one completion")
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss)
