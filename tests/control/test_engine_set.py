"""Separated mode on the CPU: one trainer, several engine processes, every update all or nothing.

The engines are real processes (``hf`` on the tiny llama where tokens are compared with the
model's own, ``store`` where committed bytes are), and the bytes cross a real torch.distributed
gloo group (``broadcast``, ``p2p``) or shared memory (``shm``, one host). A death is a real
SIGKILL of an engine process; only its moment is chosen, by the link that leads to it
(``KillEngineAt``). Nothing here is a mock of an engine.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from colosync.control.engine_set import EngineSet
from colosync.engines.config import EngineConfig, Generate
from colosync.engines.process import EngineProcess
from colosync.engines.store import Fetch
from colosync.errors import (
    ColosyncError,
    ConfigError,
    DeliveryError,
    EngineBusyError,
    EngineSetError,
    GroupJoinError,
    TransactionStateError,
)
from colosync.sync.sender import Sender
from colosync.testing import fill_lora, random_lora
from colosync.wire.manifest import dtype_from_name
from colosync.wire.protocol import Commit, Prepare, Probe, Stage, Status
from tests.faults.conftest import shm_segments
from tests.faults.updates import BUCKET_BYTES, NEW_TOKENS, PROMPTS, reference_tokens, update_for

GROUPS = ["broadcast", "p2p"]
JOIN_S = 3.0  # how long a group waits for a missing rank (and a stalled broadcast) in these tests
SCALES = {"base": 1.0, "new": 1.1, "third": 0.9}


def hf_engine(model_dir: str) -> EngineProcess:
    return EngineProcess(EngineConfig(engine="hf", model_dir=model_dir, max_lora_rank=16, timeout_s=30.0))


class Trio:
    """Three hf engine processes a, b, c, the versions they may serve and each version's greedy tokens."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.updates = {v: update_for(model_dir, scale) for v, scale in SCALES.items()}
        self.tokens = {v: reference_tokens(model_dir, named) for v, named in self.updates.items()}
        assert len({str(t) for t in self.tokens.values()}) == len(SCALES), "versions must differ in their tokens"
        self.engines = {name: hf_engine(model_dir) for name in "abc"}

    def restart(self, name: str) -> None:
        self.engines[name].close()
        self.engines[name] = hf_engine(self.model_dir)

    def set(self, names: str = "abc") -> EngineSet:
        return EngineSet({n: self.engines[n].connect(f"set-{n}") for n in names}, join_timeout_s=JOIN_S)

    def served(self, name: str) -> str:
        got = self.engines[name].call(Generate(PROMPTS, NEW_TOKENS)).tokens
        for version, tokens in self.tokens.items():
            if got == tokens:
                return version
        raise AssertionError(f"engine {name} serves tokens of no known version: {got}")

    def healthy(self, names: str, version: str) -> None:
        """Alive, nothing in flight, serving ``version``; no shared memory left behind."""
        for name in names:
            engine = self.engines[name]
            assert engine.is_alive(), f"engine {name} died"
            assert engine.call(Status()).in_flight_update_id is None, f"engine {name} has an update in flight"
            assert self.served(name) == version, f"engine {name} serves {self.served(name)}, expected {version}"
        assert not shm_segments(), f"leaked shared memory: {shm_segments()}"


@pytest.fixture(scope="module")
def trio(tiny_model_dir):
    trio = Trio(str(tiny_model_dir))
    yield trio
    for engine in trio.engines.values():
        engine.close()


@pytest.fixture(scope="module")
def stores():
    engines = {name: EngineProcess(EngineConfig(engine="store", timeout_s=30.0)) for name in "abc"}
    yield engines
    for engine in engines.values():
        engine.close()


def fetched(engine: EngineProcess) -> dict[str, torch.Tensor]:
    out = {}
    for t in engine.call(Fetch()).tensors:
        raw = torch.frombuffer(bytearray(t.data), dtype=torch.uint8) if t.data else torch.empty(0, dtype=torch.uint8)
        out[t.name] = raw.view(dtype_from_name(t.dtype)).reshape(t.shape)
    return out


# -- every engine gets every byte --------------------------------------------------------------
@pytest.mark.parametrize("transport", [*GROUPS, "shm"])
def test_every_engine_commits_the_same_bytes(stores, transport):
    g = torch.Generator().manual_seed(7)
    named = [
        ("big", torch.randn(300, 700, generator=g)),  # larger than a bucket: chunked
        ("half", torch.randn(64, 33, generator=g).to(torch.bfloat16)),
        ("ints", torch.randint(-128, 127, (1000,), generator=g, dtype=torch.int8)),
        ("empty", torch.empty(0, 8)),
    ]
    engine_set = EngineSet({n: e.connect(f"bytes-{n}") for n, e in stores.items()}, join_timeout_s=JOIN_S)
    with Sender(engine_set, transport=transport, bucket_bytes=256 << 10) as sender:
        first = None
        for round_ in range(2):  # the group is formed once and reused
            named = [(n, t + round_ if t.is_floating_point() else t) for n, t in named]
            report = sender.push(named)
            first = first or sender.transport
            assert sender.transport is first
            assert report.transport == transport
            assert [o.engine for o in report.engines] == ["a", "b", "c"]
            assert all(o.committed_update_id == report.update_id and not o.error for o in report.engines)
            for name, engine in stores.items():
                got = fetched(engine)
                for tensor_name, t in named:
                    assert torch.equal(got[tensor_name].view(torch.uint8), t.contiguous().view(torch.uint8)), (
                        f"engine {name}, tensor {tensor_name}"
                    )
    engine_set.close()


def test_engines_with_different_histories_meet_at_the_next_id(stores):
    with Sender(stores["c"].connect("ahead"), transport="shm") as ahead:  # the last member: no first-reply shortcut
        for _ in range(3):
            last = ahead.push([("x", torch.ones(4))]).update_id
    engine_set = EngineSet({n: e.connect(f"meet-{n}") for n, e in stores.items()}, join_timeout_s=JOIN_S)
    with Sender(engine_set, transport="p2p") as sender:
        report = sender.push([("x", torch.zeros(4))])
    assert report.update_id > last
    assert {e.call(Status()).committed_update_id for e in stores.values()} == {report.update_id}
    engine_set.close()


@pytest.mark.parametrize("transport", [*GROUPS, "shm"])
def test_full_and_lora_updates_match_the_model_on_every_engine(trio, transport):
    engine_set = trio.set()
    with Sender(engine_set, transport=transport, bucket_bytes=BUCKET_BYTES) as sender:
        sender.push(trio.updates["new"])
        for name in "abc":
            assert trio.served(name) == "new"
        sender.push(trio.updates["base"])  # the base the trainer's adapter sits on
        from colosync.decoding import greedy, load_model

        trainer = random_lora(load_model(trio.model_dir), rank=8, seed=4)
        for seed in (5, 6):
            fill_lora(trainer, seed)
            report = sender.push_peft(trainer, verify=Probe.from_model(trainer, PROMPTS, max_new_tokens=4))
            assert report.delivery is not None and report.delivery.max_deviation is not None
            tokens, logprobs = greedy(trainer, PROMPTS, NEW_TOKENS)
            for name, engine in trio.engines.items():
                gen = engine.call(Generate(PROMPTS, NEW_TOKENS))
                assert gen.update_id == report.update_id and gen.tokens == tokens, name
                diff = max(
                    abs(x - y) for r, s in zip(gen.logprobs, logprobs, strict=True) for x, y in zip(r, s, strict=True)
                )
                assert diff <= 1e-5, (name, diff)
        sender.push(trio.updates["base"])
    trio.healthy("abc", "base")
    engine_set.close()


def test_a_probe_that_fails_everywhere_rolls_every_engine_back(trio):
    from colosync.decoding import load_model

    engine_set = trio.set()
    with Sender(engine_set, transport="p2p", bucket_bytes=BUCKET_BYTES) as sender:
        sender.push(trio.updates["new"])
        trainer = random_lora(load_model(trio.model_dir), rank=8, seed=9)
        good = Probe.from_model(trainer, PROMPTS, max_new_tokens=4)
        lying = Probe(good.prompts, good.completions, [[lp - 1.0 for lp in row] for row in good.logprobs])
        with pytest.raises(DeliveryError, match="engine a"):
            sender.push_peft(trainer, verify=lying)
        trio.healthy("abc", "new")  # the adapter was rolled back on every engine
        sender.push(trio.updates["base"])
    engine_set.close()


def test_a_probe_that_fails_on_one_engine_is_reverted_on_all(trio):
    """Engine c serves other base weights (a full update only it got), so the trainer's probe fails there
    for real; the engines where it passed revert, and no engine serves the adapter."""
    from colosync.decoding import load_model

    with Sender(trio.engines["c"].connect("odd-one"), transport="shm", bucket_bytes=BUCKET_BYTES) as odd:
        odd.push(trio.updates["new"])
    engine_set = trio.set()
    try:
        with Sender(engine_set, transport="p2p", bucket_bytes=BUCKET_BYTES) as sender:
            trainer = random_lora(load_model(trio.model_dir), rank=8, seed=12)
            with pytest.raises(
                DeliveryError, match=r"failed verification on engine c .* reverted on a, b too"
            ) as raised:
                sender.push_peft(trainer, verify=Probe.from_model(trainer, PROMPTS, max_new_tokens=4))
            assert {o.engine: o.serving for o in raised.value.outcomes} == {"a": True, "b": True, "c": True}
            trio.healthy("ab", "base")
            trio.healthy("c", "new")
            sender.push(trio.updates["base"])
            trio.healthy("abc", "base")
    finally:
        engine_set.close()


def test_an_engine_that_refuses_the_update_does_not_hold_the_others(trio, tiny_model_dir):
    """A live engine that refuses the Begin (its LoRA slots are rank 4) never receives the stream; over
    ``p2p`` the others got their bytes regardless, and take the Abort at once, not after the group's
    timeout (30 s here). (Over gloo's ``broadcast`` tree they would wait out that timeout: see the docs.)"""
    from colosync.decoding import load_model

    small = EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir), max_lora_rank=4))
    engine_set = EngineSet(
        {"a": trio.engines["a"].connect("r-a"), "b": trio.engines["b"].connect("r-b"), "small": small.connect()},
        join_timeout_s=30.0,
    )
    try:
        with Sender(engine_set, transport="p2p", bucket_bytes=4 << 10) as sender:
            trainer = random_lora(load_model(trio.model_dir), rank=8, seed=13)
            start = time.monotonic()
            with pytest.raises(ColosyncError, match="engine small"):
                sender.push_peft(trainer)
            assert time.monotonic() - start < 15, "the others waited out the group's timeout"
        trio.healthy("ab", "base")
    finally:
        engine_set.close()
        small.close()


# -- an engine dies ----------------------------------------------------------------------------
class KillEngineAt:
    """The link to one engine of a set; SIGKILLs that engine's process at ``point`` (a real death).

    ``stage``: before its third Stage (mid-stream); ``prepare``: before its Prepare (its last
    Stages and Prepare go as one Batch), while the others prepare theirs; ``prepared``: after
    every engine voted, before the Commit goes out; ``committing``: right after its Commit was sent."""

    def __init__(self, inner, engine: EngineProcess, point: str) -> None:
        self.inner, self.engine, self.point = inner, engine, point
        self.stages = 0

    def _kill(self) -> None:
        os.kill(self.engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def submit(self, request):
        if isinstance(request, Stage):
            self.stages += 1
            if self.point == "stage" and self.stages == 3:
                self._kill()
        if isinstance(request, Commit) and self.point == "prepared":
            self._kill()
        sent = self.inner.submit(request)
        if isinstance(request, Commit) and self.point == "committing":
            self._kill()
        return sent

    def submit_batch(self, requests):
        if self.point == "prepare" and any(isinstance(r, Prepare) for r in requests):
            self._kill()
        return self.inner.submit_batch(requests)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("transport", GROUPS)
@pytest.mark.parametrize("point", ["stage", "prepare", "prepared", "committing"])
def test_an_engine_killed_at_each_phase_leaves_the_others_on_one_version(trio, transport, point):
    engine_set = trio.set("ab")
    engine_set.add("c", KillEngineAt(trio.engines["c"].connect("set-c"), trio.engines["c"], point))
    sender = Sender(engine_set, transport=transport, bucket_bytes=BUCKET_BYTES)
    try:
        with pytest.raises(ColosyncError, match="engine c") as raised:
            sender.push(trio.updates["new"])
        assert not trio.engines["c"].is_alive()
        if point in ("stage", "prepare"):  # c never voted, so no engine was asked to commit
            trio.healthy("ab", "base")
        else:  # every survivor had prepared, so every survivor committed
            assert isinstance(raised.value, EngineSetError), raised.value
            served = {o.engine: o.committed_update_id for o in raised.value.outcomes}
            assert served["a"] == served["b"] is not None and served["c"] is None, served
            assert "engine c" in str(raised.value)
            trio.healthy("ab", "new")
        engine_set.remove("c")  # the next push reaches the survivors, under a new group
        sender.push(trio.updates["third"])
        trio.healthy("ab", "third")
        trio.restart("c")  # and a restarted engine joins again, on the first try (a stream is never retried)
        engine_set.add("c", trio.engines["c"].connect("set-c"))
        base = trio.updates["base"]
        report = sender.push_stream([(n, t.shape, t.dtype) for n, t in base], iter(base))
        assert [o.committed_update_id for o in report.engines] == [report.update_id] * 3
        trio.healthy("abc", "base")
    finally:
        sender.close()
        engine_set.close()
        if not trio.engines["c"].is_alive():
            trio.restart("c")


@pytest.mark.parametrize("transport", GROUPS)
def test_a_stalled_engine_is_cut_off_and_the_others_keep_their_version(trio, transport):
    """Engine c stops (SIGSTOP) mid-stream; its link's reply timeout names it, and nobody commits."""
    stalled = trio.engines["c"]
    engine_set = trio.set("ab")
    engine_set.add("c", StopEngineAt(stalled.connect("set-c", timeout_s=JOIN_S), stalled))
    start = time.monotonic()
    try:
        with Sender(engine_set, transport=transport, bucket_bytes=BUCKET_BYTES) as sender:
            with pytest.raises(ColosyncError, match="engine c"):
                sender.push(trio.updates["new"])
            assert time.monotonic() - start < 6 * JOIN_S + 10, "a stalled engine must not hold the push"
            trio.healthy("ab", "base")
            os.kill(stalled.pid, signal.SIGCONT)
            engine_set.remove("c")
            sender.push(trio.updates["third"])
            trio.healthy("ab", "third")
            trio.healthy("c", "base")  # it saw its connection end and dropped the update it had begun
            sender.push(trio.updates["base"])
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        engine_set.close()


class StopEngineAt:
    """The link to one engine of a set; SIGSTOPs that engine's process before its third Stage (a real stall)."""

    def __init__(self, inner, engine: EngineProcess) -> None:
        self.inner, self.engine = inner, engine
        self.stages = 0

    def submit(self, request):
        if isinstance(request, Stage):
            self.stages += 1
            if self.stages == 3:
                os.kill(self.engine.pid, signal.SIGSTOP)
        return self.inner.submit(request)

    def submit_batch(self, requests):
        return self.inner.submit_batch(requests)

    def close(self) -> None:
        self.inner.close()


class ClaimsTwoWorkers:
    """A link that says its engine receives in two processes (as a vLLM engine with TP=2 would) when
    only one will open the handle: the second rank never joins. The lie is the fault; the engine is real."""

    receivers = 2

    def __init__(self, inner) -> None:
        self.inner = inner

    def submit(self, request):
        return self.inner.submit(request)

    def submit_batch(self, requests):
        return self.inner.submit_batch(requests)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("transport", GROUPS)
def test_a_rank_that_never_joins_is_named_and_nothing_changes(trio, transport):
    engine_set = EngineSet(
        {"a": trio.engines["a"].connect("join-a"), "b": ClaimsTwoWorkers(trio.engines["b"].connect("join-b"))},
        join_timeout_s=JOIN_S,
    )
    start = time.monotonic()
    missing = r"3 of its 4 ranks opened the handle \(missing ranks: \[3\]\)"
    with (
        Sender(engine_set, transport=transport, bucket_bytes=BUCKET_BYTES) as sender,
        pytest.raises(GroupJoinError, match=missing),
    ):
        sender.push(trio.updates["new"])
    assert time.monotonic() - start < 4 * JOIN_S + 10
    trio.healthy("ab", "base")
    engine_set.close()
    truthful = trio.set("ab")
    with Sender(truthful, transport=transport, bucket_bytes=BUCKET_BYTES) as sender:
        sender.push(trio.updates["new"])
        trio.healthy("ab", "new")
        sender.push(trio.updates["base"])
    truthful.close()


# -- the set's own rules ------------------------------------------------------------------------
def test_members_are_named_and_checked(stores):
    with pytest.raises(ConfigError, match="at least one engine"):
        EngineSet({})
    engine_set = EngineSet({n: e.connect() for n, e in stores.items()})
    with pytest.raises(ConfigError, match=r"already has an engine 'a'"):
        engine_set.add("a", stores["a"].connect())
    with pytest.raises(ConfigError, match=r"no engine 'z'; it has \['a', 'b', 'c'\]"):
        engine_set.remove("z")
    before = engine_set.peers
    engine_set.remove("c")
    assert engine_set.peers.receivers == 2 and engine_set.peers.generation != before.generation
    engine_set.remove("b")
    with pytest.raises(ConfigError, match="last engine"):
        engine_set.remove("a")
    assert engine_set.names == ["a"]
    engine_set.close()


def test_a_commit_without_every_vote_goes_nowhere(stores):
    engine_set = EngineSet({n: e.connect() for n, e in stores.items()})
    with pytest.raises(TransactionStateError, match="without a Prepare of it to every engine"):
        engine_set.submit(Commit(99)).wait()
    assert {e.call(Status()).committed_update_id for e in stores.values()} != {99}
    engine_set.close()


def test_engines_placed_by_ray_form_a_set():
    """Engines as Ray actors in a placement group (one bundle each), reached through ``RayLink``."""
    ray = pytest.importorskip("ray")
    import msgspec
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from colosync.control.ray import RayLink
    from colosync.engines.ray_actor import EngineActor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD")
        ray.get(group.ready(), timeout=60)
        config = msgspec.msgpack.encode(EngineConfig(engine="store", timeout_s=30.0))
        actors = [
            ray.remote(num_cpus=1)(EngineActor)
            .options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
            .remote(config)
            for i in range(2)
        ]
        links = {f"ray{i}": RayLink(actor, "store") for i, actor in enumerate(actors)}
        engine_set = EngineSet(links, host=ray.util.get_node_ip_address(), join_timeout_s=30.0)
        named = [("w", torch.arange(50_000, dtype=torch.float32)), ("b", torch.ones(7, dtype=torch.bfloat16))]
        with Sender(engine_set, transport="p2p", bucket_bytes=64 << 10) as sender:
            report = sender.push(named)
        assert [o.committed_update_id for o in report.engines] == [report.update_id] * 2
        for link in links.values():
            got = {t.name: t for t in link.call(Fetch()).tensors}
            assert got["w"].data == named[0][1].numpy().tobytes()
        assert len({ray.get(actor.pid.remote()) for actor in actors}) == 2
        remove_placement_group(group)
    finally:
        ray.shutdown()


def test_an_engine_that_refuses_the_attach_leaves_no_other_engine_attached(stores):
    """Engine c is owned by another sender, so the set's Attach fails there; a and b must not stay owned."""
    with Sender(stores["c"].connect("owner"), transport="shm") as owner:
        owner.push([("x", torch.ones(3))])
        engine_set = EngineSet({n: e.connect(f"refused-{n}") for n, e in stores.items()}, join_timeout_s=JOIN_S)
        with Sender(engine_set, transport="shm") as sender, pytest.raises(EngineBusyError, match="engine c"):
            sender.push([("x", torch.zeros(3))])
        for name in "ab":  # detached while the set's connections stay open: a new sender attaches, no takeover
            with Sender(stores[name].connect("next"), transport="shm") as nxt:
                nxt.push([("x", torch.full((3,), 2.0))])
        engine_set.close()
