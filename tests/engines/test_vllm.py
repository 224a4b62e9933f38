"""colosync driving a real vLLM engine (CPU backend, one engine for the session).

Parity is checked against PEFT/transformers in this process: same base weights, same adapter,
greedy tokens equal and per-token logprobs within 1e-3 (fp32). Rejections are checked by
what the engine serves afterwards: the same update id, tokens and logprobs as before.

The tests share one engine, so each one pushes the state it needs and leaves the engine on
the original base weights. ``test_no_lora_request_before_a_lora_commit`` must run first.
Verified commits put a ``Probe`` (the trainer's logprobs) on the Sender's Commit through
``tests.helpers.probing``. The tied-embedding tests run on a second, one-worker engine over
a tiny Qwen2 (``vllm_tied_llm``), started after the others.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from colosync.errors import (
    DeliveryError,
    EngineError,
    FailedClosedError,
    NonFiniteError,
    RankError,
    ShapeMismatchError,
    TiedWeightError,
    UpdateRejected,
)
from colosync.sync.sender import Sender, peft_lora_spec, peft_lora_tensors
from colosync.sync.target import Changes, parse_lora_name
from colosync.testing import LORA_TARGETS, fill_lora, greedy, load_model, random_lora, score
from colosync.wire.bucket import plan_buckets
from colosync.wire.protocol import Attach, Commit, Probe, Revert, Status

from ..helpers import probing
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
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=False)] for o in outs
    ]
    return outs, tokens, logprobs


def max_diff(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b, strict=False) for x, y in zip(xs, ys, strict=False))


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
    with pytest.raises(EngineError, match="serves no colosync LoRA adapter"):
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
    # The engine keeps serving an adapter across the full update (adapters="keep"): vLLM's reload
    # drops LoRAs, colosync must put the served one back.
    lora_seed = 21
    vllm_sender.push_peft(adapter(vllm_model_dir, rank=8, seed=lora_seed, base=original))
    try:
        report = vllm_sender.push(perturbed.named_parameters(), adapters="keep")
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


def test_full_update_stages_in_host_memory_only_and_a_late_nan_changes_nothing(
    vllm_llm, vllm_engine, vllm_sender, vllm_model_dir
):
    """Every worker holds the update once, in its host staging area: no staged or prepared copy.

    (The accounting fails if the Receiver stages into its own buffers or ``prepare`` copies.)
    A full update with a NaN in its last bucket then leaves the workers serving the committed
    weights bit for bit.
    """
    original = load_model(vllm_model_dir)
    perturbed = copy.deepcopy(original)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
    named = list(perturbed.named_parameters())
    payload = sum(t.numel() * t.element_size() for _, t in named)
    try:
        report = vllm_sender.push(named)
        for worker in vllm_engine.link.info():
            fp = worker.last_full
            assert fp is not None and fp.update_id == report.update_id, worker
            assert fp.outside_bytes == 0 and fp.device_bytes == 0, fp
            assert payload <= fp.host_staging_bytes <= payload + 64 * len(named), fp
        outs, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS)
        assert_parity(tokens, logprobs, *greedy(perturbed, PROMPTS, NEW))
        poisoned = [(n, t.detach().clone()) for n, t in original.named_parameters()]
        poisoned[-1][1].view(-1)[-1] = float("nan")
        _in_last_bucket(vllm_sender, poisoned)
        with pytest.raises(NonFiniteError, match="NaN"):
            vllm_sender.push(poisoned)
        assert vllm_engine.committed_update_id == report.update_id
        outs, after_tokens, after_logprobs = vllm_generate(vllm_llm, PROMPTS)
        assert after_tokens == tokens and after_logprobs == logprobs, "the served weights must not have moved"
        assert vllm_engine.version_of(outs[0]) == report.update_id
    finally:
        vllm_sender.push(original.named_parameters())
    _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS)
    assert_parity(tokens, logprobs, *greedy(original, PROMPTS, NEW))


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
                results.extend((vllm_engine.version_of(o), t) for o, t in zip(outs, tokens, strict=True))
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
    assert len(layout.bucket_sizes) > 2 and layout.tensors[-1].bucket == len(layout.bucket_sizes) - 1, (
        "the bad tensor must be in the last bucket of several"
    )


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


# -- verified commits: a probe of the trainer's own logprobs travels with the Commit ------

PROBE_PROMPTS = PROMPTS[1:]


def trainer_probe(model, prompts=PROBE_PROMPTS, new=6, shift=0.0):
    """The trainer's greedy completions of ``prompts`` and their logprobs (``+ shift``: a wrong probe)."""
    completions = greedy(model, prompts, new)[0]
    logprobs = [[lp + shift for lp in row] for row in score(model, prompts, completions)]
    return Probe(prompts, completions, logprobs, tolerance=TOL)


def lora_modules(peft_model):
    return len({parse_lora_name(name)[0] for name, _ in peft_lora_tensors(peft_model)})


def vllm_layers(named):
    """The vLLM layers HF parameters load into: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""
    fused = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
    layers = set()
    for name, _ in named:
        parent, _, leaf = name.rpartition(".")[0].rpartition(".")
        layers.add(f"{parent}.{fused.get(leaf, leaf)}" if parent else fused.get(leaf, leaf))
    return len(layers)


def test_lora_push_with_a_correct_probe_commits_and_reports_its_delivery(
    vllm_llm, vllm_engine, vllm_sender, vllm_model_dir
):
    trainer = adapter(vllm_model_dir, rank=8, seed=61)
    with probing(vllm_sender, trainer_probe(trainer)) as link:
        report = vllm_sender.push_peft(trainer)
    [ack] = link.acks
    assert ack.committed_update_id == report.update_id == vllm_engine.committed_update_id
    delivery = ack.delivery
    assert delivery is not None and delivery.max_deviation is not None
    assert delivery.max_deviation <= TOL and delivery.seconds > 0
    assert delivery.changed == delivery.expected == lora_modules(trainer) == 2 * len(LORA_TARGETS)
    _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
    assert_parity(tokens, logprobs, *greedy(trainer, PROMPTS, NEW))


def test_lora_push_with_a_wrong_probe_is_rolled_back(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir, serving):
    new = adapter(vllm_model_dir, rank=8, seed=62)
    wrong = trainer_probe(new, shift=0.5)  # the engine will compute the trainer's logprobs, not these
    with (
        probing(vllm_sender, wrong),
        pytest.raises(
            DeliveryError,
            match=r"max \|engine - trainer logprob\| 0\.[45]\d* at prompt .*"
            rf"rolled back to update {serving.uid}",
        ) as failed,
    ):
        vllm_sender.push_peft(new)
    assert "tolerance 0.001" in str(failed.value)
    assert vllm_engine.link.lora_update_id == serving.uid and vllm_engine.serving
    assert_still_serving(vllm_llm, vllm_engine, serving)
    # the next update goes through as usual
    report = vllm_sender.push_peft(new)
    _, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
    assert_parity(tokens, logprobs, *greedy(new, PROMPTS, NEW))
    assert vllm_engine.committed_update_id == report.update_id


def test_full_update_with_a_wrong_probe_fails_closed_until_a_good_one(
    vllm_llm, vllm_engine, vllm_sender, vllm_model_dir, serving
):
    original = load_model(vllm_model_dir)
    # The probe of a full update is scored the way the engine serves by default: with the adapter it keeps.
    good = Probe(PROMPTS, serving.tokens, serving.logprobs, tolerance=TOL)
    wrong = Probe(PROMPTS, serving.tokens, [[lp - 0.5 for lp in row] for row in serving.logprobs], tolerance=TOL)
    with probing(vllm_sender, wrong), pytest.raises(DeliveryError, match="fails closed") as failed:
        vllm_sender.push(original.named_parameters(), adapters="keep")
    assert "a full update cannot be rolled back" in str(failed.value)
    assert not vllm_engine.serving and vllm_engine.link.submit(Status()).wait().serving is False
    with pytest.raises(FailedClosedError, match="push a good update"):
        _ = vllm_engine.lora_request
    with probing(vllm_sender, good) as link:
        report = vllm_sender.push(original.named_parameters(), adapters="keep")
    [ack] = link.acks
    assert vllm_engine.serving and ack.serving and ack.committed_update_id == report.update_id
    named = list(original.named_parameters())
    assert ack.delivery.changed == ack.delivery.expected == vllm_layers(named)
    assert ack.delivery.max_deviation <= TOL
    outs, tokens, logprobs = vllm_generate(vllm_llm, PROMPTS, vllm_engine.lora_request)
    assert_parity(tokens, logprobs, *greedy(serving.trainer, PROMPTS, NEW))
    assert vllm_engine.version_of(outs[0]) == report.update_id


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
        from colosync.engines.vllm.worker import WorkerDoor
        from colosync.sync.receiver import Receiver

        self.stores = [StoreEngine() for _ in range(2)]
        self.receivers = [Receiver(s) for s in self.stores]
        self.hosts = [WorkerDoor(r) for r in self.receivers]  # what each vLLM worker runs
        self.calls: list[str] = []

    async def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [host.serve(*args) for host in self.hosts]

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
    from colosync.engines.vllm.link import AsyncVllmLink

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
        "pause:wait",
        "colosync_handle",
        f"version:{report.update_id}",
        "reset_prefix_cache",
        "resume",
    ]


class _FakeLoraManager:
    """Just enough of vLLM's LoRA model manager: a LoRA slot per vLLM module name, one adapter."""

    supported_lora_modules = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, slots):
        self.modules = dict.fromkeys(slots)
        self._active_adapters: dict[int, None] = {}
        self.installed = None

    def remove_adapter(self, adapter_id):
        self._active_adapters.pop(adapter_id, None)
        self.installed = None

    def add_adapter(self, lora):
        self.installed = lora

    def pin_adapter(self, adapter_id):
        self._active_adapters[adapter_id] = None


class _FakeLora:
    """A ``LoRAModel`` after vLLM packed it: ``loras`` by vLLM module, packed ones with one entry per sub-module."""

    def __init__(self, loras):
        from colosync.engines.vllm.worker import ADAPTER_ID

        self.id, self.loras = ADAPTER_ID, loras

    def get_lora(self, name):
        return self.loras.get(name)


def _fake_target(manager):
    from colosync.engines.vllm.worker import VllmTarget
    from colosync.testing import tiny_llama_config

    config = tiny_llama_config()
    model = SimpleNamespace(packed_modules_mapping=_FakeLoraManager.packed_modules_mapping)
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(
                dtype=torch.float32, hf_config=config, get_vocab_size=lambda: config.vocab_size
            ),
            lora_config=SimpleNamespace(max_lora_rank=16, lora_dtype=torch.float32),
        ),
        model_runner=SimpleNamespace(get_model=lambda: model, lora_manager=SimpleNamespace(_adapter_manager=manager)),
    )
    return VllmTarget(worker)


def test_a_full_commit_counts_moe_experts_vllm_loads_below_their_layer():
    """Qwen3-MoE: HF's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` belong to the layer
    ``mlp.experts``, and vLLM 0.32 reports loading ``mlp.experts.routed_experts.w13_weight`` /
    ``w2_weight`` (seen from a real reload, ``/tmp/helpers/qwen/vllm_moe_full.py``); a layer
    nothing was loaded into still does not count, and a name that only shares a prefix is no child."""
    from colosync.engines.vllm.worker import loaded_layers

    layers = {"model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.experts", "model.layers.1"}
    loaded = {
        "model.embed_tokens",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.mlp.experts.routed_experts",  # what the reload's load_weights returned, per module
        "model.layers.10.mlp.gate",
    }
    assert loaded_layers(layers, loaded) == layers - {"model.layers.1"}
    assert loaded_layers(layers, loaded - {"model.layers.0.mlp.experts.routed_experts"}) == {
        "model.embed_tokens",
        "model.layers.0.self_attn.qkv_proj",
    }


def test_a_cpu_engine_refuses_moe_experts_before_a_byte_moves():
    """vLLM 0.32's CPU reload leaves routed experts wrong (``/tmp/helpers/qwen/vllm_moe_full.py``: reloading a
    Qwen3-MoE's own weights changed its greedy tokens); a CPU engine refuses experts at Begin, the rest goes."""
    from transformers import Qwen3MoeConfig

    from colosync.engines.vllm.worker import VllmTarget
    from colosync.wire.manifest import UpdateManifest

    config = Qwen3MoeConfig(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = SimpleNamespace(packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.float32, hf_config=config), lora_config=None
        ),
        model_runner=SimpleNamespace(get_model=lambda: model),
    )
    target = VllmTarget(worker)
    specs = [(n, p.shape, p.dtype) for n, p in target.model_spec().params.items()]
    assert any(".experts." in n for n, _, _ in specs)
    with pytest.raises(UpdateRejected, match="MoE expert weights.*mlp.experts"):
        target.check(UpdateManifest(1, "full", plan_buckets(specs, 1 << 16)))
    rest = [s for s in specs if ".experts." not in s[0]]
    target.check(UpdateManifest(2, "full", plan_buckets(rest, 1 << 16)))


def test_lora_commit_counts_what_vllm_placed_and_reports_a_shortfall():
    from colosync.engines.vllm.worker import _PreparedLora, placed_lora_modules

    attn = "model.layers.0.self_attn"
    a = torch.zeros(8, 64)
    # The manifest names q, k, v and o of layer 0 (4 modules); vLLM packed q and v into qkv_proj
    # but lost k, and it has no slot for o_proj (a module it does not know).
    lora = _FakeLora(
        {f"{attn}.qkv_proj": SimpleNamespace(lora_a=[a, None, a]), f"{attn}.o_proj": SimpleNamespace(lora_a=a)}
    )
    manager = _FakeLoraManager([f"{attn}.qkv_proj", "model.layers.0.mlp.down_proj"])
    target = _fake_target(manager)
    assert target.commit(_PreparedLora(lora, expected=4), update_id=5) == Changes(changed=2, expected=4)
    assert target.lora_update_id == 5
    manager.modules[f"{attn}.o_proj"] = None  # with a slot for o_proj too, all but k land
    assert placed_lora_modules(manager, lora) == 3
    manager._active_adapters.clear()  # an adapter that is not active is nowhere
    assert placed_lora_modules(manager, lora) == 0


def test_lora_revert_reinstates_the_previous_adapter_once():
    from colosync.engines.vllm.worker import _PreparedLora

    attn = "model.layers.0.self_attn"
    manager = _FakeLoraManager([f"{attn}.o_proj"])
    first, second = (_FakeLora({f"{attn}.o_proj": SimpleNamespace(lora_a=torch.zeros(1))}) for _ in range(2))
    target = _fake_target(manager)
    assert target.revert(1) is False  # nothing committed
    target.commit(_PreparedLora(first, 1), update_id=1)
    target.commit(_PreparedLora(second, 1), update_id=2)
    assert target.revert(1) is False  # only the last commit can be reverted
    assert target.revert(2) is True
    assert manager.installed is first and target.lora_update_id == 1 and manager._active_adapters
    assert target.revert(2) is False  # once
    target.commit(_PreparedLora(second, 1), update_id=3)
    assert target.revert(3) is True and manager.installed is first


class _FakeLLM:
    """Just enough of ``vllm.LLM`` for ``VllmLink``: workers with a store each, and a scorer.

    Every token scores ``logprob`` under the current weight version.
    """

    def __init__(self, logprob=-1.0, store=None):
        from colosync.control.door import codecs
        from colosync.engines.store import StoreEngine
        from colosync.engines.vllm.worker import WorkerDoor
        from colosync.sync.receiver import Receiver

        self.logprob, self.version = logprob, "default"
        self.stores = [(store or StoreEngine)() for _ in range(2)]  # a store cannot revert: it fails closed
        self.hosts = [WorkerDoor(Receiver(s)) for s in self.stores]
        self._decode = codecs()[0].decode
        self.seen: list = []
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(), set_weight_version=self._set_version)

    def _set_version(self, version):
        self.version = version

    def collective_rpc(self, method, args=()):
        if method == "colosync_handle":
            self.seen.append(self._decode(bytes(args[0])))
        return [host.serve(*args) for host in self.hosts]

    def reset_prefix_cache(self):
        return True

    def generate(self, prompt, params, lora_request=None, use_tqdm=False):
        from vllm.outputs import WeightVersionSpan

        ids = prompt["prompt_token_ids"]
        steps = [None] + [{t: SimpleNamespace(logprob=self.logprob)} for t in ids[1:]]
        completion = SimpleNamespace(weight_versions=[WeightVersionSpan(self.version, 0, 1)])
        return [SimpleNamespace(prompt_logprobs=steps, outputs=[completion])]


def test_link_verifies_a_probe_itself_and_fails_closed_when_it_cannot_revert():
    from colosync.engines.vllm.link import VllmLink

    fake = _FakeLLM(logprob=-1.0)
    link = VllmLink(fake)
    probe = Probe([[1, 2]], [[3, 4]], [[-1.0, -1.0]], tolerance=1e-3)
    with Sender(link, transport="shm") as sender:
        with probing(sender, probe) as probed:
            report = sender.push([("a", torch.ones(3))])
        commits = [m for m in fake.seen if isinstance(m, Commit)]
        assert commits == [Commit(report.update_id)], "the workers must not see the probe"
        assert probed.acks[-1].delivery.max_deviation == 0.0 and link.serving
        fake.logprob = -1.25  # now the engine computes something else than the trainer
        with probing(sender, probe), pytest.raises(DeliveryError, match=r"0\.25 at prompt 0 token 0.*fails closed"):
            sender.push([("a", torch.zeros(3))])
        [revert] = [m for m in fake.seen if isinstance(m, Revert)]
        assert revert.update_id == report.update_id + 1 and "0.25" in revert.reason
        assert not link.serving
        with pytest.raises(FailedClosedError, match="push a good update"):
            link.default_lora()
        sender.push([("a", torch.zeros(3))])  # a commit (unverified here) serves again
        assert link.serving and link.default_lora() is None


def test_link_follows_workers_that_fail_a_commit_closed_on_their_own_count():
    from colosync.engines.store import StoreEngine
    from colosync.engines.vllm.link import VllmLink

    class CountingStore(StoreEngine):  # counts what each commit changed; ``short``: one tensor short
        short = False

        def commit(self, prepared, update_id):
            super().commit(prepared, update_id)
            return Changes(len(prepared) - self.short, len(prepared))

    fake = _FakeLLM(store=CountingStore)
    link = VllmLink(fake)
    with Sender(link, transport="shm") as sender:
        good = sender.push([("a", torch.ones(3))])
        assert link.serving and fake.version == str(good.update_id)
        for store in fake.stores:
            store.short = True
        with pytest.raises(DeliveryError, match="changed 1 .* names 2.*fails closed"):
            sender.push([("a", torch.zeros(3)), ("b", torch.zeros(1))])
    assert not link.serving and link.committed_update_id == good.update_id + 1
    assert fake.version == str(good.update_id + 1)  # labelled with what the workers hold now
    with pytest.raises(FailedClosedError, match="push a good update"):
        link.default_lora()


def test_a_hosted_vllm_engine_is_served_through_the_links_own_transaction():
    """An engine process serving vLLM and an in-process VllmEngine update the engine through one owner."""
    from colosync.engines.host import EngineHost
    from colosync.engines.vllm.link import VllmLink
    from colosync.engines.vllm.serving import VllmServing

    fake = _FakeLLM()
    link = VllmLink(fake)
    serving = VllmServing.__new__(VllmServing)  # its engine, without building a vLLM
    serving.engine = SimpleNamespace(link=link)
    host = EngineHost(serving.transaction(None), serving)
    assert host.transaction is link.transaction
    with Sender(link, transport="shm") as sender:
        report = sender.push([("a", torch.ones(3))])
        refused = host.handle(Attach("shm", b"not opened"), host.open_session())
        assert refused.error == "EngineBusyError" and "owned by another sender" in refused.message
        assert host.handle(Status()).committed_update_id == report.update_id
    assert host.transaction.owner is None  # the in-process sender's close released the engine for every client


def test_link_reports_a_missing_worker_extension():
    from colosync.engines.vllm.link import VllmLink

    class NoExtension:
        llm_engine = SimpleNamespace(engine_core=SimpleNamespace())

        def collective_rpc(self, method, args=()):
            raise AttributeError(f"'CPUWorker' object has no attribute '{method}'")

    with pytest.raises(EngineError, match="worker_extension_cls"):
        VllmLink(NoExtension()).info()


# -- tied embeddings (a second, one-worker engine over a tiny Qwen2 with tie_word_embeddings) --

TIED_PROMPTS = [[1, 17, 33, 250, 9, 77], [1, 99, 4, 8]]


def vllm_score(llm, prompts, completions, lora=None):
    """Per-token logprobs of ``completions`` as vLLM computes them (prompt logprobs, one sequence per call)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    rows = []
    for prompt, completion in zip(prompts, completions, strict=False):
        [out] = llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt) + list(completion)), params, lora_request=lora, use_tqdm=False
        )
        rows.append([step[t].logprob for step, t in zip(out.prompt_logprobs[len(prompt) :], completion, strict=False)])
    return rows


def _scaled(model, factor):
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        for p in scaled.parameters():  # the tied lm_head is the embedding: scaled once, with it
            p.mul_(factor)
    return scaled


@pytest.fixture(scope="module")
def tied(vllm_tied_llm, vllm_tied_model_dir):
    from colosync.engines.vllm.client import VllmEngine

    base = load_model(vllm_tied_model_dir)
    assert base.lm_head.weight is base.model.embed_tokens.weight, "the model must tie lm_head to the embedding"
    completions = greedy(base, TIED_PROMPTS, 6)[0]
    engine = VllmEngine(vllm_tied_llm)
    with Sender(engine.link, transport="shm") as sender:
        yield SimpleNamespace(llm=vllm_tied_llm, engine=engine, sender=sender, base=base, completions=completions)


def test_full_update_of_a_tied_embedding_reaches_the_lm_head(tied):
    """vLLM's CPU backend prepacks the lm_head GEMM at load; a reload must re-pack the tied head too."""
    assert (
        max_diff(vllm_score(tied.llm, TIED_PROMPTS, tied.completions), score(tied.base, TIED_PROMPTS, tied.completions))
        <= TOL
    )
    updated = _scaled(tied.base, 1.1)
    tied.sender.push(updated.named_parameters())  # lm_head.weight is not among them: it is the embedding
    got = vllm_score(tied.llm, TIED_PROMPTS, tied.completions)
    want = score(updated, TIED_PROMPTS, tied.completions)
    assert max_diff(got, want) <= TOL, f"vLLM computes logits with a stale lm_head: off by {max_diff(got, want):.3g}"


def test_tied_state_dict_with_lm_head_is_accepted_and_counted(tied):
    """A full ``state_dict()`` names ``lm_head.weight`` too; the engine ties it, so it must equal the embedding."""
    updated = _scaled(tied.base, 1.2)
    state = updated.state_dict()
    assert "lm_head.weight" in state
    with probing(
        tied.sender,
        Probe(TIED_PROMPTS, tied.completions, score(updated, TIED_PROMPTS, tied.completions), tolerance=TOL),
    ) as link:
        tied.sender.push(list(state.items()))
    delivery = link.acks[-1].delivery
    assert delivery.changed == delivery.expected == vllm_layers(updated.named_parameters())
    assert delivery.max_deviation <= TOL
    before = tied.engine.committed_update_id
    state["lm_head.weight"] = state["lm_head.weight"] + 0.01
    with pytest.raises(TiedWeightError, match="lm_head.weight"):
        tied.sender.push(list(state.items()))
    assert tied.engine.committed_update_id == before


def test_a_head_size_the_cpu_backend_cannot_run_is_refused_at_start():
    """Checked when the worker's Receiver is set up (``VllmEngine(llm)``), before any push or generate."""
    import torch

    from colosync.engines.vllm.worker import _check_cpu_head_size
    from colosync.errors import ConfigError

    small = SimpleNamespace(get_head_size=lambda: 16)
    with pytest.raises(ConfigError, match=r"head size is 16.*needs at least 32.*hidden_size=128"):
        _check_cpu_head_size(small, torch.device("cpu"))
    _check_cpu_head_size(small, torch.device("cuda", 0))  # GPU kernels run small heads
    _check_cpu_head_size(SimpleNamespace(get_head_size=lambda: 32), torch.device("cpu"))
