"""Rank bodies and a reusable world for the FSDP2 and plain source tests (real gloo, real FSDP2).

``World`` keeps ``size`` ranks alive across tests (a rank's imports cost seconds on two
cores); each test runs a function on every rank and gets each rank's plain-data result. The
models are tiny Llamas built from a transformers config with a fixed seed (the same bits on
every rank), sharded with ``torch.distributed.fsdp.fully_shard``; sizes are chosen so that
dim 0 does not divide by the world size (FSDP2's padding, and empty shards at 4 ranks).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import math
import os
import signal
import threading
import time
from typing import Any

import torch

from tests import worlds

# -- worlds ---------------------------------------------------------------------------------


def _one_compute_thread() -> None:
    torch.set_num_threads(1)  # two shared cores: one compute thread per rank


# Forkserver is one per process: when the Megatron tests' world starts it first, its preload
# wins. Listing their modules too (when installed) keeps either order fast.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "transformers.models.llama.modeling_llama",
    "peft",
    "colosync.sources.fsdp",
    *(
        ["megatron.core.models.gpt.gpt_model", "colosync.sources.megatron"]
        if importlib.util.find_spec("megatron")
        else []
    ),
]


class World(worlds.World):
    """A ``tests.worlds.World`` whose ranks run one compute thread each, forked from a forkserver
    that imported FSDP2, transformers, PEFT and the sources once."""

    def __init__(self, size: int, backend: str = "gloo") -> None:
        super().__init__(size, backend, preload=PRELOAD, set_up=_one_compute_thread)


_SHARED: dict[tuple[int, str], World] = {}


def shared_world(size: int, backend: str = "gloo") -> World:
    """One world per size for the whole session (the FSDP and plain tests share them); closed at exit."""
    world = _SHARED.get((size, backend))
    if world is None:
        world = _SHARED[(size, backend)] = World(size, backend)
        atexit.register(world.close)
    return world


# -- models ---------------------------------------------------------------------------------

ODD_SIZES = {"vocab_size": 509, "intermediate_size": 250}  # dim 0 of embed/lm_head/gate/up uneven over 2 and 4
LORA_RANK, LORA_ALPHA = 3, 6.0  # lora_A rows uneven over 2 ranks, one rank empty over 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def tiny_llama(model_dir: str | None = None, seed: int = 0, perturb: int | None = None) -> torch.nn.Module:
    """The shipped tiny model (``model_dir``) or an odd-sized one built from a config with ``seed``."""
    from transformers import LlamaForCausalLM

    from colosync.testing import load_model, tiny_llama_config

    if model_dir is not None:
        model = load_model(model_dir)
    else:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(**ODD_SIZES)).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.08)
    if perturb is not None:
        g = torch.Generator().manual_seed(perturb)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def with_lora(model: torch.nn.Module, seed: int = 1, targets: tuple[str, ...] = TARGETS) -> torch.nn.Module:
    from colosync.testing import random_lora

    return random_lora(model, rank=LORA_RANK, alpha=LORA_ALPHA, targets=targets, seed=seed, scale=0.2)


def shard(model: torch.nn.Module, mesh_shape: tuple[int, ...], device: str = "cpu") -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (FSDP2; HSDP on a 2-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=names)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in root.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def references(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The unsharded model's update tensors, under the names the engines expect."""
    from colosync.sync.sender import peft_lora_tensors

    full = {}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, p in base.named_parameters():
        if "lora_" not in name:
            full[name.replace(".base_layer.", ".")] = p.detach().clone()
    lora = {n: t.clone() for n, t in peft_lora_tensors(model)} if hasattr(model, "peft_config") else {}
    return {"full": full, "lora": lora}


def store_link() -> tuple[Any, Any, Any]:
    """A real store engine in this process (it keeps what it committed) behind a LocalLink."""
    from colosync.control.link import LocalLink
    from colosync.engines.store import StoreEngine
    from colosync.sync.receiver import Receiver

    engine = StoreEngine()
    receiver = Receiver(engine)
    return engine, receiver, LocalLink(receiver)


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if list(got) != list(want):
        return [f"names differ: {sorted(set(got) ^ set(want))[:4]} / order {list(got)[:3]} vs {list(want)[:3]}"]
    return [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])][:4]


# -- rank bodies ----------------------------------------------------------------------------


def exactness_worker(
    rank: int, world: int, mesh_shape: tuple[int, ...], bucket_sizes: list[int], senders: tuple[int, ...] = (0,)
) -> dict[str, Any]:
    """LoRA and full, through a Sender into a store engine at every bucket size: bit for bit."""
    from colosync.sources.base import EngineMap
    from colosync.sources.fsdp import FsdpSource
    from colosync.sync.sender import Sender

    model = with_lora(tiny_llama(seed=0))
    want = references(model)
    want_bf16 = {n: t.to(torch.bfloat16) for n, t in want["full"].items()}
    shard(model, mesh_shape)
    out: dict[str, Any] = {"pushes": []}
    cases = [("lora", None, want["lora"]), ("full", None, want["full"]), ("full", torch.bfloat16, want_bf16)]
    for kind, dtype, expected in cases:
        for bucket_bytes in bucket_sizes if dtype is None else bucket_sizes[-1:]:
            source = FsdpSource(model, kind, engines=EngineMap(senders), dtype=dtype, bucket_bytes=bucket_bytes)
            record: dict[str, Any] = {"kind": kind, "dtype": str(dtype), "bucket_bytes": bucket_bytes}
            if source.is_sender:
                engine, receiver, link = store_link()
                with Sender(link, transport="shm", bucket_bytes=bucket_bytes) as sender:
                    report = source.push(sender)
                receiver.close()
                record.update(
                    mismatched=_diff(engine.tensors, expected),
                    update_id=report.update_id if report else None,
                    buckets=report.buckets if report else None,
                    live_after=source.live_buffer_bytes(),
                )
            else:
                assert source.push(None) is None
            s = source.stats
            record.update(
                is_sender=source.is_sender,
                gathers=s.gathers,
                yielded=s.tensors_yielded,
                peak=s.peak_buffer_bytes,
                bound=source.max_buffer_bytes(),
                largest_bucket=source.largest_bucket_bytes(),
                total=sum(t.numel() * t.element_size() for t in expected.values()),
            )
            out["pushes"].append(record)
    return out


def stream_worker(rank: int, world: int, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """``tensors()`` without a Sender, and its buffer-reuse contract: clone what you keep."""
    from colosync.sources.fsdp import FsdpSource

    model = with_lora(tiny_llama(seed=0))
    want = references(model)
    shard(model, mesh_shape)
    source = FsdpSource(model, "full", bucket_bytes=64 << 10)
    got, kept = {}, []
    for name, t in source.tensors():
        got[name] = t.clone()
        kept.append((name, t))
    stale = [n for n, t in kept if not torch.equal(t, want["full"][n])]
    return {
        "is_sender": source.is_sender,
        "mismatched": _diff(got, want["full"]) if source.is_sender else [],
        "stale_views": len(stale),  # views kept past their bucket were overwritten: the buffers are reused
        "specs_equal": [s[0] for s in source.specs()] == list(want["full"]),
    }


def perturbed_sources(model_dir: str, world: int, bucket_bytes: int) -> tuple[Any, Any]:
    """The full and the LoRA ``FsdpSource`` of the perturbed tiny llama with its adapter, sharded over ``world``."""
    from colosync.sources.fsdp import FsdpSource

    model = shard(with_lora(tiny_llama(model_dir, perturb=5), seed=2), (world,))
    return FsdpSource(model, "full", bucket_bytes=bucket_bytes), FsdpSource(model, "lora", bucket_bytes=bucket_bytes)


def engine_worker(rank: int, world: int, model_dir: str, address_bytes: bytes, bucket_bytes: int) -> dict[str, Any]:
    """Full weights, then the LoRA, from an FSDP2 model into the hf engine process."""
    import msgspec

    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.sync.sender import Sender

    full, lora = perturbed_sources(model_dir, world, bucket_bytes)
    if not full.is_sender:
        full.push(None)
        lora.push(None)
        return {"is_sender": False, "yielded": full.stats.tensors_yielded + lora.stats.tensors_yielded}
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), "hf")
    try:
        with Sender(link, transport="shm", bucket_bytes=bucket_bytes) as sender:
            reports = [full.push(sender), lora.push(sender)]
    finally:
        link.close()
    return {
        "is_sender": True,
        "update_ids": [r.update_id for r in reports if r],
        "tensors": [r.tensors for r in reports if r],
    }


def engine_set_worker(
    rank: int, world: int, model_dir: str, addresses: list[bytes], bucket_bytes: int, transport: str
) -> dict[str, Any]:
    """Full weights, then the LoRA, from an FSDP2 model into a set of hf engine processes (separated mode)."""
    import msgspec

    from colosync.control.channel import EngineAddress
    from colosync.control.engine_set import EngineSet
    from colosync.engines.process import connect
    from colosync.sync.sender import Sender

    full, lora = perturbed_sources(model_dir, world, bucket_bytes)
    if not full.is_sender:
        full.push(None)
        lora.push(None)
        return {"is_sender": False}
    links = {f"e{i}": connect(msgspec.msgpack.decode(a, type=EngineAddress), "hf") for i, a in enumerate(addresses)}
    engines = EngineSet(links, join_timeout_s=30.0)
    try:
        with Sender(engines, transport=transport, bucket_bytes=bucket_bytes) as sender:
            reports = [full.push(sender), lora.push(sender)]
    finally:
        engines.close()
    return {
        "is_sender": True,
        "update_ids": [r.update_id for r in reports if r],
        "served": [[o.committed_update_id for o in r.engines] for r in reports if r],
    }


def refused_worker(rank: int, world: int, address_bytes: bytes) -> dict[str, Any]:
    """An odd-sized model's full weights into the hf engine of the shipped model: refused mid-stream.

    The engine refuses the manifest at Begin; the Sender reads that reply only when it must
    reuse a slot, so buckets have been gathered and sent by then. Every rank must raise, and a
    later, valid push (attention-only LoRA) must commit.
    """
    import msgspec

    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.errors import ColosyncError
    from colosync.sources.fsdp import FsdpSource
    from colosync.sync.sender import Sender

    model = shard(with_lora(tiny_llama(seed=0), targets=ATTN_TARGETS), (world,))
    bucket_bytes = 4 << 10
    full = FsdpSource(model, "full", bucket_bytes=bucket_bytes)
    lora = FsdpSource(model, "lora", bucket_bytes=bucket_bytes)
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), "hf") if full.is_sender else None
    raised = None
    result: dict[str, Any] = {"is_sender": full.is_sender}
    try:
        with contextlib.ExitStack() as stack:
            sender = stack.enter_context(Sender(link, transport="shm", bucket_bytes=bucket_bytes)) if link else None
            t = time.perf_counter()
            try:
                full.push(sender)
            except ColosyncError as exc:
                raised = type(exc).__name__
            result.update(
                raised=raised,
                seconds=time.perf_counter() - t,
                buckets=full.stats.buckets,
                total_buckets=len(full._buckets),
                yielded=full.stats.tensors_yielded,
                total_tensors=len(full.specs()),
            )
            report = lora.push(sender)
            result["retry_update_id"] = report.update_id if report else None
    finally:
        if link is not None:
            link.close()
    return result


def killed_worker(rank: int, world: int, address_bytes: bytes, engine_pid: int, after_buckets: int) -> dict[str, Any]:
    """SIGKILL the engine process once ``after_buckets`` buckets went through: every rank raises, none hangs."""
    import msgspec

    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.errors import ColosyncError
    from colosync.sources.fsdp import FsdpSource
    from colosync.sync.sender import Sender

    model = shard(tiny_llama(seed=0), (world,))
    bucket_bytes = 2 << 10
    source = FsdpSource(model, "full", bucket_bytes=bucket_bytes)
    result: dict[str, Any] = {"is_sender": source.is_sender}
    killed = threading.Event()
    if source.is_sender:

        def kill_midway() -> None:
            while source.stats.buckets < after_buckets:
                time.sleep(0.0005)
            os.kill(engine_pid, signal.SIGKILL)
            result["killed_at_bucket"] = source.stats.buckets
            killed.set()

        threading.Thread(target=kill_midway, daemon=True).start()
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), "store") if source.is_sender else None
    t = time.perf_counter()
    try:
        sender = Sender(link, transport="shm", bucket_bytes=bucket_bytes) if link is not None else None
        try:
            source.push(sender)
            result["raised"] = None
        except ColosyncError as exc:
            result["raised"] = type(exc).__name__
        finally:
            if sender is not None:
                sender.close()
    finally:
        if link is not None:
            link.close()
    result.update(
        seconds=time.perf_counter() - t,
        buckets=source.stats.buckets,
        total_buckets=len(source._buckets),
        yielded=source.stats.tensors_yielded,
        killed=killed.is_set() or not source.is_sender,
    )
    return result


def gpu_worker(rank: int, world: int, model_dir: str, address_bytes: bytes, bucket_bytes: int) -> dict[str, Any]:
    """World size 1 under NCCL: full weights then the LoRA through cuda_ipc into an hf engine on the GPU."""
    import msgspec

    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.sources.fsdp import FsdpSource
    from colosync.sync.sender import Sender

    model = shard(with_lora(tiny_llama(model_dir, perturb=5), seed=2).cuda(), (world,), device="cuda")
    full = FsdpSource(model, "full", bucket_bytes=bucket_bytes)
    lora = FsdpSource(model, "lora", bucket_bytes=bucket_bytes)
    link = connect(msgspec.msgpack.decode(address_bytes, type=EngineAddress), "hf")
    try:
        with Sender(link, transport="cuda_ipc", bucket_bytes=bucket_bytes) as sender:
            sender.push([], adapters="keep")  # an empty update: attaches the transport outside the measured window
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            reports = [full.push(sender), lora.push(sender)]
            torch.cuda.synchronize()
            peak_extra = torch.cuda.max_memory_allocated() - before
    finally:
        link.close()
    return {
        "transports": [r.transport for r in reports if r],
        "update_ids": [r.update_id for r in reports if r],
        "peak_extra": peak_extra,
        "bound": max(full.max_buffer_bytes(), lora.max_buffer_bytes()),
        "total": sum(math.prod(s) * d.itemsize for _, s, d in full.specs()),
    }


# -- plain source under DDP -----------------------------------------------------------------


def ddp_worker(rank: int, world: int) -> dict[str, Any]:
    """DDP-wrapped PEFT model: two engines (one per rank), each gets the payload once, under PEFT's names."""
    from colosync.sources.base import EngineMap
    from colosync.sources.plain import PlainSource
    from colosync.sync.sender import Sender

    model = with_lora(tiny_llama(seed=0))
    want = references(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    out: dict[str, Any] = {}
    for kind in ("lora", "full"):
        source = PlainSource(ddp, kind, engines=EngineMap((0, 1)))
        engine, receiver, link = store_link()
        with Sender(link, transport="shm", bucket_bytes=16 << 10) as sender:
            report = source.push(sender)
        receiver.close()
        out[kind] = {"mismatched": _diff(engine.tensors, want[kind]), "update_id": report.update_id if report else None}
    refused = PlainSource(ddp, "lora")  # rank 0 sends; the engine refuses a repeated update id: a real refusal
    engine, receiver, link = store_link()
    with Sender(link, transport="shm") as sender:
        first = refused.push(sender if rank == 0 else None)
        try:
            refused.push(sender if rank == 0 else None, update_id=first.update_id if first else 1)
            out["after_failure"] = None
        except Exception as exc:
            out["after_failure"] = type(exc).__name__
    receiver.close()
    try:
        PlainSource(shard(with_lora(tiny_llama(seed=0)), (world,)), "lora")
        out["plain_on_fsdp"] = None
    except Exception as exc:
        out["plain_on_fsdp"] = type(exc).__name__
    return out


__all__ = [
    "World",
    "engine_worker",
    "gpu_worker",
    "shared_world",
    "exactness_worker",
    "killed_worker",
    "refused_worker",
    "stream_worker",
]
