"""Trainer-side sources: turn a trainer's parameters into the named HF/PEFT tensors a Sender sends.

Sources never import their trainer framework at module scope (Megatron loads only when a
Megatron source is used), so ``import colosync.sources`` stays light.
"""

from __future__ import annotations

__all__ = ["architectures", "base", "fsdp", "megatron", "megatron_layout", "plain"]
