"""Qwen3-Next: Qwen3.5's hybrid of Gated-DeltaNet and gated attention, with a routed + shared-expert MoE.

* **GDN in_proj, grouped per key head.** megatron-core's ``GatedDeltaNet`` is the same module
  as in Qwen3.5 (per TP shard ``[q_t; k_t; v_t; z_t; b_t; a_t]``), but HF's Qwen3-Next fuses
  it as ``in_proj_qkvz`` -- per key head ``[q; k; v; z]``, with the ``r = value heads / key
  heads`` value (and gate) heads of that key head together -- and ``in_proj_ba`` -- per key
  head ``[b; a]`` (HF's ``fix_query_key_value_ordering`` undoes exactly that). conv1d,
  ``A_log``, ``dt_bias``, ``norm`` and ``out_proj`` are Qwen3.5's.
* **MoE in every layer**: Qwen3-MoE's router and routed experts (gathered over EP into the
  fused 3-D ``gate_up_proj`` / ``down_proj``), plus megatron-core's ``SharedExpertMLP``
  (``moe_shared_expert_intermediate_size``, a dense MLP over the dense TP group) and its
  sigmoid gate (``moe_shared_expert_gate``: one ``(1, hidden)`` weight) -> HF's
  ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``.
* **LoRA** on attention and on GDN's ``in_proj`` (one ``lora_A`` shared by ``in_proj_qkvz``
  and ``in_proj_ba``, ``lora_B`` regrouped like the weight) and ``out_proj``; on experts (routed
  or shared) it is refused by name, as for Qwen3-MoE.
"""

from __future__ import annotations

from colosync.sources.architectures.base import SET, Architecture, Role, Slot
from colosync.sources.architectures.qwen3 import ATTENTION
from colosync.sources.architectures.qwen3_5 import GDN

_MOE: tuple[tuple[Slot, Role], ...] = (
    (Slot.ROUTER, Role.WEIGHT),
    (Slot.EXPERT_FC1, Role.WEIGHT),
    (Slot.EXPERT_FC2, Role.WEIGHT),
    (Slot.SHARED_FC1, Role.WEIGHT),
    (Slot.SHARED_FC2, Role.WEIGHT),
    (Slot.SHARED_GATE, Role.WEIGHT),
)

_NO_EXPERT_LORA = (
    "Qwen3-Next has no dense MLP; LoRA on routed or shared experts is refused (no converter to a per-expert "
    "adapter the engines load); target q_proj, k_proj, v_proj, o_proj and in_proj_qkvz, in_proj_ba, out_proj"
)

ARCH = Architecture(
    name="qwen3_next",
    hf_architecture="Qwen3NextForCausalLM",
    layer_tensors=(*ATTENTION, *_MOE),
    linear_layer_tensors=(*GDN, *_MOE),
    config={
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": SET,
        "attention_output_gate": True,
        "num_moe_experts": SET,
        "moe_layer_freq": 1,
        "moe_shared_expert_intermediate_size": SET,
        "moe_shared_expert_gate": True,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": False,
        "moe_router_num_groups": None,
        "moe_router_topk_scaling_factor": None,
    },
    lora_slots=(Slot.QKV, Slot.PROJ, Slot.GDN_IN_PROJ, Slot.GDN_OUT_PROJ),
    refused_lora={p: _NO_EXPERT_LORA for p in ("gate_proj", "up_proj", "down_proj")},
    gated_attention=True,
    hf_zero_centered_norms=True,
    grouped_gdn=True,
)
