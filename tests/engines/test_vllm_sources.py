"""Trainer-side sources into the real vLLM engine: an FSDP2 LoRA, gathered over two gloo ranks,
generates in vLLM what the unsharded PEFT model generates.

The test process is rank 0 of a two-rank gloo world (it holds the session's vLLM engine and
its Sender); a spawned process is rank 1. Both build the same seeded PEFT model and shard it
with ``fully_shard``; rank 0's ``FsdpSource`` gathers every bucket from both and pushes it.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from colosync.testing import LORA_TARGETS, greedy, load_model, random_lora

from .test_vllm import NEW, PROMPTS, assert_parity, vllm_generate

SEED = 21


def sharded_peft(model_dir: Path) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = peft_model(model_dir)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def peft_model(model_dir: Path) -> torch.nn.Module:
    return random_lora(load_model(model_dir), rank=8, alpha=16.0, targets=LORA_TARGETS, seed=SEED, scale=0.08)


def rank_one(store: str, model_dir: Path, bucket_bytes: int) -> None:
    from colosync.sources.fsdp import FsdpSource

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=1, world_size=2)
    try:
        FsdpSource(sharded_peft(model_dir), kind="lora", bucket_bytes=bucket_bytes).push(None)
        dist.barrier()  # leave together (a rank that tears its group down early can abort its peer)
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_lora_gathered_over_two_ranks_matches_peft_in_vllm(
    vllm_llm, vllm_engine, vllm_sender, vllm_model_dir, tmp_path
):
    from colosync.sources.fsdp import FsdpSource

    store = str(tmp_path / "gloo-store")
    peer = mp.get_context("spawn").Process(target=rank_one, args=(store, vllm_model_dir, vllm_sender.bucket_bytes))
    peer.start()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=2)
    try:
        source = FsdpSource(sharded_peft(vllm_model_dir), kind="lora", bucket_bytes=vllm_sender.bucket_bytes)
        report = source.push(vllm_sender)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        peer.join(timeout=120)
    assert peer.exitcode == 0, "rank 1 failed its part of the gather"
    assert report is not None and report.update_id == vllm_engine.committed_update_id
    assert report.buckets > 1 and source.stats.gathers >= report.buckets, "every bucket gathered from both ranks"
    outs, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
    assert_parity(tokens, logprobs, *greedy(peft_model(vllm_model_dir), PROMPTS, NEW))
    assert {vllm_engine.version_of(o) for o in outs} == {report.update_id}
    with pytest.raises(AssertionError):  # the adapter visibly changes the output, or parity proves little
        assert_parity(tokens, logprobs, *greedy(load_model(vllm_model_dir), PROMPTS, NEW))
