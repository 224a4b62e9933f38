"""Small local models and random adapters for tests, examples and parity checks; nothing is downloaded.

Public on purpose: a framework testing its own colosync integration needs the same fixed-seed
models and adapters colosync's tests use, without importing the demo.

``make_tiny_llama`` writes a Llama-style model (GQA, 2 layers) with fixed-seed weights to a
directory (``make_tiny_qwen2`` a Qwen2 one, embeddings tied), so a trainer and every engine process (hf, vLLM)
load bit-identical weights.
The reference decoder both sides use for parity (``greedy``, ``score``) is the hf engine's
own, re-exported here for tests and the demo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from colosync.decoding import completion_logprobs, generate, greedy, load_model, score

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel, Qwen2Config

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


_TINY: dict[str, Any] = {  # keyword arguments of any transformers config
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


@dataclass(frozen=True)
class TinySizes:
    """The dimensions of a tiny model; every config field a test or example may override."""

    vocab_size: int = 512
    hidden_size: int = 128  # head size 32: the smallest vLLM's CPU attention runs
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256


def tiny_llama_config(**sizes: int) -> LlamaConfig:
    """A Llama config of ``TinySizes`` (override any field by name), untied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(**asdict(TinySizes(**sizes)), tie_word_embeddings=False, **_TINY)


def tiny_qwen2_config(tie_word_embeddings: bool = True, **sizes: int) -> Qwen2Config:
    """A Qwen2 config (q/k/v biases; embeddings tied by default). Head size hidden/heads = 32:
    vLLM's CPU attention has no kernel for smaller heads."""
    from transformers import Qwen2Config

    fields = asdict(TinySizes(**{"hidden_size": 128, "intermediate_size": 256, **sizes}))
    return Qwen2Config(**fields, tie_word_embeddings=tie_word_embeddings, use_sliding_window=False, **_TINY)


def _save_tiny(path: str | Path, seed: int, build: Callable[[], PreTrainedModel], biases: bool = False) -> Path:
    """Create (or reuse) ``build()``'s model at ``path`` with weights drawn from ``seed``."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():  # larger than HF's default init so LoRA and updates visibly matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif biases and p.dim() == 1 and not torch.all(p == 1):  # biases; norms stay at one
                p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_llama(path: str | Path, seed: int = 0, **config_overrides: int) -> Path:
    """Create (or reuse) a tiny Llama at ``path`` with weights drawn from ``seed``."""
    from transformers import LlamaForCausalLM

    return _save_tiny(path, seed, lambda: LlamaForCausalLM(tiny_llama_config(**config_overrides)))


def make_tiny_qwen2(path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Create (or reuse) a tiny Qwen2 (tied embeddings unless ``tie_word_embeddings=False``) at ``path``."""
    from transformers import Qwen2ForCausalLM

    return _save_tiny(path, seed, lambda: Qwen2ForCausalLM(tiny_qwen2_config(**config_overrides)), biases=True)


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
        model,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; a float alpha works (scale alpha/r)
            target_modules=list(targets),
            lora_dropout=0.0,
        ),
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


__all__ = [
    "LORA_TARGETS",
    "completion_logprobs",
    "fill_lora",
    "generate",
    "greedy",
    "load_model",
    "make_tiny_llama",
    "make_tiny_qwen2",
    "random_lora",
    "score",
    "TinySizes",
    "tiny_llama_config",
    "tiny_qwen2_config",
]
