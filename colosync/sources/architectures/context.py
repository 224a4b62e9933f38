"""Everything a Megatron -> HF/PEFT conversion needs, in one frozen, validated object.

The seed run lost ``lora_rank`` somewhere in a chain of Megatron-to-HF converters and lost
``**kwargs`` at an intermediate weight-buffer flush. Both failures come from the same shape
of code: a conversion that needs several facts (rank, alpha, head counts, dtype, ...) and
receives them piecemeal, through optional arguments that each layer may forget to pass on.
Here every fact lives in one frozen :class:`ConversionContext` -- the architecture among
them -- and every function on the path takes that context as an explicit, required
argument. There is no ``**kwargs`` on this path; a flush (or any other stage) cannot drop
what it cannot omit. The context refuses, by name, what would convert wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from colosync.errors import ConversionError
from colosync.sources.architectures import get, supported
from colosync.sources.architectures.base import Architecture, Kind, Role, Slot
from colosync.sources.architectures.naming import DEFAULT_NAMING, NamingRule
from colosync.wire.manifest import LoraSpec

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

# -- the context ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DtypePolicy:
    """The dtype each kind of tensor travels in (cast once, on the rank that owns the shard)."""

    base: torch.dtype = torch.float32
    lora: torch.dtype = torch.float32

    def for_role(self, role: Role) -> torch.dtype:
        return self.base if role.base else self.lora


@dataclass(frozen=True)
class LinearAttention:
    """The Gated-DeltaNet geometry of a hybrid model (megatron-core's ``linear_*`` config fields).

    ``num_key_heads`` query/key heads of ``key_head_dim``, ``num_value_heads`` value (and gate)
    heads of ``value_head_dim``; ``conv_kernel`` the causal conv1d's width.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for attr in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            if getattr(self, attr) <= 0:
                raise ConversionError(f"LinearAttention.{attr} must be > 0, got {getattr(self, attr)}")
        if self.num_value_heads % self.num_key_heads:
            raise ConversionError(
                f"LinearAttention.num_value_heads={self.num_value_heads} must be a multiple of "
                f"num_key_heads={self.num_key_heads}"
            )

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: ``[q; k; v]``."""
        return 2 * self.qk_dim + self.v_dim

    @property
    def in_proj_dim(self) -> int:
        """Rows of Megatron's fused ``in_proj``: q, k, v, z (gate), b (beta), a (alpha)."""
        return 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads

    @classmethod
    def from_megatron(cls, config: TransformerConfig) -> LinearAttention:
        return cls(
            num_key_heads=int(config.linear_num_key_heads),
            num_value_heads=int(config.linear_num_value_heads),
            key_head_dim=int(config.linear_key_head_dim),
            value_head_dim=int(config.linear_value_head_dim),
            conv_kernel=int(config.linear_conv_kernel_dim),
        )


def linear_attention_layers(config: TransformerConfig) -> tuple[int, ...]:
    """The global indices of the Gated-DeltaNet layers, as megatron-core places them.

    ``linear_attention_freq`` N: every N-th layer (1-based) is full attention, the rest GDN;
    a list: 1 marks a GDN layer (megatron-core's ``get_linear_attention_pattern``).
    """
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return ()
    freq = config.linear_attention_freq
    n = int(config.num_layers)
    if isinstance(freq, int):
        pattern = [0 if (i + 1) % freq == 0 else 1 for i in range(n)]
    elif isinstance(freq, list | tuple) and len(freq) == n:
        pattern = [int(v) for v in freq]
    else:
        raise ConversionError(
            f"TransformerConfig.linear_attention_freq={freq!r}: give an int or a list of {n} 0/1 flags"
        )
    return tuple(i for i, v in enumerate(pattern) if v == 1)


@dataclass(frozen=True)
class ConversionContext:
    """Everything the Megatron -> HF/PEFT conversion needs, in one immutable object.

    Geometry (``num_layers`` ... ``padded_vocab_size``) is the *global*, unsharded model;
    ``arch`` names the :class:`Architecture` (see ``colosync.sources.architectures``);
    ``num_experts``/``moe_ffn_hidden_size`` are the routed experts of an MoE architecture;
    ``tp_size``/``pp_size``/``stage_layers`` describe how Megatron placed it, ``ep_size`` and
    ``expert_tp_size`` (default: ``tp_size``) how it placed the experts; ``kind`` says
    whether an update carries the LoRA adapter (``lora`` is then required) or the base
    weights; ``dtypes`` is the wire dtype policy; ``naming`` is the naming table. A hybrid
    (Qwen3.5, Qwen3-Next) lists its Gated-DeltaNet layers in ``linear_layers`` and their
    geometry in ``linear_attention``; ``zero_centered_gamma`` says Megatron's norms compute
    ``(1 + w) * x``; ``shared_expert_size`` is an MoE layer's shared expert (Qwen3-Next). Build it
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
    arch: str = "llama"
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    ep_size: int = 1
    expert_tp_size: int = 0  # 0: the same as tp_size
    linear_layers: tuple[int, ...] = ()  # global indices of the Gated-DeltaNet layers of a hybrid
    linear_attention: LinearAttention | None = None
    zero_centered_gamma: bool = False  # Megatron's norms compute (1 + w) * x (layernorm_zero_centered_gamma)
    shared_expert_size: int = 0  # intermediate size of an MoE layer's shared expert (Qwen3-Next)

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
            "ep_size",
        ):
            if getattr(self, attr) <= 0:
                raise ConversionError(f"ConversionContext.{attr} must be > 0, got {getattr(self, attr)}")
        architecture = get(self.arch)  # raises, naming the supported ones
        if not self.expert_tp_size:
            object.__setattr__(self, "expert_tp_size", self.tp_size)
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
        self._check_experts(architecture)
        self._check_linear(architecture)
        if self.kind not in ("lora", "full"):
            raise ConversionError(f"kind must be 'lora' or 'full', got {self.kind!r}")
        if self.kind == "lora":
            if self.lora is None:
                raise ConversionError("kind='lora' needs the adapter's LoraSpec (rank, alpha, target_modules)")
            self._check_targets(self.lora, architecture)
        elif self.lora is not None:
            raise ConversionError(
                "kind='full' carries base weights only and no adapter; pass lora=None "
                "(dataclasses.replace(ctx, kind='full', lora=None))"
            )
        if not self.naming:
            raise ConversionError("ConversionContext.naming is empty; use DEFAULT_NAMING or extend it")

    def _check_experts(self, architecture: Architecture) -> None:
        if not architecture.moe:
            if self.num_experts or self.ep_size != 1:
                raise ConversionError(
                    f"architecture {self.arch!r} has no routed experts but the context says num_experts="
                    f"{self.num_experts}, ep_size={self.ep_size}; use an MoE architecture (e.g. 'qwen3_moe')"
                )
            return
        e, f, ep, etp = self.num_experts, self.moe_ffn_hidden_size, self.ep_size, self.expert_tp_size
        if e <= 0 or f <= 0:
            raise ConversionError(
                f"architecture {self.arch!r} routes to experts: num_experts and moe_ffn_hidden_size must be > 0, "
                f"got {e} and {f}"
            )
        shared = any(slot is Slot.SHARED_FC1 for slot, _ in architecture.layer_tensors)
        if shared and (self.shared_expert_size <= 0 or self.shared_expert_size % self.tp_size):
            raise ConversionError(
                f"architecture {self.arch!r} has a shared expert: shared_expert_size must be > 0 and a multiple of "
                f"tp_size={self.tp_size}, got {self.shared_expert_size}"
            )
        if e % ep:
            raise ConversionError(f"ep_size={ep} must divide num_experts={e} (each EP rank holds whole experts)")
        if f % etp:
            raise ConversionError(f"expert_tp_size={etp} must divide moe_ffn_hidden_size={f}")

    def _check_linear(self, architecture: Architecture) -> None:
        if not architecture.hybrid:
            if self.linear_layers or self.linear_attention is not None:
                raise ConversionError(
                    f"architecture {self.arch!r} has no Gated-DeltaNet layers but the context lists linear_layers="
                    f"{list(self.linear_layers)}; use a hybrid architecture (e.g. 'qwen3_5')"
                )
            return
        if sorted(set(self.linear_layers)) != list(self.linear_layers) or any(
            not 0 <= n < self.num_layers for n in self.linear_layers
        ):
            raise ConversionError(
                f"linear_layers={list(self.linear_layers)} must be distinct increasing layer indices below "
                f"num_layers={self.num_layers}"
            )
        la = self.linear_attention
        if self.linear_layers and la is None:
            raise ConversionError(
                f"architecture {self.arch!r} has Gated-DeltaNet layers {list(self.linear_layers)}: pass their "
                "LinearAttention geometry (ConversionContext.from_megatron reads it from the config)"
            )
        if la is not None and (la.num_key_heads % self.tp_size or la.num_value_heads % self.tp_size):
            raise ConversionError(
                f"tp_size={self.tp_size} must divide the Gated-DeltaNet heads (num_key_heads={la.num_key_heads}, "
                f"num_value_heads={la.num_value_heads}): each rank holds whole heads"
            )

    @staticmethod
    def _check_targets(lora: LoraSpec, architecture: Architecture) -> None:
        refused = sorted(set(lora.target_modules) & set(architecture.refused_lora))
        if refused:
            raise ConversionError(
                f"LoRA target_modules {refused}: {architecture.refused_lora[refused[0]]} (architecture "
                f"{architecture.name!r} converts LoRA on {list(architecture.lora_targets)})"
            )
        known = set(architecture.lora_targets)
        unknown = sorted(set(lora.target_modules) - known)
        if unknown:
            raise ConversionError(
                f"LoRA target_modules {unknown} have no Megatron counterpart in architecture {architecture.name!r}; "
                f"the converter knows {sorted(known)}"
            )
        for slot in architecture.lora_slots:
            parts = architecture.parts(slot)
            have = [p for p in parts if p in lora.target_modules]
            if have and len(have) != len(parts):
                raise ConversionError(
                    f"Megatron's {slot.value} adapter becomes {list(parts)} together; target_modules lists only "
                    f"{have}. List all of {list(parts)} or none"
                )

    # -- derived ----------------------------------------------------------------------------
    @property
    def architecture(self) -> Architecture:
        return get(self.arch)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def local_experts(self) -> int:
        """Experts per EP rank (0 for a dense architecture)."""
        return self.num_experts // self.ep_size

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
        arch = self.architecture
        return tuple(s for s in arch.lora_slots if arch.parts(s)[0] in self.lora.target_modules)

    def is_linear(self, layer: int) -> bool:
        """Layer ``layer`` (global) is a Gated-DeltaNet layer of a hybrid."""
        return layer in self.linear_layers

    def layer_tensors(self, layer: int) -> tuple[tuple[Slot, Role], ...]:
        """The (slot, role) of every base tensor of global layer ``layer``, in stream order."""
        return self.architecture.tensors_of_layer(self.is_linear(layer))

    def layer_lora_slots(self, layer: int) -> tuple[Slot, ...]:
        """The adapter-carrying modules that layer ``layer`` has (a hybrid's layers differ)."""
        present = {slot for slot, role in self.layer_tensors(layer) if role is Role.WEIGHT}
        return tuple(s for s in self.lora_slots if s in present)

    def norm_offset(self, slot: Slot) -> float:
        """What to add to a Megatron norm weight to get HF's: both sides may be zero-centered.

        Megatron computes ``(1 + w) * x`` when ``zero_centered_gamma``; HF's layer norms do
        when the architecture says so (Qwen3.5's), its Gated-DeltaNet norm never does.
        """
        megatron = 1.0 if self.zero_centered_gamma else 0.0
        if slot.layer_norm:
            return megatron - (1.0 if self.architecture.hf_zero_centered_norms else 0.0)
        if slot is Slot.GDN_NORM:
            return megatron
        return 0.0

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
        arch: str = "llama",
    ) -> ConversionContext:
        """Read geometry and parallel sizes from a Megatron-core ``TransformerConfig``.

        ``arch`` names the HF architecture (``colosync.sources.architectures.names()``).
        Rejects architecture flags that architecture does not convert (a bias it lacks, MoE,
        qk-norm, MLA, GDN, ...) by name, instead of producing a model that silently
        computes something else.
        """
        architecture = get(arch)
        architecture.check_config(config, supported())
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
        experts = int(getattr(config, "num_moe_experts", None) or 0)
        moe_ffn = getattr(config, "moe_ffn_hidden_size", None) or (config.ffn_hidden_size if experts else 0)
        expert_tp = int(getattr(config, "expert_tensor_parallel_size", None) or config.tensor_model_parallel_size)
        linear_layers = linear_attention_layers(config)
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
            arch=arch,
            num_experts=experts,
            moe_ffn_hidden_size=int(moe_ffn),
            ep_size=int(getattr(config, "expert_model_parallel_size", 1) or 1) if experts else 1,
            expert_tp_size=expert_tp if experts else 0,
            linear_layers=linear_layers,
            linear_attention=LinearAttention.from_megatron(config) if linear_layers else None,
            zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
            shared_expert_size=int(getattr(config, "moe_shared_expert_intermediate_size", None) or 0) if experts else 0,
        )


__all__ = ["ConversionContext", "DtypePolicy", "LinearAttention", "linear_attention_layers"]
