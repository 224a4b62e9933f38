"""Qwen3 dense: Llama plus per-head RMSNorm on queries and keys (megatron-core ``qk_layernorm``).

``q_layernorm`` / ``k_layernorm`` hold one ``head_dim`` weight each, shared by every head and
replicated over TP; they become HF's ``self_attn.q_norm`` / ``k_norm``. No q/k/v biases.
"""

from __future__ import annotations

from colosync.sources.architectures.base import DENSE, Architecture, Role, Slot

ATTENTION: tuple[tuple[Slot, Role], ...] = (
    (Slot.INPUT_NORM, Role.WEIGHT),
    (Slot.QKV, Role.WEIGHT),
    (Slot.Q_NORM, Role.WEIGHT),
    (Slot.K_NORM, Role.WEIGHT),
    (Slot.PROJ, Role.WEIGHT),
    (Slot.POST_NORM, Role.WEIGHT),
)

ARCH = Architecture(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    layer_tensors=(*ATTENTION, (Slot.FC1, Role.WEIGHT), (Slot.FC2, Role.WEIGHT)),
    config={**DENSE, "qk_layernorm": True},
)
