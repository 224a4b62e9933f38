"""colosync driving a real vLLM engine (CPU backend, one engine for the session).

Parity is checked against PEFT/transformers in this process: same base weights, same adapter,
greedy tokens equal and per-token logprobs within 1e-3 (fp32). Rejections are checked by
what the engine serves afterwards: the same update id, tokens and logprobs as before.

The tests share one engine, so each one pushes the state it needs and leaves the engine on
the original base weights. ``test_no_lora_request_before_a_lora_commit`` must run first.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from colosync.wire.bucket import plan_buckets
from colosync.errors import EngineError, NonFiniteError, RankError, ShapeMismatchError, UpdateRejected
from colosync.demo.models import LORA_TARGETS, fill_lora, greedy, load_model, random_lora
from colosync.wire.protocol import Status
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors

from .conftest import BLOCK_SIZE, MAX_LORA_RANK, vllm_tensor_parallel_size

# One prompt longer than a KV block (so the prefix cache holds a block of it across updates)
# and two short ones.
_g = torch.Generator().manual_seed(1234)
PROMPTS = [[1, *torch.randint(3, 500, (BLOCK_SIZE + 8,), generator=_g).tolist()], [1, 17, 33, 250], [1, 99, 4]]
NEW = 12
TOL = 1e-3


def vllm_generate(llm, prompts, lora=None, new=NEW):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return outs, tokens, logprobs


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def assert_parity(got_tokens, got_logprobs, ref_tokens, ref_logprobs):
    assert got_tokens == ref_tokens
    assert max_diff(got_logprobs, ref_logprobs) <= TOL


def adapter(model_dir, rank, seed, alpha=None, base=None):
    model = copy.deepcopy(base) if base is not None else load_model(model_dir)
    return random_lora(model, rank=rank, alpha=alpha or 2.0 * rank, targets=LORA_TARGETS, seed=seed, scale=0.08)


# -- engine state and attribution ---------------------------------------------------------


def test_no_lora_request_before_a_lora_commit(vllm_llm):
    from colosync.engines.vllm.client import VllmEngine

    fresh = VllmEngine(vllm_llm)
    assert all(w.lora_update_id == 0 for w in fresh.workers), "this test must run before any LoRA push"
    with pytest.raises(EngineError, match="no colosync LoRA has been committed"):
        _ = fresh.lora_request


def test_every_worker_runs_the_extension(vllm_engine):
    tp = vllm_tensor_parallel_size()
    assert [w.rank for w in vllm_engine.workers] == list(range(tp))
    assert all(w.tensor_parallel_size == tp and w.lora_enabled for w in vllm_engine.workers)
    assert all(w.max_lora_rank == MAX_LORA_RANK for w in vllm_engine.workers)


# -- LoRA ---------------------------------------------------------------------------------


def test_five_consecutive_lora_updates_match_peft(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    previous = None
    for i, rank in enumerate((8, 16, 8, 16, 16)):
        trainer = adapter(vllm_model_dir, rank, seed=100 + i, alpha=(16.0, 8.0, 32.0, 32.0, 4.0)[i])
        report = vllm_sender.push_peft(trainer)
        assert report.update_id == vllm_engine.committed_update_id
        ref_tokens, ref_logprobs = greedy(trainer, PROMPTS, NEW)
        outs, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
        assert_parity(tokens, logprobs, ref_tokens, ref_logprobs)
        assert {vllm_engine.version_of(o) for o in outs} == {report.update_id}
        if previous is not None:  # each version must visibly differ, or parity would prove little
            assert max_diff(ref_logprobs, previous) > 10 * TOL
        previous = ref_logprobs
    with trainer.disable_adapter():
        base_tokens, _ = greedy(trainer, PROMPTS, NEW)
    assert base_tokens != tokens, "the adapter must change the output"


def test_reloading_one_adapter_does_not_compound_scaling(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    trainer = adapter(vllm_model_dir, rank=16, seed=7, alpha=64.0)  # scaling 4: compounding would show at once
    ref_tokens, ref_logprobs = greedy(trainer, PROMPTS, NEW)
    runs = []
    for _ in range(5):
        vllm_sender.push_peft(trainer)
        _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
        assert_parity(tokens, logprobs, ref_tokens, ref_logprobs)
        runs.append(logprobs)
    assert all(max_diff(run, runs[0]) <= 1e-6 for run in runs)


def test_base_model_requests_ignore_the_adapter(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    vllm_sender.push_peft(adapter(vllm_model_dir, rank=8, seed=8))
    base = load_model(vllm_model_dir)
    _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS)
    assert_parity(tokens, logprobs, *greedy(base, PROMPTS, NEW))


# -- full weights -------------------------------------------------------------------------


def test_full_weight_update_matches_transformers(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    original = load_model(vllm_model_dir)
    perturbed = copy.deepcopy(original)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
    # The engine serves an adapter across the full update: vLLM's reload drops LoRAs, colosync
    # must put the served one back.
    lora_seed = 21
    vllm_sender.push_peft(adapter(vllm_model_dir, rank=8, seed=lora_seed, base=original))
    try:
        report = vllm_sender.push(perturbed.named_parameters())
        assert report.kind == "full"
        outs, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS)
        ref_tokens, ref_logprobs = greedy(perturbed, PROMPTS, NEW)
        assert_parity(tokens, logprobs, ref_tokens, ref_logprobs)
        assert vllm_engine.version_of(outs[0]) == report.update_id
        assert tokens != greedy(original, PROMPTS, NEW)[0], "the update must change the output"
        _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
        assert_parity(tokens, logprobs, *greedy(adapter(vllm_model_dir, 8, lora_seed, base=perturbed), PROMPTS, NEW))
    finally:
        vllm_sender.push(original.named_parameters())
    _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS)
    assert_parity(tokens, logprobs, *greedy(original, PROMPTS, NEW))


def test_full_update_must_send_whole_fused_groups(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    model = load_model(vllm_model_dir)
    before = vllm_engine.committed_update_id
    q_only = [(n, p) for n, p in model.named_parameters() if n == "model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(UpdateRejected, match="k_proj.*v_proj|fused"):
        vllm_sender.push(q_only)
    assert vllm_engine.committed_update_id == before


def test_full_update_with_wrong_shape_is_rejected(vllm_engine, vllm_sender, vllm_model_dir):
    named = dict(load_model(vllm_model_dir).named_parameters())
    named["model.norm.weight"] = torch.ones(7)
    before = vllm_engine.committed_update_id
    with pytest.raises(ShapeMismatchError, match="model.norm.weight"):
        vllm_sender.push(named.items())
    assert vllm_engine.committed_update_id == before


# -- atomicity ----------------------------------------------------------------------------


def test_commits_are_atomic_while_another_thread_generates(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    prompt = PROMPTS[0]
    trainer = adapter(vllm_model_dir, rank=8, seed=0)
    refs: dict[int, list[int]] = {}

    def push(seed):
        fill_lora(trainer, seed, scale=0.1)
        uid = vllm_sender.push_peft(trainer).update_id
        refs[uid] = greedy(trainer, [prompt], NEW)[0][0]

    push(3000)
    lora = vllm_engine.lora_request
    results: list[tuple[int, list[int]]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def generate_forever():
        try:
            while not stop.is_set():
                outs, tokens, _ = vllm_generate(vllm_llm, [prompt, prompt], lora)
                results.extend((vllm_engine.version_of(o), t) for o, t in zip(outs, tokens))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=generate_forever, daemon=True)
    thread.start()
    try:
        for i in range(20):
            push(3001 + i)
            time.sleep(0.05)  # let a generation start on this version
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors
    assert len(refs) == 21 and len({tuple(t) for t in refs.values()}) == 21, "versions must be distinguishable"
    assert len(results) >= 20
    for version, tokens in results:
        matching = [uid for uid, ref in refs.items() if ref == tokens]
        assert matching == [version], f"result labelled {version} matches versions {matching}"
    assert len({v for v, _ in results}) >= 5, "generation must really overlap the updates"


# -- rejected updates change nothing ------------------------------------------------------


@pytest.fixture()
def serving(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    """Commit a known adapter and record what the engine serves with it."""
    trainer = adapter(vllm_model_dir, rank=8, seed=55)
    uid = vllm_sender.push_peft(trainer).update_id
    _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
    return SimpleNamespace(trainer=trainer, uid=uid, tokens=tokens, logprobs=logprobs)


def assert_still_serving(llm, engine, serving):
    assert engine.committed_update_id == serving.uid
    assert engine.link.submit(Status()).wait().in_flight_update_id is None
    outs, tokens, logprobs = vllm_generate(llm, PROMPTS, engine.lora_request)
    assert tokens == serving.tokens and max_diff(logprobs, serving.logprobs) <= 1e-6
    assert engine.version_of(outs[0]) == serving.uid


def _in_last_bucket(sender, tensors):
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in tensors], sender.bucket_bytes)
    assert len(layout.bucket_sizes) > 2 and layout.tensors[-1].bucket == len(layout.bucket_sizes) - 1, "the bad tensor must be in the last bucket of several"


def test_bad_shape_in_last_bucket_is_rejected(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir, serving):
    new = adapter(vllm_model_dir, rank=8, seed=56)
    tensors = peft_lora_tensors(new)
    name, last = tensors[-1]
    tensors[-1] = (name, torch.randn(last.shape[0], last.shape[1] + 1))
    _in_last_bucket(vllm_sender, tensors)
    with pytest.raises(ShapeMismatchError, match=name.replace(".", r"\.")):
        vllm_sender.push(tensors, lora=peft_lora_spec(new))
    assert_still_serving(vllm_llm, vllm_engine, serving)


def test_nonfinite_last_bucket_is_rejected_after_earlier_buckets_staged(vllm_llm, vllm_engine, vllm_sender, serving):
    tensors = peft_lora_tensors(serving.trainer)
    name, last = tensors[-1]
    poisoned = last.clone()
    poisoned[0, 0] = float("nan")
    tensors[-1] = (name, poisoned)
    _in_last_bucket(vllm_sender, tensors)
    with pytest.raises(NonFiniteError, match="NaN"):
        vllm_sender.push(tensors, lora=peft_lora_spec(serving.trainer))
    assert_still_serving(vllm_llm, vllm_engine, serving)


def test_rank_over_engine_max_is_rejected(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir, serving):
    too_big = adapter(vllm_model_dir, rank=MAX_LORA_RANK * 2, seed=57)
    with pytest.raises(RankError, match="max_lora_rank"):
        vllm_sender.push_peft(too_big)
    assert_still_serving(vllm_llm, vllm_engine, serving)


# -- trainer-side logic that needs no engine ----------------------------------------------


def _completion(*spans):
    from vllm.outputs import WeightVersionSpan

    return SimpleNamespace(weight_versions=[WeightVersionSpan(v, s, e) for v, s, e in spans])


def test_version_of_reads_vllms_weight_version_spans():
    from colosync.engines.vllm.client import VllmEngine

    assert VllmEngine.version_of(SimpleNamespace(outputs=[_completion(("7", 0, 4))])) == 7
    assert VllmEngine.version_of(_completion(("default", 0, 4))) == 0
    with pytest.raises(EngineError, match="several updates"):
        VllmEngine.version_of(_completion(("3", 0, 2), ("4", 2, 4)))
    with pytest.raises(EngineError, match="weight_versions"):
        VllmEngine.version_of(SimpleNamespace(weight_versions=None))


class _FakeAsyncLLM:
    """Just enough of ``vllm.AsyncLLM`` to drive ``AsyncVllmLink``: two workers, a store each."""

    def __init__(self):
        from colosync.engines.store import StoreEngine
        from colosync.sync.receiver import Receiver

        from colosync.engines.host import EngineHost

        self.stores = [StoreEngine() for _ in range(2)]
        self.receivers = [Receiver(s) for s in self.stores]
        self.hosts = [EngineHost(r) for r in self.receivers]  # what each vLLM worker runs
        self.calls: list[str] = []

    async def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [host.handle_bytes(*args) for host in self.hosts]

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(f"pause:{mode}")

    async def resume_generation(self):
        self.calls.append("resume")

    async def update_weight_version(self, version):
        self.calls.append(f"version:{version}")

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True


def test_async_link_pushes_through_the_engines_event_loop():
    from colosync.engines.vllm.client import AsyncVllmLink

    async def main():
        fake = _FakeAsyncLLM()
        link = AsyncVllmLink(fake, asyncio.get_running_loop())
        named = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3))]
        with Sender(link, transport="shm") as sender:
            with pytest.raises(EngineError, match="to_thread"):  # blocking on the loop would deadlock
                sender.push(named)
            report = await asyncio.to_thread(sender.push, named)
        return fake, report

    fake, report = asyncio.run(main())
    for store in fake.stores:  # every worker received the full update
        assert torch.equal(store.tensors["b"], torch.ones(2, 3))
    commit_at = fake.calls.index(f"version:{report.update_id}")
    assert fake.calls[commit_at - 2 : commit_at + 3] == [
        "pause:wait", "colosync_handle", f"version:{report.update_id}", "reset_prefix_cache", "resume",
    ]


def test_link_reports_a_missing_worker_extension():
    from colosync.engines.vllm.client import VllmLink

    class NoExtension:
        llm_engine = SimpleNamespace(engine_core=SimpleNamespace())

        def collective_rpc(self, method, args=()):
            raise AttributeError(f"'CPUWorker' object has no attribute '{method}'")

    with pytest.raises(EngineError, match="worker_extension_cls"):
        VllmLink(NoExtension()).info()
