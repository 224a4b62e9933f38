"""Shared machinery for the Megatron source tests: spawned worlds, a real GPTModel, a LoRA.

* ``run_world`` spawns N processes joined by a gloo (CPU) or NCCL (GPU) group on 127.0.0.1
  and returns each rank's result, or fails with every failed rank's traceback.
* ``build_gpt`` builds a *real* megatron-core ``GPTModel`` (local layer spec) for this
  rank's pipeline stage, so the source is tested against Megatron's own parameter names,
  shapes and partition attributes, not an imitation.
* ``attach_lora`` adds LoRA to Megatron's Column/RowParallelLinear modules. megatron-core
  0.16.1 ships no LoRA (it lives in NeMo / Megatron-Bridge / PEFT), so this is our own small
  wrapper, written to the layout those use: column-parallel targets keep ``lora_A``
  replicated and split ``lora_B`` like the weight's rows; row-parallel targets split
  ``lora_A`` on its input dim and all-reduce before the replicated ``lora_B``. It names the
  halves either PEFT-style (``lora_A.weight``) or NeMo-style (``adapter.linear_in.weight``).
* ``megatron_cpu_shims`` lets Megatron's forward run on CPU: it hard-codes
  ``torch.cuda.current_device()`` for a few buffers and forks a CUDA RNG state around
  attention dropout. The shims redirect the device to ``"cpu"`` and make the fork a no-op
  (dropout is off in eval mode), and give the MoE router the ``te_general_gemm = None`` its
  failed Transformer-Engine import forgot to define; they change where tensors live and
  which GEMM kernel runs, not what is computed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tests import worlds

Convention = Literal["peft", "nemo"]
LORA_NAMES: Mapping[Convention, tuple[str, str]] = {
    "peft": ("lora_A", "lora_B"),
    "nemo": ("adapter.linear_in", "adapter.linear_out"),
}
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
GROUPED_GDN_TARGETS = ("in_proj_qkvz", "in_proj_ba", "out_proj")  # Qwen3-Next's


@dataclass(frozen=True)
class Geometry:
    """A tiny model of one architecture that TP=4 can split (4 query groups).

    ``arch`` is a name of ``colosync.sources.architectures``; ``num_experts`` > 0 (with
    ``moe_ffn_hidden_size``) for Qwen3-MoE; ``tie`` ties the output layer to the embedding.
    """

    vocab_size: int = 250
    padded_vocab_size: int = 256  # Megatron pads the vocabulary to a multiple of the TP size
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 8
    num_query_groups: int = 4
    ffn_hidden_size: int = 96
    rms_eps: float = 1e-6
    arch: str = "llama"
    tie: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 2
    shared_expert_size: int = 0  # Qwen3-Next: a gated shared expert next to the routed ones
    # Gated-DeltaNet hybrids: every linear_freq-th layer is full attention, the rest GDN (0: no GDN)
    linear_freq: int = 0
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel: int = 4
    rotary_percent: float = 1.0  # Qwen3.5 rotates a quarter of each head (HF partial_rotary_factor)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def targets(self) -> tuple[str, ...]:
        """Every HF module a LoRA of this architecture may target."""
        if self.linear_freq and self.num_experts:
            return ATTENTION_TARGETS + GROUPED_GDN_TARGETS
        if self.linear_freq:
            return ALL_TARGETS + GDN_TARGETS
        return ATTENTION_TARGETS if self.num_experts else ALL_TARGETS

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated-DeltaNet layers (megatron-core's linear_attention_freq rule)."""
        if not self.linear_freq:
            return ()
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.linear_freq)

    def linear_attention(self) -> Any:
        from colosync.sources.architectures.context import LinearAttention

        if not self.linear_freq:
            return None
        return LinearAttention(
            num_key_heads=self.linear_key_heads,
            num_value_heads=self.linear_value_heads,
            key_head_dim=self.linear_key_head_dim,
            value_head_dim=self.linear_value_head_dim,
            conv_kernel=self.linear_conv_kernel,
        )


GEOMETRIES: Mapping[str, Geometry] = {
    "llama": Geometry(),
    "qwen2": Geometry(arch="qwen2", tie=True),
    "qwen3": Geometry(arch="qwen3"),
    "qwen3_moe": Geometry(arch="qwen3_moe", num_layers=2, num_experts=4, moe_ffn_hidden_size=32, tie=True),
    "qwen3_5": Geometry(arch="qwen3_5", linear_freq=2, tie=True, rotary_percent=0.25),
    "qwen3_next": Geometry(
        arch="qwen3_next",
        num_layers=2,
        linear_freq=2,
        num_experts=4,
        moe_ffn_hidden_size=32,
        shared_expert_size=48,
        rotary_percent=0.25,
    ),
}
"""One tiny model per architecture (Qwen2, Qwen3-MoE and Qwen3.5 tied, as their small checkpoints are).

Qwen3.5's layers alternate Gated-DeltaNet and gated full attention (linear_freq=2), so any two
consecutive layers (the 2-layer variants) hold one of each."""


# -- worlds ---------------------------------------------------------------------------------


def _reset_megatron() -> None:
    with contextlib.suppress(Exception):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


class World(worlds.World):
    """A ``tests.worlds.World`` for the Megatron tests: the forkserver imports megatron-core once
    (instead of each rank paying the multi-second import on shared cores), and Megatron's
    parallel state is reset after every task."""

    def __init__(self, size: int, backend: str = "gloo") -> None:
        super().__init__(
            size,
            backend,
            preload=["torch", "megatron.core.models.gpt.gpt_model", "colosync.sources.megatron"],
            after_task=_reset_megatron,
        )


def run_world(
    target: Callable[..., Any], world: int, args: tuple = (), backend: str = "gloo", timeout_s: float = 240.0
) -> list[Any]:
    """Run ``target(rank, world, *args)`` once on a fresh world of ``world`` ranks."""
    w = World(world, backend)
    try:
        return w.run(target, *args, timeout_s=timeout_s)
    finally:
        w.close()


# -- Megatron -------------------------------------------------------------------------------


def megatron_cpu_shims() -> None:
    """Let Megatron-core's forward run on CPU in this process (see the module docstring)."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # a CPU shim, not torch's signature
    # The RNG tracker's fork is a CUDA-state context manager; on CPU a no-op one.
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda name=None: contextlib.nullcontext()  # type: ignore[method-assign]  # a CPU shim


def _router_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MoE router reads ``te_general_gemm`` even when Transformer Engine's
    import failed and left it undefined; ``None`` selects its plain-torch GEMM, as intended."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def init_megatron(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    _router_without_transformer_engine()
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    else:
        megatron_cpu_shims()


def transformer_config(
    geom: Geometry,
    tp: int,
    pp: int,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.08,
    ep: int = 1,
    etp: int | None = None,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if geom.num_experts:
        moe = dict(
            num_moe_experts=geom.num_experts,
            moe_ffn_hidden_size=geom.moe_ffn_hidden_size,
            moe_router_topk=geom.moe_topk,
            moe_grouped_gemm=False,  # grouped GEMM needs Transformer Engine or the grouped_gemm CUDA package
            moe_token_dispatcher_type="allgather",  # the alltoall dispatcher allocates CUDA streams
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            moe_router_dtype="fp32",
            moe_shared_expert_intermediate_size=geom.shared_expert_size or None,
            moe_shared_expert_gate=bool(geom.shared_expert_size),
        )
    gdn: dict[str, Any] = {}
    if geom.linear_freq:
        gdn = dict(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=geom.linear_freq,
            linear_num_key_heads=geom.linear_key_heads,
            linear_num_value_heads=geom.linear_value_heads,
            linear_key_head_dim=geom.linear_key_head_dim,
            linear_value_head_dim=geom.linear_value_head_dim,
            linear_conv_kernel_dim=geom.linear_conv_kernel,
            attention_output_gate=True,
            deterministic_mode=True,  # GDN's torch chunked delta rule, not FLA's Triton kernel
        )
    return TransformerConfig(
        **gdn,
        add_qkv_bias=geom.arch == "qwen2",
        qk_layernorm=geom.arch.startswith("qwen3"),
        **moe,
        num_layers=geom.num_layers,
        hidden_size=geom.hidden_size,
        num_attention_heads=geom.num_heads,
        num_query_groups=geom.num_query_groups,
        kv_channels=geom.head_dim,
        ffn_hidden_size=geom.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=geom.rms_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        init_method_std=init_std,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt(config: Any, geom: Geometry, seed: int = 0) -> torch.nn.Module:
    """A real ``GPTModel`` holding this rank's pipeline stage (local layer spec, RoPE)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=geom.num_experts or None, qk_layernorm=config.qk_layernorm)
    if geom.linear_freq:
        spec = _hybrid_block_spec(config, spec, geom)
    with _cpu_tensor_cuda():
        return _gpt(GPTModel, config, spec, geom, parallel_state)


def _hybrid_block_spec(config: Any, attention_layer: Any, geom: Geometry) -> Any:
    """This stage's layers of a GDN hybrid, built from megatron-core's local-spec modules.

    megatron-core 0.16.1's own hybrid block spec (``get_transformer_block_with_experimental_
    attention_variant_spec``) asserts Transformer Engine; this is the same block with the local
    spec's modules: megatron-core's ``GatedDeltaNet`` with a ``ColumnParallelLinear`` in_proj, a
    torch RMSNorm out_norm and a ``RowParallelLinear`` out_proj in the GDN layers, the local
    gated attention in the others. GatedDeltaNet refuses to build without the FLA package,
    which it only calls in forward (``l2norm``; its chunked kernel is replaced by its torch
    one under ``deterministic_mode``): ``gdn_without_fla`` provides a torch ``l2norm`` (and runs
    its ``torch.compile``'d gated norm uncompiled).
    """
    import copy

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    gdn_without_fla()
    norm = attention_layer.submodules.input_layernorm
    linear_layer = copy.deepcopy(attention_layer)
    linear_layer.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear),
    )
    layers = [linear_layer if i in geom.linear_layers else attention_layer for i in range(geom.num_layers)]
    offset = get_transformer_layer_offset(config)
    mine = layers[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=mine, layer_norm=norm)


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's ``l2norm`` (``x / sqrt(sum(x^2) + eps)``, in fp32), in torch."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def gdn_without_fla() -> None:
    """Let megatron-core's GatedDeltaNet build and run without the FLA package (see above)."""
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = _l2norm
    # its gated-norm helper is torch.compile'd (megatron's jit_fuser): the same ops, uncompiled (no C++ build)
    gated = gated_delta_net.GatedDeltaNet._apply_gated_norm
    gated_delta_net.GatedDeltaNet._apply_gated_norm = getattr(gated, "_torchdynamo_orig_callable", gated)


@contextlib.contextmanager
def _cpu_tensor_cuda():
    """On a CPU-only torch, ``Tensor.cuda()`` is the tensor itself while a model is built.

    Megatron moves a tied embedding to CUDA before all-reducing it between the first and last
    pipeline stage; on CPU the all-reduce runs on gloo where the tensor already is.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]  # a CPU shim
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def _gpt(GPTModel: Any, config: Any, spec: Any, geom: Geometry, parallel_state: Any) -> torch.nn.Module:
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=geom.padded_vocab_size,
        max_sequence_length=128,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=geom.tie,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=geom.rotary_percent,
    )


class _LoraHook:
    def __init__(self, module: torch.nn.Module, a: str, b: str, row_parallel: bool, scaling: float) -> None:
        self.a, self.b, self.row, self.scaling = a, b, row_parallel, scaling
        self.module = module

    def _param(self, path: str) -> torch.Tensor:
        obj: Any = self.module
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj.weight

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        x = args[0]
        a, b = self._param(self.a), self._param(self.b)
        low = x @ a.t()
        if self.row:  # the input is split across TP ranks: x_i @ A_i^T are partial sums
            from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

            low = reduce_from_tensor_model_parallel_region(low)
        delta = (low @ b.t()) * self.scaling
        out, bias = output
        return out + delta.to(out.dtype), bias


def _linear(rows: int, cols: int, dtype: torch.dtype) -> torch.nn.Linear:
    lin = torch.nn.Linear(cols, rows, bias=False, dtype=dtype)
    torch.nn.init.zeros_(lin.weight)
    return lin


def attach_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    convention: Convention,
    dtype: torch.dtype = torch.float32,
    experts: bool = False,
) -> list[str]:
    """Add a LoRA to every linear_qkv/linear_proj/linear_fc1/linear_fc2 (and GDN in_proj/out_proj);
    returns the module names.

    Routed (and shared) experts' linears get one only with ``experts=True`` (to test that it is refused).
    Shapes are this rank's shards; values are zero until loaded (``load_megatron_tensors``).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    a_name, b_name = LORA_NAMES[convention]
    wrapped = []
    for name, module in list(model.named_modules()):
        if not name.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", ".in_proj", ".out_proj")):
            continue
        if (".experts." in name or ".shared_experts." in name) and not experts:
            continue
        out_local, in_local = module.weight.shape
        row = isinstance(module, RowParallelLinear)
        assert row or isinstance(module, ColumnParallelLinear), name
        a = _linear(rank, in_local, dtype)  # row: split on input; column: replicated (full input)
        b = _linear(out_local, rank, dtype)  # row: full output (replicated); column: this rank's rows
        if convention == "peft":
            module.lora_A, module.lora_B = a, b
        else:
            module.adapter = torch.nn.Module()
            module.adapter.linear_in, module.adapter.linear_out = a, b
        module.register_forward_hook(_LoraHook(module, a_name, b_name, row, alpha / rank))
        wrapped.append(name)
    return wrapped


def load_megatron_tensors(model: torch.nn.Module, tensors: Mapping[Any, torch.Tensor], naming: tuple) -> int:
    """Copy ``{ParamKey: local shard}`` into the model's parameters, found through the naming table."""
    from colosync.sources.megatron_layout import index_params

    index = index_params(model.named_parameters(), naming)
    with torch.no_grad():
        for key, value in tensors.items():
            name, param = index[key]
            assert tuple(param.shape) == tuple(value.shape), (name, param.shape, value.shape)
            param.copy_(value)
    return len(tensors)


def local_shards(
    ctx: Any,
    stage: int,
    tp_rank: int,
    hf: Mapping[str, torch.Tensor],
    pad: torch.Tensor,
    ep_rank: int = 0,
    etp_rank: int | None = None,
) -> dict[Any, torch.Tensor]:
    """This rank's Megatron shards of every planned tensor (experts: its local ones), from HF/PEFT tensors."""
    from colosync.sources.megatron_layout import local_params, plan, to_megatron

    out = {}
    for item in plan(ctx):
        if item.stage != stage:
            continue
        rank = (tp_rank if etp_rank is None else etp_rank) if item.experts else tp_rank
        for key, value in local_params(item, to_megatron(item, hf, ctx, pad), ctx, rank, ep_rank).items():
            out[key] = value.clone()
    return out


# -- HF / PEFT reference --------------------------------------------------------------------


def hf_config(geom: Geometry) -> Any:
    """The transformers config of ``geom``'s architecture (RoPE base 10000, as ``build_gpt``)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=geom.vocab_size,
        hidden_size=geom.hidden_size,
        num_hidden_layers=geom.num_layers,
        num_attention_heads=geom.num_heads,
        num_key_value_heads=geom.num_query_groups,
        intermediate_size=geom.ffn_hidden_size,
        head_dim=geom.head_dim,
        rms_norm_eps=geom.rms_eps,
        tie_word_embeddings=geom.tie,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=geom.vocab_size - 1,  # vLLM stops at EOS, HF's reference greedy does not: keep it rare
        pad_token_id=0,
    )
    if geom.arch == "llama":
        return transformers.LlamaConfig(**common)
    if geom.arch == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if geom.arch == "qwen3":
        return transformers.Qwen3Config(**common, attention_bias=False, use_sliding_window=False)
    moe = dict(
        moe_intermediate_size=geom.moe_ffn_hidden_size,
        num_experts=geom.num_experts,
        num_experts_per_tok=geom.moe_topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.0,
    )
    if geom.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **moe)
    if geom.arch in ("qwen3_5", "qwen3_next"):  # Gated-DeltaNet hybrids
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": geom.rotary_percent}
        hybrid = dict(
            common,
            rope_parameters=rope,
            attention_bias=False,
            layer_types=[
                "linear_attention" if i in geom.linear_layers else "full_attention" for i in range(geom.num_layers)
            ],
            linear_num_key_heads=geom.linear_key_heads,
            linear_num_value_heads=geom.linear_value_heads,
            linear_key_head_dim=geom.linear_key_head_dim,
            linear_value_head_dim=geom.linear_value_head_dim,
            linear_conv_kernel_dim=geom.linear_conv_kernel,
        )
        if geom.arch == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**hybrid)
        return transformers.Qwen3NextConfig(**hybrid, **moe, shared_expert_intermediate_size=geom.shared_expert_size)
    raise ValueError(geom.arch)


def hf_class(geom: Geometry) -> Any:
    import transformers

    from colosync.sources.architectures import get

    return getattr(transformers, get(geom.arch).hf_architecture)


def make_reference(
    geom: Geometry, lora_rank: int, lora_alpha: float, seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """A seeded HF model of ``geom.arch`` plus a PEFT LoRA whose fused parts share lora_A (Megatron's layout).

    Returns ``{"full": the tensors a full update sends (a tied ``lm_head`` is the embedding and is
    not among them), "lora": PEFT adapter state dict}``.
    """
    from peft import get_peft_model_state_dict

    from colosync.testing import random_lora

    torch.manual_seed(seed)
    model = hf_class(geom)(hf_config(geom))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            else:
                p.uniform_(0.5, 1.5)
    exact_norms(model)
    full = {k: v.clone() for k, v in model.state_dict().items() if not (geom.tie and k == "lm_head.weight")}
    peft_model = random_lora(model, rank=lora_rank, alpha=lora_alpha, targets=geom.targets, seed=seed + 1, scale=0.1)
    share_fused_lora_a(peft_model)
    lora = {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    return {"full": full, "lora": lora}


def exact_norms(model: torch.nn.Module) -> None:
    """Round 1-D weights to multiples of 2^-16 so that shifting a zero-centered norm by one is exact.

    Qwen3.5's HF layer norms compute ``(1 + w) * x`` and the local spec's Megatron norms
    ``w * x``: the conversion adds one on the way in and subtracts it on the way out, which
    is bit-exact for weights on this grid (and for any Megatron weight in [0.5, 2])."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((p * 65536).round() / 65536)


def share_fused_lora_a(peft_model: torch.nn.Module) -> None:
    """Make k/v share q's lora_A, up share gate's and GDN's z/b/a share in_proj_qkv's: what a
    fused Megatron module can express."""

    def share(first: Any, *others: Any) -> None:
        for m in others:
            m.lora_A["default"].weight.copy_(first.lora_A["default"].weight)

    with torch.no_grad():
        for layer in peft_model.base_model.model.model.layers:
            mlp = layer.mlp
            if hasattr(layer, "self_attn"):
                attn = layer.self_attn
                share(attn.q_proj, attn.k_proj, attn.v_proj)
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None and hasattr(getattr(gdn, "in_proj_qkv", None), "lora_A"):
                share(gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a)
            if gdn is not None and hasattr(getattr(gdn, "in_proj_qkvz", None), "lora_A"):
                share(gdn.in_proj_qkvz, gdn.in_proj_ba)
            if hasattr(mlp, "up_proj") and hasattr(mlp.up_proj, "lora_A"):
                share(mlp.gate_proj, mlp.up_proj)


def vocab_pad(geom: Geometry, seed: int = 7) -> torch.Tensor:
    """Garbage for Megatron's vocab padding rows: conversion must drop it."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(geom.padded_vocab_size - geom.vocab_size, geom.hidden_size, generator=gen) * 100


def hf_model(geom: Geometry, full: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The HF model of ``geom.arch`` holding exactly ``full`` (a tied lm_head follows the embedding)."""
    model = hf_class(geom)(hf_config(geom))
    missing, unexpected = model.load_state_dict(dict(full), strict=False)
    allowed = {"lm_head.weight"} if geom.tie else set()
    assert not unexpected and not [m for m in missing if "rotary" not in m and m not in allowed], (missing, unexpected)
    if geom.tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.to(device=device, dtype=dtype).eval()


hf_llama = hf_model  # the name the Llama-only tests used


def lora_delta(a: torch.Tensor, b: torch.Tensor, rank: int, alpha: float) -> torch.Tensor:
    """The weight change a LoRA pair makes, read with the manifest's rank and alpha."""
    return (b.double() @ a.double()) * (alpha / rank)


def close(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative error ||x - y|| / ||y||."""
    return float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))


def module_from_named(named: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A bare module tree whose ``named_parameters()`` are exactly ``named`` (single-process tests)."""
    root = torch.nn.Module()
    for name, value in named.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(value.clone(), requires_grad=False))
    return root


def megatron_named(
    ctx: Any, hf: Mapping[str, torch.Tensor], pad: torch.Tensor, convention: Convention = "peft"
) -> dict[str, torch.Tensor]:
    """TP=1, PP=1 Megatron (local spec) parameter names and tensors for ``ctx``'s plan, from HF/PEFT."""
    from colosync.sources.megatron_layout import Role, local_params, plan, to_megatron

    a_name, b_name = LORA_NAMES[convention]
    suffixes = {
        Role.WEIGHT: "weight",
        Role.BIAS: "bias",
        Role.LORA_A: f"{a_name}.weight",
        Role.LORA_B: f"{b_name}.weight",
    }
    out = {}
    for item in plan(ctx):
        prefix = f"decoder.layers.{item.local_layer}." if item.local_layer is not None else ""
        for key, value in local_params(item, to_megatron(item, hf, ctx, pad), ctx, 0).items():
            module = item.slot.value
            if key.expert is not None:  # SequentialMLP: mlp.experts.local_experts.<i>.linear_fc1
                module = module.replace("experts.", f"experts.local_experts.{key.expert}.")
            if item.slot.bare:  # GatedDeltaNet's own A_log / dt_bias
                out[f"{prefix}{module}"] = value
                continue
            out[f"{prefix}{module}.{suffixes[item.role]}"] = value
    return out
