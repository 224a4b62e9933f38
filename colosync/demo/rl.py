"""The demo's learner: one on-policy policy-gradient step with per-token advantages.

Per-token credit, not one advantage per completion: a sequence-level advantage reinforces
every token of a better-than-average sample, the wrong ones too, and on a tiny random model
that drives the policy onto one token repeated. Each token is pushed by its own advantage
(``colosync.demo.tasks``), and an entropy bonus keeps the policy sampling other tokens long
enough to find the right ones, instead of settling on the first that ever paid. The step is
on-policy (ratio 1), so no clipping is needed. The loss is computed in batches of equal
shapes, one forward pass per batch, not one per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from colosync.errors import ConfigError


def policy_gradient_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    advantages: Sequence[Sequence[float]],
    entropy_coef: float = 0.0,
) -> float:
    """One step on ``-(advantage * logprob) - entropy_coef * entropy``, both averaged over the
    completion tokens; returns the loss."""
    if not completions or len(prompts) != len(completions) or len(advantages) != len(completions):
        raise ConfigError(
            f"a policy-gradient step needs one advantage row per completion and at least one completion; "
            f"got {len(prompts)} prompts, {len(completions)} completions, {len(advantages)} advantage rows"
        )
    device = next(model.parameters()).device
    model.train()
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(len(c) for c in completions)
    if tokens == 0:
        raise ConfigError("a policy-gradient step needs at least one completion token")
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if len(advantages[i]) != len(c):
            raise ConfigError(f"completion {i} has {len(c)} tokens but {len(advantages[i])} advantages")
        shapes.setdefault((len(p), len(c)), []).append(i)
    total = torch.zeros((), device=device)
    for (plen, clen), rows in shapes.items():
        if clen == 0:
            continue
        ids = torch.tensor([[*prompts[i], *completions[i]] for i in rows], device=device)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[:, plen - 1 : plen - 1 + clen]
        chosen = logp.gather(2, ids[:, plen:, None]).squeeze(2)
        adv = torch.tensor([list(advantages[i]) for i in rows], device=device, dtype=torch.float32)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        total = total - (adv * chosen).sum() - entropy_coef * entropy.sum()
    loss = total / tokens
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss.detach())
