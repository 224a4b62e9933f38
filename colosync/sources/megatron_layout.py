"""Megatron-core GPT layouts -> HF/PEFT layouts, as pure functions of one typed context.

The seed run lost ``lora_rank`` somewhere in a chain of Megatron-to-HF converters and lost
``**kwargs`` at an intermediate weight-buffer flush. Both failures come from the same shape
of code: a conversion that needs several facts (rank, alpha, head counts, dtype, ...) and
receives them piecemeal, through optional arguments that each layer may forget to pass on.
Here every fact lives in one frozen :class:`ConversionContext`, and every function on the
path takes that context as an explicit, required argument. There is no ``**kwargs`` on this
path; a flush (or any other stage) cannot drop what it cannot omit.

What this module knows, and nothing else (no process groups, no I/O):

* **Where each tensor lives.** :func:`plan` turns the context into the ordered list of
  Megatron tensors to move (one :class:`ConversionItem` each: its slot, role, global layer,
  owning pipeline stage, tensor-parallel split, full shape and the HF tensors it becomes).
  Every rank computes the same plan from the same context, which is what lets the
  distributed source run its collectives in lockstep, and lets the ``Sender`` plan its
  manifest from ``(name, shape, dtype)`` before a single tensor is gathered.
* **How local parameters are named.** A :data:`DEFAULT_NAMING` table of regex rules maps
  every Megatron parameter name (local spec, Transformer-Engine spec with fused norms, PEFT's
  ``base_layer``/``lora_A.<adapter>``, NeMo / Megatron-Bridge's ``to_wrap`` and
  ``adapter.linear_in``/``linear_out``) to a canonical :class:`ParamKey`. Adding a naming
  convention is adding rules, not code.
* **How layouts convert.** ``linear_qkv`` rows are interleaved per query group (that group's
  query heads, one key head, one value head); ``linear_fc1`` holds ``[gate; up]`` *per
  tensor-parallel shard*; embedding and output rows are padded to a multiple of the TP size.
  :func:`convert` undoes all of that on a gathered tensor; :func:`to_megatron` is the exact
  inverse (for loading HF weights into Megatron, and for tests).

Tensor-parallel sharding rules (Megatron-core, and PEFT's ``LoraParallelLinear``):

=================  ==============  ==============  ==============
module             weight          lora_A          lora_B
=================  ==============  ==============  ==============
linear_qkv, fc1    rows (column)   replicated      rows
linear_proj, fc2   cols (row)      cols            replicated
embedding, output  rows (vocab)    --              --
norms              replicated      --              --
=================  ==============  ==============  ==============

One module for now (~680 lines): the naming table, the context and the conversions are one
contract for one architecture (Llama-style); the Qwen-family work splits it per architecture.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from colosync.errors import ConversionError
from colosync.wire.manifest import LoraSpec

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

Kind = Literal["lora", "full"]


class Slot(enum.Enum):
    """A canonical Megatron GPT parameter slot (module), independent of naming convention."""

    EMBEDDING = "embedding.word_embeddings"
    INPUT_NORM = "input_layernorm"
    QKV = "self_attention.linear_qkv"
    PROJ = "self_attention.linear_proj"
    POST_NORM = "pre_mlp_layernorm"
    FC1 = "mlp.linear_fc1"
    FC2 = "mlp.linear_fc2"
    FINAL_NORM = "decoder.final_layernorm"
    OUTPUT = "output_layer"

    @property
    def per_layer(self) -> bool:
        return self in _LAYER_SLOTS


class Role(enum.Enum):
    WEIGHT = "weight"
    LORA_A = "lora_A"
    LORA_B = "lora_B"


class Split(enum.Enum):
    """How tensor parallelism splits a tensor: not at all, on dim 0 (rows) or dim 1 (cols)."""

    NONE = None
    ROWS = 0
    COLS = 1


_LAYER_SLOTS = frozenset({Slot.INPUT_NORM, Slot.QKV, Slot.PROJ, Slot.POST_NORM, Slot.FC1, Slot.FC2})
LORA_SLOTS: tuple[Slot, ...] = (Slot.QKV, Slot.PROJ, Slot.FC1, Slot.FC2)

SPLITS: Mapping[tuple[Slot, Role], Split] = {
    (Slot.EMBEDDING, Role.WEIGHT): Split.ROWS,
    (Slot.OUTPUT, Role.WEIGHT): Split.ROWS,
    (Slot.INPUT_NORM, Role.WEIGHT): Split.NONE,
    (Slot.POST_NORM, Role.WEIGHT): Split.NONE,
    (Slot.FINAL_NORM, Role.WEIGHT): Split.NONE,
    # column-parallel: output rows split; lora_A replicated, lora_B split like the rows
    (Slot.QKV, Role.WEIGHT): Split.ROWS,
    (Slot.QKV, Role.LORA_A): Split.NONE,
    (Slot.QKV, Role.LORA_B): Split.ROWS,
    (Slot.FC1, Role.WEIGHT): Split.ROWS,
    (Slot.FC1, Role.LORA_A): Split.NONE,
    (Slot.FC1, Role.LORA_B): Split.ROWS,
    # row-parallel: input columns split; lora_A split like the input, lora_B replicated
    (Slot.PROJ, Role.WEIGHT): Split.COLS,
    (Slot.PROJ, Role.LORA_A): Split.COLS,
    (Slot.PROJ, Role.LORA_B): Split.NONE,
    (Slot.FC2, Role.WEIGHT): Split.COLS,
    (Slot.FC2, Role.LORA_A): Split.COLS,
    (Slot.FC2, Role.LORA_B): Split.NONE,
}
"""The tensor-parallel split of every (slot, role) the converter handles."""

HF_PARTS: Mapping[Slot, tuple[str, ...]] = {
    Slot.QKV: ("q_proj", "k_proj", "v_proj"),
    Slot.PROJ: ("o_proj",),
    Slot.FC1: ("gate_proj", "up_proj"),
    Slot.FC2: ("down_proj",),
}
"""The HF linear modules each Megatron module becomes (fused modules become several)."""

_HF_PARENT = {Slot.QKV: "self_attn", Slot.PROJ: "self_attn", Slot.FC1: "mlp", Slot.FC2: "mlp"}
_HF_SINGLE = {
    Slot.EMBEDDING: "model.embed_tokens.weight",
    Slot.FINAL_NORM: "model.norm.weight",
    Slot.OUTPUT: "lm_head.weight",
    Slot.INPUT_NORM: "model.layers.{layer}.input_layernorm.weight",
    Slot.POST_NORM: "model.layers.{layer}.post_attention_layernorm.weight",
}
PEFT_PREFIX = "base_model.model."


def hf_module(slot: Slot, layer: int, part: str) -> str:
    """``model.layers.3.self_attn.q_proj``: the HF module path of one part of ``slot``."""
    return f"model.layers.{layer}.{_HF_PARENT[slot]}.{part}"


# -- naming table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamKey:
    """A Megatron parameter, canonically: slot, role and *local* layer index (or None)."""

    slot: Slot
    role: Role
    local_layer: int | None = None

    def describe(self) -> str:
        where = f"decoder.layers.{self.local_layer}." if self.local_layer is not None else ""
        return f"{where}{self.slot.value}.{self.role.value}"


@dataclass(frozen=True)
class NamingRule:
    """One row of the naming table: a regex over a local parameter name -> (slot, role).

    ``pattern`` must match the whole name (after any leading ``module.`` wrappers are
    stripped); per-layer slots capture the local layer index as ``(?P<layer>\\d+)``.
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
        # Transformer-Engine spec: the norms are fused into the following linear
        NamingRule(
            _LAYER + r"self_attention\.linear_qkv\." + _WRAP + r"layer_norm_weight", Slot.INPUT_NORM, Role.WEIGHT
        ),
        NamingRule(_LAYER + r"mlp\.linear_fc1\." + _WRAP + r"layer_norm_weight", Slot.POST_NORM, Role.WEIGHT),
    ]
    for slot in LORA_SLOTS:
        module = _LAYER + re.escape(slot.value) + r"\."
        rules += [NamingRule(module + suffix, slot, Role.WEIGHT) for suffix in BASE_SUFFIXES]
        for _, a, b in ADAPTER_SUFFIXES:
            rules += [NamingRule(module + a, slot, Role.LORA_A), NamingRule(module + b, slot, Role.LORA_B)]
    return tuple(rules)


DEFAULT_NAMING: tuple[NamingRule, ...] = _default_naming()
"""Local spec, TE spec, PEFT, NeMo and Megatron-Bridge names. Extend it with more rules."""

_WRAPPER_PREFIX = re.compile(r"^(?:module\.)+")  # DDP / Float16Module wrappers


def classify(name: str, naming: tuple[NamingRule, ...]) -> ParamKey:
    """The canonical key of one local Megatron parameter name, by the naming table."""
    bare = _WRAPPER_PREFIX.sub("", name)
    hits = [(rule, m) for rule in naming if (m := rule.regex.fullmatch(bare))]
    if not hits:
        raise ConversionError(
            f"Megatron parameter {name!r} matches no rule of the naming table; if it belongs to the "
            "model (e.g. a bias, qk-norm or another LoRA implementation's names) add a "
            "NamingRule(pattern, slot, role) to ConversionContext.naming, otherwise remove it"
        )
    keys = {ParamKey(r.slot, r.role, int(m["layer"]) if "layer" in m.groupdict() else None) for r, m in hits}
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


# -- the context ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DtypePolicy:
    """The dtype each kind of tensor travels in (cast once, on the rank that owns the shard)."""

    base: torch.dtype = torch.float32
    lora: torch.dtype = torch.float32

    def for_role(self, role: Role) -> torch.dtype:
        return self.base if role is Role.WEIGHT else self.lora


@dataclass(frozen=True)
class ConversionContext:
    """Everything the Megatron -> HF/PEFT conversion needs, in one immutable object.

    Geometry (``num_layers`` ... ``padded_vocab_size``) is the *global*, unsharded model;
    ``tp_size``/``pp_size``/``stage_layers`` describe how Megatron placed it; ``kind`` says
    whether an update carries the LoRA adapter (``lora`` is then required) or the base
    weights; ``dtypes`` is the wire dtype policy; ``naming`` is the naming table. Build it
    with :meth:`from_megatron` from a ``TransformerConfig`` to avoid transcription errors.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    kind: Kind
    lora: LoraSpec | None = None
    tie_word_embeddings: bool = False
    tp_size: int = 1
    pp_size: int = 1
    stage_layers: tuple[int, ...] = ()
    dtypes: DtypePolicy = field(default_factory=DtypePolicy)
    naming: tuple[NamingRule, ...] = DEFAULT_NAMING

    def __post_init__(self) -> None:
        for attr in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
            "tp_size",
            "pp_size",
        ):
            if getattr(self, attr) <= 0:
                raise ConversionError(f"ConversionContext.{attr} must be > 0, got {getattr(self, attr)}")
        if not self.stage_layers:
            if self.num_layers % self.pp_size:
                raise ConversionError(
                    f"{self.num_layers} layers do not split evenly over pp_size={self.pp_size}; pass "
                    "stage_layers (layers per pipeline stage) explicitly"
                )
            object.__setattr__(self, "stage_layers", (self.num_layers // self.pp_size,) * self.pp_size)
        if (
            len(self.stage_layers) != self.pp_size
            or sum(self.stage_layers) != self.num_layers
            or min(self.stage_layers) < 0
        ):
            raise ConversionError(
                f"stage_layers={list(self.stage_layers)} must list {self.pp_size} non-negative layer counts "
                f"summing to num_layers={self.num_layers}"
            )
        heads, groups, tp = self.num_attention_heads, self.num_query_groups, self.tp_size
        if heads % groups:
            raise ConversionError(f"num_attention_heads={heads} is not a multiple of num_query_groups={groups}")
        if groups % tp or heads % tp:
            raise ConversionError(
                f"tp_size={tp} must divide num_query_groups={groups} (each rank holds whole query groups) "
                f"and num_attention_heads={heads}"
            )
        if self.ffn_hidden_size % tp:
            raise ConversionError(f"tp_size={tp} must divide ffn_hidden_size={self.ffn_hidden_size}")
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % tp:
            raise ConversionError(
                f"padded_vocab_size={self.padded_vocab_size} must be >= vocab_size={self.vocab_size} and a "
                f"multiple of tp_size={tp}; pass Megatron's padded vocabulary size"
            )
        if self.kind not in ("lora", "full"):
            raise ConversionError(f"kind must be 'lora' or 'full', got {self.kind!r}")
        if self.kind == "lora":
            if self.lora is None:
                raise ConversionError("kind='lora' needs the adapter's LoraSpec (rank, alpha, target_modules)")
            self._check_targets(self.lora)
        elif self.lora is not None:
            raise ConversionError(
                "kind='full' carries base weights only and no adapter; pass lora=None "
                "(dataclasses.replace(ctx, kind='full', lora=None))"
            )
        if not self.naming:
            raise ConversionError("ConversionContext.naming is empty; use DEFAULT_NAMING or extend it")

    @staticmethod
    def _check_targets(lora: LoraSpec) -> None:
        known = {p for parts in HF_PARTS.values() for p in parts}
        unknown = sorted(set(lora.target_modules) - known)
        if unknown:
            raise ConversionError(
                f"LoRA target_modules {unknown} have no Megatron counterpart; the converter knows {sorted(known)}"
            )
        for slot, parts in HF_PARTS.items():
            have = [p for p in parts if p in lora.target_modules]
            if have and len(have) != len(parts):
                raise ConversionError(
                    f"Megatron's {slot.value} adapter becomes {list(parts)} together; target_modules lists only "
                    f"{have}. List all of {list(parts)} or none"
                )

    # -- derived ----------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def stage_offsets(self) -> tuple[int, ...]:
        """Global index of each pipeline stage's first layer."""
        offsets, total = [], 0
        for n in self.stage_layers:
            offsets.append(total)
            total += n
        return tuple(offsets)

    def stage_of_layer(self, layer: int) -> int:
        for stage, (offset, n) in enumerate(zip(self.stage_offsets, self.stage_layers, strict=True)):
            if offset <= layer < offset + n:
                return stage
        raise ConversionError(f"layer {layer} is outside the model's {self.num_layers} layers")

    @property
    def lora_slots(self) -> tuple[Slot, ...]:
        """The Megatron modules that carry the adapter (empty for a full update)."""
        if self.lora is None:
            return ()
        return tuple(s for s in LORA_SLOTS if HF_PARTS[s][0] in self.lora.target_modules)

    @classmethod
    def from_megatron(
        cls,
        config: TransformerConfig,
        vocab_size: int,
        padded_vocab_size: int,
        kind: Kind,
        lora: LoraSpec | None,
        tie_word_embeddings: bool,
        dtypes: DtypePolicy | None = None,
        stage_layers: tuple[int, ...] = (),
        naming: tuple[NamingRule, ...] = DEFAULT_NAMING,
    ) -> ConversionContext:
        """Read geometry and parallel sizes from a Megatron-core ``TransformerConfig``.

        Rejects architecture flags the converter does not handle (biases, MoE, qk-norm, ...)
        by name, instead of producing a model that silently computes something else.
        """
        unsupported = {
            "add_bias_linear": False,
            "add_qkv_bias": False,
            "qk_layernorm": False,
            "num_moe_experts": None,
            "multi_latent_attention": False,
            "rotary_interleaved": False,
            "gated_linear_unit": True,
            "normalization": "RMSNorm",
            "virtual_pipeline_model_parallel_size": None,
        }
        for attr, want in unsupported.items():
            have = getattr(config, attr, want)
            if have != want:
                raise ConversionError(
                    f"TransformerConfig.{attr}={have!r}: the Megatron->HF Llama converter needs {want!r}; "
                    "add the layout to colosync.sources.megatron_layout before syncing this model"
                )
        activation = getattr(config, "activation_func", None)
        if activation is not None and activation is not torch.nn.functional.silu:
            raise ConversionError(
                f"TransformerConfig.activation_func={activation!r}: the HF Llama layout computes "
                "silu(gate) * up; set activation_func=torch.nn.functional.silu with gated_linear_unit=True"
            )
        if not stage_layers and (
            getattr(config, "num_layers_in_first_pipeline_stage", None) is not None
            or getattr(config, "num_layers_in_last_pipeline_stage", None) is not None
            or getattr(config, "pipeline_model_parallel_layout", None) is not None
            or getattr(config, "account_for_embedding_in_pipeline_split", False)
            or getattr(config, "account_for_loss_in_pipeline_split", False)
        ):
            raise ConversionError(
                "the TransformerConfig places layers unevenly over pipeline stages; pass stage_layers "
                "(the number of layers on each stage) to ConversionContext.from_megatron"
            )
        heads = int(config.num_attention_heads)
        groups = int(config.num_query_groups or heads)
        dtypes = dtypes or DtypePolicy(base=config.params_dtype, lora=config.params_dtype)
        return cls(
            num_layers=int(config.num_layers),
            hidden_size=int(config.hidden_size),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(config.kv_channels or config.hidden_size // heads),
            ffn_hidden_size=int(config.ffn_hidden_size),
            vocab_size=vocab_size,
            padded_vocab_size=padded_vocab_size,
            kind=kind,
            lora=lora,
            tie_word_embeddings=tie_word_embeddings,
            tp_size=int(config.tensor_model_parallel_size),
            pp_size=int(config.pipeline_model_parallel_size),
            stage_layers=tuple(stage_layers),
            dtypes=dtypes,
            naming=naming,
        )


# -- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ConversionItem:
    """One Megatron tensor to gather, and the HF/PEFT tensors it becomes."""

    slot: Slot
    role: Role
    layer: int | None  # global layer index
    stage: int  # the pipeline stage that owns it
    local_layer: int | None  # its index inside that stage
    split: Split
    shape: tuple[int, ...]  # full (gathered) Megatron shape
    dtype: torch.dtype
    outputs: tuple[HFTensor, ...]

    @property
    def key(self) -> ParamKey:
        return ParamKey(self.slot, self.role, self.local_layer)

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.split is Split.NONE:
            return self.shape
        dim = self.split.value
        return tuple(d // tp_size if i == dim else d for i, d in enumerate(self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        where = f"layer {self.layer} (stage {self.stage}, local {self.local_layer}) " if self.layer is not None else ""
        return f"{where}{self.slot.value}.{self.role.value} {list(self.shape)}"


def _megatron_shape(slot: Slot, role: Role, ctx: ConversionContext) -> tuple[int, ...]:
    h, hd, r = ctx.hidden_size, ctx.head_dim, ctx.lora.rank if ctx.lora else 0
    qkv = (ctx.num_attention_heads + 2 * ctx.num_query_groups) * hd
    dims = {  # (out, in) of each linear
        Slot.QKV: (qkv, h),
        Slot.PROJ: (h, ctx.num_attention_heads * hd),
        Slot.FC1: (2 * ctx.ffn_hidden_size, h),
        Slot.FC2: (h, ctx.ffn_hidden_size),
    }
    if slot in (Slot.EMBEDDING, Slot.OUTPUT):
        return (ctx.padded_vocab_size, h)
    if slot in (Slot.INPUT_NORM, Slot.POST_NORM, Slot.FINAL_NORM):
        return (h,)
    out_f, in_f = dims[slot]
    return {Role.WEIGHT: (out_f, in_f), Role.LORA_A: (r, in_f), Role.LORA_B: (out_f, r)}[role]


def _hf_outputs(slot: Slot, role: Role, layer: int | None, ctx: ConversionContext) -> tuple[HFTensor, ...]:
    h, hd, r = ctx.hidden_size, ctx.head_dim, ctx.lora.rank if ctx.lora else 0
    if slot in _HF_SINGLE:
        shape = (ctx.vocab_size, h) if slot in (Slot.EMBEDDING, Slot.OUTPUT) else (h,)
        return (HFTensor(_HF_SINGLE[slot].format(layer=layer), shape),)
    if layer is None:
        raise ConversionError(f"{slot} is a per-layer slot but no layer index was given")
    out_dims = {
        "q_proj": ctx.num_attention_heads * hd,
        "k_proj": ctx.num_query_groups * hd,
        "v_proj": ctx.num_query_groups * hd,
        "o_proj": h,
        "gate_proj": ctx.ffn_hidden_size,
        "up_proj": ctx.ffn_hidden_size,
        "down_proj": h,
    }
    in_dims = {"o_proj": ctx.num_attention_heads * hd, "down_proj": ctx.ffn_hidden_size}
    outputs = []
    for part in HF_PARTS[slot]:
        module = hf_module(slot, layer, part)
        out_f, in_f = out_dims[part], in_dims.get(part, h)
        if role is Role.WEIGHT:
            outputs.append(HFTensor(f"{module}.weight", (out_f, in_f)))
        elif role is Role.LORA_A:
            outputs.append(HFTensor(f"{PEFT_PREFIX}{module}.lora_A.weight", (r, in_f)))
        else:
            outputs.append(HFTensor(f"{PEFT_PREFIX}{module}.lora_B.weight", (out_f, r)))
    return tuple(outputs)


@functools.lru_cache(maxsize=32)
def plan(ctx: ConversionContext) -> tuple[ConversionItem, ...]:
    """The ordered Megatron tensors of one update; identical on every rank for one context."""
    entries: list[tuple[Slot, Role, int | None]] = []
    if ctx.kind == "full":
        entries.append((Slot.EMBEDDING, Role.WEIGHT, None))
        for n in range(ctx.num_layers):
            for slot in (Slot.INPUT_NORM, Slot.QKV, Slot.PROJ, Slot.POST_NORM, Slot.FC1, Slot.FC2):
                entries.append((slot, Role.WEIGHT, n))
        entries.append((Slot.FINAL_NORM, Role.WEIGHT, None))
        if not ctx.tie_word_embeddings:
            entries.append((Slot.OUTPUT, Role.WEIGHT, None))
    else:
        for n in range(ctx.num_layers):
            for slot in ctx.lora_slots:
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
            )
        )
    return tuple(items)


def hf_specs(ctx: ConversionContext) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every HF/PEFT tensor of the update, in stream order."""
    return [(out.name, out.shape, item.dtype) for item in plan(ctx) for out in item.outputs]


# -- layout conversion ----------------------------------------------------------------------


def split_qkv(qkv: torch.Tensor, ctx: ConversionContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """De-interleave a gathered ``linear_qkv`` weight (or its ``lora_B``) into q, k, v.

    Rows are grouped per query group ``[q_0 .. q_{n-1}, k, v]`` (``n`` heads per group, each
    ``head_dim`` rows). A TP rank holds whole groups, so the gathered tensor is the TP shards
    concatenated and every group is still intact: de-interleaving per group is
    de-interleaving per shard. Works for any trailing dims (``hidden`` or the LoRA rank).
    """
    n, g, hd = ctx.heads_per_group, ctx.num_query_groups, ctx.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.view(g, n + 2, hd, *rest)
    q = grouped[:, :n].reshape(g * n * hd, *rest)
    k = grouped[:, n].reshape(g * hd, *rest)
    v = grouped[:, n + 1].reshape(g * hd, *rest)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ConversionContext) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    n, g, hd = ctx.heads_per_group, ctx.num_query_groups, ctx.head_dim
    rest = q.shape[1:]
    grouped = torch.cat([q.view(g, n, hd, *rest), k.view(g, 1, hd, *rest), v.view(g, 1, hd, *rest)], dim=1)
    return grouped.reshape(g * (n + 2) * hd, *rest)


def split_fc1(fc1: torch.Tensor, ctx: ConversionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a gathered ``linear_fc1`` weight (or its ``lora_B``) into gate and up.

    Each TP rank's shard is ``[gate_i; up_i]`` (Megatron's GLU chunks the *local* output in
    two), so the gathered tensor is ``[gate_0; up_0; gate_1; up_1; ...]``: split per shard,
    then join the gates and the ups.
    """
    tp, rest = ctx.tp_size, fc1.shape[1:]
    shards = fc1.view(tp, 2, ctx.ffn_hidden_size // tp, *rest)
    return shards[:, 0].reshape(ctx.ffn_hidden_size, *rest), shards[:, 1].reshape(ctx.ffn_hidden_size, *rest)


def merge_fc1(gate: torch.Tensor, up: torch.Tensor, ctx: ConversionContext) -> torch.Tensor:
    """Inverse of :func:`split_fc1`."""
    tp, rest = ctx.tp_size, gate.shape[1:]
    f = ctx.ffn_hidden_size // tp
    return torch.stack([gate.view(tp, f, *rest), up.view(tp, f, *rest)], dim=1).reshape(2 * ctx.ffn_hidden_size, *rest)


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
    else:
        parts = (full,)
    return list(zip(names, parts, strict=False))


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
    return parts[0]


def shard(full: torch.Tensor, split: Split, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (a view)."""
    if split is Split.NONE:
        return full
    return full.chunk(tp_size, dim=split.value)[tp_rank]


__all__ = [
    "ADAPTER_SUFFIXES",
    "BASE_SUFFIXES",
    "DEFAULT_NAMING",
    "HF_PARTS",
    "LORA_SLOTS",
    "PEFT_PREFIX",
    "SPLITS",
    "ConversionContext",
    "ConversionError",
    "ConversionItem",
    "DtypePolicy",
    "HFTensor",
    "Kind",
    "NamingRule",
    "ParamKey",
    "Role",
    "Slot",
    "Split",
    "classify",
    "convert",
    "hf_module",
    "hf_specs",
    "index_params",
    "merge_fc1",
    "merge_qkv",
    "plan",
    "shard",
    "split_fc1",
    "split_qkv",
    "to_megatron",
]
