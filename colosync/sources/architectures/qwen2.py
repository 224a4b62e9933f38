"""Qwen2 / Qwen2.5: Llama plus q/k/v biases (megatron-core ``add_qkv_bias``), usually tied embeddings.

The fused ``linear_qkv.bias`` is interleaved per query group exactly like its weight's rows
and split over TP with them, so the same de-interleave turns it into q/k/v biases. LoRA
leaves biases alone (PEFT's default ``bias="none"``), so the adapter side is Llama's.
"""

from __future__ import annotations

from colosync.sources.architectures.base import DENSE, Architecture, Role, Slot

ARCH = Architecture(
    name="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    layer_tensors=(
        (Slot.INPUT_NORM, Role.WEIGHT),
        (Slot.QKV, Role.WEIGHT),
        (Slot.QKV, Role.BIAS),
        (Slot.PROJ, Role.WEIGHT),
        (Slot.POST_NORM, Role.WEIGHT),
        (Slot.FC1, Role.WEIGHT),
        (Slot.FC2, Role.WEIGHT),
    ),
    config={**DENSE, "add_qkv_bias": True},
)
