"""Small local models for tests, demos and parity checks; nothing is ever downloaded.

``make_tiny_llama`` writes a Llama-style model (GQA, 2 layers) with fixed-seed weights to a
directory, so a trainer and every engine process (hf, vLLM) load bit-identical weights.
``greedy`` is the reference decoder both sides use for parity: tokens and per-token
logprobs, fp32, no sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama_config(
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )


def make_tiny_llama(path: str | Path, seed: int = 0, **config_overrides: int) -> Path:
    """Create (or reuse) a tiny Llama at ``path`` with weights drawn from ``seed``."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = tiny_llama_config(**config_overrides)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than HF's default init so LoRA and updates visibly matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def random_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = LORA_TARGETS,
    seed: int = 0,
    scale: float = 0.05,
) -> torch.nn.Module:
    """Wrap ``model`` in a PEFT LoRA whose A *and* B are random, so it changes the output."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    )
    fill_lora(peft_model, seed, scale)
    return peft_model


def fill_lora(peft_model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Draw fresh values for every LoRA weight of ``peft_model`` (a new adapter version)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


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
            for row, token, lp in zip(rows, picked.flatten().tolist(), chosen):
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
    for prompt, completion in zip(prompts, completions):
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
