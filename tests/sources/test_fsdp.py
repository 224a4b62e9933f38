"""FsdpSource on real FSDP2 (``fully_shard``) under gloo: exact bytes, engine parity, failures, memory.

The ranks are real processes sharing one process group (``fsdp_workers.World``); models are
tiny Llamas with dims that do not divide by the world size, so FSDP2 pads and, at 4 ranks,
leaves a rank with an empty shard of ``lora_A``.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.sources.fsdp_workers import (
    engine_set_worker,
    engine_worker,
    exactness_worker,
    gpu_worker,
    killed_worker,
    refused_worker,
    shared_world,
    stream_worker,
    tiny_llama,
    with_lora,
)

PROMPTS = [[5, 17, 33, 2, 101], [200, 7], [64, 64, 9, 13]]
BUCKETS = [64, 4096, 1 << 20]  # every tensor alone; a few per bucket; the whole update in one or two


@pytest.fixture(scope="module")
def world2():
    return shared_world(2)


@pytest.fixture(scope="module")
def world4():
    world = shared_world(4)
    yield world
    world.close()  # four idle ranks are too many to keep on two cores


def _check_exact(ranks: list[dict], senders: tuple[int, ...]) -> None:
    for rank, result in enumerate(ranks):
        for push in result["pushes"]:
            where = f"rank {rank}, {push['kind']} {push['dtype']} at {push['bucket_bytes']} B buckets"
            assert push["is_sender"] == (rank in senders), where
            if push["is_sender"]:
                assert push["mismatched"] == [], where
                assert push["update_id"] == 1 and push["live_after"] == 0, where
            else:
                assert push["yielded"] == 0, f"{where}: a non-sending rank handed tensors on"
            # memory: the sender holds its gather buffer and its copy-out buffer, nothing more
            assert push["peak"] <= push["bound"] <= 2 * push["largest_bucket"], where
            if not push["is_sender"]:
                assert push["peak"] <= push["largest_bucket"], where


@pytest.mark.parametrize(
    "mesh, senders",
    [((2,), (0,)), ((4,), (0,)), ((2, 2), (0, 3))],
    ids=["fsdp2-world2", "fsdp2-world4", "hsdp-2x2-two-engines"],
)
def test_lora_and_full_are_bit_for_bit_at_every_bucket_size(world2, world4, mesh, senders):
    world = world2 if mesh == (2,) else world4
    ranks = world.run(exactness_worker, mesh, BUCKETS, senders)
    _check_exact(ranks, senders)
    first = ranks[0]["pushes"]
    assert [p["gathers"] for p in first if p["kind"] == "lora" and p["dtype"] == "None"] == [28, 17, 1], (
        "one all_gather per Sender bucket"
    )


def test_hsdp_gathers_only_in_the_shard_group_that_feeds_an_engine(world4):
    ranks = world4.run(exactness_worker, (2, 2), BUCKETS[-1:], (1,))
    _check_exact(ranks, (1,))
    gathers = [sum(p["gathers"] for p in r["pushes"]) for r in ranks]
    assert gathers[0] == gathers[1] > 0 and gathers[2] == gathers[3] == 0, gathers


def test_memory_stays_within_two_buckets_not_the_model(world2):
    """Small buckets: the sending rank's live buffers peak at two buckets, far below the update."""
    (sender, other) = world2.run(exactness_worker, (2,), [4096], (0,))
    full = next(p for p in sender["pushes"] if p["kind"] == "full" and p["dtype"] == "None")
    assert full["peak"] <= 2 * full["largest_bucket"] < full["total"], full
    assert full["peak"] < full["total"] / 2, "the sender held more than two buckets' worth of gathered tensors"
    assert full["live_after"] == 0, "the source kept its buffers after the push"


def test_tensors_stream_without_a_sender_and_reuses_its_buffers(world2):
    sender, other = world2.run(stream_worker, (2,))
    assert sender["is_sender"] and not other["is_sender"]
    assert sender["mismatched"] == [] and sender["specs_equal"] and other["specs_equal"]
    assert sender["stale_views"] > 0, "views kept past their bucket must be overwritten: two buffers, reused"


def test_fsdp_push_into_hf_engine_matches_unsharded_peft_greedy(world2, hf_engine, tiny_model_dir):
    from colosync.engines.config import Generate
    from colosync.testing import greedy

    reference = with_lora(tiny_llama(str(tiny_model_dir), perturb=5), seed=2)
    want_tokens, want_logprobs = greedy(reference, PROMPTS, 8)
    with reference.disable_adapter():
        base_tokens, _ = greedy(reference, PROMPTS, 8)
    assert want_tokens != base_tokens, "the adapter must change the generations for the test to mean anything"
    address = msgspec.msgpack.encode(hf_engine.address)
    sender, other = world2.run(engine_worker, str(tiny_model_dir), address, 16 << 10)
    assert sender["is_sender"] and not other["is_sender"] and other["yielded"] == 0
    got = hf_engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
    assert got.update_id == sender["update_ids"][-1] == sender["update_ids"][0] + 1
    assert got.tokens == want_tokens
    for got_lp, want_lp in zip(got.logprobs, want_logprobs, strict=True):
        assert got_lp == pytest.approx(want_lp, abs=1e-5)


@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_two_fsdp_ranks_feed_two_engines_as_one_set(world2, hf_engine, tiny_model_dir, transport):
    from colosync.engines.config import EngineConfig, Generate
    from colosync.engines.process import EngineProcess
    from colosync.testing import greedy

    reference = with_lora(tiny_llama(str(tiny_model_dir), perturb=5), seed=2)
    want_tokens, _ = greedy(reference, PROMPTS, 8)
    with EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lora_rank=16)) as second:
        addresses = [msgspec.msgpack.encode(e.address) for e in (hf_engine, second)]
        sender, other = world2.run(engine_set_worker, str(tiny_model_dir), addresses, 16 << 10, transport)
        assert sender["is_sender"] and not other["is_sender"]
        assert sender["served"] == [[uid, uid] for uid in sender["update_ids"]]
        for engine in (hf_engine, second):
            got = engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
            assert got.update_id == sender["update_ids"][-1] and got.tokens == want_tokens


def test_engine_refusing_mid_push_raises_on_every_rank_then_a_valid_push_commits(world2, hf_engine):
    address = msgspec.msgpack.encode(hf_engine.address)
    sender, other = world2.run(refused_worker, address, timeout_s=60)
    assert sender["raised"] == "ShapeMismatchError"  # the odd vocabulary does not fit the engine's model
    assert other["raised"] == "PeerFailedError"
    for r in (sender, other):
        assert r["buckets"] == r["total_buckets"], "every rank left the gathers in step"
    assert 0 < sender["yielded"] < sender["total_tensors"], "the refusal came mid-stream, after tensors were sent"
    assert sender["retry_update_id"] is not None and other["retry_update_id"] is None


def test_engine_killed_mid_push_raises_on_every_rank_and_none_hangs(world2):
    from colosync.engines.config import EngineConfig
    from colosync.engines.process import EngineProcess

    engine = EngineProcess(EngineConfig(engine="store", timeout_s=30.0))
    try:
        address = msgspec.msgpack.encode(engine.address)
        sender, other = world2.run(killed_worker, address, engine.pid, 3, timeout_s=60)
    finally:
        engine.close()
    assert sender["killed"] and sender["killed_at_bucket"] >= 3
    assert sender["raised"] == "EngineError" and other["raised"] == "PeerFailedError"
    assert sender["total_buckets"] == sender["buckets"] == other["buckets"], "every rank left the gathers in step"
    assert sender["yielded"] < sender["total_buckets"], "the engine died mid-stream"
    assert max(sender["seconds"], other["seconds"]) < 30


@pytest.mark.gpu
def test_world_size_one_nccl_push_through_cuda_ipc(tmp_path):
    from colosync.engines.config import EngineConfig, Generate
    from colosync.engines.process import EngineProcess
    from colosync.testing import greedy, make_tiny_llama
    from tests.sources.fsdp_workers import World

    model_dir = make_tiny_llama(tmp_path / "llama", seed=0)
    reference = with_lora(tiny_llama(str(model_dir), perturb=5), seed=2).cuda()
    want_tokens, want_logprobs = greedy(reference, PROMPTS, 8)
    world = World(1, backend="nccl")
    try:
        with EngineProcess(EngineConfig(engine="hf", model_dir=str(model_dir), device="cuda")) as engine:
            (result,) = world.run(gpu_worker, str(model_dir), msgspec.msgpack.encode(engine.address), 256 << 10)
            got = engine.call(Generate(prompts=PROMPTS, max_new_tokens=8))
    finally:
        world.close()
    assert result["transports"] == ["cuda_ipc", "cuda_ipc"]
    assert got.update_id == result["update_ids"][-1] and got.tokens == want_tokens
    for got_lp, want_lp in zip(got.logprobs, want_logprobs, strict=True):
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
    # the allocator's own count: the source's two buffers (and the Sender's small state), not the model
    assert result["peak_extra"] <= result["bound"] + (1 << 20) < result["total"], result
    assert torch.cuda.is_available()
