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


@torch.no_grad()
def greedy(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuation of each prompt, with the logprob of every chosen token."""
    device = next(model.parameters()).device
    all_tokens, all_logprobs = [], []
    for prompt in prompts:
        out = model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True)
        tokens, logprobs = [], []
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            out = model(
                input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True
            )
        all_tokens.append(tokens)
        all_logprobs.append(logprobs)
    return all_tokens, all_logprobs


@torch.no_grad()
def score(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> list[list[float]]:
    """Logprob of each completion token given its prompt (one forward pass per sequence)."""
    device = next(model.parameters()).device
    result = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(prompt) - 1
        picked = logp[start : start + len(completion)].gather(1, ids[0, len(prompt) :, None])
        result.append(picked.flatten().tolist())
    return result
