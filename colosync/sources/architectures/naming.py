"""How local Megatron parameter names map to canonical keys: a table of regex rules.

:data:`DEFAULT_NAMING` maps every Megatron parameter name (local spec, Transformer-Engine
spec with fused norms and grouped-GEMM experts, PEFT's ``base_layer``/``lora_A.<adapter>``,
NeMo / Megatron-Bridge's ``to_wrap`` and ``adapter.linear_in``/``linear_out``) to a
canonical :class:`ParamKey`. Adding a naming convention is adding rules, not code; a name
no rule matches is refused by name rather than silently skipped.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from colosync.errors import ConversionError
from colosync.sources.architectures.base import LINEAR_SLOTS, Role, Slot

# -- naming table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamKey:
    """A Megatron parameter, canonically: slot, role, *local* layer and *local* expert index."""

    slot: Slot
    role: Role
    local_layer: int | None = None
    expert: int | None = None

    def describe(self) -> str:
        where = f"decoder.layers.{self.local_layer}." if self.local_layer is not None else ""
        which = f" (local expert {self.expert})" if self.expert is not None else ""
        return f"{where}{self.slot.value}.{self.role.value}{which}"


@dataclass(frozen=True)
class NamingRule:
    """One row of the naming table: a regex over a local parameter name -> (slot, role).

    ``pattern`` must match the whole name (after any leading ``module.`` wrappers are
    stripped); per-layer slots capture the local layer index as ``(?P<layer>\\d+)``, expert
    slots the local expert index as ``(?P<expert>\\d+)``.
    """

    pattern: str
    slot: Slot
    role: Role

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern)


_LAYER = r"decoder\.layers\.(?P<layer>\d+)\."
_WRAP = r"(?:base_layer\.|to_wrap\.)?"  # PEFT wraps the base as base_layer, Megatron-Bridge as to_wrap

BASE_SUFFIXES: tuple[str, ...] = (_WRAP + r"weight",)
"""Suffixes of a wrapped or unwrapped base weight."""

ADAPTER_SUFFIXES: tuple[tuple[str, str, str], ...] = (
    # (convention, lora_A suffix, lora_B suffix)
    ("peft / plain", r"lora_A(?:\.[\w-]+)?\.weight", r"lora_B(?:\.[\w-]+)?\.weight"),
    ("nemo / megatron-bridge", r"adapter\.linear_in\.weight", r"adapter\.linear_out\.weight"),
)
"""LoRA naming conventions: how each Megatron LoRA implementation names the two halves."""


def _default_naming() -> tuple[NamingRule, ...]:
    rules = [
        NamingRule(r"embedding\.word_embeddings\.weight", Slot.EMBEDDING, Role.WEIGHT),
        NamingRule(r"decoder\.final_layernorm\.weight", Slot.FINAL_NORM, Role.WEIGHT),
        NamingRule(r"output_layer\.weight", Slot.OUTPUT, Role.WEIGHT),
        NamingRule(_LAYER + r"input_layernorm\.weight", Slot.INPUT_NORM, Role.WEIGHT),
        NamingRule(_LAYER + r"pre_mlp_layernorm\.weight", Slot.POST_NORM, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.q_layernorm\.weight", Slot.Q_NORM, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.k_layernorm\.weight", Slot.K_NORM, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.linear_qkv\." + _WRAP + r"bias", Slot.QKV, Role.BIAS),
        NamingRule(_LAYER + r"mlp\.router\.weight", Slot.ROUTER, Role.WEIGHT),
        # Transformer-Engine spec: the norms are fused into the following linear
        NamingRule(
            _LAYER + r"self_attention\.linear_qkv\." + _WRAP + r"layer_norm_weight", Slot.INPUT_NORM, Role.WEIGHT
        ),
        NamingRule(_LAYER + r"mlp\.linear_fc1\." + _WRAP + r"layer_norm_weight", Slot.POST_NORM, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.in_proj\." + _WRAP + r"layer_norm_weight", Slot.INPUT_NORM, Role.WEIGHT),
        # Gated-DeltaNet's own parameters and its output norm
        NamingRule(_LAYER + r"self_attention\.conv1d\.weight", Slot.GDN_CONV, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.A_log", Slot.GDN_A_LOG, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.dt_bias", Slot.GDN_DT_BIAS, Role.WEIGHT),
        NamingRule(_LAYER + r"self_attention\.out_norm\.weight", Slot.GDN_NORM, Role.WEIGHT),
        NamingRule(_LAYER + r"mlp\.shared_experts\.gate_weight", Slot.SHARED_GATE, Role.WEIGHT),
    ]
    for slot in LINEAR_SLOTS:
        module = _LAYER + re.escape(slot.value) + r"\."
        rules += [NamingRule(module + suffix, slot, Role.WEIGHT) for suffix in BASE_SUFFIXES]
        for _, a, b in ADAPTER_SUFFIXES:
            rules += [NamingRule(module + a, slot, Role.LORA_A), NamingRule(module + b, slot, Role.LORA_B)]
    for slot, fc in ((Slot.EXPERT_FC1, "linear_fc1"), (Slot.EXPERT_FC2, "linear_fc2")):
        sequential = _LAYER + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\." + fc + r"\."
        rules += [NamingRule(sequential + suffix, slot, Role.WEIGHT) for suffix in BASE_SUFFIXES]
        # TEGroupedMLP (moe_grouped_gemm with Transformer Engine): one weight<i> per local expert
        rules.append(NamingRule(_LAYER + r"mlp\.experts\." + fc + r"\." + r"weight(?P<expert>\d+)", slot, Role.WEIGHT))
        for _, a, b in ADAPTER_SUFFIXES:  # classified so that they can be refused by name
            rules += [NamingRule(sequential + a, slot, Role.LORA_A), NamingRule(sequential + b, slot, Role.LORA_B)]
    return tuple(rules)


DEFAULT_NAMING: tuple[NamingRule, ...] = _default_naming()
"""Local spec, TE spec, PEFT, NeMo and Megatron-Bridge names. Extend it with more rules."""

_WRAPPER_PREFIX = re.compile(r"^(?:module\.)+")  # DDP / Float16Module wrappers
_LEGACY_GROUPED = re.compile(_LAYER + r"mlp\.experts\.weight[12]")


def classify(name: str, naming: tuple[NamingRule, ...]) -> ParamKey:
    """The canonical key of one local Megatron parameter name, by the naming table."""
    bare = _WRAPPER_PREFIX.sub("", name)
    hits = [(rule, m) for rule in naming if (m := rule.regex.fullmatch(bare))]
    if not hits and _LEGACY_GROUPED.fullmatch(bare):
        raise ConversionError(
            f"Megatron parameter {name!r} is a legacy GroupedMLP's stacked expert weight (moe_grouped_gemm with "
            "the local spec, or moe_use_legacy_grouped_gemm), which is not converted; use SequentialMLP "
            "(moe_grouped_gemm=False) or Transformer Engine's TEGroupedMLP (weight<i> per expert)"
        )
    if not hits:
        raise ConversionError(
            f"Megatron parameter {name!r} matches no rule of the naming table; if it belongs to the "
            "model (e.g. a linear bias, a shared expert or another LoRA implementation's names) add a "
            "NamingRule(pattern, slot, role) to ConversionContext.naming, otherwise remove it"
        )
    keys = set()
    for rule, m in hits:
        groups = m.groupdict()
        layer = int(groups["layer"]) if groups.get("layer") is not None else None
        expert = int(groups["expert"]) if groups.get("expert") is not None else None
        keys.add(ParamKey(rule.slot, rule.role, layer, expert))
    if len(keys) > 1:
        raise ConversionError(
            f"Megatron parameter {name!r} matches naming rules for {sorted(k.describe() for k in keys)}; "
            "make the patterns in ConversionContext.naming disjoint"
        )
    return keys.pop()


def index_params(
    named: Iterable[tuple[str, torch.Tensor]], naming: tuple[NamingRule, ...]
) -> dict[ParamKey, tuple[str, torch.Tensor]]:
    """Classify every local parameter; two names for one key is an error."""
    found: dict[ParamKey, tuple[str, torch.Tensor]] = {}
    for name, tensor in named:
        key = classify(name, naming)
        if key in found:
            raise ConversionError(
                f"Megatron parameters {found[key][0]!r} and {name!r} both map to {key.describe()}; "
                "a module can carry one adapter under one naming convention"
            )
        found[key] = (name, tensor)
    return found


__all__ = ["ADAPTER_SUFFIXES", "BASE_SUFFIXES", "DEFAULT_NAMING", "NamingRule", "ParamKey", "classify", "index_params"]
