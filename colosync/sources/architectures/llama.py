"""Llama-style GPT: GQA attention without biases, RMSNorm, SwiGLU MLP, untied or tied embeddings."""

from __future__ import annotations

from colosync.sources.architectures.base import DENSE, Architecture

ARCH = Architecture(name="llama", hf_architecture="LlamaForCausalLM", config=DENSE)
