"""The vocabulary every Megatron -> HF architecture shares, and ``Architecture`` itself.

A Megatron GPT checkpoint is described here independently of any one naming convention or
model: canonical slots (modules) and roles (weight, bias, the two LoRA halves), how tensor
parallelism splits each (slot, role), and which HF modules each slot becomes. What differs
between Llama, Qwen2, Qwen3 and Qwen3-MoE (which tensors a layer has, which flags of
Megatron's ``TransformerConfig`` it needs, which HF modules a LoRA may target) is one
declarative :class:`Architecture` per file next to this one, found through the registry in
``colosync.sources.architectures``; the naming table (``naming``), the typed context
(``context``) and the plan and layout conversions (``layout``) are shared by all.

Tensor-parallel sharding rules (Megatron-core, and PEFT's ``LoraParallelLinear``):

=====================  ==============  ==============  ==============
module                 weight / bias   lora_A          lora_B
=====================  ==============  ==============  ==============
linear_qkv, fc1        rows (column)   replicated      rows
linear_proj, fc2       cols (row)      cols            replicated
expert fc1 / fc2       rows / cols     --              --
embedding, output      rows (vocab)    --              --
norms, q/k norms       replicated      --              --
router                 replicated      --              --
GDN in_proj            rows (column)   replicated      rows
GDN out_proj           cols (row)      cols            replicated
GDN conv1d, A_log,     rows (channels  --              --
dt_bias                / heads)
GDN out_norm           replicated      --              --
=====================  ==============  ==============  ==============

Gated-DeltaNet (megatron-core ``GatedDeltaNet``, Qwen3.5's linear-attention layers) keeps
each TP shard's rows as ``[q_t; k_t; v_t; z_t; b_t; a_t]`` in ``in_proj`` and its conv1d
channels as ``[q_t; k_t; v_t]``; the HF side has separate ``in_proj_qkv`` (``[q; k; v]``),
``in_proj_z``, ``in_proj_b``, ``in_proj_a`` and one ``conv1d`` over ``[q; k; v]``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from colosync.errors import ConversionError

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

Kind = Literal["lora", "full"]


class Slot(enum.Enum):
    """A canonical Megatron GPT parameter slot (module), independent of naming convention."""

    EMBEDDING = "embedding.word_embeddings"
    INPUT_NORM = "input_layernorm"
    QKV = "self_attention.linear_qkv"
    Q_NORM = "self_attention.q_layernorm"
    K_NORM = "self_attention.k_layernorm"
    PROJ = "self_attention.linear_proj"
    POST_NORM = "pre_mlp_layernorm"
    FC1 = "mlp.linear_fc1"
    FC2 = "mlp.linear_fc2"
    ROUTER = "mlp.router"
    EXPERT_FC1 = "mlp.experts.linear_fc1"
    EXPERT_FC2 = "mlp.experts.linear_fc2"
    FINAL_NORM = "decoder.final_layernorm"
    OUTPUT = "output_layer"
    # Gated-DeltaNet (linear attention) layers: megatron-core's GatedDeltaNet
    GDN_IN_PROJ = "self_attention.in_proj"
    GDN_CONV = "self_attention.conv1d"
    GDN_A_LOG = "self_attention.A_log"
    GDN_DT_BIAS = "self_attention.dt_bias"
    GDN_NORM = "self_attention.out_norm"
    GDN_OUT_PROJ = "self_attention.out_proj"
    # a shared expert next to the routed ones (Qwen3-Next), with its sigmoid gate
    SHARED_FC1 = "mlp.shared_experts.linear_fc1"
    SHARED_FC2 = "mlp.shared_experts.linear_fc2"
    SHARED_GATE = "mlp.shared_experts.gate_weight"

    @property
    def per_layer(self) -> bool:
        return self not in (Slot.EMBEDDING, Slot.FINAL_NORM, Slot.OUTPUT)

    @property
    def expert(self) -> bool:
        """Routed-expert slots: one parameter per local expert, stacked into one HF tensor."""
        return self in (Slot.EXPERT_FC1, Slot.EXPERT_FC2)

    @property
    def bare(self) -> bool:
        """A module's own parameter (``A_log``, ``dt_bias``), not a submodule's ``.weight``."""
        return self in (Slot.GDN_A_LOG, Slot.GDN_DT_BIAS, Slot.SHARED_GATE)

    @property
    def layer_norm(self) -> bool:
        """A norm whose HF counterpart may be zero-centered (``(1 + w) * x``, Qwen3.5's)."""
        return self in (Slot.INPUT_NORM, Slot.POST_NORM, Slot.FINAL_NORM, Slot.Q_NORM, Slot.K_NORM)


class Role(enum.Enum):
    WEIGHT = "weight"
    BIAS = "bias"
    LORA_A = "lora_A"
    LORA_B = "lora_B"

    @property
    def base(self) -> bool:
        """A base-model tensor (weight or bias), as opposed to an adapter half."""
        return self in (Role.WEIGHT, Role.BIAS)


class Split(enum.Enum):
    """How tensor parallelism splits a tensor: not at all, on dim 0 (rows) or dim 1 (cols).

    For expert slots the dims are those of one expert's matrix (the stacked tensor's dims
    1 and 2), split over the expert-tensor-parallel group.
    """

    NONE = None
    ROWS = 0
    COLS = 1


LORA_SLOTS: tuple[Slot, ...] = (Slot.QKV, Slot.PROJ, Slot.FC1, Slot.FC2)
GDN_LORA_SLOTS: tuple[Slot, ...] = (Slot.GDN_IN_PROJ, Slot.GDN_OUT_PROJ)
LINEAR_SLOTS: tuple[Slot, ...] = LORA_SLOTS + GDN_LORA_SLOTS + (Slot.SHARED_FC1, Slot.SHARED_FC2)
"""Every Megatron linear the naming table knows (base weight and adapter halves)."""

SPLITS: Mapping[tuple[Slot, Role], Split] = {
    (Slot.EMBEDDING, Role.WEIGHT): Split.ROWS,
    (Slot.OUTPUT, Role.WEIGHT): Split.ROWS,
    (Slot.INPUT_NORM, Role.WEIGHT): Split.NONE,
    (Slot.POST_NORM, Role.WEIGHT): Split.NONE,
    (Slot.FINAL_NORM, Role.WEIGHT): Split.NONE,
    (Slot.Q_NORM, Role.WEIGHT): Split.NONE,
    (Slot.K_NORM, Role.WEIGHT): Split.NONE,
    (Slot.ROUTER, Role.WEIGHT): Split.NONE,
    # column-parallel: output rows split; lora_A replicated, lora_B split like the rows
    (Slot.QKV, Role.WEIGHT): Split.ROWS,
    (Slot.QKV, Role.BIAS): Split.ROWS,
    (Slot.QKV, Role.LORA_A): Split.NONE,
    (Slot.QKV, Role.LORA_B): Split.ROWS,
    (Slot.FC1, Role.WEIGHT): Split.ROWS,
    (Slot.FC1, Role.LORA_A): Split.NONE,
    (Slot.FC1, Role.LORA_B): Split.ROWS,
    (Slot.EXPERT_FC1, Role.WEIGHT): Split.ROWS,
    # row-parallel: input columns split; lora_A split like the input, lora_B replicated
    (Slot.PROJ, Role.WEIGHT): Split.COLS,
    (Slot.PROJ, Role.LORA_A): Split.COLS,
    (Slot.PROJ, Role.LORA_B): Split.NONE,
    (Slot.FC2, Role.WEIGHT): Split.COLS,
    (Slot.FC2, Role.LORA_A): Split.COLS,
    (Slot.FC2, Role.LORA_B): Split.NONE,
    (Slot.EXPERT_FC2, Role.WEIGHT): Split.COLS,
    # Gated-DeltaNet: in_proj column-parallel, out_proj row-parallel, conv1d/A_log/dt_bias per channel/head
    (Slot.GDN_IN_PROJ, Role.WEIGHT): Split.ROWS,
    (Slot.GDN_IN_PROJ, Role.LORA_A): Split.NONE,
    (Slot.GDN_IN_PROJ, Role.LORA_B): Split.ROWS,
    (Slot.GDN_OUT_PROJ, Role.WEIGHT): Split.COLS,
    (Slot.GDN_OUT_PROJ, Role.LORA_A): Split.COLS,
    (Slot.GDN_OUT_PROJ, Role.LORA_B): Split.NONE,
    (Slot.GDN_CONV, Role.WEIGHT): Split.ROWS,
    (Slot.GDN_A_LOG, Role.WEIGHT): Split.ROWS,
    (Slot.GDN_DT_BIAS, Role.WEIGHT): Split.ROWS,
    (Slot.GDN_NORM, Role.WEIGHT): Split.NONE,
    # the shared expert is a dense MLP over the dense TP group; its gate is replicated
    (Slot.SHARED_FC1, Role.WEIGHT): Split.ROWS,
    (Slot.SHARED_FC2, Role.WEIGHT): Split.COLS,
    (Slot.SHARED_GATE, Role.WEIGHT): Split.NONE,
}
"""The tensor-parallel split of every (slot, role) the converter handles."""

HF_PARTS: Mapping[Slot, tuple[str, ...]] = {
    Slot.QKV: ("q_proj", "k_proj", "v_proj"),
    Slot.PROJ: ("o_proj",),
    Slot.FC1: ("gate_proj", "up_proj"),
    Slot.FC2: ("down_proj",),
    Slot.GDN_IN_PROJ: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    Slot.GDN_OUT_PROJ: ("out_proj",),
    Slot.SHARED_FC1: ("gate_proj", "up_proj"),
    Slot.SHARED_FC2: ("down_proj",),
}
"""The HF linear modules each Megatron module becomes (fused modules become several).

Qwen3-Next groups GDN's in_proj differently (:data:`GROUPED_GDN_PARTS`); ask
:meth:`Architecture.parts` rather than this table."""

GROUPED_GDN_PARTS: tuple[str, ...] = ("in_proj_qkvz", "in_proj_ba")
"""Qwen3-Next's GDN in_proj: ``[q, k, v, z]`` and ``[b, a]`` grouped per key head."""

_HF_PARENT = {
    Slot.QKV: "self_attn",
    Slot.PROJ: "self_attn",
    Slot.FC1: "mlp",
    Slot.FC2: "mlp",
    Slot.GDN_IN_PROJ: "linear_attn",
    Slot.GDN_OUT_PROJ: "linear_attn",
    Slot.SHARED_FC1: "mlp.shared_expert",
    Slot.SHARED_FC2: "mlp.shared_expert",
}
_HF_SINGLE = {
    Slot.EMBEDDING: "model.embed_tokens.weight",
    Slot.FINAL_NORM: "model.norm.weight",
    Slot.OUTPUT: "lm_head.weight",
    Slot.INPUT_NORM: "model.layers.{layer}.input_layernorm.weight",
    Slot.POST_NORM: "model.layers.{layer}.post_attention_layernorm.weight",
    Slot.Q_NORM: "model.layers.{layer}.self_attn.q_norm.weight",
    Slot.K_NORM: "model.layers.{layer}.self_attn.k_norm.weight",
    Slot.ROUTER: "model.layers.{layer}.mlp.gate.weight",
    Slot.EXPERT_FC1: "model.layers.{layer}.mlp.experts.gate_up_proj",
    Slot.EXPERT_FC2: "model.layers.{layer}.mlp.experts.down_proj",
    Slot.GDN_CONV: "model.layers.{layer}.linear_attn.conv1d.weight",
    Slot.GDN_A_LOG: "model.layers.{layer}.linear_attn.A_log",
    Slot.GDN_DT_BIAS: "model.layers.{layer}.linear_attn.dt_bias",
    Slot.GDN_NORM: "model.layers.{layer}.linear_attn.norm.weight",
    Slot.SHARED_GATE: "model.layers.{layer}.mlp.shared_expert_gate.weight",
}
PEFT_PREFIX = "base_model.model."


def hf_module(slot: Slot, layer: int, part: str) -> str:
    """``model.layers.3.self_attn.q_proj``: the HF module path of one part of ``slot``."""
    return f"model.layers.{layer}.{_HF_PARENT[slot]}.{part}"


# -- architectures ----------------------------------------------------------------------------

_LLAMA_LAYER: tuple[tuple[Slot, Role], ...] = (
    (Slot.INPUT_NORM, Role.WEIGHT),
    (Slot.QKV, Role.WEIGHT),
    (Slot.PROJ, Role.WEIGHT),
    (Slot.POST_NORM, Role.WEIGHT),
    (Slot.FC1, Role.WEIGHT),
    (Slot.FC2, Role.WEIGHT),
)

_CONFIG_NEVER: Mapping[str, object] = {
    # flags no architecture here converts; each is refused by name
    "add_bias_linear": False,
    "multi_latent_attention": False,
    "rotary_interleaved": False,
    "gated_linear_unit": True,
    "normalization": "RMSNorm",
    "virtual_pipeline_model_parallel_size": None,
    "experimental_attention_variant": None,
    "qk_l2_norm": False,
    "moe_latent_size": None,
    "attention_output_gate": False,
    "moe_shared_expert_gate": False,
}
_NEVER_WHY: Mapping[str, str] = {
    "experimental_attention_variant": (
        "Gated-DeltaNet hybrids convert with arch='qwen3_5' (dense MLP); Qwen3-Next (GDN + MoE) and DSA "
        "are not converted yet, so they are refused rather than sent wrong"
    ),
    "multi_latent_attention": "MLA (DeepSeek-style attention) has no converter here",
    "attention_output_gate": "a gated full attention (the gate rides in q_proj) is Qwen3.5's: use arch='qwen3_5'",
}

DENSE: Mapping[str, object] = {"add_qkv_bias": False, "qk_layernorm": False, "num_moe_experts": None}
"""The ``TransformerConfig`` values of a dense, bias-free, norm-free-attention architecture."""


class _Set:
    """An ``Architecture.config`` value: the flag must be set (not ``None``), to any value."""

    def __repr__(self) -> str:
        return "a value (not None)"


SET = _Set()


def _accepts(want: object, have: object) -> bool:
    return have is not None if want is SET else want == have


@dataclass(frozen=True)
class Architecture:
    """What one HF architecture's Megatron checkpoint holds, declared as data.

    ``layer_tensors``: the (slot, role) of each base tensor of one decoder layer, in stream
    order. ``config``: the ``TransformerConfig`` values this architecture needs (a different
    value is refused by name, before any byte moves); ``lora_slots``: the Megatron modules a
    LoRA may wrap, in HF-module terms through :data:`HF_PARTS`. ``refused_lora``: HF module
    names that exist but whose LoRA is refused, with the reason. ``hf_architecture``: the
    ``transformers`` class the converted tensors load into.

    Hybrids: ``linear_layer_tensors`` (non-empty) are the tensors of a linear-attention
    (Gated-DeltaNet) layer, which the context's ``linear_layers`` place; ``layer_tensors``
    are then those of the full-attention layers. ``gated_attention``: the full attention's
    ``linear_qkv`` carries an output gate per query head (HF: the second half of each head's
    ``q_proj`` rows). ``hf_zero_centered_norms``: HF's layer norms compute ``(1 + w) * x``.
    ``grouped_gdn``: HF's GDN in_proj is Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``
    (grouped per key head) rather than Qwen3.5's four separate projections.
    """

    name: str
    hf_architecture: str
    layer_tensors: tuple[tuple[Slot, Role], ...] = _LLAMA_LAYER
    config: Mapping[str, object] = field(default_factory=dict)
    lora_slots: tuple[Slot, ...] = LORA_SLOTS
    refused_lora: Mapping[str, str] = field(default_factory=dict)
    linear_layer_tensors: tuple[tuple[Slot, Role], ...] = ()
    gated_attention: bool = False
    hf_zero_centered_norms: bool = False
    grouped_gdn: bool = False

    def parts(self, slot: Slot) -> tuple[str, ...]:
        """The HF linear modules Megatron's ``slot`` becomes in this architecture."""
        if slot is Slot.GDN_IN_PROJ and self.grouped_gdn:
            return GROUPED_GDN_PARTS
        return HF_PARTS[slot]

    @property
    def moe(self) -> bool:
        return any(slot.expert for slot, _ in self.layer_tensors + self.linear_layer_tensors)

    @property
    def hybrid(self) -> bool:
        """Has linear-attention (Gated-DeltaNet) layers."""
        return bool(self.linear_layer_tensors)

    def tensors_of_layer(self, linear: bool) -> tuple[tuple[Slot, Role], ...]:
        """The base tensors of a linear-attention layer (``linear``) or of a full-attention one."""
        return self.linear_layer_tensors if linear else self.layer_tensors

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return tuple(p for s in self.lora_slots for p in self.parts(s))

    def check_config(self, config: TransformerConfig, supported: Sequence[Architecture] = ()) -> None:
        """Refuse, by name, every ``TransformerConfig`` flag this architecture does not convert;
        the message proposes one of ``supported`` (the registry's) that would."""
        for attr, want in {**_CONFIG_NEVER, **self.config}.items():
            have = getattr(config, attr, None if want is SET else want)
            if (have is not None) if want is SET else (have == want):
                continue
            alternatives = [a.name for a in supported if _accepts(a.config.get(attr, _CONFIG_NEVER.get(attr)), have)]
            why = _NEVER_WHY.get(attr, "no architecture converts it")
            hint = f"use arch={alternatives[0]!r}" if alternatives else why
            raise ConversionError(
                f"TransformerConfig.{attr}={have!r}: the Megatron->HF {self.name!r} converter needs {want!r} "
                f"({hint}; supported: {[a.name for a in supported]})"
            )
        activation = getattr(config, "activation_func", None)
        if activation is not None and activation is not torch.nn.functional.silu:
            raise ConversionError(
                f"TransformerConfig.activation_func={activation!r}: the HF {self.hf_architecture} layout computes "
                "silu(gate) * up; set activation_func=torch.nn.functional.silu with gated_linear_unit=True"
            )


__all__ = [
    "Architecture",
    "ConversionError",
    "DENSE",
    "GDN_LORA_SLOTS",
    "GROUPED_GDN_PARTS",
    "HF_PARTS",
    "LINEAR_SLOTS",
    "Kind",
    "LORA_SLOTS",
    "PEFT_PREFIX",
    "Role",
    "SET",
    "SPLITS",
    "Slot",
    "Split",
    "hf_module",
]
