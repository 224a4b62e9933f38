"""The executor driving an engine in its own process (a real hf EngineProcess) and a trainer
in this one: the plan's cycles with every invariant checked as measured across both
processes, through one shared host arena or private pools, and an engine that dies mid-op."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import msgspec
import pytest
import torch

from colosync.control.channel import EngineAddress
from colosync.engines.config import Generate
from colosync.engines.process import EngineConfig, EngineProcess
from colosync.errors import HandoffInvariantError, ParticipantError
from colosync.handoff import PhaseName, Region, build_plan
from colosync.handoff.backends.arena import PREFIX, HostArena
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.handoff.runtime.invariants import NoCoexistingHostCopies
from colosync.wire.protocol import MemoryOp
from tests.helpers import CHUNK, make_trainer_state

PROMPT = [[1, 2, 3, 4]]
BACKUP = 48 << 20  # make_trainer_state(): 4 x 4 MiB weights + AdamW's two moments


def arenas() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(PREFIX))


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory):
    """A tiny Llama whose weights (104 MiB) are large enough to see on the host."""
    from colosync.testing import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("models") / "llama-104m",
        seed=0,
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.fixture(scope="module")
def big_engine(big_model_dir):
    engine = EngineProcess(EngineConfig(engine="hf", model_dir=str(big_model_dir)))
    yield engine
    engine.close()


def test_private_pools_break_gpu_mode_as_measured_across_processes(big_model_dir):
    # The order is right but each process keeps its own pool's chunks: only measuring both
    # processes sees that two copies' memory is on the host. A fresh engine process: one that
    # has already freed memory could hand it to the new pool without its RSS growing.
    with EngineProcess(EngineConfig(engine="hf", model_dir=str(big_model_dir))) as fresh:
        _private_pools_break_gpu_mode(fresh)


def _private_pools_break_gpu_mode(big_engine: EngineProcess) -> None:
    engine = big_engine.memory(chunk_bytes=CHUNK, pin="none")
    trainer = TorchTrainerMemory(loader=make_trainer_state, pool=HostPool(chunk_bytes=CHUNK, pin="none"), device="cpu")
    executor = HandoffExecutor(trainer, engine, invariants=[NoCoexistingHostCopies()])
    with pytest.raises(HandoffInvariantError, match=r"no-coexisting-host-copies broke at rollout_to_train step 3"):
        executor.run(build_plan(peak_device="gpu"), cycles=1)
    engine.onload_weights()  # leave the engine serving for the tests after this one
    assert big_engine.call(Generate(PROMPT, 6)).tokens


def test_remote_engine_gpu_mode_through_one_arena(big_engine):
    before = big_engine.call(Generate(PROMPT, 6)).tokens
    plan = build_plan(peak_device="gpu")
    engine = big_engine.memory(chunk_bytes=CHUNK, pin="none")  # its sizes first, to size the arena
    mirror = engine.region_bytes()[Region.ENGINE_MIRROR]
    assert engine.pid == big_engine.pid and mirror > 100 << 20
    arena = HostArena.for_plan(
        plan, {Region.ENGINE_MIRROR: mirror, Region.TRAINER_BACKUP: BACKUP}, chunk_bytes=CHUNK, pin="none"
    )
    try:
        engine = big_engine.memory(arena=arena, pin="none")  # the engine maps the arena
        arena.seal()
        assert arena.name not in arenas()  # this test's own segment: others may run beside it
        assert arena.nbytes < mirror + BACKUP  # room for one copy, not two
        trainer = TorchTrainerMemory(loader=make_trainer_state, pool=arena.pool(), device="cpu")
        executor = HandoffExecutor(trainer, engine, pools=[arena.pool()])
        served = []

        def between(phase: PhaseName) -> None:
            if phase is PhaseName.ROLLOUT_TO_TRAIN:  # the trainer's turn: one training step
                trainer.model(torch.randn(2, 1024)).sum().backward()
            else:  # the engine's turn: it serves
                served.append(big_engine.call(Generate(PROMPT, 6)).tokens)

        result = executor.run(plan, cycles=2, between=between)
        assert not result.violations
        offload = next(r for r in result.records if r.step.startswith("engine.offload_weights"))
        assert offload.report.participant == "engine" and offload.report.bytes_to_host == mirror
        assert offload.held_after == ["engine.mirror", "trainer.state", "trainer.grad_buffer", "trainer.cache"]
        # the engine's mirror went into the arena's pages and came back intact, twice
        assert len(served) == 3 and served[0] == served[-1] == before
        # host copies as measured over both processes: the arena (counted once), never two copies
        assert result.host_peak <= arena.nbytes * 1.05 + CHUNK
    finally:
        arena.close()
    assert arena.name not in arenas()  # this test's own segment: others may run beside it


def test_remote_engine_cpu_mode_measures_the_mirror_in_the_engine_process(big_engine):
    engine = big_engine.memory(chunk_bytes=CHUNK, pin="none")  # a private pool in the engine process
    trainer = TorchTrainerMemory(loader=make_trainer_state, pool=HostPool(chunk_bytes=CHUNK, pin="none"), device="cpu")
    result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="cpu"), cycles=1)
    assert not result.violations
    both = engine.region_bytes()[Region.ENGINE_MIRROR] + trainer.region_bytes()[Region.TRAINER_BACKUP]
    # the mirror lives in the other process: measured there, it still adds up to both copies
    assert result.host_peak >= 0.8 * both, (result.host_peak, both)
    assert big_engine.call(Generate(PROMPT, 6)).tokens


def _trainer_process(conn) -> None:
    """A trainer in a process of its own, serving its memory to a controller."""
    from colosync.engines.process import ParticipantServer
    from colosync.handoff.runtime.remote import MemoryService

    make_trainer_state(layers=1, width=64)  # a first optimizer step imports modules: not the trainer's memory
    service = MemoryService(factory=lambda pool: TorchTrainerMemory(loader=make_trainer_state, pool=pool, device="cpu"))
    with ParticipantServer(service) as server:
        conn.send(msgspec.msgpack.encode(server.address))
        conn.recv()  # serve until the controller is done


def test_a_controller_drives_a_trainer_process_and_an_engine_process(big_engine):
    """Three processes: this one only controls; the trainer and the engine each map the arena."""
    from colosync.engines.process import connect_trainer

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_trainer_process, args=(there,), daemon=True)
    proc.start()
    plan = build_plan(peak_device="gpu")
    mirror = big_engine.memory(chunk_bytes=CHUNK, pin="none").region_bytes()[Region.ENGINE_MIRROR]
    arena = HostArena.for_plan(
        plan, {Region.ENGINE_MIRROR: mirror, Region.TRAINER_BACKUP: BACKUP}, chunk_bytes=CHUNK, pin="none"
    )
    try:
        address = msgspec.msgpack.decode(here.recv(), type=EngineAddress)
        trainer = connect_trainer(address, arena=arena, pin="none", alive=proc.is_alive)
        engine = big_engine.memory(arena=arena, pin="none")
        arena.seal()
        assert trainer.pid == proc.pid and engine.pid == big_engine.pid and trainer.pid != os.getpid()
        executor = HandoffExecutor(trainer, engine, pools=[arena.pool()])
        result = executor.run(plan, cycles=2)
        assert not result.violations
        sleep = next(r for r in result.records if r.step == "trainer.sleep")
        assert sleep.report.participant == "trainer" and sleep.report.bytes_to_host >= BACKUP
        assert trainer.regions() == {Region.TRAINER_BACKUP}  # asleep in the arena, held by its own process
        assert any("trainer.state" in who and f"pid {proc.pid}" in who for who in arena.holders())
        assert big_engine.call(Generate(PROMPT, 6)).tokens
    finally:
        here.send("stop")
        proc.join(30)
        arena.close()
    assert proc.exitcode == 0 and arena.name not in arenas()


def test_remote_engine_in_a_ray_actor(big_model_dir):
    """The same requests through a Ray actor's ``handle``: cpu order, the mirror measured in the actor."""
    ray = pytest.importorskip("ray")
    from colosync.control.ray import RayLink
    from colosync.engines.ray_actor import EngineActor, remote_engine_memory

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = EngineConfig(engine="hf", model_dir=str(big_model_dir))
        actor = ray.remote(num_cpus=1)(EngineActor).remote(msgspec.msgpack.encode(config))
        before = RayLink(actor, "hf").call(Generate(PROMPT, 6)).tokens
        engine = remote_engine_memory(actor, "hf", chunk_bytes=CHUNK, pin="none")
        assert engine.pid == ray.get(actor.pid.remote()) != os.getpid()
        pool = HostPool(chunk_bytes=CHUNK, pin="none")
        trainer = TorchTrainerMemory(loader=make_trainer_state, pool=pool, device="cpu")
        result = HandoffExecutor(trainer, engine).run(build_plan(peak_device="cpu"), cycles=1)
        assert not result.violations
        both = engine.region_bytes()[Region.ENGINE_MIRROR] + trainer.region_bytes()[Region.TRAINER_BACKUP]
        assert result.host_peak >= 0.8 * both, (result.host_peak, both)
        assert RayLink(actor, "hf").call(Generate(PROMPT, 6)).tokens == before
    finally:
        ray.shutdown()


class KillDuring:
    """Forwards to a ``SocketLink``; for operation ``op`` it freezes the engine, sends the
    request and SIGKILLs the engine before it can answer. Only the moment is chosen; the
    death is real."""

    def __init__(self, inner, pid: int, op: str) -> None:
        self.inner, self.pid, self.op = inner, pid, op

    def call(self, request):
        if isinstance(request, MemoryOp) and request.op == self.op:
            os.kill(self.pid, signal.SIGSTOP)
            pending = self.inner.submit(request)
            os.kill(self.pid, signal.SIGKILL)
            return pending.wait()
        return self.inner.call(request)


def test_engine_dies_mid_operation(tiny_model_dir):
    proc = EngineProcess(EngineConfig(engine="hf", model_dir=str(tiny_model_dir)))
    plan = build_plan(peak_device="gpu")
    arena = HostArena.for_plan(
        plan, {Region.ENGINE_MIRROR: 8 << 20, Region.TRAINER_BACKUP: BACKUP}, chunk_bytes=CHUNK, pin="none"
    )
    try:
        engine = proc.memory(arena=arena, pin="none")  # not sealed: a kill must not leave the name behind
        trainer = TorchTrainerMemory(loader=make_trainer_state, pool=arena.pool(), device="cpu")
        executor = HandoffExecutor(trainer, engine, pools=[arena.pool()])
        executor.run_phase(plan, "init")
        engine.link = KillDuring(engine.link, proc.pid, "engine.offload_weights")
        with pytest.raises(ParticipantError) as info:
            executor.run_phase(plan, "rollout_to_train")  # wake_up, then the engine dies releasing its weights
        message = str(info.value)
        assert "engine participant 'engine'" in message and f"pid {proc.pid}" in message and "died" in message
        assert "during engine.offload_weights at rollout_to_train step 3" in message
        assert (info.value.participant, info.value.op, info.value.phase, info.value.step) == (
            "engine",
            "engine.offload_weights",
            "rollout_to_train",
            3,
        )
        # the trainer keeps its state: awake, its tensors intact, and it can still sleep into the arena
        assert trainer.regions() >= {Region.TRAINER_STATE} and not trainer.asleep
        weights = [p.detach().clone() for p in trainer.model.parameters()]
        assert trainer.sleep().bytes_to_host > 0 and not trainer.wake_up().noop
        assert all(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters(), strict=True))
    finally:
        proc.close()
        arena.close()
    assert arena.name not in arenas()  # this test's own segment: others may run beside it
