"""The plan of an update and the layout conversions, as pure functions of the context.

* **Where each tensor lives.** :func:`plan` turns the context into the ordered list of
  Megatron tensors to move (one :class:`ConversionItem` each: its slot, role, global layer,
  owning pipeline stage, tensor-parallel split, full shape and the HF tensors it becomes).
  Every rank computes the same plan from the same context, which is what lets the
  distributed source run its collectives in lockstep, and lets the ``Sender`` plan its
  manifest from ``(name, shape, dtype)`` before a single tensor is gathered. Routed experts
  are one item per layer and matrix: every expert of the layer, gathered over the expert
  (EP x expert-TP) ranks into the one fused 3-D tensor transformers 5.x stores.
* **How layouts convert.** ``linear_qkv`` rows (and its bias) are interleaved per query
  group (that group's query heads, one key head, one value head); ``linear_fc1`` holds
  ``[gate; up]`` *per tensor-parallel shard* (per expert-TP shard for experts); embedding
  and output rows are padded to a multiple of the TP size; a gated attention's groups also
  carry their query heads' gates; Gated-DeltaNet's ``in_proj`` and ``conv1d`` hold their
  sections (q, k, v, z, b, a) per TP shard; zero-centered norms are shifted by one where
  Megatron and HF disagree. :func:`convert` undoes all of that on a gathered tensor;
  :func:`to_megatron` is the exact inverse.

No process groups, no I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from colosync.errors import ConversionError
from colosync.sources.architectures.base import _HF_SINGLE, PEFT_PREFIX, SPLITS, Role, Slot, Split, hf_module
from colosync.sources.architectures.context import ConversionContext, LinearAttention
from colosync.sources.architectures.naming import ParamKey

# -- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ConversionItem:
    """One Megatron tensor to gather, and the HF/PEFT tensors it becomes.

    For a routed-expert slot (``experts > 0``) the Megatron tensor is the stack of every
    expert's matrix of that layer, ``shape == (experts, *one_expert)``; each expert's matrix
    is split over the expert-TP group like ``split`` says, and lives on EP rank
    ``expert // local_experts``.
    """

    slot: Slot
    role: Role
    layer: int | None  # global layer index
    stage: int  # the pipeline stage that owns it
    local_layer: int | None  # its index inside that stage
    split: Split
    shape: tuple[int, ...]  # full (gathered) Megatron shape
    dtype: torch.dtype
    outputs: tuple[HFTensor, ...]
    experts: int = 0

    @property
    def key(self) -> ParamKey:
        return ParamKey(self.slot, self.role, self.local_layer)

    def expert_key(self, local_expert: int) -> ParamKey:
        return ParamKey(self.slot, self.role, self.local_layer, local_expert)

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """The shape of one Megatron parameter before TP: the tensor, or one expert's matrix."""
        return self.shape[1:] if self.experts else self.shape

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """One local parameter's shape under ``tp_size`` (the expert-TP size for expert items)."""
        if self.split is Split.NONE:
            return self.unit_shape
        dim = self.split.value
        return tuple(d // tp_size if i == dim else d for i, d in enumerate(self.unit_shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        where = f"layer {self.layer} (stage {self.stage}, local {self.local_layer}) " if self.layer is not None else ""
        return f"{where}{self.slot.value}.{self.role.value} {list(self.shape)}"


def _gdn(ctx: ConversionContext) -> LinearAttention:
    if ctx.linear_attention is None:
        raise ConversionError("a Gated-DeltaNet tensor was planned but the context has no LinearAttention geometry")
    return ctx.linear_attention


def _q_rows(ctx: ConversionContext) -> int:
    """Rows of HF's q_proj: the queries, and with a gated attention each head's gate after it."""
    return ctx.num_attention_heads * ctx.head_dim * (2 if ctx.architecture.gated_attention else 1)


def _linear_dims(slot: Slot, ctx: ConversionContext) -> tuple[int, int]:
    h, hd = ctx.hidden_size, ctx.head_dim
    if slot is Slot.GDN_IN_PROJ:
        return (_gdn(ctx).in_proj_dim, h)
    if slot is Slot.GDN_OUT_PROJ:
        return (h, _gdn(ctx).v_dim)
    if slot is Slot.SHARED_FC1:
        return (2 * ctx.shared_expert_size, h)
    if slot is Slot.SHARED_FC2:
        return (h, ctx.shared_expert_size)
    qkv = _q_rows(ctx) + 2 * ctx.num_query_groups * hd
    return {  # (out, in) of each linear
        Slot.QKV: (qkv, h),
        Slot.PROJ: (h, ctx.num_attention_heads * hd),
        Slot.FC1: (2 * ctx.ffn_hidden_size, h),
        Slot.FC2: (h, ctx.ffn_hidden_size),
        Slot.EXPERT_FC1: (2 * ctx.moe_ffn_hidden_size, h),
        Slot.EXPERT_FC2: (h, ctx.moe_ffn_hidden_size),
        Slot.ROUTER: (ctx.num_experts, h),
    }[slot]


def _megatron_shape(slot: Slot, role: Role, ctx: ConversionContext) -> tuple[int, ...]:
    r = ctx.lora.rank if ctx.lora else 0
    if slot in (Slot.EMBEDDING, Slot.OUTPUT):
        return (ctx.padded_vocab_size, ctx.hidden_size)
    if slot in (Slot.INPUT_NORM, Slot.POST_NORM, Slot.FINAL_NORM):
        return (ctx.hidden_size,)
    if slot in (Slot.Q_NORM, Slot.K_NORM):
        return (ctx.head_dim,)
    if slot is Slot.GDN_CONV:
        return (_gdn(ctx).conv_dim, 1, _gdn(ctx).conv_kernel)
    if slot in (Slot.GDN_A_LOG, Slot.GDN_DT_BIAS):
        return (_gdn(ctx).num_value_heads,)
    if slot is Slot.GDN_NORM:
        return (_gdn(ctx).value_head_dim,)
    if slot is Slot.SHARED_GATE:
        return (1, ctx.hidden_size)
    out_f, in_f = _linear_dims(slot, ctx)
    if slot.expert:
        return (ctx.num_experts, out_f, in_f)
    return {Role.WEIGHT: (out_f, in_f), Role.BIAS: (out_f,), Role.LORA_A: (r, in_f), Role.LORA_B: (out_f, r)}[role]


def _hf_outputs(slot: Slot, role: Role, layer: int | None, ctx: ConversionContext) -> tuple[HFTensor, ...]:
    h, hd, r = ctx.hidden_size, ctx.head_dim, ctx.lora.rank if ctx.lora else 0
    if slot in _HF_SINGLE:
        if slot in (Slot.EMBEDDING, Slot.OUTPUT):
            shape: tuple[int, ...] = (ctx.vocab_size, h)
        elif slot in (Slot.INPUT_NORM, Slot.POST_NORM, Slot.FINAL_NORM):
            shape = (h,)
        else:
            shape = _megatron_shape(slot, role, ctx)
        return (HFTensor(_HF_SINGLE[slot].format(layer=layer), shape),)
    if layer is None:
        raise ConversionError(f"{slot} is a per-layer slot but no layer index was given")
    out_dims = {
        "q_proj": _q_rows(ctx),
        "k_proj": ctx.num_query_groups * hd,
        "v_proj": ctx.num_query_groups * hd,
        "o_proj": h,
        "gate_proj": ctx.ffn_hidden_size,
        "up_proj": ctx.ffn_hidden_size,
        "down_proj": h,
        "out_proj": h,
    }
    in_dims = {"o_proj": ctx.num_attention_heads * hd, "down_proj": ctx.ffn_hidden_size}
    if slot in (Slot.GDN_IN_PROJ, Slot.GDN_OUT_PROJ):
        la = _gdn(ctx)
        out_dims.update(
            in_proj_qkv=la.conv_dim, in_proj_z=la.v_dim, in_proj_b=la.num_value_heads, in_proj_a=la.num_value_heads
        )
        in_dims["out_proj"] = la.v_dim
        out_dims.update(in_proj_qkvz=2 * la.qk_dim + 2 * la.v_dim, in_proj_ba=2 * la.num_value_heads)
    if slot in (Slot.SHARED_FC1, Slot.SHARED_FC2):
        out_dims.update(gate_proj=ctx.shared_expert_size, up_proj=ctx.shared_expert_size)
        in_dims["down_proj"] = ctx.shared_expert_size
    outputs = []
    for part in ctx.architecture.parts(slot):
        module = hf_module(slot, layer, part)
        out_f, in_f = out_dims[part], in_dims.get(part, h)
        if role is Role.WEIGHT:
            outputs.append(HFTensor(f"{module}.weight", (out_f, in_f)))
        elif role is Role.BIAS:
            outputs.append(HFTensor(f"{module}.bias", (out_f,)))
        elif role is Role.LORA_A:
            outputs.append(HFTensor(f"{PEFT_PREFIX}{module}.lora_A.weight", (r, in_f)))
        else:
            outputs.append(HFTensor(f"{PEFT_PREFIX}{module}.lora_B.weight", (out_f, r)))
    return tuple(outputs)


@functools.lru_cache(maxsize=64)
def plan(ctx: ConversionContext) -> tuple[ConversionItem, ...]:
    """The ordered Megatron tensors of one update; identical on every rank for one context."""
    entries: list[tuple[Slot, Role, int | None]] = []
    if ctx.kind == "full":
        entries.append((Slot.EMBEDDING, Role.WEIGHT, None))
        for n in range(ctx.num_layers):
            entries += [(slot, role, n) for slot, role in ctx.layer_tensors(n)]
        entries.append((Slot.FINAL_NORM, Role.WEIGHT, None))
        if not ctx.tie_word_embeddings:
            entries.append((Slot.OUTPUT, Role.WEIGHT, None))
    else:
        for n in range(ctx.num_layers):
            for slot in ctx.layer_lora_slots(n):
                entries += [(slot, Role.LORA_A, n), (slot, Role.LORA_B, n)]
    last = ctx.pp_size - 1
    items = []
    for slot, role, layer in entries:
        if layer is not None:
            stage = ctx.stage_of_layer(layer)
            local: int | None = layer - ctx.stage_offsets[stage]
        else:
            stage, local = (0 if slot is Slot.EMBEDDING else last), None
        items.append(
            ConversionItem(
                slot=slot,
                role=role,
                layer=layer,
                stage=stage,
                local_layer=local,
                split=SPLITS[(slot, role)],
                shape=_megatron_shape(slot, role, ctx),
                dtype=ctx.dtypes.for_role(role),
                outputs=_hf_outputs(slot, role, layer, ctx),
                experts=ctx.num_experts if slot.expert else 0,
            )
        )
    return tuple(items)


def hf_specs(ctx: ConversionContext) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every HF/PEFT tensor of the update, in stream order."""
    return [(out.name, out.shape, item.dtype) for item in plan(ctx) for out in item.outputs]


# -- layout conversion ----------------------------------------------------------------------


def split_qkv(qkv: torch.Tensor, ctx: ConversionContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """De-interleave a gathered ``linear_qkv`` weight, bias or ``lora_B`` into q, k, v.

    Rows are grouped per query group ``[q_0 .. q_{n-1}, k, v]`` (``n`` heads per group, each
    ``head_dim`` rows). A TP rank holds whole groups, so the gathered tensor is the TP shards
    concatenated and every group is still intact: de-interleaving per group is
    de-interleaving per shard. Works for any trailing dims (``hidden``, the LoRA rank, or
    none for the bias).

    A gated attention (``attention_output_gate``, Qwen3.5) groups ``[q_0 .. q_{n-1},
    gate_0 .. gate_{n-1}, k, v]``; HF's ``q_proj`` then holds ``[q_h; gate_h]`` per head, which
    is what the first tensor returned is.
    """
    n, g, hd = ctx.heads_per_group, ctx.num_query_groups, ctx.head_dim
    rest = qkv.shape[1:]
    gated = ctx.architecture.gated_attention
    grouped = qkv.view(g, (2 * n if gated else n) + 2, hd, *rest)
    if gated:
        q = torch.stack([grouped[:, :n], grouped[:, n : 2 * n]], dim=2).reshape(g * n * 2 * hd, *rest)
    else:
        q = grouped[:, :n].reshape(g * n * hd, *rest)
    m = grouped.shape[1] - 2
    k = grouped[:, m].reshape(g * hd, *rest)
    v = grouped[:, m + 1].reshape(g * hd, *rest)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ConversionContext) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    n, g, hd = ctx.heads_per_group, ctx.num_query_groups, ctx.head_dim
    rest = q.shape[1:]
    if ctx.architecture.gated_attention:
        heads = q.view(g, n, 2, hd, *rest)
        queries = torch.cat([heads[:, :, 0], heads[:, :, 1]], dim=1)  # (g, 2n, hd): queries, then gates
    else:
        queries = q.view(g, n, hd, *rest)
    grouped = torch.cat([queries, k.view(g, 1, hd, *rest), v.view(g, 1, hd, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def _gdn_sections(ctx: ConversionContext, slot: Slot) -> tuple[int, ...]:
    """One TP shard's row sections of GDN ``in_proj`` (q, k, v, z, b, a) or ``conv1d`` (q, k, v)."""
    la, tp = _gdn(ctx), ctx.tp_size
    qkv = (la.qk_dim // tp, la.qk_dim // tp, la.v_dim // tp)
    if slot is Slot.GDN_CONV:
        return qkv
    return (*qkv, la.v_dim // tp, la.num_value_heads // tp, la.num_value_heads // tp)


def _split_per_shard(full: torch.Tensor, tp: int, sections: tuple[int, ...]) -> list[torch.Tensor]:
    """Rows ``[s0_t; s1_t; ...]`` per TP shard ``t`` -> ``[s0 (all shards); s1; ...]``."""
    rest = full.shape[1:]
    shards = full.view(tp, sum(sections), *rest)
    return [part.reshape(tp * part.shape[1], *rest) for part in shards.split(list(sections), dim=1)]


def _merge_per_shard(parts: list[torch.Tensor], tp: int) -> torch.Tensor:
    rest = parts[0].shape[1:]
    return torch.cat([p.view(tp, p.shape[0] // tp, *rest) for p in parts], dim=1).reshape(-1, *rest)


def split_gdn(full: torch.Tensor, slot: Slot, ctx: ConversionContext) -> tuple[torch.Tensor, ...]:
    """A gathered GDN ``in_proj`` weight / ``lora_B`` -> HF ``in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a``; a gathered ``conv1d`` weight -> HF's one ``conv1d`` over ``[q; k; v]``.

    megatron-core's ``GatedDeltaNet`` splits its *local* ``in_proj`` output into
    ``q, k, v, z, b, a`` (and its local conv channels into ``q, k, v``), so every TP shard
    holds those sections of its own heads, one after the other.
    """
    q, k, v, *zba = _split_per_shard(full, ctx.tp_size, _gdn_sections(ctx, slot))
    if slot is Slot.GDN_IN_PROJ and ctx.architecture.grouped_gdn:
        return _group_per_key_head([q, k, v, *zba], ctx)
    return (torch.cat([q, k, v]), *zba)


def merge_gdn(parts: list[torch.Tensor], slot: Slot, ctx: ConversionContext) -> torch.Tensor:
    """Inverse of :func:`split_gdn`."""
    la = _gdn(ctx)
    if slot is Slot.GDN_IN_PROJ and ctx.architecture.grouped_gdn:
        return _merge_per_shard(_ungroup_per_key_head(parts[0], parts[1], ctx), ctx.tp_size)
    q, k, v = parts[0].split([la.qk_dim, la.qk_dim, la.v_dim])
    return _merge_per_shard([q, k, v, *parts[1:]], ctx.tp_size)


def _group_per_key_head(sections: list[torch.Tensor], ctx: ConversionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` from the q, k, v, z, b, a sections: per key
    head ``[q; k; v; z]`` and ``[b; a]``, the ``r = value heads / key heads`` value heads of that
    key head together."""
    q, k, v, z, b, a = sections
    rest, hk = q.shape[1:], _gdn(ctx).num_key_heads
    qkvz = torch.cat([x.reshape(hk, -1, *rest) for x in (q, k, v, z)], dim=1).reshape(-1, *rest)
    ba = torch.cat([x.reshape(hk, -1, *rest) for x in (b, a)], dim=1).reshape(-1, *rest)
    return qkvz, ba


def _ungroup_per_key_head(qkvz: torch.Tensor, ba: torch.Tensor, ctx: ConversionContext) -> list[torch.Tensor]:
    la, rest = _gdn(ctx), qkvz.shape[1:]
    hk, r = la.num_key_heads, la.num_value_heads // la.num_key_heads
    dk, dv = la.key_head_dim, la.value_head_dim
    grouped = qkvz.reshape(hk, -1, *rest).split([dk, dk, r * dv, r * dv], dim=1)
    pairs = ba.reshape(hk, -1, *rest).split([r, r], dim=1)
    return [x.reshape(-1, *rest) for x in (*grouped, *pairs)]


def split_fc1(fc1: torch.Tensor, ctx: ConversionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a gathered ``linear_fc1`` weight (or its ``lora_B``) into gate and up.

    Each TP rank's shard is ``[gate_i; up_i]`` (Megatron's GLU chunks the *local* output in
    two), so the gathered tensor is ``[gate_0; up_0; gate_1; up_1; ...]``: split per shard,
    then join the gates and the ups.
    """
    return _split_glu(fc1, ctx.tp_size, ctx.ffn_hidden_size)


def merge_fc1(gate: torch.Tensor, up: torch.Tensor, ctx: ConversionContext) -> torch.Tensor:
    """Inverse of :func:`split_fc1`."""
    return _merge_glu(gate, up, ctx.tp_size, ctx.ffn_hidden_size)


def _split_glu(fc1: torch.Tensor, tp: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    rest = fc1.shape[1:]
    shards = fc1.view(tp, 2, ffn // tp, *rest)
    return shards[:, 0].reshape(ffn, *rest), shards[:, 1].reshape(ffn, *rest)


def _merge_glu(gate: torch.Tensor, up: torch.Tensor, tp: int, ffn: int) -> torch.Tensor:
    rest, f = gate.shape[1:], ffn // tp
    return torch.stack([gate.view(tp, f, *rest), up.view(tp, f, *rest)], dim=1).reshape(2 * ffn, *rest)


def experts_to_hf(fc1: torch.Tensor, ctx: ConversionContext) -> torch.Tensor:
    """Stacked Megatron expert ``linear_fc1`` ``(E, 2F, h)`` -> HF ``gate_up_proj`` ``(E, 2F, h)``.

    Each expert's gathered matrix is ``[gate_0; up_0; gate_1; up_1; ...]`` over the
    expert-TP shards; transformers wants ``[gate; up]`` per expert (it ``chunk(2)``s the
    output). With one expert-TP shard the two layouts are the same bytes.
    """
    e, etp, f = ctx.num_experts, ctx.expert_tp_size, ctx.moe_ffn_hidden_size
    h = fc1.shape[-1]
    return fc1.view(e, etp, 2, f // etp, h).transpose(1, 2).reshape(e, 2 * f, h)


def experts_from_hf(gate_up: torch.Tensor, ctx: ConversionContext) -> torch.Tensor:
    """Inverse of :func:`experts_to_hf`."""
    e, etp, f = ctx.num_experts, ctx.expert_tp_size, ctx.moe_ffn_hidden_size
    h = gate_up.shape[-1]
    return gate_up.view(e, 2, etp, f // etp, h).transpose(1, 2).reshape(e, 2 * f, h)


def convert(item: ConversionItem, full: torch.Tensor, ctx: ConversionContext) -> list[tuple[str, torch.Tensor]]:
    """The HF/PEFT tensors of one gathered Megatron tensor (views where possible)."""
    if tuple(full.shape) != item.shape:
        raise ConversionError(f"{item.describe()}: gathered shape {list(full.shape)} differs from the plan")
    names = [out.name for out in item.outputs]
    if item.slot in (Slot.EMBEDDING, Slot.OUTPUT):
        parts: tuple[torch.Tensor, ...] = (full[: ctx.vocab_size],)  # drop Megatron's vocab padding
    elif item.role is Role.LORA_A and len(names) > 1:
        parts = (full,) * len(names)  # a fused module's lora_A is shared by its parts
    elif item.slot is Slot.QKV:
        parts = split_qkv(full, ctx)
    elif item.slot is Slot.FC1:
        parts = split_fc1(full, ctx)
    elif item.slot is Slot.SHARED_FC1:
        parts = _split_glu(full, ctx.tp_size, ctx.shared_expert_size)
    elif item.slot is Slot.EXPERT_FC1:
        parts = (experts_to_hf(full, ctx),)
    elif item.slot in (Slot.GDN_IN_PROJ, Slot.GDN_CONV):
        parts = split_gdn(full, item.slot, ctx)
    elif offset := ctx.norm_offset(item.slot):
        parts = (full + offset,)
    else:
        parts = (full,)
    return list(zip(names, parts, strict=True))


def to_megatron(
    item: ConversionItem, hf: Mapping[str, torch.Tensor], ctx: ConversionContext, pad: torch.Tensor | None = None
) -> torch.Tensor:
    """The full Megatron tensor of ``item`` from HF/PEFT tensors (inverse of :func:`convert`).

    ``pad`` fills the vocabulary padding rows of the embedding and output layer (zeros if
    omitted). A shared ``lora_A`` must be equal across the fused parts; it is checked.
    """
    parts = [hf[out.name] for out in item.outputs]
    if item.slot in (Slot.EMBEDDING, Slot.OUTPUT):
        extra = ctx.padded_vocab_size - ctx.vocab_size
        filler = pad if pad is not None else parts[0].new_zeros(extra, ctx.hidden_size)
        return torch.cat([parts[0], filler[:extra]])
    if item.role is Role.LORA_A and len(parts) > 1:
        if not all(torch.equal(parts[0], p) for p in parts[1:]):
            raise ConversionError(
                f"{[o.name for o in item.outputs]} have different lora_A; Megatron's fused {item.slot.value} "
                "shares one lora_A, so the PEFT adapter cannot be expressed in Megatron's layout"
            )
        return parts[0]
    if item.slot is Slot.QKV:
        q, k, v = parts
        return merge_qkv(q, k, v, ctx)
    if item.slot is Slot.FC1:
        gate, up = parts
        return merge_fc1(gate, up, ctx)
    if item.slot is Slot.SHARED_FC1:
        gate, up = parts
        return _merge_glu(gate, up, ctx.tp_size, ctx.shared_expert_size)
    if item.slot is Slot.EXPERT_FC1:
        return experts_from_hf(parts[0], ctx)
    if item.slot in (Slot.GDN_IN_PROJ, Slot.GDN_CONV):
        return merge_gdn(parts, item.slot, ctx)
    if offset := ctx.norm_offset(item.slot):
        return parts[0] - offset
    return parts[0]


def shard(full: torch.Tensor, split: Split, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (a view)."""
    if split is Split.NONE:
        return full
    return full.chunk(tp_size, dim=split.value)[tp_rank]


def local_params(
    item: ConversionItem, full: torch.Tensor, ctx: ConversionContext, tp_rank: int, ep_rank: int = 0
) -> dict[ParamKey, torch.Tensor]:
    """``{key: local parameter}`` of one rank for a full Megatron tensor (views; for loading and tests).

    ``tp_rank`` is the expert-TP rank for expert items, whose keys carry the local expert.
    """
    if not item.experts:
        return {item.key: shard(full, item.split, ctx.tp_size, tp_rank)}
    per = ctx.local_experts
    out = {}
    for i in range(per):
        matrix = full[ep_rank * per + i]
        out[item.expert_key(i)] = shard(matrix, item.split, ctx.expert_tp_size, tp_rank)
    return out


__all__ = [
    "ConversionItem",
    "HFTensor",
    "convert",
    "experts_from_hf",
    "experts_to_hf",
    "hf_specs",
    "local_params",
    "merge_fc1",
    "merge_gdn",
    "merge_qkv",
    "plan",
    "shard",
    "split_fc1",
    "split_gdn",
    "split_qkv",
    "to_megatron",
]
