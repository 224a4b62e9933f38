"""Qwen3-MoE: Qwen3's attention with a routed-expert MLP in every layer, no shared expert.

* ``mlp.router.weight`` (replicated over TP) becomes ``mlp.gate.weight``.
* Routed experts -- SequentialMLP's ``mlp.experts.local_experts.<i>.linear_fc1/fc2`` or
  TEGroupedMLP's ``mlp.experts.linear_fc1.weight<i>`` -- are gathered over expert
  parallelism (local expert ``i`` of EP rank ``r`` is global expert ``r * E/EP + i``) and
  the expert-TP group into transformers 5.x's fused 3-D ``mlp.experts.gate_up_proj``
  ``(E, 2F, h)`` (``[gate; up]`` per expert) and ``mlp.experts.down_proj`` ``(E, h, F)``.
* Megatron's default router (top-k of the logits, then a softmax over those k;
  ``moe_router_pre_softmax=False``) computes HF's softmax, top-k and renormalize, i.e. the
  HF config must say ``norm_topk_prob=True`` (Qwen3-MoE's do); sigmoid, grouped or
  expert-biased routers are refused by name.
* vLLM 0.32's fused-MoE loader takes these fused names too (``experts.gate_up_proj`` is
  split into its w1/w3 halves, ``experts.down_proj`` becomes w2), as well as per-expert
  ``experts.<e>.gate_proj.weight`` ones.
* LoRA converts on attention only. A LoRA on experts would need the engine to accept
  per-expert (3-D) adapters: transformers' PEFT targets fused 3-D experts only through
  ``target_parameters`` and vLLM's CPU MoE LoRA path needs Triton, so it is refused by name.
"""

from __future__ import annotations

from colosync.sources.architectures.base import SET, Architecture, Role, Slot
from colosync.sources.architectures.qwen3 import ATTENTION

_NO_EXPERT_LORA = (
    "Qwen3-MoE has no dense MLP; LoRA on routed experts is refused (no converter to a per-expert adapter "
    "the engines load); target the attention modules q_proj, k_proj, v_proj, o_proj"
)

ARCH = Architecture(
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    layer_tensors=(
        *ATTENTION,
        (Slot.ROUTER, Role.WEIGHT),
        (Slot.EXPERT_FC1, Role.WEIGHT),
        (Slot.EXPERT_FC2, Role.WEIGHT),
    ),
    config={
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "num_moe_experts": SET,
        "moe_layer_freq": 1,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": False,
        "moe_router_num_groups": None,
        "moe_router_topk_scaling_factor": None,
    },
    lora_slots=(Slot.QKV, Slot.PROJ),
    refused_lora={p: _NO_EXPERT_LORA for p in ("gate_proj", "up_proj", "down_proj")},
)
