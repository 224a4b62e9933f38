"""The demo's task: count on from the prompt, a rule a tiny model learns in a minute on two cores.

A reward that ignores the prompt lets a policy collapse: the demo's first task (speak from a
target vocabulary) ended with every prompt answered by one token repeated. Here the right
answer depends on the prompt and never repeats a token: the prompt shows three numbers in a
row and the policy must keep counting (``5 6 7`` -> ``8 9 10 ...``), modulo the size of
the alphabet. Each token earns 1 when it is the successor of the token before it (the first
completion token: of the prompt's last number), so the reward is dense and a wrong start
costs one token, not the whole answer; one token repeated earns 1/12. (Refusing credit to a
token already seen, which makes cycles pay less, helped the hf engine and hurt vLLM's
sampler in one run each; it is not used.) Training prompts are drawn fresh
every step, so the policy learns the rule, not four answers; the probe prompts (parity and
the greedy samples) stay fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colosync.errors import ConfigError

FIRST_NUMBER = 3  # token ids 0, 1, 2 are pad, bos and eos in the tiny models
BOS = 1


@dataclass(frozen=True)
class CountTask:
    """Continue ``s, s+1, s+2`` with ``s+3, s+4, ...`` modulo ``numbers``; numbers are token ids
    ``FIRST_NUMBER ..``, so the model's vocabulary is ``vocab_size``."""

    numbers: int = 29
    shown: int = 3  # numbers in each prompt
    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 12
    seed: int = 0

    def __post_init__(self) -> None:
        if self.numbers < self.shown + self.max_new_tokens or self.prompts_per_step > self.numbers:
            raise ConfigError(
                f"CountTask(numbers={self.numbers}) cannot count {self.shown}+{self.max_new_tokens} distinct "
                f"numbers for {self.prompts_per_step} prompts: raise numbers or lower max_new_tokens"
            )

    @property
    def probe_prompts(self) -> list[list[int]]:
        """The fixed prompts of the parity probe and the greedy samples (the same for a seed)."""
        return self._prompts(torch.Generator().manual_seed(self.seed))

    @property
    def vocab_size(self) -> int:
        return FIRST_NUMBER + self.numbers

    def prompt(self, start: int) -> list[int]:
        return [BOS, *(self._token(start + j) for j in range(self.shown))]

    def target(self, prompt: Sequence[int]) -> list[int]:
        """The right completion of ``prompt``."""
        last = prompt[-1] - FIRST_NUMBER
        return [self._token(last + 1 + i) for i in range(self.max_new_tokens)]

    def batch(self, step: int) -> list[list[int]]:
        """Step ``step``'s training prompts (fresh, drawn from the seed), each repeated ``group_size`` times."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        return [p for p in self._prompts(gen) for _ in range(self.group_size)]

    def token_rewards(self, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
        """1.0 for each token that is the successor of the token before it, else 0.0."""
        previous = [prompt[-1], *completion[:-1]]
        return [
            float(self._is_number(p) and t == self._successor(p)) for p, t in zip(previous, completion, strict=True)
        ]

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """The share of ``completion``'s tokens that count on from the token before them."""
        rewards = self.token_rewards(prompt, completion)
        return sum(rewards) / max(len(rewards), 1)

    def advantages(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per-token group-relative advantages: each token's reward against the mean (and spread)
        of the same position over its prompt's group (the ``group_size`` consecutive rows)."""
        if len(prompts) % self.group_size or len(prompts) != len(completions):
            raise ConfigError(
                f"advantages need whole groups of {self.group_size} completions, got {len(prompts)} prompts "
                f"and {len(completions)} completions: pass the rollout of batch() unchanged"
            )
        r = torch.tensor([self.token_rewards(p, c) for p, c in zip(prompts, completions, strict=True)])
        groups = r.view(-1, self.group_size, r.shape[-1]).double()
        adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-6)
        return adv.view(r.shape).tolist()

    def _prompts(self, gen: torch.Generator) -> list[list[int]]:
        starts = torch.randperm(self.numbers, generator=gen)[: self.prompts_per_step].tolist()
        return [self.prompt(s) for s in starts]

    def _token(self, number: int) -> int:
        return FIRST_NUMBER + number % self.numbers

    def _is_number(self, token: int) -> bool:
        return FIRST_NUMBER <= token < self.vocab_size

    def _successor(self, token: int) -> int:
        return self._token(token - FIRST_NUMBER + 1)
