"""Rank bodies for the multi-process Megatron source tests (run through ``run_world``).

Each returns plain data (lists, dicts, numbers) to the parent test, which asserts on it;
equality with the reference is checked inside the sending rank, where the tensors are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from colosync.sync.target import EngineTarget

from megatron_helpers import (
    GEOMETRIES,
    Convention,
    Geometry,
    attach_lora,
    build_gpt,
    close,
    hf_model,
    init_megatron,
    load_megatron_tensors,
    local_shards,
    transformer_config,
    vocab_pad,
)


class RecordingTarget(EngineTarget):
    """An EngineTarget that keeps what it was sent, for exact comparison."""

    def __init__(self, full: dict[str, torch.Tensor], max_lora_rank: int | None = None) -> None:
        from colosync.sync.target import ModelSpec, ParamSpec

        params = {n: ParamSpec(tuple(t.shape), t.dtype) for n, t in full.items()}
        linears = {
            n.removesuffix(".weight"): (t.shape[1], t.shape[0])
            for n, t in full.items()
            if t.dim() == 2 and "embed_tokens" not in n
        }
        self.spec = ModelSpec(params, linears, max_lora_rank, torch.float32)
        self.manifests: list[Any] = []
        self.committed: dict[str, torch.Tensor] = {}

    def model_spec(self):
        return self.spec

    def prepare(self, manifest, tensors):
        self.manifests.append(manifest)
        return {n: t.clone() for n, t in tensors.items()}

    def commit(self, prepared, update_id):
        self.committed = prepared

    def discard(self, prepared):
        pass


class FailingLink:
    """A LocalLink whose engine 'dies' at the n-th Stage of an update."""

    def __init__(self, inner: Any, fail_at_stage: int) -> None:
        self.inner, self.fail_at, self.stages = inner, fail_at_stage, 0

    def submit(self, request):
        from colosync.errors import EngineError
        from colosync.sync.link import Done
        from colosync.wire.protocol import Stage

        if isinstance(request, Stage):
            self.stages += 1
            if self.stages == self.fail_at:
                return Done(error=EngineError("engine died mid-update (test)"))
        return self.inner.submit(request)

    def close(self) -> None:
        self.inner.close()


def _setup(tp: int, pp: int, ref: dict[str, Any], convention: Convention, ep: int = 1, etp: int | None = None):
    from megatron.core import parallel_state

    from colosync.sources.megatron_layout import ConversionContext
    from colosync.wire.manifest import LoraSpec

    init_megatron(tp, pp, ep, etp)
    geom = Geometry(**ref.get("geometry", {}))
    config = transformer_config(geom, tp, pp, ep=ep, etp=etp)
    model = build_gpt(config, geom)
    attach_lora(model, ref["rank"], ref["alpha"], convention)
    spec = LoraSpec(rank=ref["rank"], alpha=ref["alpha"], target_modules=geom.targets)
    ctx_lora = ConversionContext.from_megatron(
        config, geom.vocab_size, geom.padded_vocab_size, "lora", spec, geom.tie, arch=geom.arch
    )
    ctx_full = dataclasses.replace(ctx_lora, kind="full", lora=None)
    stage, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    ep_rank, etp_rank = (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )
    hf = {**ref["full"], **ref["lora"]}
    loaded = 0
    for ctx in (ctx_full, ctx_lora):
        shards = local_shards(ctx, stage, tp_rank, hf, vocab_pad(geom), ep_rank, etp_rank)
        loaded += load_megatron_tensors(model, shards, ctx.naming)
    if geom.tie and pp > 1 and parallel_state.is_pipeline_last_stage():
        # the last stage's copy of the tied embedding (Megatron keeps it equal by an all-reduce)
        embedding = torch.cat([ref["full"]["model.embed_tokens.weight"], vocab_pad(geom)])
        with torch.no_grad():
            model.output_layer.weight.copy_(embedding.chunk(tp)[tp_rank])
        loaded += 1
    params = list(model.named_parameters())
    assert loaded == len(params), f"loaded {loaded} of {len(params)} real Megatron parameters: {[n for n, _ in params]}"
    return geom, model, ctx_lora, ctx_full, stage, tp_rank, params


def _push(source: Any, link: Any, bucket_bytes: int) -> Any:
    from colosync.sync.sender import Sender

    if not source.is_sender:
        return source.push(None)
    with Sender(link, transport="shm", bucket_bytes=bucket_bytes) as sender:
        return source.push(sender)


def exactness_worker(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    ref_path: str,
    convention: Convention,
    bucket_sizes: list[int],
    ep: int = 1,
    etp: int | None = None,
    extras: bool = True,
) -> dict[str, Any]:
    """Push LoRA and full weights at every bucket size; compare with the reference exactly.

    ``extras``: also run the laziness, failure and other-sender scenarios.
    """
    from megatron.core import parallel_state

    from colosync.control.link import LocalLink
    from colosync.sources.megatron import MegatronSource, ParallelGroups
    from colosync.sync.receiver import Receiver

    ref = torch.load(ref_path, weights_only=True)
    geom, model, ctx_lora, ctx_full, stage, tp_rank, params = _setup(tp, pp, ref, convention, ep, etp)
    groups = ParallelGroups.from_megatron()
    out: dict[str, Any] = {
        "stage": stage,
        "tp_rank": tp_rank,
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "pushes": [],
        "param_names": [n for n, _ in params],
    }
    for ctx, expected in ((ctx_lora, ref["lora"]), (ctx_full, ref["full"])):
        source = MegatronSource(model, ctx, groups)
        local_bytes = max(
            math_bytes(it.local_shape(ctx.expert_tp_size if it.experts else tp), it.dtype) for it in _mine(ctx, stage)
        )
        for bucket_bytes in bucket_sizes:
            target = RecordingTarget(ref["full"]) if source.is_sender else None
            receiver = Receiver(target) if target else None
            link = LocalLink(receiver) if receiver else None
            report = _push(source, link, bucket_bytes)
            record = {
                "kind": ctx.kind,
                "bucket_bytes": bucket_bytes,
                "is_sender": source.is_sender,
                "replica": min(source.sync_ranks),
                "stats": dataclasses.asdict(source.stats),
                "max_local_shard": local_bytes,
            }
            if source.is_sender:
                receiver.close()
                record.update(_check_received(target, expected, ctx, report))
            out["pushes"].append(record)
    if not extras:
        return out
    out["lazy"] = _laziness(model, ctx_lora, groups)
    out["failure"] = _failure_then_success(model, ctx_lora, groups, ref)
    if pp > 1:
        out["other_sender"] = _push_from_stage(model, ctx_lora, groups, ref, sender_stage=pp - 1)
    return out


def math_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def _mine(ctx: Any, stage: int) -> list[Any]:
    from colosync.sources.megatron_layout import plan

    return [it for it in plan(ctx) if it.stage == stage]


def _check_received(
    target: RecordingTarget, expected: dict[str, torch.Tensor], ctx: Any, report: Any
) -> dict[str, Any]:
    """On the sender: the engine got exactly the reference, and every bucket carries the context."""
    got = target.committed
    assert list(got) == [name for name, _, _ in _specs(ctx)], "the engine saw tensors out of plan order"
    assert set(got) == set(expected), (sorted(set(got) ^ set(expected)))[:6]
    mismatched = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not mismatched, f"{len(mismatched)} tensors differ from the HF/PEFT reference, e.g. {mismatched[:4]}"
    (manifest,) = target.manifests
    if ctx.kind == "lora":
        # the manifest's LoraSpec is the context's, unchanged: rank and alpha survive every flush
        assert manifest.lora == ctx.lora, (manifest.lora, ctx.lora)
        for bucket in range(len(manifest.bucket_sizes)):
            for meta in manifest.layout.bucket_tensors(bucket):
                rank_dim = meta.shape[0] if ".lora_A." in meta.name else meta.shape[1]
                assert rank_dim == manifest.lora.rank == ctx.lora.rank, (bucket, meta.name, meta.shape)
    else:
        assert manifest.lora is None
    return {
        "tensors": len(manifest.tensors),
        "buckets": len(manifest.bucket_sizes),
        "update_id": report.update_id,
        "manifest_rank": manifest.lora.rank if manifest.lora else None,
        "manifest_alpha": manifest.lora.alpha if manifest.lora else None,
    }


def _specs(ctx: Any) -> list[Any]:
    from colosync.sources.megatron_layout import hf_specs

    return hf_specs(ctx)


def _laziness(model: Any, ctx: Any, groups: Any) -> dict[str, int]:
    """How many Megatron tensors had been gathered when the first converted tensor arrived."""
    from colosync.sources.megatron import MegatronSource

    source = MegatronSource(model, ctx, groups)
    stream = source.tensors()
    first = next(stream, None)
    at_first = source.stats.items
    rest = sum(1 for _ in stream)
    return {
        "at_first": at_first if first is not None else -1,
        "total_items": source.stats.items,
        "yielded": (first is not None) + rest,
        "is_sender": source.is_sender,
    }


def _failure_then_success(model: Any, ctx: Any, groups: Any, ref: dict[str, Any]) -> dict[str, Any]:
    """The engine fails mid-update: every rank raises, nobody hangs, and the next push works."""
    from colosync.control.link import LocalLink
    from colosync.errors import ColosyncError
    from colosync.sources.megatron import MegatronSource
    from colosync.sync.receiver import Receiver

    source = MegatronSource(model, ctx, groups)
    target = RecordingTarget(ref["full"]) if source.is_sender else None
    receiver = Receiver(target) if target else None
    link = FailingLink(LocalLink(receiver), fail_at_stage=3) if receiver else None
    raised = None
    try:
        _push(source, link, 256)
    except ColosyncError as exc:
        raised = type(exc).__name__
    result: dict[str, Any] = {"raised": raised}
    if source.is_sender:
        result["committed_after_failure"] = receiver.committed_update_id
        result["stages_before_failure"] = link.stages
        _push(source, LocalLink(receiver), 1 << 20)
        result["committed_after_retry"] = receiver.committed_update_id
        result["retry_equal"] = all(torch.equal(target.committed[n], t) for n, t in ref["lora"].items())
        receiver.close()
    else:
        _push(source, None, 1 << 20)
    return result


def _push_from_stage(model: Any, ctx: Any, groups: Any, ref: dict[str, Any], sender_stage: int) -> dict[str, Any]:
    from colosync.control.link import LocalLink
    from colosync.sources.megatron import MegatronSource
    from colosync.sync.receiver import Receiver

    source = MegatronSource(model, ctx, groups, sender_stage=sender_stage)
    if not source.is_sender:
        source.push(None)
        return {"is_sender": False}
    target = RecordingTarget(ref["full"])
    receiver = Receiver(target)
    _push(source, LocalLink(receiver), 4096)
    receiver.close()
    equal = set(target.committed) == set(ref["lora"]) and all(
        torch.equal(target.committed[n], t) for n, t in ref["lora"].items()
    )
    return {"is_sender": True, "equal": equal}


# -- forward parity -------------------------------------------------------------------------


def forward_worker(
    rank: int, world: int, tp: int, dtype_name: str, seq: int = 12, arch: str = "llama", ep: int = 1
) -> dict[str, Any]:
    """Real Megatron forward vs the HF model built from the converted stream, at ``tp`` (and ``ep``).

    Every weight is drawn directly in Megatron's global layout (qkv interleaved per group,
    ``[gate; up]`` per TP shard, each expert its own values) and sharded as Megatron shards
    it, and so is the LoRA, so nothing here relies on the converter's inverse. Norm weights,
    q/k norms and q/k/v biases get values away from Megatron's ones/zeros init, so a swapped
    or dropped one changes the logits.
    """
    import peft
    from megatron.core import parallel_state

    from colosync.sources.megatron import MegatronSource, ParallelGroups
    from colosync.sources.megatron_layout import ConversionContext, Role, local_params, plan
    from colosync.wire.manifest import LoraSpec

    dtype = getattr(torch, dtype_name)
    init_megatron(tp, 1, ep)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_backend() == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    geom = dataclasses.replace(GEOMETRIES[arch], num_layers=2)
    config = transformer_config(geom, tp, 1, dtype, ep=ep)
    model = build_gpt(config, geom, seed=11)
    lora_rank, alpha = 4, 6.0
    attach_lora(model, lora_rank, alpha, "nemo", dtype)
    model = model.to(device).eval()
    spec = LoraSpec(rank=lora_rank, alpha=alpha, target_modules=geom.targets)
    ctx_lora = ConversionContext.from_megatron(
        config, geom.vocab_size, geom.padded_vocab_size, "lora", spec, geom.tie, arch=arch
    )
    ctx_full = dataclasses.replace(ctx_lora, kind="full", lora=None)
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    gen = torch.Generator().manual_seed(5)

    def draw(item: Any) -> torch.Tensor:
        if item.role is Role.BIAS:
            return torch.randn(item.shape, generator=gen) * 0.1
        if len(item.shape) == 1:  # norms
            return torch.rand(item.shape, generator=gen) + 0.5
        return torch.randn(item.shape, generator=gen) * (0.15 if not item.role.base else 0.08)

    base_global = {it: draw(it) for it in plan(ctx_full)}
    lora_global = {it: draw(it) for it in plan(ctx_lora)}
    ids = torch.randint(0, geom.vocab_size, (2, seq), generator=gen)

    def load(tensors: dict[Any, torch.Tensor], scale: float) -> None:
        local = {}
        for it, full in tensors.items():
            local.update(local_params(it, full * scale, ctx_full, etp_rank if it.experts else tp_rank, ep_rank))
        load_megatron_tensors(model, {k: v.to(device, dtype) for k, v in local.items()}, ctx_lora.naming)

    def megatron_logits() -> torch.Tensor:
        pos = torch.arange(seq).expand(2, seq).to(device)
        mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
        with torch.no_grad():
            return model(ids.to(device), pos, attention_mask=mask)[..., : geom.vocab_size].float().cpu()

    groups = ParallelGroups.from_megatron()
    load(base_global, 1.0)
    load(lora_global, 0.0)
    base_logits = megatron_logits()
    load(lora_global, 1.0)
    lora_logits = megatron_logits()
    full = dict(MegatronSource(model, ctx_full, groups).tensors())
    adapter = dict(MegatronSource(model, ctx_lora, groups).tensors())
    if rank != 0:
        return {}
    hf = hf_model(geom, full, dtype, str(device))
    with torch.no_grad():
        hf_base = hf(input_ids=ids.to(device)).logits.float().cpu()
    peft_model = peft.get_peft_model(
        hf, peft.LoraConfig(r=lora_rank, lora_alpha=alpha, target_modules=list(geom.targets), lora_dropout=0.0)
    )
    result = peft.set_peft_model_state_dict(peft_model, adapter)
    assert not [k for k in result.unexpected_keys if "lora_" in k], result.unexpected_keys
    peft_model = peft_model.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        hf_lora = peft_model(input_ids=ids.to(device)).logits.float().cpu()
    return {
        "base_err": close(hf_base, base_logits),
        "lora_err": close(hf_lora, lora_logits),
        "lora_effect": close(lora_logits, base_logits),  # how much the LoRA changes Megatron's logits
        "max_abs_base": float((hf_base - base_logits).abs().max()),
        "max_abs_lora": float((hf_lora - lora_logits).abs().max()),
        "argmax_agree": float((hf_lora.argmax(-1) == lora_logits.argmax(-1)).float().mean()),
    }


# -- end to end -----------------------------------------------------------------------------


def engine_worker(
    rank: int,
    world: int,
    tp: int,
    ref_path: str,
    address_bytes: bytes,
    model_geometry: dict[str, Any],
    kind: str = "lora",
    ep: int = 1,
    engine_name: str = "hf",
) -> dict[str, Any]:
    """A TP=``tp`` (EP=``ep``) Megatron model holding ``ref``'s weights and LoRA, pushed into a running hf engine.

    ``kind="lora"`` pushes the adapter, ``"full"`` the base weights. With more ranks than one
    replica needs there are several data-parallel replicas; only replica 0 syncs (one
    engine, one payload): its model-parallel group, plus the expert-parallel ranks that hold
    its experts.
    """
    import msgspec
    from megatron.core import parallel_state

    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.sources.megatron import MegatronSource, ParallelGroups
    from colosync.sources.megatron_layout import ConversionContext
    from colosync.sync.sender import Sender
    from colosync.wire.manifest import LoraSpec

    ref = torch.load(ref_path, weights_only=True)
    geom = Geometry(**model_geometry)
    init_megatron(tp, 1, ep)
    replica_zero = parallel_state.get_data_parallel_rank() == 0 or (
        geom.num_experts and parallel_state.get_expert_data_parallel_rank() == 0
    )
    if not replica_zero:
        return {"is_sender": False, "yielded": 0, "replica": parallel_state.get_data_parallel_rank()}
    config = transformer_config(geom, tp, 1, ep=ep)
    model = build_gpt(config, geom)
    attach_lora(model, ref["rank"], ref["alpha"], "peft")
    spec = LoraSpec(rank=ref["rank"], alpha=ref["alpha"], target_modules=geom.targets)
    ctx = ConversionContext.from_megatron(
        config, geom.vocab_size, geom.padded_vocab_size, "lora", spec, geom.tie, arch=geom.arch
    )
    full_ctx = dataclasses.replace(ctx, kind="full", lora=None)
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    hf = {**ref["full"], **ref["lora"]}
    for c in (ctx, full_ctx):
        load_megatron_tensors(model, local_shards(c, 0, tp_rank, hf, vocab_pad(geom), ep_rank, etp_rank), c.naming)
    source = MegatronSource(model, ctx if kind == "lora" else full_ctx, ParallelGroups.from_megatron())
    if not source.is_sender:
        source.push(None)
        return {"is_sender": False, "yielded": source.stats.tensors_yielded}
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), engine_name)
    try:
        with Sender(link, transport="shm") as sender:
            report = source.push(sender)
    finally:
        link.close()
    return {
        "is_sender": True,
        "update_id": report.update_id,
        "tensors": report.tensors,
        "yielded": source.stats.tensors_yielded,
    }


# -- the parent's side of the engine tests ----------------------------------------------------


def _assert_gdn_lora_matters(peft_model: Any, want_logprobs: list, margin: float) -> None:
    """Without the LoRA on the Gated-DeltaNet linears, PEFT's logprobs move by more than ``margin``."""
    from colosync.testing import greedy

    saved = {}
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".linear_attn." in name and "lora_B" in name:
                saved[name] = p.clone()
                p.zero_()
    assert saved, "the reference adapter has no LoRA on the Gated-DeltaNet linears"
    _, without = greedy(peft_model, ENGINE_PROMPTS, 8)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if name in saved:
                p.copy_(saved[name])
    moved = max(abs(a - b) for g, w in zip(without, want_logprobs, strict=True) for a, b in zip(g, w, strict=False))
    assert moved > margin, f"the GDN LoRA moves PEFT's logprobs by only {moved}"


ENGINE_PROMPTS = [[5, 17, 33, 2, 101], [200, 7], [64, 64, 9, 13]]


def full_then_lora_through_engine(
    world: Any, tmp_path: Any, engine_name: str, geom: Geometry, tp: int, ep: int, tolerance: float
) -> None:
    """Start ``engine_name`` on one checkpoint; push the trainer's other weights (full), then a LoRA.

    After each push the engine's greedy tokens must equal HF's (then PEFT's) with the
    trainer's weights, and its logprobs agree within ``tolerance``.
    """
    import msgspec
    from peft import get_peft_model_state_dict

    from colosync.engines.config import EngineConfig, Generate
    from colosync.engines.process import EngineProcess
    from colosync.testing import greedy, random_lora

    from megatron_helpers import exact_norms, hf_class, hf_config, share_fused_lora_a

    rank, alpha = 4, 10.0

    def seeded(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = hf_class(geom)(hf_config(geom))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() > 1 or name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
                else:
                    p.uniform_(0.5, 1.5)
        exact_norms(model)
        return model.eval()

    engine_model = seeded(1)
    engine_model.save_pretrained(tmp_path / geom.arch)
    base_tokens, _ = greedy(engine_model, ENGINE_PROMPTS, 8)
    trainer_model = seeded(2)
    full = {k: v.clone() for k, v in trainer_model.state_dict().items() if not (geom.tie and k == "lm_head.weight")}
    full_tokens, full_logprobs = greedy(trainer_model, ENGINE_PROMPTS, 8)
    assert full_tokens != base_tokens, "the full update must change the generations for the test to mean anything"
    peft_model = random_lora(trainer_model, rank=rank, alpha=alpha, targets=geom.targets, seed=9, scale=0.3)
    share_fused_lora_a(peft_model)
    lora_tokens, lora_logprobs = greedy(peft_model, ENGINE_PROMPTS, 8)
    assert lora_tokens != full_tokens, "the adapter must change the generations for the test to mean anything"
    if geom.linear_freq:  # an engine that dropped the GDN in_proj / out_proj adapter would be caught
        _assert_gdn_lora_matters(peft_model, lora_logprobs, 100 * tolerance)
    ref_path = tmp_path / "reference.pt"
    lora = get_peft_model_state_dict(peft_model)
    torch.save({"full": full, "lora": lora, "rank": rank, "alpha": alpha}, ref_path)

    config = EngineConfig(engine=engine_name, model_dir=str(tmp_path / geom.arch), max_lora_rank=16)
    with EngineProcess(config) as engine:
        assert engine.call(Generate(prompts=ENGINE_PROMPTS, max_new_tokens=8)).tokens == base_tokens
        address = msgspec.msgpack.encode(engine.address)
        for kind, want_tokens, want_logprobs in (
            ("full", full_tokens, full_logprobs),
            ("lora", lora_tokens, lora_logprobs),
        ):
            geometry = dataclasses.asdict(geom)
            ranks = world.run(engine_worker, tp, str(ref_path), address, geometry, kind, ep, engine_name)
            senders = [r for r in ranks if r["is_sender"]]
            assert len(senders) == 1, "one rank per engine sends"
            assert all(r["yielded"] == 0 for r in ranks if not r["is_sender"])
            got = engine.call(Generate(prompts=ENGINE_PROMPTS, max_new_tokens=8))
            assert got.update_id == senders[0]["update_id"], kind
            assert got.tokens == want_tokens, kind
            worst = max(
                abs(a - b) for g, w in zip(got.logprobs, want_logprobs, strict=True) for a, b in zip(g, w, strict=True)
            )
            assert worst <= tolerance, (kind, worst)
