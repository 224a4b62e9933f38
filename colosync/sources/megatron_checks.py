"""What ``MegatronSource`` refuses before anything moves: the checks of a model against its context.

Why this is not part of ``megatron``: the checks run once, on each rank, on that rank's own
parameters, and only produce messages; whether a sync can start is then agreed in one
collective there. Kept apart, the collective schedule reads as one piece, and a check (or
the hint for a model given the wrong architecture) changes without touching the
collectives every rank must run in lockstep.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from colosync.errors import ConversionError
from colosync.sources.architectures.base import Role, Slot, Split
from colosync.sources.architectures.context import ConversionContext
from colosync.sources.architectures.layout import ConversionItem, plan
from colosync.sources.architectures.naming import ParamKey
from colosync.sources.megatron_groups import ParallelGroups

_LAYER_MODULE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)$")


_WRONG_ARCH_HINT = {
    (Slot.QKV, Role.BIAS): "q/k/v biases are Qwen2's: use arch='qwen2'",
    (Slot.Q_NORM, Role.WEIGHT): "q/k norms are Qwen3's: use arch='qwen3' (or 'qwen3_moe')",
    (Slot.K_NORM, Role.WEIGHT): "q/k norms are Qwen3's: use arch='qwen3' (or 'qwen3_moe')",
    (Slot.ROUTER, Role.WEIGHT): "routed experts are Qwen3-MoE's: use arch='qwen3_moe'",
    (Slot.EXPERT_FC1, Role.WEIGHT): "routed experts are Qwen3-MoE's: use arch='qwen3_moe'",
    (Slot.EXPERT_FC2, Role.WEIGHT): "routed experts are Qwen3-MoE's: use arch='qwen3_moe'",
    (Slot.FC1, Role.WEIGHT): "a dense MLP: use a dense architecture ('llama', 'qwen2', 'qwen3')",
    (Slot.FC2, Role.WEIGHT): "a dense MLP: use a dense architecture ('llama', 'qwen2', 'qwen3')",
    **{
        (slot, Role.WEIGHT): "a gated shared expert is Qwen3-Next's: use arch='qwen3_next'"
        for slot in (Slot.SHARED_FC1, Slot.SHARED_FC2, Slot.SHARED_GATE)
    },
    **{
        (slot, Role.WEIGHT): "Gated-DeltaNet layers are Qwen3.5's and Qwen3-Next's: use arch='qwen3_5' or "
        "'qwen3_next' (the context's linear_layers must list this layer)"
        for slot in (
            Slot.GDN_IN_PROJ,
            Slot.GDN_CONV,
            Slot.GDN_A_LOG,
            Slot.GDN_DT_BIAS,
            Slot.GDN_NORM,
            Slot.GDN_OUT_PROJ,
        )
    },
}


_GDN_ROWS = (Slot.GDN_CONV, Slot.GDN_A_LOG, Slot.GDN_DT_BIAS)


def check_layout(ctx: ConversionContext, groups: ParallelGroups, *, collective: bool, moe: bool) -> list[str]:
    """The process groups against the context's TP x PP (and EP x expert-TP) geometry; raises where
    a missing group would leave the ranks no way to agree on a failure."""
    problems = []
    if (groups.tp_size, groups.pp_size) != (ctx.tp_size, ctx.pp_size):
        problems.append(
            f"the process groups are TP={groups.tp_size} x PP={groups.pp_size} but the context says "
            f"TP={ctx.tp_size} x PP={ctx.pp_size}; build the context from the model's TransformerConfig"
        )
    if collective and (groups.mp is None or not dist.is_initialized()):
        # without a group there is no way to agree on failure: fail here, on every rank alike
        raise ConversionError(
            "TP x PP > 1 needs torch.distributed initialized and ParallelGroups with tp, pp and mp "
            "(use ParallelGroups.from_megatron())"
        )
    if collective and dist.get_world_size(groups.mp) != ctx.tp_size * ctx.pp_size:
        problems.append(
            f"ParallelGroups.mp has {dist.get_world_size(groups.mp)} ranks, expected TP x PP = "
            f"{ctx.tp_size * ctx.pp_size}"
        )
    if moe:
        if (groups.ep_size, groups.etp_size) != (ctx.ep_size, ctx.expert_tp_size):
            problems.append(
                f"the expert groups are EP={groups.ep_size} x expert-TP={groups.etp_size} but the context says "
                f"EP={ctx.ep_size} x expert-TP={ctx.expert_tp_size}; build the context from the model's "
                "TransformerConfig (expert_model_parallel_size, expert_tensor_parallel_size)"
            )
        if ctx.ep_size * ctx.expert_tp_size > 1 and groups.expert_mp is None:
            raise ConversionError(
                "expert parallelism needs ParallelGroups with ep, etp and expert_mp "
                "(use ParallelGroups.from_megatron())"
            )
    return problems


def check_layer_numbers(model: torch.nn.Module, ctx: ConversionContext, stage: int) -> list[str]:
    """Megatron's TransformerLayer knows its global ``layer_number``: it must match the context."""
    offset = ctx.stage_offsets[stage]
    problems, count = [], 0
    for name, module in model.named_modules():
        match = _LAYER_MODULE.match(name)
        if not match:
            continue
        count += 1
        local = int(match[1])
        number = getattr(module, "layer_number", None)
        if number is not None and number - 1 != offset + local:
            problems.append(
                f"{name} is global layer {number - 1} but the context places stage {stage}'s local "
                f"layer {local} at {offset + local}; pass stage_layers as Megatron placed the layers"
            )
    if count and count != ctx.stage_layers[stage]:
        problems.append(
            f"stage {stage} holds {count} layers but the context's stage_layers says "
            f"{ctx.stage_layers[stage]}; pass stage_layers as Megatron placed the layers"
        )
    return problems


def check_params(
    ctx: ConversionContext,
    items: Sequence[ConversionItem],
    local: dict[ParamKey, tuple[str, torch.Tensor]],
    *,
    stage: int,
    tp_rank: int,
    etp_rank: int,
) -> list[str]:
    """This stage's local parameters (``local``) against the conversion plan (``items``): every
    planned one present with its shard's shape and split, none the plan would drop."""
    problems = []
    mine = [item for item in items if item.stage == stage]
    for item in mine:
        keys = [item.expert_key(i) for i in range(ctx.local_experts)] if item.experts else [item.key]
        tp = ctx.expert_tp_size if item.experts else ctx.tp_size
        for key in keys:
            problems += _check_param(ctx, item, key, tp, local, tp_rank=tp_rank, etp_rank=etp_rank)
    problems += _check_unconverted(ctx, items, local, stage)
    if ctx.kind == "lora":
        wanted = set(ctx.lora_slots)
        for key, (name, _) in local.items():
            if key.role.base or key.slot in wanted:
                continue
            if key.slot.expert or key.slot in (Slot.SHARED_FC1, Slot.SHARED_FC2):
                which = "routed" if key.slot.expert else "shared"
                problems.append(
                    f"{name} is a LoRA on a {which} expert; LoRA on experts is not converted (refused by name): "
                    "train the adapter on attention (and Gated-DeltaNet in_proj / out_proj) only"
                )
            else:
                problems.append(
                    f"{name} is an adapter weight but {key.slot.value} is not among the LoraSpec's "
                    f"target_modules {list(ctx.lora.target_modules) if ctx.lora else []}; add its HF names"
                )
    return problems


def _check_param(
    ctx: ConversionContext,
    item: ConversionItem,
    key: ParamKey,
    tp: int,
    local: dict[ParamKey, tuple[str, torch.Tensor]],
    *,
    tp_rank: int,
    etp_rank: int,
) -> list[str]:
    found = local.get(key)
    if found is None:
        hint = (
            "; the adapter is missing on this module: attach it, or drop "
            f"{[o.name.split('.')[-3] for o in item.outputs]} from LoraSpec.target_modules"
            if not item.role.base
            else ""
        )
        return [f"no local parameter for {key.describe()} ({item.describe()}){hint}"]
    problems = []
    name, param = found
    want = item.local_shape(tp)
    if tuple(param.shape) != want:
        why = f" (lora rank {ctx.lora.rank} from the LoraSpec)" if not item.role.base and ctx.lora else ""
        problems.append(
            f"{name} has shape {list(param.shape)}, expected {list(want)}{why} for TP rank "
            f"{etp_rank if item.experts else tp_rank} of {tp}; check the context against the "
            "model's config"
        )
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        # GatedDeltaNet marks conv1d / A_log / dt_bias tensor_model_parallel without a partition_dim:
        # they are split on dim 0 (its sharded_state_dict says so)
        dim = getattr(param, "partition_dim", 0 if key.slot in _GDN_ROWS else None)
        if item.split is Split.NONE or dim != item.split.value:
            problems.append(
                f"{name} is split on dim {dim} by Megatron but the converter expects "
                f"{item.split.name}; the naming table maps it to the wrong slot"
            )
    return problems


def _check_unconverted(
    ctx: ConversionContext, items: Sequence[ConversionItem], local: dict[ParamKey, tuple[str, torch.Tensor]], stage: int
) -> list[str]:
    """A base tensor the architecture does not convert would be dropped: refuse it by name."""
    base = plan(dataclasses.replace(ctx, kind="full", lora=None)) if ctx.kind == "lora" else items
    planned = {(it.slot, it.role, it.local_layer) for it in base if it.stage == stage}
    problems = []
    for key, (name, _) in local.items():
        if not key.role.base or (key.slot, key.role, key.local_layer) in planned:
            if key.expert is not None and key.expert >= ctx.local_experts:
                problems.append(
                    f"{name} is local expert {key.expert} but the context has {ctx.local_experts} experts per "
                    f"EP rank (num_experts={ctx.num_experts}, ep_size={ctx.ep_size})"
                )
            continue
        if key.slot is Slot.OUTPUT and ctx.tie_word_embeddings:
            continue  # the last stage's copy of a tied embedding: the engine ties it
        hint = _WRONG_ARCH_HINT.get((key.slot, key.role), "check the context against the model")
        problems.append(
            f"{name} ({key.slot.value}.{key.role.value}) is not converted by architecture {ctx.arch!r} and "
            f"would be dropped; {hint}"
        )
    return problems
