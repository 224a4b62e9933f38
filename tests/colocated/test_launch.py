"""Where a trainer runs: a trainer class from the caller's own module, errors that come back
as the class they were raised as, and a Ray cluster that leaves the caller's Ray and no actor
behind (real processes and a real local Ray)."""

from __future__ import annotations

import time

import pytest

from colosync.colocated.cluster import Cluster
from colosync.colocated.launch import ActorProcess, RayTrainer, trainer_class
from colosync.engines.synthetic import Digest, SyntheticModel
from colosync.errors import ColosyncError, ConfigError, DeliveryError, HandoffInvariantError

MiB = 1 << 20
USER = "tests.colocated.user_actor:EchoActor"
SYNTHETIC = "colosync.colocated.synthetic:SyntheticTrainer"


def test_a_trainer_class_from_the_callers_module_runs_and_its_errors_keep_their_class():
    trainer = ActorProcess(USER, greeting="hi")
    try:
        assert trainer.call("echo", 3) == ["hi", 3] and trainer.pid != 0
        with pytest.raises(DeliveryError) as refused:
            trainer.call("fail", "DeliveryError", "max |delta logprob| 0.3 > 0.01")
        assert str(refused.value) == "max |delta logprob| 0.3 > 0.01"  # the message as raised
        assert any("raised in the trainer process, in fail" in note for note in refused.value.__notes__)
        with pytest.raises(HandoffInvariantError, match="broke"):  # a subclass with more constructor arguments
            trainer.call("fail", "HandoffInvariantError", "an invariant broke")
        with pytest.raises(ColosyncError, match="failed in fail: ValueError: not a colosync error") as other:
            trainer.call("fail", "ValueError", "not a colosync error")
        assert type(other.value) is ColosyncError
        with pytest.raises(ConfigError, match="no method"):
            trainer.call("_private")
        assert trainer.call("echo", [1, 2]) == ["hi", [1, 2]]  # the process still serves after each error
    finally:
        trainer.close()
    assert not trainer.is_alive()


def test_a_trainer_that_fails_to_start_raises_its_own_class():
    with pytest.raises(ConfigError, match="synthetic.json does not exist"):
        ActorProcess(SYNTHETIC, model_dir="/nonexistent", engine=b"")


@pytest.mark.parametrize(
    "path, why",
    [
        ("EchoActor", "module:Class"),
        ("colosync.colocated:", "module:Class"),
        ("no.such.module_here:EchoActor", "cannot import"),
        ("tests.colocated.user_actor:Missing", "has no 'Missing'"),
        ("tests.colocated.user_actor:os", "not a class"),
    ],
)
def test_a_trainer_class_path_is_checked(path, why):
    with pytest.raises(ConfigError, match=why):
        trainer_class(path)
    assert trainer_class(USER).__name__ == "EchoActor"


@pytest.fixture(scope="module")
def callers_ray():
    """A local Ray the test initialises itself, as a job that uses Ray for more than colosync does."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def ray_cluster_kwargs(tmp_path):
    folder = str(SyntheticModel(2 * MiB, MiB, MiB, seed=3).save(tmp_path))
    trainer = dict(model_dir=folder, engine_name="synthetic", transport="shm", device="cpu", bucket_bytes=MiB)
    return dict(engine="synthetic", model_dir=folder, device="cpu", threads=1, trainer_actor=SYNTHETIC,
                trainer_kwargs=trainer)  # fmt: skip


def test_a_ray_cluster_whose_trainer_fails_to_start_kills_its_engine_actor(callers_ray, ray_cluster_kwargs):
    ray = callers_ray
    ray_cluster_kwargs["trainer_kwargs"]["optimizer_shards"] = 0  # the trainer actor dies in its constructor
    with pytest.raises(Exception, match="optimizer_shards"):
        Cluster("ray", **ray_cluster_kwargs)
    assert ray.is_initialized(), "a failed Cluster shut down the caller's Ray"
    deadline = time.monotonic() + 15
    while ray.available_resources().get("CPU", 0) < 2:  # the engine actor's CPU comes back once it is gone
        assert time.monotonic() < deadline, "the engine actor of the cluster that failed to start is still alive"
        time.sleep(0.1)


def test_closing_a_ray_cluster_kills_its_actors_and_leaves_the_callers_ray_running(callers_ray, ray_cluster_kwargs):
    ray = callers_ray
    with Cluster("ray", **ray_cluster_kwargs) as cluster:
        assert cluster.driver.call(Digest()).update_id >= 0
        assert isinstance(cluster.trainer, RayTrainer)
        actors = [cluster._engine_actor, cluster.trainer.actor]
    assert ray.is_initialized(), "Cluster.close() shut down the caller's Ray"
    deadline = time.monotonic() + 30
    for actor in actors:  # ray.kill is asynchronous: a call may still be answered until the kill lands
        while True:
            try:
                ray.get(actor.pid.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                pass  # busy or dying: ask again
            assert time.monotonic() < deadline, "an actor of the closed cluster is still serving"
            time.sleep(0.2)
