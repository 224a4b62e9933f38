"""Named adapters on the session's real vLLM engine (``max_loras=3``): each its own versions, beside the others.

Two trainers each own one adapter and push their versions from threads of their own while a rollout
loop keeps four requests of both adapters in vLLM at all times. Every finished request's tokens are
compared with PEFT's for the (adapter, version) the engine reports; a version that fails
verification is rolled back for its adapter alone. The module leaves both adapters dropped (their
slots free) and the default adapter as it found it (none), as the session expects.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import threading
import time

import pytest

from colosync.errors import AdapterSlotsError, ConfigError, DeliveryError, EngineError
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, greedy, load_model
from colosync.wire.protocol import Stage, Status

from .test_vllm import NEW, PROMPTS, adapter, trainer_probe, vllm_generate
from .test_vllm_inflight import greedy_params

NAMES = ("policy", "reference")
VERSIONS = 20


@pytest.fixture(scope="module")
def engine(vllm_engine, vllm_sender):
    """The session's engine with its default adapter dropped (named adapters need its slot) and two lanes."""
    if vllm_engine.link.lora_update_id:
        vllm_sender.drop_adapter()
    for name in NAMES:
        vllm_engine.lane(name)
    yield vllm_engine
    for name in NAMES:
        with Sender(vllm_engine.lane(name), transport="shm") as sender:
            sender.drop_adapter()  # frees its slots for the rest of the session
        assert vllm_engine.llm.collective_rpc("colosync_kept_versions", args=(name,)) == [[]] * len(vllm_engine.workers)


def lane_generate(engine, name):
    """One batch on adapter ``name``'s served version; returns (the versions vLLM reports, tokens)."""
    with engine.lane(name).lease() as lease:
        outs, tokens, _ = vllm_generate(engine.llm, PROMPTS, lease.lora_request)
    return {engine.version_of(o) for o in outs}, tokens


def test_two_trainers_push_twenty_versions_each_while_generation_never_stops(engine, vllm_model_dir):
    from colosync.engines.vllm.rollouts import Rollouts

    trainers = {
        "policy": adapter(vllm_model_dir, rank=8, seed=300),
        "reference": adapter(vllm_model_dir, rank=4, seed=301),
    }
    senders = {name: Sender(engine.lane(name), transport="shm", bucket_bytes=32 << 10) for name in NAMES}
    refs: dict[tuple[str, int], list[list[int]]] = {}
    lock = threading.Lock()

    def push(name, seed, verified=False):
        model = trainers[name]
        fill_lora(model, seed, scale=0.08)
        tokens = greedy(model, PROMPTS, NEW)[0]
        uid = senders[name].push_peft(model, verify=trainer_probe(model) if verified else None).update_id
        with lock:
            refs[name, uid] = tokens

    rolled_back: dict[str, int] = {}
    errors: list[BaseException] = []

    def trainer(name, seed):
        try:
            for i in range(1, VERSIONS):
                push(name, seed + i, verified=i % 5 == 1)
                if name == "reference" and i == 9:  # fails verification: this adapter alone goes back
                    fill_lora(trainers[name], seed + 99, scale=0.08)
                    with pytest.raises(DeliveryError, match="rolled back"):
                        senders[name].push_peft(trainers[name], verify=trainer_probe(trainers[name], shift=0.5))
                    rolled_back[name] = engine.lane(name).submit(Status()).wait().highest_update_id
                    fill_lora(trainers[name], seed + i, scale=0.08)  # the served version's weights again
                time.sleep(0.02)
        except BaseException as exc:
            errors.append(exc)

    for name, seed in zip(NAMES, (3000, 4000), strict=True):
        push(name, seed)  # a first version of each before generation starts
    rollouts = Rollouts(engine, PROMPTS, greedy_params(NEW), concurrency=4, adapters=NAMES).start()
    threads = [threading.Thread(target=trainer, args=(n, s)) for n, s in zip(NAMES, (3000, 4000), strict=True)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    finally:
        done = rollouts.stop()
        for sender in senders.values():
            sender.close()
    assert not errors, errors
    assert len(refs) == 2 * VERSIONS and len({str(t) for t in refs.values()}) == len(refs), "versions must differ"
    for r in done:
        assert r.leased, "every request ran on a version of its adapter"
        assert r.version == r.leased, "one version per request: the one it was given"
        assert r.tokens == refs[r.adapter, r.leased][r.prompt], f"{r.adapter} version {r.leased} is not PEFT's"
    seen = {name: {r.leased for r in done if r.adapter == name} for name in NAMES}
    assert all(len(versions) >= 5 for versions in seen.values()), f"generation must overlap the commits: {seen}"
    assert rolled_back["reference"] not in seen["reference"]
    for name in NAMES:  # each adapter serves its last version, and only that one is installed
        last = max(uid for n, uid in refs if n == name)
        assert lane_generate(engine, name) == ({last}, refs[name, last])
        assert engine.lane(name).versions.installed() == [last]


def test_a_full_update_of_the_base_keeps_each_adapter_serving(engine, vllm_sender, vllm_model_dir):
    """vLLM's reload drops every adapter; the workers put each named adapter's versions back."""
    before = {name: lane_generate(engine, name) for name in NAMES}
    vllm_sender.push(load_model(vllm_model_dir).named_parameters())  # the same base weights, reloaded
    assert {name: lane_generate(engine, name) for name in NAMES} == before


def test_an_adapter_beyond_the_slots_is_refused_naming_those_that_hold_them(engine):
    with pytest.raises(AdapterSlotsError, match=r"'third'.*\['policy', 'reference'\].*max_loras=4"):
        engine.lane("third")
    assert sorted(engine.link.lanes) == sorted(NAMES)
    from colosync.engines.vllm.rollouts import Rollouts

    with pytest.raises(EngineError, match=r"no adapters \['third'\]"):
        Rollouts(engine, PROMPTS, greedy_params(NEW), adapters=("policy", "third"))


@contextlib.contextmanager
def hosted(engine):
    """The session's engine behind an ``EngineHost`` on a real socket, as ``EngineProcess`` serves it."""
    from colosync.control.channel import ChannelServer, EngineAddress
    from colosync.engines.host import EngineHost
    from colosync.engines.vllm.serving import VllmServing

    serving = VllmServing(engine.llm, engine=engine)
    host = EngineHost(serving.transaction(None), serving)
    folder = tempfile.mkdtemp(prefix="colosync-test-lanes-")
    address = EngineAddress(os.path.join(folder, "socket"), secrets.token_bytes(32))
    server = ChannelServer(address, host.open_session, lambda s, data: host.handle_bytes(data, s), host.close_session)
    ready = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs={"ready": ready.set}, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield address
    finally:
        server.stop()
        thread.join(30)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_connection_naming_an_adapter_updates_that_adapter_of_a_hosted_engine(engine, vllm_model_dir):
    """``EngineProcess.connect(adapter=...)``'s path: Hello names the adapter, Generate asks for it."""
    from colosync.engines.config import Generate
    from colosync.engines.process import connect

    trainer = adapter(vllm_model_dir, rank=8, seed=320)
    before = lane_generate(engine, "reference")
    with hosted(engine) as address:
        with Sender(connect(address, "vllm", "policy-trainer", adapter="policy"), transport="shm") as sender:
            uid = sender.push_peft(trainer).update_id
        reader = connect(address, "vllm", "reader")
        try:
            served = reader.call(Generate(PROMPTS, NEW, adapter="policy"))
            with pytest.raises(ConfigError, match="no adapter 'third'.*push it first"):
                reader.call(Generate(PROMPTS, NEW, adapter="third"))
        finally:
            reader.close()
    assert (served.update_id, served.tokens) == (uid, greedy(trainer, PROMPTS, NEW)[0])
    assert lane_generate(engine, "policy") == ({uid}, served.tokens)
    assert lane_generate(engine, "reference") == before


class DiesAfter:
    """A link that stops answering after two Stages, as a trainer's does when its process is killed mid-push."""

    def __init__(self, inner) -> None:
        self.inner, self.stages = inner, 0

    def submit(self, request):
        if isinstance(request, Stage):
            self.stages += 1
        if self.stages > 2:
            raise ConnectionError("the trainer is gone")
        return self.inner.submit(request)

    def close(self) -> None:
        pass


def test_a_sender_gone_mid_push_leaves_its_adapter_serving_and_the_other_untouched(engine, vllm_model_dir):
    trainer = adapter(vllm_model_dir, rank=8, seed=310)
    before = {name: lane_generate(engine, name) for name in NAMES}
    gone = Sender(DiesAfter(engine.lane("policy")), transport="shm", bucket_bytes=4 << 10)
    with pytest.raises(ConnectionError):
        gone.push_peft(trainer)
    assert {name: lane_generate(engine, name) for name in NAMES} == before
    # this process is the sender again (takeover: the gone one's half-sent update is aborted); its push recovers
    with Sender(engine.lane("policy"), transport="shm", takeover=True) as again:
        uid = again.push_peft(trainer).update_id
    assert lane_generate(engine, "policy") == ({uid}, greedy(trainer, PROMPTS, NEW)[0])
    assert lane_generate(engine, "reference") == before["reference"]
