"""Qwen3.5 dense: a hybrid of Gated-DeltaNet (linear attention) and gated full attention, SwiGLU MLP.

* **Which layer is which** comes from megatron-core's ``linear_attention_freq`` (every N-th
  layer full attention, the rest GDN; or a 0/1 list), read into the context's
  ``linear_layers``; HF's ``layer_types`` says the same thing.
* **GDN layers** (megatron-core ``GatedDeltaNet``): ``in_proj`` holds, per TP shard,
  ``[q_t; k_t; v_t; z_t; b_t; a_t]``; it becomes HF's ``linear_attn.in_proj_qkv``
  (``[q; k; v]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. ``conv1d`` channels are
  ``[q_t; k_t; v_t]`` per shard -> one HF ``conv1d`` over ``[q; k; v]``. ``A_log`` and
  ``dt_bias`` split by value heads; ``out_proj`` is row-parallel; ``out_norm`` (one
  ``value_head_dim`` weight) is replicated and becomes ``linear_attn.norm``.
* **Full-attention layers** carry an output gate (``attention_output_gate``): Megatron's
  ``linear_qkv`` groups ``[q heads; gate heads; k; v]`` per query group, HF's ``q_proj``
  holds ``[q_h; gate_h]`` per head. q/k norms as Qwen3's.
* **Norms**: HF's layer norms (input, post-attention, final, q/k) compute ``(1 + w) * x``;
  its GDN norm computes ``w * x``. Megatron does ``(1 + w)`` for all of them exactly when
  ``layernorm_zero_centered_gamma`` (Transformer Engine's norms; the local spec's torch
  norms cannot), so one of the two kinds is shifted by one on the way (exact for weights
  in [0.5, 2] and for any weight whose bits survive the shift).
* **LoRA**: on ``q_proj``/``k_proj``/``v_proj``/``o_proj``, the MLP, and GDN's ``in_proj``
  (one ``lora_A`` shared by ``in_proj_qkv``/``z``/``b``/``a``, ``lora_B`` split per shard like
  the weight) and ``out_proj``.
"""

from __future__ import annotations

from colosync.sources.architectures.base import GDN_LORA_SLOTS, LORA_SLOTS, SET, Architecture, Role, Slot
from colosync.sources.architectures.qwen3 import ATTENTION

_MLP: tuple[tuple[Slot, Role], ...] = ((Slot.FC1, Role.WEIGHT), (Slot.FC2, Role.WEIGHT))

GDN: tuple[tuple[Slot, Role], ...] = (
    (Slot.INPUT_NORM, Role.WEIGHT),
    (Slot.GDN_IN_PROJ, Role.WEIGHT),
    (Slot.GDN_CONV, Role.WEIGHT),
    (Slot.GDN_A_LOG, Role.WEIGHT),
    (Slot.GDN_DT_BIAS, Role.WEIGHT),
    (Slot.GDN_NORM, Role.WEIGHT),
    (Slot.GDN_OUT_PROJ, Role.WEIGHT),
    (Slot.POST_NORM, Role.WEIGHT),
)
"""The tensors of one Gated-DeltaNet token mixer and the norms around it."""

ARCH = Architecture(
    name="qwen3_5",
    hf_architecture="Qwen3_5ForCausalLM",
    layer_tensors=(*ATTENTION, *_MLP),
    linear_layer_tensors=(*GDN, *_MLP),
    config={
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "num_moe_experts": None,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": SET,
        "attention_output_gate": True,
    },
    lora_slots=LORA_SLOTS + GDN_LORA_SLOTS,
    gated_attention=True,
    hf_zero_centered_norms=True,
)
