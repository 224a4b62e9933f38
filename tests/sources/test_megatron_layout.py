"""Single-process tests of the Megatron -> HF/PEFT conversion and of the context's journey.

Layout functions are checked against independent oracles (explicit per-head / per-shard
loops, HF's and PEFT's own parameter names and shapes); the context is checked end to end
through the Sender: whatever the bucket size, every bucket's manifest carries the
context's LoRA rank and alpha, and the engine gets exactly the reference tensors.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colosync.control.link import LocalLink
from colosync.sources import megatron, megatron_checks, megatron_groups, megatron_layout
from colosync.sources.architectures import base as layout_base
from colosync.sources.architectures import context as layout_context
from colosync.sources.architectures import layout as layout_layout
from colosync.sources.architectures import naming as layout_naming
from colosync.sources.megatron import MegatronSource, ParallelGroups
from colosync.sources.megatron_layout import (
    DEFAULT_NAMING,
    ConversionContext,
    ConversionError,
    NamingRule,
    ParamKey,
    Role,
    Slot,
    Split,
    classify,
    hf_specs,
    merge_fc1,
    merge_qkv,
    plan,
    split_fc1,
    split_qkv,
)
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender
from colosync.wire.manifest import LoraSpec

from megatron_helpers import (
    ALL_TARGETS,
    GEOMETRIES,
    Geometry,
    hf_class,
    hf_config,
    make_reference,
    megatron_named,
    module_from_named,
    vocab_pad,
)
from megatron_workers import RecordingTarget

DEFAULT_GEOMETRY = Geometry()


def _ctx(
    geom: Geometry = DEFAULT_GEOMETRY, kind: str = "lora", tp: int = 1, pp: int = 1, **changes
) -> ConversionContext:
    """A context for ``geom``; ``changes`` override fields (``lora`` defaults to rank 6, alpha 9 for kind='lora')."""
    lora = LoraSpec(rank=6, alpha=9.0, target_modules=geom.targets) if kind == "lora" else None
    fields = dict(
        arch=geom.arch,
        tie_word_embeddings=geom.tie,
        num_experts=geom.num_experts,
        moe_ffn_hidden_size=geom.moe_ffn_hidden_size,
        num_layers=geom.num_layers,
        hidden_size=geom.hidden_size,
        num_attention_heads=geom.num_heads,
        num_query_groups=geom.num_query_groups,
        head_dim=geom.head_dim,
        ffn_hidden_size=geom.ffn_hidden_size,
        vocab_size=geom.vocab_size,
        padded_vocab_size=geom.padded_vocab_size,
        kind=kind,
        lora=lora,
        tp_size=tp,
        pp_size=pp,
        linear_layers=geom.linear_layers,
        linear_attention=geom.linear_attention(),
        shared_expert_size=geom.shared_expert_size,
    )
    fields.update(changes)
    return ConversionContext(**fields)


# -- naming table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("decoder.layers.3.self_attention.linear_qkv.weight", ParamKey(Slot.QKV, Role.WEIGHT, 3)),
        ("module.module.decoder.layers.0.mlp.linear_fc2.weight", ParamKey(Slot.FC2, Role.WEIGHT, 0)),
        ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", ParamKey(Slot.INPUT_NORM, Role.WEIGHT, 1)),
        ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", ParamKey(Slot.POST_NORM, Role.WEIGHT, 1)),
        ("decoder.layers.2.pre_mlp_layernorm.weight", ParamKey(Slot.POST_NORM, Role.WEIGHT, 2)),
        # PEFT's LoraParallelLinear on Megatron
        ("decoder.layers.0.self_attention.linear_proj.base_layer.weight", ParamKey(Slot.PROJ, Role.WEIGHT, 0)),
        ("decoder.layers.0.self_attention.linear_proj.lora_A.default.weight", ParamKey(Slot.PROJ, Role.LORA_A, 0)),
        ("decoder.layers.0.self_attention.linear_proj.lora_B.weight", ParamKey(Slot.PROJ, Role.LORA_B, 0)),
        # NeMo / Megatron-Bridge
        ("decoder.layers.5.mlp.linear_fc1.to_wrap.weight", ParamKey(Slot.FC1, Role.WEIGHT, 5)),
        ("decoder.layers.5.mlp.linear_fc1.adapter.linear_in.weight", ParamKey(Slot.FC1, Role.LORA_A, 5)),
        ("decoder.layers.5.mlp.linear_fc1.adapter.linear_out.weight", ParamKey(Slot.FC1, Role.LORA_B, 5)),
        ("embedding.word_embeddings.weight", ParamKey(Slot.EMBEDDING, Role.WEIGHT)),
        # Qwen2 / Qwen3 / Qwen3-MoE
        ("decoder.layers.2.self_attention.linear_qkv.bias", ParamKey(Slot.QKV, Role.BIAS, 2)),
        ("decoder.layers.2.self_attention.linear_qkv.base_layer.bias", ParamKey(Slot.QKV, Role.BIAS, 2)),
        ("decoder.layers.1.self_attention.q_layernorm.weight", ParamKey(Slot.Q_NORM, Role.WEIGHT, 1)),
        ("decoder.layers.1.self_attention.k_layernorm.weight", ParamKey(Slot.K_NORM, Role.WEIGHT, 1)),
        ("decoder.layers.0.mlp.router.weight", ParamKey(Slot.ROUTER, Role.WEIGHT, 0)),
        (
            "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
            ParamKey(Slot.EXPERT_FC1, Role.WEIGHT, 0, 3),
        ),
        (
            "decoder.layers.4.mlp.experts.local_experts.11.linear_fc2.weight",
            ParamKey(Slot.EXPERT_FC2, Role.WEIGHT, 4, 11),
        ),
        # TEGroupedMLP (moe_grouped_gemm=True): one weight<i> per local expert
        ("decoder.layers.0.mlp.experts.linear_fc1.weight5", ParamKey(Slot.EXPERT_FC1, Role.WEIGHT, 0, 5)),
        ("decoder.layers.0.mlp.experts.linear_fc2.weight0", ParamKey(Slot.EXPERT_FC2, Role.WEIGHT, 0, 0)),
        (
            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.lora_A.weight",
            ParamKey(Slot.EXPERT_FC1, Role.LORA_A, 0, 1),
        ),
        ("output_layer.weight", ParamKey(Slot.OUTPUT, Role.WEIGHT)),
        # Gated-DeltaNet (local and Transformer-Engine specs) and Qwen3-Next's gated shared expert
        ("decoder.layers.0.self_attention.in_proj.weight", ParamKey(Slot.GDN_IN_PROJ, Role.WEIGHT, 0)),
        ("decoder.layers.0.self_attention.in_proj.lora_A.weight", ParamKey(Slot.GDN_IN_PROJ, Role.LORA_A, 0)),
        (
            "decoder.layers.0.self_attention.in_proj.adapter.linear_out.weight",
            ParamKey(Slot.GDN_IN_PROJ, Role.LORA_B, 0),
        ),
        ("decoder.layers.2.self_attention.in_proj.layer_norm_weight", ParamKey(Slot.INPUT_NORM, Role.WEIGHT, 2)),
        ("decoder.layers.0.self_attention.conv1d.weight", ParamKey(Slot.GDN_CONV, Role.WEIGHT, 0)),
        ("decoder.layers.0.self_attention.A_log", ParamKey(Slot.GDN_A_LOG, Role.WEIGHT, 0)),
        ("decoder.layers.0.self_attention.dt_bias", ParamKey(Slot.GDN_DT_BIAS, Role.WEIGHT, 0)),
        ("decoder.layers.0.self_attention.out_norm.weight", ParamKey(Slot.GDN_NORM, Role.WEIGHT, 0)),
        ("decoder.layers.0.self_attention.out_proj.weight", ParamKey(Slot.GDN_OUT_PROJ, Role.WEIGHT, 0)),
        ("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", ParamKey(Slot.SHARED_FC2, Role.WEIGHT, 1)),
        ("decoder.layers.1.mlp.shared_experts.gate_weight", ParamKey(Slot.SHARED_GATE, Role.WEIGHT, 1)),
    ],
)
def test_naming_table_accepts_every_convention(name, key):
    assert classify(name, DEFAULT_NAMING) == key


def test_unknown_names_ask_for_a_naming_rule_and_rules_extend_the_table():
    name = "decoder.layers.0.self_attention.linear_qkv.my_lora.down.weight"
    with pytest.raises(ConversionError, match="NamingRule"):
        classify(name, DEFAULT_NAMING)
    extended = DEFAULT_NAMING + (
        NamingRule(
            r"decoder\.layers\.(?P<layer>\d+)\.self_attention\.linear_qkv\.my_lora\.down\.weight", Slot.QKV, Role.LORA_A
        ),
    )
    assert classify(name, extended) == ParamKey(Slot.QKV, Role.LORA_A, 0)
    with pytest.raises(ConversionError, match="bias"):  # add_bias_linear: no architecture here has it
        classify("decoder.layers.0.self_attention.linear_proj.bias", DEFAULT_NAMING)
    # a shared expert is classified (Qwen3-Next converts it; other architectures refuse it by name)
    shared = classify("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", DEFAULT_NAMING)
    assert shared == ParamKey(Slot.SHARED_FC1, Role.WEIGHT, 0)
    with pytest.raises(ConversionError, match="legacy GroupedMLP"):
        classify("decoder.layers.0.mlp.experts.weight1", DEFAULT_NAMING)


# -- layouts against explicit oracles --------------------------------------------------------

geometries = st.tuples(
    st.sampled_from([1, 2, 4]),  # tp
    st.integers(1, 3),  # query groups per TP rank
    st.integers(1, 4),  # query heads per group
    st.sampled_from([2, 4]),  # head_dim
    st.sampled_from([0, 1, 3]),  # trailing dim (hidden, or a LoRA rank); 0: none (the q/k/v bias)
)


@settings(max_examples=40, deadline=None)
@given(geometries)
def test_qkv_deinterleave_matches_per_head_oracle(g):
    tp, groups_per_rank, heads_per_group, hd, rest = g
    groups = tp * groups_per_rank
    heads = groups * heads_per_group
    ctx = _ctx(
        Geometry(hidden_size=heads * hd, num_heads=heads, num_query_groups=groups, ffn_hidden_size=4 * tp),
        kind="full",
        tp=tp,
        padded_vocab_size=256,
    )
    trailing = (rest,) if rest else ()
    q = torch.randn(heads * hd, *trailing)
    k = torch.randn(groups * hd, *trailing)
    v = torch.randn(groups * hd, *trailing)

    def head(t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i * hd : (i + 1) * hd]

    # Megatron's layout, spelled out: TP rank r holds groups [r*gpr, (r+1)*gpr); each group is
    # its query heads, then its key head, then its value head
    shards = []
    for r in range(tp):
        rows = []
        for grp in range(r * groups_per_rank, (r + 1) * groups_per_rank):
            rows += [head(q, grp * heads_per_group + j) for j in range(heads_per_group)]
            rows += [head(k, grp), head(v, grp)]
        shards.append(torch.cat(rows))
    gathered = torch.cat(shards)
    got = split_qkv(gathered, ctx)
    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v), strict=False))
    assert torch.equal(merge_qkv(q, k, v, ctx), gathered)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 5), st.sampled_from([1, 3]))
def test_fc1_split_matches_per_shard_oracle(tp, per_rank, rest):
    ffn = tp * per_rank
    ctx = _ctx(Geometry(ffn_hidden_size=ffn, num_heads=4, num_query_groups=4), kind="full", tp=tp)
    gate, up = torch.randn(ffn, rest), torch.randn(ffn, rest)
    # each TP rank's local linear_fc1 is [its gate rows; its up rows]
    gathered = torch.cat([torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]) for r in range(tp)])
    got_gate, got_up = split_fc1(gathered, ctx)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    assert torch.equal(merge_fc1(gate, up, ctx), gathered)


# -- the plan names what HF and PEFT name ----------------------------------------------------


def test_plan_names_and_shapes_are_hf_and_peft_s_own():
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    from colosync.testing import tiny_llama_config

    geom = Geometry(num_layers=2)
    config = tiny_llama_config(
        vocab_size=geom.vocab_size,
        hidden_size=geom.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=geom.num_heads,
        num_key_value_heads=geom.num_query_groups,
        intermediate_size=geom.ffn_hidden_size,
    )
    model = LlamaForCausalLM(config)
    hf = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert {n: tuple(s) for n, s, _ in hf_specs(_ctx(geom, kind="full", tp=2))} == hf
    peft_model = get_peft_model(model, LoraConfig(r=5, lora_alpha=7, target_modules=list(ALL_TARGETS)))
    adapter = {n: tuple(t.shape) for n, t in get_peft_model_state_dict(peft_model).items()}
    lora = LoraSpec(rank=5, alpha=7.0, target_modules=ALL_TARGETS)
    assert {n: tuple(s) for n, s, _ in hf_specs(_ctx(geom, lora=lora, tp=2))} == adapter


def test_pipeline_stage_offsets_give_global_layers():
    ctx = _ctx(Geometry(num_layers=5), kind="full", pp=2, stage_layers=(3, 2))
    layers = {(it.layer, it.stage, it.local_layer) for it in plan(ctx) if it.layer is not None}
    assert layers == {(i, 0 if i < 3 else 1, i if i < 3 else i - 3) for i in range(5)}
    assert {it.stage for it in plan(ctx) if it.slot is Slot.EMBEDDING} == {0}
    assert {it.stage for it in plan(ctx) if it.slot in (Slot.OUTPUT, Slot.FINAL_NORM)} == {1}


# -- the context ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"lora": LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))}, "k_proj"),
        ({"lora": LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "lm_head"))}, "lm_head"),
        ({"tp_size": 8}, "whole query groups"),
        ({"padded_vocab_size": 249}, "padded_vocab_size"),
        ({"pp_size": 3}, "stage_layers"),
        ({"lora": None}, "LoraSpec"),
    ],
)
def test_context_rejects_what_would_convert_wrongly(changes, match):
    with pytest.raises(ConversionError, match=match):
        _ctx(**changes)


def test_context_from_real_transformer_config_rejects_unsupported_architecture():
    from megatron_helpers import transformer_config

    config = transformer_config(Geometry(), tp=2, pp=2)
    ctx = ConversionContext.from_megatron(config, 250, 256, "full", None, False)
    assert (ctx.tp_size, ctx.pp_size, ctx.stage_layers, ctx.head_dim) == (2, 2, (2, 2), 8)
    with pytest.raises(ConversionError, match="add_bias_linear"):
        ConversionContext.from_megatron(
            dataclasses.replace(config, add_bias_linear=True), 250, 256, "full", None, False
        )


def test_no_kwargs_anywhere_on_the_conversion_path():
    """Context cannot be dropped by a stage that forwards **kwargs: there is no such stage."""
    offenders, inspected = [], set()
    for module in (
        megatron,
        megatron_checks,
        megatron_groups,
        layout_base,
        layout_naming,
        layout_context,
        layout_layout,
    ):
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [(name, obj)] + (
                [(f"{name}.{m}", f) for m, f in vars(obj).items()] if inspect.isclass(obj) else []
            )
            for qual, fn in members:
                fn = inspect.unwrap(getattr(fn, "__func__", fn))
                if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                    inspected.add(qual)
                    try:
                        params = inspect.signature(fn).parameters.values()
                    except (TypeError, ValueError):
                        continue
                    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                        offenders.append(f"{module.__name__}.{qual}")
    assert {
        "convert",
        "plan",
        "split_qkv",
        "MegatronSource.push",
        "MegatronSource.tensors",
        "MegatronSource._bring",
    } <= inspected
    assert not offenders


def test_context_is_immutable():
    ctx = _ctx()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.lora = None  # type: ignore[misc]  # deliberately assigning to a frozen dataclass


# -- the context's journey through the Sender, single process --------------------------------


@pytest.fixture(scope="module")
def reference():
    return make_reference(Geometry(num_layers=2), lora_rank=6, lora_alpha=9.0, seed=5)


def _source(
    ctx: ConversionContext, reference: dict, convention: str = "peft", geom: Geometry = DEFAULT_GEOMETRY
) -> MegatronSource:
    named = megatron_named(
        ctx if ctx.kind == "full" else dataclasses.replace(ctx, kind="full", lora=None),
        reference["full"],
        vocab_pad(geom),
    )
    if ctx.kind == "lora":
        named.update(megatron_named(ctx, {**reference["full"], **reference["lora"]}, vocab_pad(geom), convention))
    return MegatronSource(module_from_named(named), ctx, ParallelGroups())


@settings(max_examples=12, deadline=None)
@given(bucket_bytes=st.sampled_from([64, 256, 1024, 4096, 1 << 14, 1 << 30]), kind=st.sampled_from(["lora", "full"]))
def test_context_reaches_every_bucket_and_stream_is_exact(reference, bucket_bytes, kind):
    ctx = _ctx(
        Geometry(num_layers=2),
        kind=kind,
        lora=None if kind == "full" else LoraSpec(rank=6, alpha=9.0, target_modules=ALL_TARGETS),
    )
    source = _source(ctx, reference)
    target = RecordingTarget(reference["full"])
    begun, flushed = [], []

    class Watch(LocalLink):  # what the engine is told: the manifest once, then one Stage per bucket chunk
        def submit(self, request):
            from colosync.wire.protocol import Begin, Stage

            if isinstance(request, Begin):
                begun.append(request.manifest)
            if isinstance(request, Stage):
                flushed.append((request.update_id, request.bucket))
            return super().submit(request)

    receiver = Receiver(target)
    with Sender(Watch(receiver), transport="shm", bucket_bytes=bucket_bytes) as sender:
        report = source.push(sender)
    receiver.close()
    expected = reference["lora"] if kind == "lora" else reference["full"]
    (manifest,) = begun
    assert target.manifests == [manifest] and receiver.committed_update_id == report.update_id
    assert manifest.lora == ctx.lora  # the context's own spec; None for a full update
    assert {b for _, b in flushed} == set(range(len(manifest.bucket_sizes)))
    assert {u for u, _ in flushed} == {manifest.update_id}
    if bucket_bytes == 64:
        assert len(manifest.bucket_sizes) == len(expected)  # a flush after every single tensor
    for bucket in range(len(manifest.bucket_sizes)):
        for meta in manifest.layout.bucket_tensors(bucket):
            if kind == "lora":  # each bucket's adapter halves have the context's rank
                assert (meta.shape[0] if ".lora_A." in meta.name else meta.shape[1]) == ctx.lora.rank == 6
    if kind == "lora":
        assert (manifest.lora.rank, manifest.lora.alpha) == (6, 9.0)
    assert list(target.committed) == [name for name, _, _ in hf_specs(ctx)]
    assert set(target.committed) == set(expected)
    assert all(torch.equal(target.committed[n], t) for n, t in expected.items())


def test_wrong_rank_in_context_is_refused_before_anything_moves(reference):
    good = _source(_ctx(Geometry(num_layers=2)), reference)
    named = dict(good._local[k] for k in good._local)
    wrong = _ctx(Geometry(num_layers=2), lora=LoraSpec(rank=8, alpha=9.0, target_modules=ALL_TARGETS))
    with pytest.raises(ConversionError, match="lora rank 8 from the LoraSpec"):
        MegatronSource(module_from_named(named), wrong, ParallelGroups())


def test_adapters_must_match_target_modules(reference):
    good = _source(_ctx(Geometry(num_layers=2)), reference)
    named = dict(good._local[k] for k in good._local)
    fewer = LoraSpec(rank=6, alpha=9.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(ConversionError, match="not among the LoraSpec's target_modules"):
        MegatronSource(module_from_named(named), _ctx(Geometry(num_layers=2), lora=fewer), ParallelGroups())
    without_fc2 = {n: t for n, t in named.items() if not ("linear_fc2" in n and "lora" in n)}
    with pytest.raises(ConversionError, match="down_proj"):
        MegatronSource(module_from_named(without_fc2), _ctx(Geometry(num_layers=2)), ParallelGroups())


def test_fused_parts_with_different_lora_a_cannot_be_expressed():
    ctx = _ctx(Geometry(num_layers=1))
    item = next(it for it in plan(ctx) if it.slot is Slot.QKV and it.role is Role.LORA_A)
    hf = {out.name: torch.randn(out.shape) for out in item.outputs}
    with pytest.raises(ConversionError, match="shares one lora_A"):
        megatron_layout.to_megatron(item, hf, ctx)


# -- architectures ----------------------------------------------------------------------------

ARCHS = sorted(GEOMETRIES)


def _arch_geom(arch: str, layers: int = 2) -> Geometry:
    return dataclasses.replace(GEOMETRIES[arch], num_layers=layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_names_and_shapes_are_each_architecture_s_own(arch):
    """Full: exactly the HF model's state dict (a tied lm_head excepted); LoRA: exactly PEFT's adapter."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    geom = _arch_geom(arch)
    model = hf_class(geom)(hf_config(geom))
    hf = {n: tuple(t.shape) for n, t in model.state_dict().items() if not (geom.tie and n == "lm_head.weight")}
    assert {n: tuple(s) for n, s, _ in hf_specs(_ctx(geom, kind="full", tp=2))} == hf
    peft_model = get_peft_model(model, LoraConfig(r=5, lora_alpha=7, target_modules=list(geom.targets)))
    adapter = {n: tuple(t.shape) for n, t in get_peft_model_state_dict(peft_model).items()}
    lora = LoraSpec(rank=5, alpha=7.0, target_modules=geom.targets)
    assert {n: tuple(s) for n, s, _ in hf_specs(_ctx(geom, lora=lora, tp=2))} == adapter


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize(("tp", "ep", "etp"), [(2, 1, 2), (2, 2, 1), (4, 2, 2)])
def test_to_megatron_then_convert_is_identity(arch, kind, tp, ep, etp):
    geom = _arch_geom(arch)
    moe = dict(ep_size=ep, expert_tp_size=etp) if geom.num_experts else {}
    ctx = _ctx(geom, kind=kind, tp=tp, **moe)
    gen = torch.Generator().manual_seed(1)
    for item in plan(ctx):
        # on a 2^-16 grid: a zero-centered norm's shift by one (Qwen3.5) is then exact both ways
        hf = {out.name: torch.randn(out.shape, generator=gen).mul(65536).round().div(65536) for out in item.outputs}
        if item.role is Role.LORA_A:  # a fused module's parts share one lora_A
            hf = dict.fromkeys(hf, next(iter(hf.values())))
        full = megatron_layout.to_megatron(item, hf, ctx, pad=torch.randn(64, geom.hidden_size, generator=gen))
        assert tuple(full.shape) == item.shape
        back = dict(megatron_layout.convert(item, full, ctx))
        assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf), item.describe()
        again = megatron_layout.to_megatron(item, back, ctx, pad=full[ctx.vocab_size :])
        assert torch.equal(again, full), item.describe()  # and the other way round


@pytest.mark.parametrize(("etp", "ep"), [(1, 1), (2, 1), (2, 2), (4, 4)])
def test_expert_layout_matches_per_expert_per_shard_oracle(etp, ep):
    """Megatron's experts, spelled out: expert e on EP rank e // (E/EP); each expert-TP shard
    of its fc1 is [gate rows of the shard; up rows of the shard]; HF fuses [gate; up] per expert."""
    geom = GEOMETRIES["qwen3_moe"]
    ctx = _ctx(geom, kind="full", tp=etp, ep_size=ep, expert_tp_size=etp)
    e, f, h = geom.num_experts, geom.moe_ffn_hidden_size, geom.hidden_size
    gate, up = torch.randn(e, f, h), torch.randn(e, f, h)
    down = torch.randn(e, h, f)
    hf_gate_up = torch.cat([gate, up], dim=1)
    fc1 = next(it for it in plan(ctx) if it.slot is Slot.EXPERT_FC1)
    fc2 = next(it for it in plan(ctx) if it.slot is Slot.EXPERT_FC2)
    per = e // ep
    for ep_rank in range(ep):
        for t in range(etp):
            local1 = megatron_layout.local_params(
                fc1, megatron_layout.experts_from_hf(hf_gate_up, ctx), ctx, t, ep_rank
            )
            local2 = megatron_layout.local_params(fc2, down, ctx, t, ep_rank)
            for i in range(per):
                g = ep_rank * per + i
                rows = slice(t * f // etp, (t + 1) * f // etp)
                assert torch.equal(local1[fc1.expert_key(i)], torch.cat([gate[g, rows], up[g, rows]]))
                assert torch.equal(local2[fc2.expert_key(i)], down[g][:, rows])
    # and HF's own forward reads gate_up_proj as [gate; up]
    assert torch.equal(hf_gate_up[0].chunk(2)[0], gate[0])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_each_architecture_streams_exactly_through_the_sender(arch, kind):
    geom = _arch_geom(arch)
    reference = make_reference(geom, lora_rank=6, lora_alpha=9.0, seed=5)
    ctx = _ctx(geom, kind=kind)
    source = _source(ctx, reference, geom=geom)
    target = RecordingTarget(reference["full"])
    receiver = Receiver(target)
    with Sender(LocalLink(receiver), transport="shm", bucket_bytes=1024) as sender:
        source.push(sender)
    receiver.close()
    expected = reference[kind]
    assert list(target.committed) == [name for name, _, _ in hf_specs(ctx)]
    assert set(target.committed) == set(expected)
    assert all(torch.equal(target.committed[n], t) for n, t in expected.items())


def _real_config(arch: str, **changes):
    from megatron_helpers import transformer_config

    config = transformer_config(GEOMETRIES[arch], tp=2, pp=1)
    for attr, value in changes.items():  # set after __post_init__: these flags are validated by Megatron too
        object.__setattr__(config, attr, value)
    return config


@pytest.mark.parametrize(
    ("arch", "changes", "match"),
    [
        ("llama", {"add_qkv_bias": True}, r"add_qkv_bias=True.*use arch='qwen2'"),
        ("qwen2", {"qk_layernorm": True}, r"qk_layernorm=True.*use arch='qwen3'"),
        ("qwen3", {"num_moe_experts": 8}, r"num_moe_experts=8.*use arch='qwen3_moe'"),
        ("qwen3_moe", {"num_moe_experts": None}, r"num_moe_experts=None"),
        ("qwen3_moe", {"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size"),
        ("qwen3_moe", {"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
        ("qwen3", {"experimental_attention_variant": "gated_delta_net"}, r"gated_delta_net.*use arch='qwen3_5'"),
        ("qwen3", {"attention_output_gate": True}, r"attention_output_gate=True.*use arch='qwen3_5'"),
        ("qwen3_5", {"attention_output_gate": False}, "attention_output_gate=False"),
        ("qwen3_5", {"num_moe_experts": 8}, "num_moe_experts=8"),
        ("qwen3", {"multi_latent_attention": True}, "MLA"),
    ],
)
def test_from_megatron_refuses_what_the_architecture_does_not_convert(arch, changes, match):
    geom = GEOMETRIES[arch]
    with pytest.raises(ConversionError, match=match):
        ConversionContext.from_megatron(_real_config(arch, **changes), 250, 256, "full", None, geom.tie, arch=arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_from_megatron_reads_each_architecture(arch):
    geom = GEOMETRIES[arch]
    ctx = ConversionContext.from_megatron(_real_config(arch), 250, 256, "full", None, geom.tie, arch=arch)
    assert (ctx.arch, ctx.num_experts, ctx.moe_ffn_hidden_size, ctx.tie_word_embeddings) == (
        arch,
        geom.num_experts,
        geom.moe_ffn_hidden_size,
        geom.tie,
    )
    assert ctx.expert_tp_size == ctx.tp_size == 2
    assert ctx.linear_layers == geom.linear_layers  # the GDN layers, by megatron-core's linear_attention_freq
    assert ctx.linear_attention == geom.linear_attention()


@pytest.mark.parametrize(
    ("arch", "match"),
    [("qwen2_moe", "gated shared expert"), ("deepseek_v3", "multi-latent attention"), ("gpt9", "unknown")],
)
def test_unsupported_architectures_are_refused_by_name(arch, match):
    with pytest.raises(ConversionError, match=match):
        _ctx(kind="full", arch=arch)


def test_lora_on_experts_is_refused_by_name():
    geom = GEOMETRIES["qwen3_moe"]
    with pytest.raises(ConversionError, match="LoRA on routed experts is refused"):
        _ctx(geom, lora=LoraSpec(rank=4, alpha=8.0, target_modules=ALL_TARGETS))
    # an adapter found on an expert's linear is refused before anything moves
    reference = make_reference(_arch_geom("qwen3_moe"), lora_rank=6, lora_alpha=9.0, seed=5)
    ctx = _ctx(_arch_geom("qwen3_moe"))
    named = dict(_source(ctx, reference, geom=_arch_geom("qwen3_moe"))._local.values())
    named["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.lora_A.weight"] = torch.zeros(6, 64)
    with pytest.raises(ConversionError, match="LoRA on a routed expert"):
        MegatronSource(module_from_named(named), ctx, ParallelGroups())


@pytest.mark.parametrize(
    ("model_arch", "ctx_arch", "match"),
    [
        ("qwen2", "llama", "use arch='qwen2'"),
        ("qwen3", "qwen2", "use arch='qwen3'"),
        ("qwen3_moe", "qwen3", "use arch='qwen3_moe'"),
        ("qwen3_5", "qwen3", "use arch='qwen3_5'"),
        ("qwen3_next", "qwen3_moe", "use arch='qwen3_next'"),
    ],
)
def test_a_tensor_the_architecture_would_drop_is_refused_by_name(model_arch, ctx_arch, match):
    """A context of the wrong architecture would silently drop a tensor (a bias, a norm, the
    experts): the source refuses the model's parameter by name before anything moves."""
    geom = _arch_geom(model_arch)
    reference = make_reference(geom, lora_rank=6, lora_alpha=9.0, seed=5)
    named = dict(_source(_ctx(geom, kind="full"), reference, geom=geom)._local.values())
    moe = ctx_arch == "qwen3_moe"
    wrong_geom = dataclasses.replace(
        geom,
        arch=ctx_arch,
        num_experts=geom.num_experts if moe else 0,
        moe_ffn_hidden_size=geom.moe_ffn_hidden_size if moe else 0,
        shared_expert_size=0,
        linear_freq=0,
    )
    wrong = _ctx(wrong_geom, kind="full")
    with pytest.raises(ConversionError, match=match):
        MegatronSource(module_from_named(named), wrong, ParallelGroups())


def test_context_checks_expert_geometry():
    geom = GEOMETRIES["qwen3_moe"]
    with pytest.raises(ConversionError, match="ep_size=3 must divide num_experts=4"):
        _ctx(geom, kind="full", ep_size=3)
    with pytest.raises(ConversionError, match="expert_tp_size=3"):
        _ctx(geom, kind="full", expert_tp_size=3)
    with pytest.raises(ConversionError, match="has no routed experts"):
        _ctx(GEOMETRIES["qwen3"], kind="full", num_experts=4)


# -- Gated-DeltaNet hybrids (Qwen3.5) ------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_layout_matches_per_shard_oracle(tp):
    """megatron-core's GatedDeltaNet, spelled out: TP shard t of in_proj is [q_t; k_t; v_t; z_t; b_t; a_t]
    (its forward splits the *local* output so), of conv1d [q_t; k_t; v_t]; HF has in_proj_qkv = [q; k; v],
    in_proj_z/b/a and one conv1d over [q; k; v]; A_log / dt_bias are split by value heads."""
    geom = _arch_geom("qwen3_5")
    ctx = _ctx(geom, kind="full", tp=tp)
    la, h = geom.linear_attention(), geom.hidden_size
    q, k = torch.randn(la.qk_dim, h), torch.randn(la.qk_dim, h)
    v, z = torch.randn(la.v_dim, h), torch.randn(la.v_dim, h)
    b, a = torch.randn(la.num_value_heads, h), torch.randn(la.num_value_heads, h)
    conv = torch.randn(la.conv_dim, 1, la.conv_kernel)
    hf = {
        "model.layers.0.linear_attn.in_proj_qkv.weight": torch.cat([q, k, v]),
        "model.layers.0.linear_attn.in_proj_z.weight": z,
        "model.layers.0.linear_attn.in_proj_b.weight": b,
        "model.layers.0.linear_attn.in_proj_a.weight": a,
        "model.layers.0.linear_attn.conv1d.weight": conv,
    }
    items = {it.slot: it for it in plan(ctx) if it.layer == 0}
    in_proj = megatron_layout.to_megatron(items[Slot.GDN_IN_PROJ], hf, ctx)
    conv1d = megatron_layout.to_megatron(items[Slot.GDN_CONV], hf, ctx)
    cq, ck, cv = conv.split([la.qk_dim, la.qk_dim, la.v_dim])
    for t in range(tp):
        mine = megatron_layout.shard(in_proj, items[Slot.GDN_IN_PROJ].split, tp, t)
        want = torch.cat([x.chunk(tp)[t] for x in (q, k, v, z, b, a)])
        assert torch.equal(mine, want), t
        mine_conv = megatron_layout.shard(conv1d, items[Slot.GDN_CONV].split, tp, t)
        assert torch.equal(mine_conv, torch.cat([x.chunk(tp)[t] for x in (cq, ck, cv)])), t
    assert items[Slot.GDN_A_LOG].split is Split.ROWS and items[Slot.GDN_DT_BIAS].split is Split.ROWS
    assert items[Slot.GDN_NORM].split is Split.NONE


def test_gated_attention_q_proj_matches_per_head_oracle():
    """Megatron's gated linear_qkv groups [q heads; gate heads; k; v] per query group; HF's
    q_proj holds [q_h; gate_h] per head (its forward chunks each head's 2 * head_dim rows)."""
    geom = _arch_geom("qwen3_5")
    ctx = _ctx(geom, kind="full", tp=2)
    g, n, hd, h = geom.num_query_groups, geom.num_heads // geom.num_query_groups, geom.head_dim, geom.hidden_size
    qkv = torch.randn(g * (2 * n + 2) * hd, h)
    q_proj, k_proj, v_proj = split_qkv(qkv, ctx)
    assert q_proj.shape == (g * n * 2 * hd, h)
    for group in range(g):
        block = qkv[group * (2 * n + 2) * hd : (group + 1) * (2 * n + 2) * hd]
        for i in range(n):
            head = q_proj[(group * n + i) * 2 * hd : (group * n + i + 1) * 2 * hd]
            assert torch.equal(head[:hd], block[i * hd : (i + 1) * hd])  # the query
            assert torch.equal(head[hd:], block[(n + i) * hd : (n + i + 1) * hd])  # its gate
        assert torch.equal(k_proj[group * hd : (group + 1) * hd], block[2 * n * hd : (2 * n + 1) * hd])
        assert torch.equal(v_proj[group * hd : (group + 1) * hd], block[(2 * n + 1) * hd :])
    assert torch.equal(merge_qkv(q_proj, k_proj, v_proj, ctx), qkv)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_zero_centered_norms_shift_where_megatron_and_hf_disagree(zero_centered):
    """HF Qwen3.5's layer norms are (1 + w), its GDN norm w; Megatron's are all (1 + w) exactly
    when layernorm_zero_centered_gamma. The effective scale must survive the conversion."""
    geom = _arch_geom("qwen3_5")
    ctx = _ctx(geom, kind="full", zero_centered_gamma=zero_centered)
    megatron_shift = 1.0 if zero_centered else 0.0
    for item in plan(ctx):
        if item.slot not in (Slot.INPUT_NORM, Slot.Q_NORM, Slot.FINAL_NORM, Slot.GDN_NORM):
            continue
        m = torch.full(item.shape, 0.75)
        ((_, w),) = megatron_layout.convert(item, m, ctx)
        hf_shift = 0.0 if item.slot is Slot.GDN_NORM else 1.0
        assert torch.equal(w + hf_shift, m + megatron_shift), item.describe()


def test_gdn_lora_on_in_proj_shares_lora_a_and_splits_lora_b_per_shard():
    """LoRA on GDN in_proj: one lora_A for in_proj_qkv/z/b/a, lora_B split per TP shard like the weight."""
    geom = _arch_geom("qwen3_5")
    ctx = _ctx(geom, tp=2)
    items = [it for it in plan(ctx) if it.slot is Slot.GDN_IN_PROJ]
    assert {it.layer for it in items} == set(geom.linear_layers)
    lora_a, lora_b = (next(it for it in items if it.role is r) for r in (Role.LORA_A, Role.LORA_B))
    assert lora_a.split is Split.NONE and lora_b.split is Split.ROWS
    assert [o.name.split(".")[-3] for o in lora_a.outputs] == ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    a = torch.randn(lora_a.shape)
    assert all(t is a for _, t in megatron_layout.convert(lora_a, a, ctx))
    with pytest.raises(ConversionError, match="List all of"):
        _ctx(geom, lora=LoraSpec(rank=4, alpha=8.0, target_modules=("in_proj_qkv", "in_proj_z")))
    with pytest.raises(ConversionError, match="has no Gated-DeltaNet layers"):
        _ctx(GEOMETRIES["qwen3"], kind="full", linear_layers=(0,))
    with pytest.raises(ConversionError, match="must divide the Gated-DeltaNet heads"):
        _ctx(geom, kind="full", tp=8, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=96 + 8)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_grouped_gdn_in_proj_is_what_hf_qwen3_next_ungroups(tp):
    """Qwen3-Next: HF's own ``fix_query_key_value_ordering`` applied to the converted in_proj_qkvz /
    in_proj_ba gives back, per output feature, exactly Megatron's q, k, v, z, b, a sections."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    geom = GEOMETRIES["qwen3_next"]
    ctx = _ctx(geom, kind="full", tp=tp)
    la, h = geom.linear_attention(), geom.hidden_size
    q, k = torch.randn(la.qk_dim, h), torch.randn(la.qk_dim, h)
    v, z = torch.randn(la.v_dim, h), torch.randn(la.v_dim, h)
    b, a = torch.randn(la.num_value_heads, h), torch.randn(la.num_value_heads, h)
    sections = [(q, k, v, z, b, a)[i].chunk(tp)[t] for t in range(tp) for i in range(6)]
    megatron = torch.cat(sections)  # per TP shard [q_t; k_t; v_t; z_t; b_t; a_t]
    item = next(it for it in plan(ctx) if it.slot is Slot.GDN_IN_PROJ)
    converted = dict(megatron_layout.convert(item, megatron, ctx))
    qkvz, ba = (converted[f"model.layers.0.linear_attn.{p}.weight"] for p in ("in_proj_qkvz", "in_proj_ba"))
    gdn = Qwen3NextGatedDeltaNet(hf_config(geom), layer_idx=0)
    got = gdn.fix_query_key_value_ordering(qkvz.t()[None], ba.t()[None])  # the "tokens" are the hidden dims
    for name, hf_part, want in zip("qkvzba", got, (q, k, v, z, b, a), strict=True):
        assert torch.equal(hf_part[0].reshape(h, -1).t(), want), name
    assert torch.equal(megatron_layout.to_megatron(item, converted, ctx), megatron)


def test_qwen3_next_lora_on_experts_is_refused_by_name():
    """Qwen3-Next: LoRA on the shared expert's gate/up/down (as on routed experts) is refused, in the
    LoraSpec and when an adapter is found on the shared expert's linear."""
    geom = GEOMETRIES["qwen3_next"]
    with pytest.raises(ConversionError, match="LoRA on routed or shared experts is refused"):
        _ctx(geom, lora=LoraSpec(rank=4, alpha=8.0, target_modules=geom.targets + ("gate_proj", "up_proj")))
    reference = make_reference(geom, lora_rank=6, lora_alpha=9.0, seed=5)
    ctx = _ctx(geom)
    named = dict(_source(ctx, reference, geom=geom)._local.values())
    named["decoder.layers.0.mlp.shared_experts.linear_fc1.lora_A.weight"] = torch.zeros(6, geom.hidden_size)
    with pytest.raises(ConversionError, match="LoRA on a shared expert"):
        MegatronSource(module_from_named(named), ctx, ParallelGroups())
