"""LoRA commits beside running requests on the session's real vLLM engine (``commit_mode="inflight"``).

Asynchronous RL never stops generating for a sync: a commit installs the new version under an
adapter id of its own, new requests get it once it verified, and requests already running finish
on the version they started with, which retires when its last request ends. Every output's tokens
are compared with PEFT's for the version the output reports. The module switches the session's
workers to one id per version and back (after a full update that drops the adapter), and leaves
the engine on the original base weights, as the session expects.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from colosync.errors import ConfigError, DeliveryError, NonFiniteError, VersionLagError
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, greedy, load_model
from colosync.wire.protocol import Status

from .test_vllm import NEW, PROMPTS, adapter, trainer_probe, vllm_generate

LONG = 160  # tokens of the long request: it must outlast a push by far


@pytest.fixture(scope="module")
def inflight(vllm_llm, vllm_engine, vllm_sender, vllm_model_dir):
    """A second link to the session's engine that commits beside running requests (two versions at once)."""
    from colosync.engines.vllm.client import VllmEngine

    if vllm_engine.link.lora_update_id:  # an adapter under the stable id: versions start from none
        vllm_sender.drop_adapter()
    vllm_sender.close()  # one sender per engine: the session's attaches again on its next push
    engine = VllmEngine(vllm_llm, commit_mode="inflight", versions_in_flight=2)
    sender = Sender(engine.link, transport="shm", bucket_bytes=32 << 10)
    yield engine, sender
    sender.push(load_model(vllm_model_dir).named_parameters())  # the base again, the adapter dropped
    sender.close()
    assert vllm_llm.collective_rpc("colosync_kept_versions") == [[]] * len(engine.workers)
    vllm_llm.collective_rpc("colosync_keep_versions", args=(False,))  # the session's link uses one id


def until(condition, rollouts, timeout_s: float = 120.0) -> None:
    """Wait for ``condition`` while the rollout loop lives."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert rollouts.error is None, rollouts.error
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def kept(engine) -> list[int]:
    """The superseded versions every worker still holds (all workers must agree)."""
    [versions] = {tuple(v) for v in engine.llm.collective_rpc("colosync_kept_versions")}
    return list(versions)


def generate_leased(engine, prompts, new=NEW):
    """One request batch on the served version, held by a lease; returns (lease's version, versions, tokens)."""
    with engine.lease() as lease:
        outs, tokens, _ = vllm_generate(engine.llm, prompts, lease.lora_request, new=new)
    return lease.update_id, [engine.version_of(o) for o in outs], tokens


def greedy_params(new):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)


def test_bench_async_runs_both_commit_modes_and_checks_every_request(vllm_engine, vllm_sender, vllm_model_dir):
    """``colosync bench-async``'s measurement on the session's engine, small: both modes generate through every
    push and every request's tokens are PEFT's for the version it reports (first here: before ``inflight``)."""
    import argparse

    from colosync.tools.bench.asynchronous import BASELINE, run_mode

    if vllm_engine.link.lora_update_id:
        vllm_sender.drop_adapter()
    vllm_sender.close()
    args = argparse.Namespace(pushes=2, every=3, concurrency=3, max_tokens=12, rank=8)
    for mode in ("wait", "inflight"):
        result = run_mode(vllm_engine.llm, vllm_model_dir, mode, args)
        assert result.verified and result.requests > 0 and result.versions_served >= 2, result
        assert result.path == mode and result.tokens_per_s > 0 and result.push_ms_median > 0
    baseline = run_mode(vllm_engine.llm, vllm_model_dir, BASELINE, args)
    assert baseline.verified and baseline.versions_served == 1 and baseline.kind == "floor"
    assert vllm_engine.llm.collective_rpc("colosync_info")  # the workers answer, back in one-id mode
    assert not any(i.keep_versions for i in vllm_engine.link.info())


def test_pausing_commits_with_max_lag_start_no_rollout_and_no_generation_on_a_lagging_version(
    vllm_engine, vllm_sender, vllm_model_dir
):
    """``commit_mode="wait"`` (the session's engine, before ``inflight``): two failed pushes leave the served
    adapter two updates behind; ``lora_request`` refuses at once, ``Rollouts`` starts nothing and lives, scoring
    goes on, and the next good push starts generation again."""
    from colosync.engines.vllm.rollouts import Rollouts

    trainer = adapter(vllm_model_dir, rank=8, seed=95)
    good = vllm_sender.push_peft(trainer).update_id
    poisoned = next(p for n, p in trainer.named_parameters() if "lora_B" in n)
    saved = poisoned.detach().clone()
    vllm_engine.link.limit_lag(1)
    try:
        with torch.no_grad():
            poisoned.view(-1)[0] = float("nan")
        for _ in range(2):
            with pytest.raises(NonFiniteError):
                vllm_sender.push_peft(trainer)
        with pytest.raises(VersionLagError, match=rf"update {good}: the trainer began 2 updates"):
            _ = vllm_engine.lora_request
        scores, updates = vllm_engine.link.score(PROMPTS[:1], [[3, 4]], vllm_engine.link.default_lora())
        assert updates == {good} and len(scores[0]) == 2  # scoring is not a sample: it is served
        rollouts = Rollouts(vllm_engine, PROMPTS, greedy_params(NEW), concurrency=2).start()
        time.sleep(0.5)
        assert rollouts.finished == [] and rollouts.error is None
        with torch.no_grad():
            poisoned.copy_(saved)
        fill_lora(trainer, 96)
        fresh = vllm_sender.push_peft(trainer).update_id
        until(lambda: len(rollouts.finished) >= 2, rollouts)
        done = rollouts.stop()
    finally:
        vllm_engine.link.limit_lag(None)
    want = greedy(trainer, PROMPTS, NEW)[0]
    assert all(r.version == fresh and r.tokens == want[r.prompt] for r in done)


def test_a_stable_lora_request_is_refused_where_versions_are_leased(inflight):
    engine, _ = inflight
    with pytest.raises(ConfigError, match="engine.lease"):
        _ = engine.lora_request


def test_more_versions_than_vllm_has_slots_are_refused_by_name(vllm_llm):
    from colosync.engines.vllm.client import VllmEngine

    with pytest.raises(ConfigError, match=r"max_loras=5"):
        VllmEngine(vllm_llm, commit_mode="inflight", versions_in_flight=5)


def test_a_commit_does_not_wait_for_a_long_request_which_finishes_on_its_version(inflight, vllm_model_dir):
    from colosync.engines.vllm.rollouts import Rollouts

    engine, sender = inflight
    first = adapter(vllm_model_dir, rank=8, seed=71)
    uid_a = sender.push_peft(first).update_id
    rollouts = Rollouts(engine, PROMPTS[:1], greedy_params(LONG), concurrency=1).start()
    until(lambda: engine.link.versions.in_flight(), rollouts)  # the long request holds its version
    time.sleep(0.2)  # and vLLM is generating it
    second = adapter(vllm_model_dir, rank=8, seed=72)
    report = sender.push_peft(second)
    pushed_at = time.perf_counter()
    assert not rollouts.finished, "the long request ended before the push: make LONG larger"
    assert engine.link.versions.installed() == [uid_a, report.update_id]  # the long request still runs on a
    until(lambda: len(rollouts.finished) >= 2, rollouts)  # the long request, then one started after the commit
    long, after, *_ = rollouts.stop()
    assert long.finished > pushed_at  # measured: the commit did not wait for the long request
    assert (long.leased, long.version, long.tokens) == (uid_a, uid_a, greedy(first, PROMPTS[:1], LONG)[0][0])
    assert (after.leased, after.version) == (report.update_id, report.update_id)
    assert after.tokens == greedy(second, PROMPTS[:1], LONG)[0][0]
    assert engine.link.versions.installed() == [report.update_id]  # a retired when its request ended
    assert kept(engine) == []
    assert "commit_wait" not in report.seconds


def test_beyond_its_versions_a_commit_waits_for_the_oldest_to_retire_and_says_so(inflight, vllm_model_dir):
    engine, sender = inflight
    trainer = adapter(vllm_model_dir, rank=8, seed=73)
    sender.push_peft(trainer)
    reports = []
    third = threading.Thread(target=lambda: reports.append(sender.push_peft(trainer)))
    with engine.lease() as lease:  # a request that has its version and has not ended (two versions fill the engine)
        fill_lora(trainer, 74, scale=0.08)
        sender.push_peft(trainer)
        assert kept(engine) == [lease.update_id]
        fill_lora(trainer, 75, scale=0.08)
        third.start()
        time.sleep(0.5)
        assert third.is_alive() and not reports, "the third version must wait for room"
    # the request ended: its version retires, the commit proceeds
    third.join(timeout=60)
    [report] = reports
    assert report.seconds["commit_wait"] > 0.1
    assert generate_leased(engine, PROMPTS)[2] == greedy(trainer, PROMPTS, NEW)[0]
    assert kept(engine) == []


def test_commits_while_generation_never_stops_each_request_on_its_version(inflight, vllm_model_dir):
    """Continuous batching (four requests always in vLLM) while eight versions commit, some verified, one that
    fails verification is rolled back, and a full update drains every request: every request matches PEFT (or
    the base model, after the full update dropped the adapter) for the version it reports."""
    from colosync.engines.vllm.rollouts import Rollouts

    engine, sender = inflight
    trainer = adapter(vllm_model_dir, rank=8, seed=80)
    refs: dict[int, list[list[int]]] = {}

    def push(seed, verified):
        fill_lora(trainer, seed, scale=0.08)
        uid = sender.push_peft(trainer, verify=trainer_probe(trainer) if verified else None).update_id
        refs[uid] = greedy(trainer, PROMPTS, NEW)[0]

    push(800, verified=False)
    base = load_model(vllm_model_dir)
    rollouts = Rollouts(engine, PROMPTS, greedy_params(NEW), concurrency=4).start()
    failed_uid = full_uid = None
    try:
        for i in range(8):
            push(801 + i, verified=bool(i % 2))
            if i == 4:  # a version that does not verify is rolled back and served to nobody
                fill_lora(trainer, 900, scale=0.08)
                with pytest.raises(DeliveryError, match="rolled back"):
                    sender.push_peft(trainer, verify=trainer_probe(trainer, shift=0.5))
                failed_uid = engine.link.submit(Status()).wait().highest_update_id
            if i == 6:  # the base weights, the adapter dropped: no request runs while they change
                full_uid = sender.push(base.named_parameters()).update_id
                time.sleep(0.3)  # requests on the base weights alone
            time.sleep(0.15)
    finally:
        done = rollouts.stop()
    assert len({str(t) for t in refs.values()}) == len(refs) == 9, "versions must differ in their tokens"
    base_tokens = greedy(base, PROMPTS, NEW)[0]
    for r in done:
        if not r.leased:  # after the full update, before the next LoRA: the base weights, labelled with it
            assert r.version == full_uid and r.tokens == base_tokens[r.prompt]
            continue
        assert r.version == r.leased, "one version per request: the one it was given"
        assert r.tokens == refs[r.leased][r.prompt], f"the output of version {r.leased} is not PEFT's"
    assert any(not r.leased for r in done), "requests must have run on the full update's weights"
    seen = {r.leased for r in done}
    assert failed_uid is not None and failed_uid not in seen
    assert len(seen) >= 4, f"generation must really overlap the commits (saw versions {sorted(seen)})"
    assert len(done) > 20
    assert kept(engine) == []
    # a sample's staleness: eight later LoRA versions and the full update after the first; the failed one never
    assert engine.lag(max(refs)) == 0 and engine.lag(min(refs)) == len(refs) - 1 + 1


def test_no_request_starts_on_a_version_more_than_max_lag_behind_while_generation_runs(inflight, vllm_model_dir):
    """``max_lag=1`` with rollouts never stopping: two pushes fail (NaN), so the served version lags its trainer by
    two; the loop starts no request until the next good push commits, and a lease waits, then says why."""
    from colosync.engines.vllm.rollouts import Rollouts

    engine, sender = inflight
    versions = engine.link.versions
    trainer = adapter(vllm_model_dir, rank=8, seed=90)
    good = sender.push_peft(trainer).update_id
    engine.link.limit_lag(1)
    rollouts = Rollouts(engine, PROMPTS, greedy_params(NEW), concurrency=2).start()
    try:
        poisoned = next(p for n, p in trainer.named_parameters() if "lora_B" in n)
        with torch.no_grad():
            poisoned.view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteError):
            sender.push_peft(trainer)
        seen = len(rollouts.finished)
        until(lambda: len(rollouts.finished) > seen + 2, rollouts)  # one behind: generation goes on
        with pytest.raises(NonFiniteError):
            sender.push_peft(trainer)
        stale_at = time.perf_counter()
        until(lambda: not versions.in_flight(), rollouts)  # the running requests end, none starts
        time.sleep(0.5)
        assert not versions.in_flight() and rollouts.error is None
        versions.room_timeout_s = 0.3
        with pytest.raises(VersionLagError, match=rf"update {good}: the trainer began 2 updates after it"):
            generate_leased(engine, PROMPTS)
        versions.room_timeout_s = 600.0

        fill_lora(trainer, 91)
        fresh = sender.push_peft(trainer).update_id
        until(lambda: sum(r.started > stale_at for r in rollouts.finished) >= 4, rollouts)  # started again
    finally:
        done = rollouts.stop()
        engine.link.limit_lag(None)
        versions.room_timeout_s = 600.0
    late = [r for r in done if r.started > stale_at]
    assert late and all((r.leased, r.version) == (fresh, fresh) for r in late), "nothing started on the stale one"
    want = greedy(trainer, PROMPTS, NEW)[0]
    assert all(r.tokens == want[r.prompt] for r in late)
    assert kept(engine) == []
