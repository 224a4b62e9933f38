"""``Colocated.step`` against real processes: an engine process and a trainer process, this test
the controller. The synthetic pair checks the step's order and records (every weight the engine
serves must be the trainer's); the hf engine with the demo's LoRA trainer checks the probe that
rides the push (a wrong one is refused and the engine keeps serving the update before it)."""

from __future__ import annotations

import pytest

from colosync.colocated.cluster import Cluster
from colosync.colocated.step import Colocated
from colosync.engines.config import Generate, Score
from colosync.engines.synthetic import Digest, SyntheticModel
from colosync.errors import ColosyncError, ConfigError, DeliveryError
from colosync.handoff import build_plan
from colosync.wire.protocol import Probe

MiB = 1 << 20
SYNTHETIC = "colosync.colocated.synthetic:SyntheticTrainer"
LORA = "colosync.demo.actors:TrainerActor"


def ops(peak_device: str, phase: str) -> list[str]:
    return [s.label for s in build_plan(peak_device=peak_device, sync=True).phase(phase).steps]


@pytest.fixture
def synthetic(tmp_path):
    folder = SyntheticModel(4 * MiB, MiB, MiB, seed=3).save(tmp_path)
    kwargs = dict(model_dir=str(folder), engine_name="synthetic", transport="shm", device="cpu", bucket_bytes=MiB)
    with Cluster(
        "process", engine="synthetic", model_dir=str(folder), device="cpu", threads=1,
        trainer_actor=SYNTHETIC, trainer_kwargs=kwargs,
    ) as cluster:  # fmt: skip
        yield cluster


@pytest.mark.parametrize("peak_device", ["gpu", "cpu"])
def test_each_step_hands_over_trains_and_syncs_inside_the_handoff(synthetic, peak_device):
    cluster = synthetic
    with Colocated(cluster, peak_device, bucket_bytes=MiB, pin="none") as colo:
        with pytest.raises(ConfigError, match="before init"):
            colo.step(lambda: None, lambda _: None)
        init = colo.init()
        assert init is not None and init.steps == ops(peak_device, "init") and not init.violations
        assert colo.arena_bytes > 0
        order: list[str] = []
        served_before = cluster.driver.call(Digest())

        def rollout():
            order.append("rollout")
            return cluster.driver.call(Digest())

        def train(served):
            order.append("train")
            cluster.trainer.call("train_step")
            return cluster.trainer.call("digest")

        def check(want, sync):
            order.append("check")
            served = cluster.driver.call(Digest())
            return served.update_id == sync.update_id and list(served.fingerprints) == list(want)

        records = [colo.step(rollout, train, check=check) for _ in range(2)]
    assert order == ["rollout", "train", "check"] * 2
    first, second = records
    assert first.rollout.update_id == served_before.update_id  # the rollout served the version before the step
    assert second.rollout.update_id == first.sync.update_id
    assert [r.sync.update_id for r in records] == [served_before.update_id + 1, served_before.update_id + 2]
    for record in records:
        assert record.checked is True, "the engine does not serve the trainer's weights after the sync"
        assert record.trained != list(served_before.fingerprints)  # the step changed the weights
        assert record.rollout_to_train is not None and record.train_to_rollout is not None
        assert record.rollout_to_train.steps == ops(peak_device, "rollout_to_train")
        assert record.train_to_rollout.steps == ops(peak_device, "train_to_rollout")
        assert "sync.weights" in record.train_to_rollout.steps and record.violations == []
        assert record.sync_s == record.train_to_rollout.sync_seconds > 0
        assert record.sync.kind == "full" and record.sync.bytes > 0 and not record.verified
        assert record.seconds >= record.rollout_s + record.train_s + record.check_s
    assert list(colo.sync.reports) == [r.sync for r in records]


def test_a_step_that_verifies_nothing_new_is_refused_before_check(synthetic):
    """A plan without the sync would leave the engine on the old weights: the step says so."""
    with Colocated(synthetic, "gpu", bucket_bytes=MiB, pin="none") as colo:
        colo.init()
        assert colo.handoff is not None
        colo.handoff.sync.push = lambda _mark: None  # the sync.weights step runs, but pushes nothing
        with pytest.raises(ConfigError, match="ran no sync"):
            colo.step(lambda: None, lambda _: cluster_step(synthetic), check=lambda *_: pytest.fail("checked"))


def cluster_step(cluster: Cluster) -> None:
    cluster.trainer.call("train_step")


def test_a_sync_refused_inside_the_handoff_finishes_the_phase_and_the_next_step_runs(synthetic):
    """The push of ``train_to_rollout`` carries a probe the synthetic engine cannot score, so the
    engine refuses it: the phase still ends with the trainer asleep and the engine's KV back,
    the refusal raises from the step, and the next step runs against the plan."""
    cluster = synthetic

    def train(_):
        cluster.trainer.call("train_step")
        return cluster.trainer.call("digest")

    def check(want, sync):
        served = cluster.driver.call(Digest())
        return served.update_id == sync.update_id and list(served.fingerprints) == list(want)

    with Colocated(cluster, "cpu", bucket_bytes=MiB, pin="none") as colo:
        colo.init()
        served_before = cluster.driver.call(Digest())
        with pytest.raises(ConfigError, match="cannot score a probe"):
            colo.step(lambda: None, train, probe=lambda _: PROBE, check=lambda *_: pytest.fail("checked"))
        assert colo.broken is None and colo.sync.syncs == 0 and colo.sync.due()
        assert cluster.driver.call(Digest()).update_id == served_before.update_id  # nothing was installed
        records = [colo.step(lambda: cluster.driver.call(Digest()), train, check=check) for _ in range(2)]
    for record in records:
        assert record.violations == [], record.violations
        assert record.rollout_to_train is not None and record.rollout_to_train.steps == ops("cpu", "rollout_to_train")
        assert record.checked is True, "the engine does not serve the trainer's weights after the sync"
    assert records[0].rollout.update_id == served_before.update_id
    assert colo.sync.syncs == 2 and list(colo.sync.reports) == [r.sync for r in records]


def test_a_step_whose_train_raises_between_the_phases_refuses_the_next_step(synthetic):
    """``train`` raised with the trainer awake and the engine offloaded: no later step may roll
    out against that engine, and the refusal says why."""

    def train(_):
        raise RuntimeError("out of patience")

    with Colocated(synthetic, "cpu", bucket_bytes=MiB, pin="none") as colo:
        colo.init()
        with pytest.raises(RuntimeError, match="out of patience"):
            colo.step(lambda: None, train)
        assert colo.broken is not None and "train raised RuntimeError" in colo.broken
        with pytest.raises(ColosyncError, match="cannot step: train raised RuntimeError between the handoff's phases"):
            colo.step(lambda: pytest.fail("rolled out"), train)


PROBE = Probe([[1, 2]], [[3]], [[-0.5]], tolerance=1e-4)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    from colosync.testing import make_tiny_llama

    model_dir = str(make_tiny_llama(tmp_path_factory.mktemp("colocated") / "tiny-llama", seed=0))
    kwargs = dict(
        model_dir=model_dir, engine_name="hf", transport="shm", rank=8, alpha=16.0, lr=5e-2, seed=0,
        device="cpu", threads=1,
    )  # fmt: skip
    with Cluster(
        "process", engine="hf", model_dir=model_dir, device="cpu", threads=1, trainer_actor=LORA,
        trainer_kwargs=kwargs,
    ) as cluster:  # fmt: skip
        yield cluster


PROMPTS, COMPLETIONS = [[1, 5, 6, 7]], [[8, 9, 10, 11]]


def _rollout(cluster):
    return lambda: cluster.driver.call(Generate(PROMPTS, 4, temperature=1.0, seed=0)).tokens


def _train(cluster):
    def train(tokens):
        cluster.trainer.call("train_step", PROMPTS, tokens, [[1.0] * len(tokens[0])])
        return cluster.trainer.call("score", PROMPTS, COMPLETIONS)

    return train


def test_without_the_handoff_a_probe_rides_every_due_push(lora):
    made: list[int] = []

    def probe(reference):
        made.append(len(made))
        return Probe(PROMPTS, COMPLETIONS, reference, tolerance=1e-4)

    colo = Colocated(lora, None, verify_every=2)
    assert colo.init() is None and colo.arena_bytes == 0
    first = colo.push()  # the trainer's first adapter, before any step: due, but no probe rode it
    assert colo.sync.due()  # so the first step's push verifies
    records = [colo.step(_rollout(lora), _train(lora), probe=probe) for _ in range(4)]
    assert made == [0, 1]  # pushes 2 and 4 verify; the probe is made only for them
    assert [r.verified for r in records] == [True, False, True, False]
    assert [r.sync.update_id for r in records] == [first.update_id + i for i in (1, 2, 3, 4)]
    for record in records:
        delivery = record.sync.delivery
        assert record.rollout_to_train is None and record.train_to_rollout is None and record.sync_s > 0
        assert delivery is not None
        assert (delivery.max_deviation is not None) == record.verified
        if record.verified:
            assert delivery.max_deviation <= 1e-4
    served = lora.driver.call(Score(PROMPTS, COMPLETIONS))
    assert served.update_id == records[-1].sync.update_id
    assert served.logprobs[0] == pytest.approx(records[-1].trained[0], abs=1e-5)


def test_a_probe_that_does_not_match_is_refused_and_the_engine_keeps_the_update_before(lora):
    colo = Colocated(lora, None)
    good = colo.step(_rollout(lora), _train(lora), probe=lambda ref: Probe(PROMPTS, COMPLETIONS, ref, 1e-4))
    assert good.verified and good.sync.delivery is not None and good.sync.delivery.max_deviation <= 1e-4
    wrong = lambda ref: Probe(PROMPTS, COMPLETIONS, [[x - 1.0 for x in row] for row in ref], 1e-4)  # noqa: E731
    with pytest.raises(DeliveryError):  # the engine's refusal, as the class it was raised as
        colo.step(_rollout(lora), _train(lora), probe=wrong, check=lambda *_: pytest.fail("checked"))
    served = lora.driver.call(Score(PROMPTS, COMPLETIONS))
    assert served.update_id == good.sync.update_id  # the refused update was rolled back
    assert served.logprobs[0] == pytest.approx(good.trained[0], abs=1e-5)
    assert colo.sync.last is good.sync and colo.sync.syncs == 1  # a refused push is not counted


def test_peak_device_is_checked():
    with pytest.raises(ConfigError, match="peak_device"):
        Colocated(None, "both")  # type: ignore[arg-type]
