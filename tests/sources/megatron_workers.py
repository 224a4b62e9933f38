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
    ALL_TARGETS,
    Convention,
    Geometry,
    attach_lora,
    build_gpt,
    close,
    hf_llama,
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


def _setup(tp: int, pp: int, ref: dict[str, Any], convention: Convention):
    from megatron.core import parallel_state

    from colosync.sources.megatron_layout import ConversionContext
    from colosync.wire.manifest import LoraSpec

    init_megatron(tp, pp)
    geom = Geometry()
    config = transformer_config(geom, tp, pp)
    model = build_gpt(config, geom)
    attach_lora(model, ref["rank"], ref["alpha"], convention)
    spec = LoraSpec(rank=ref["rank"], alpha=ref["alpha"], target_modules=ALL_TARGETS)
    ctx_lora = ConversionContext.from_megatron(config, geom.vocab_size, geom.padded_vocab_size, "lora", spec, False)
    ctx_full = dataclasses.replace(ctx_lora, kind="full", lora=None)
    stage, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    hf = {**ref["full"], **ref["lora"]}
    loaded = 0
    for ctx in (ctx_full, ctx_lora):
        loaded += load_megatron_tensors(model, local_shards(ctx, stage, tp_rank, hf, vocab_pad(geom)), ctx.naming)
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
    rank: int, world: int, tp: int, pp: int, ref_path: str, convention: Convention, bucket_sizes: list[int]
) -> dict[str, Any]:
    """Push LoRA and full weights at every bucket size; compare with the reference exactly."""
    from colosync.sources.megatron import MegatronSource, ParallelGroups
    from colosync.sync.link import LocalLink
    from colosync.sync.receiver import Receiver

    ref = torch.load(ref_path, weights_only=True)
    geom, model, ctx_lora, ctx_full, stage, tp_rank, params = _setup(tp, pp, ref, convention)
    groups = ParallelGroups.from_megatron()
    out: dict[str, Any] = {"stage": stage, "tp_rank": tp_rank, "pushes": [], "param_names": [n for n, _ in params]}
    for ctx, expected in ((ctx_lora, ref["lora"]), (ctx_full, ref["full"])):
        source = MegatronSource(model, ctx, groups)
        local_bytes = max(math_bytes(it.local_shape(tp), it.dtype) for it in _mine(ctx, stage))
        for bucket_bytes in bucket_sizes:
            target = RecordingTarget(ref["full"]) if source.is_sender else None
            receiver = Receiver(target) if target else None
            link = LocalLink(receiver) if receiver else None
            report = _push(source, link, bucket_bytes)
            record = {
                "kind": ctx.kind,
                "bucket_bytes": bucket_bytes,
                "is_sender": source.is_sender,
                "stats": dataclasses.asdict(source.stats),
                "max_local_shard": local_bytes,
            }
            if source.is_sender:
                receiver.close()
                record.update(_check_received(target, expected, ctx, report))
            out["pushes"].append(record)
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
    from colosync.errors import ColosyncError
    from colosync.sources.megatron import MegatronSource
    from colosync.sync.link import LocalLink
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
    from colosync.sources.megatron import MegatronSource
    from colosync.sync.link import LocalLink
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


def forward_worker(rank: int, world: int, tp: int, dtype_name: str, seq: int = 12) -> dict[str, Any]:
    """Real Megatron forward vs the HF model built from the converted stream, at ``tp``.

    Megatron's weights are Megatron's own initialization and the LoRA is drawn directly in
    Megatron's global layout, so nothing here relies on the converter's inverse.
    """
    import peft
    from megatron.core import parallel_state

    from colosync.sources.megatron import MegatronSource, ParallelGroups
    from colosync.sources.megatron_layout import ConversionContext, plan, shard
    from colosync.wire.manifest import LoraSpec

    dtype = getattr(torch, dtype_name)
    init_megatron(tp, 1)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_backend() == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    geom = Geometry(num_layers=2)
    config = transformer_config(geom, tp, 1, dtype)
    model = build_gpt(config, geom, seed=11)
    lora_rank, alpha = 4, 6.0
    attach_lora(model, lora_rank, alpha, "nemo", dtype)
    model = model.to(device).eval()
    spec = LoraSpec(rank=lora_rank, alpha=alpha, target_modules=ALL_TARGETS)
    ctx_lora = ConversionContext.from_megatron(config, geom.vocab_size, geom.padded_vocab_size, "lora", spec, False)
    ctx_full = dataclasses.replace(ctx_lora, kind="full", lora=None)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(5)
    lora_global = {it.key: torch.randn(it.shape, generator=gen) * 0.15 for it in plan(ctx_lora)}
    ids = torch.randint(0, geom.vocab_size, (2, seq), generator=gen)

    def megatron_logits() -> torch.Tensor:
        pos = torch.arange(seq).expand(2, seq).to(device)
        mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
        with torch.no_grad():
            return model(ids.to(device), pos, attention_mask=mask)[..., : geom.vocab_size].float().cpu()

    def set_lora(on: bool) -> None:
        local = {it.key: shard(lora_global[it.key], it.split, tp, tp_rank) * float(on) for it in plan(ctx_lora)}
        load_megatron_tensors(model, {k: v.to(device, dtype) for k, v in local.items()}, ctx_lora.naming)

    groups = ParallelGroups.from_megatron()
    set_lora(False)
    base_logits = megatron_logits()
    set_lora(True)
    lora_logits = megatron_logits()
    full = dict(MegatronSource(model, ctx_full, groups).tensors())
    adapter = dict(MegatronSource(model, ctx_lora, groups).tensors())
    if rank != 0:
        return {}
    hf = hf_llama(geom, full, dtype, str(device))
    with torch.no_grad():
        hf_base = hf(input_ids=ids.to(device)).logits.float().cpu()
    peft_model = peft.get_peft_model(
        hf, peft.LoraConfig(r=lora_rank, lora_alpha=alpha, target_modules=list(ALL_TARGETS), lora_dropout=0.0)
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
    rank: int, world: int, tp: int, ref_path: str, address_bytes: bytes, model_geometry: dict[str, Any]
) -> dict[str, Any]:
    """A TP=``tp`` Megatron model with a Megatron-layout LoRA, pushed into a running hf engine.

    With more ranks than ``tp`` there are several data-parallel replicas; only replica 0's
    model-parallel group syncs (one engine, one payload).
    """
    import msgspec
    from megatron.core import parallel_state

    from colosync.engines.process import EngineAddress, connect
    from colosync.sources.megatron import MegatronSource, ParallelGroups
    from colosync.sources.megatron_layout import ConversionContext
    from colosync.sync.sender import Sender
    from colosync.wire.manifest import LoraSpec

    ref = torch.load(ref_path, weights_only=True)
    geom = Geometry(**model_geometry)
    init_megatron(tp, 1)
    if parallel_state.get_data_parallel_rank() != 0:
        return {"is_sender": False, "yielded": 0, "replica": parallel_state.get_data_parallel_rank()}
    config = transformer_config(geom, tp, 1)
    model = build_gpt(config, geom)
    attach_lora(model, ref["rank"], ref["alpha"], "peft")
    spec = LoraSpec(rank=ref["rank"], alpha=ref["alpha"], target_modules=ALL_TARGETS)
    ctx = ConversionContext.from_megatron(config, geom.vocab_size, geom.padded_vocab_size, "lora", spec, False)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    hf = {**ref["full"], **ref["lora"]}
    load_megatron_tensors(model, local_shards(ctx, 0, tp_rank, hf, vocab_pad(geom)), ctx.naming)
    load_megatron_tensors(
        model,
        local_shards(dataclasses.replace(ctx, kind="full", lora=None), 0, tp_rank, hf, vocab_pad(geom)),
        ctx.naming,
    )
    source = MegatronSource(model, ctx, ParallelGroups.from_megatron())
    if not source.is_sender:
        source.push(None)
        return {"is_sender": False, "yielded": source.stats.tensors_yielded}
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), "hf")
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
