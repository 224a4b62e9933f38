"""The engine lends its KV cache's block to the trainer (``HandoffConfig(lend_kv=True)``).

On the CPU the block is a POSIX shared-memory segment, lent across real processes here; the
same participants and executor run it over CUDA IPC on a GPU (``tests/tools/test_step_bench.py``,
gpu marker). What is checked: the trainer's state wakes up inside the engine's block with its
values, the engine gets the block back zeroed, no handoff operation allocates or frees it, a
trainer too large for the block is refused before anything moves, and a borrower that dies
costs the lender nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import msgspec
import pytest
import torch

from colosync.errors import PlanError, StashError, UnsupportedOperation
from colosync.handoff import PhaseName, Region, build_plan
from colosync.handoff.backends.host_pool import HostPool
from colosync.handoff.backends.loan import PREFIX, DeviceLoan
from colosync.handoff.backends.stash import TensorStash
from colosync.handoff.backends.torch_engine import TorchEngineMemory
from colosync.handoff.backends.torch_trainer import TorchTrainerMemory
from colosync.handoff.model.plans import HandoffConfig, Plan
from colosync.handoff.model.simulator import HandoffSizes, simulate
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.wire.protocol import LoanHandle
from tests.helpers import CHUNK, make_engine_state, make_trainer_state

MiB = 1 << 20


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(PREFIX + "*")}


def _pair(kv_tensors: int = 6) -> tuple[TorchTrainerMemory, TorchEngineMemory]:
    pool = HostPool(chunk_bytes=CHUNK, pin="none")
    model, kv = make_engine_state(kv_tensors=kv_tensors)  # 16 MiB per KV tensor
    engine = TorchEngineMemory(model, kv, pool=pool, device="cpu")
    trainer = TorchTrainerMemory(loader=make_trainer_state, pool=pool, device="cpu")  # 48 MiB state, 16 MiB grads
    return trainer, engine


def _sums(tensors) -> list[float]:
    """One number per tensor (copies of the state would count as host memory the plan does not expect)."""
    return [float(t.detach().sum(dtype=torch.float64)) for t in tensors]


def test_the_trainer_wakes_up_in_the_engines_kv_block_and_nothing_is_allocated_or_freed():
    before = _segments()
    trainer, engine = _pair()
    executor = HandoffExecutor(trainer, engine)
    plan = build_plan(peak_device="gpu", lend_kv=True)
    executor.run_phase(plan, PhaseName.INIT)
    assert engine.loan is None  # init runs as without a loan
    kept = None
    for cycle in range(2):
        executor.run_phase(plan, PhaseName.ROLLOUT_TO_TRAIN)
        loan = engine.loan
        assert loan is not None and trainer.loan is not None and trainer.loan.handle == loan.handle
        state = list(trainer.state_tensors())
        assert state and all(loan.contains(t) for t in state)  # woken up inside the engine's block
        assert all(loan.contains(p.grad) for p in trainer.model.parameters())  # the grad buffer too, zeroed
        assert all(not p.grad.any() for p in trainer.model.parameters())
        if kept is not None:
            assert _sums(state) == kept  # its values survived the sleep and the wake-up
        with torch.no_grad():  # "train": every value changes
            for t in state:
                t.add_(cycle + 1)
        kept = _sums(state)
        executor.run_phase(plan, PhaseName.TRAIN_TO_ROLLOUT)
        kv = engine.kv_tensors()
        assert all(loan.contains(t) and not t.any() for t in kv)  # the engine's KV cache is back, zeroed
    result = executor.result
    assert result is not None and not result.violations
    ops = {(r.phase, r.step): r.report for r in result.records if r.phase != "init"}
    for op in ("engine.offload_kv", "trainer.wake_up"):
        report = ops[("rollout_to_train", op)]
        assert report.device_allocated == 0 and report.device_freed == 0, report
    for op in ("trainer.offload_grad_buffer", "trainer.sleep", "engine.onload_kv"):
        report = ops[("train_to_rollout", op)]
        assert report.device_allocated == 0 and report.device_freed == 0, report
    assert ops[("rollout_to_train", "trainer.wake_up")].bytes_to_device > 0  # the state was copied in
    assert engine.lend() == loan.handle  # lent once, the same block after
    trainer.close()  # the borrower first
    engine.close()
    assert _segments() == before


def test_a_trainer_larger_than_the_block_is_refused_before_anything_moves():
    trainer, engine = _pair(kv_tensors=2)  # 32 MiB of KV cache against 48 MiB of state + 16 of grads
    executor = HandoffExecutor(trainer, engine)
    plan = build_plan(peak_device="gpu", lend_kv=True)
    executor.run_phase(plan, PhaseName.INIT)
    with pytest.raises(StashError, match="do not fit .* the engine lends; give the engine a larger KV cache"):
        executor.run_phase(plan, PhaseName.ROLLOUT_TO_TRAIN)  # refused as the trainer borrows
    assert trainer.asleep and trainer.regions() == {Region.TRAINER_BACKUP}  # still asleep, its backup intact
    assert trainer.loan is None and not executor.lent
    assert engine.loan is not None and Region.ENGINE_KV in engine.regions()  # the engine still serves
    engine.close()


def test_a_custom_order_that_puts_the_kv_cache_beside_the_trainer_in_the_block_is_refused():
    phases = {
        "init": ["engine.offload_kv", "trainer.load", "trainer.sleep", "engine.onload_kv"],
        "rollout_to_train": ["engine.offload_kv", "engine.offload_weights", "trainer.wake_up"],
        "train_to_rollout": ["engine.onload_weights", "engine.onload_kv", "trainer.sleep"],
    }
    with pytest.raises(PlanError, match=r"step 2 engine.onload_kv: with lend_kv .* put engine.offload_kv before"):
        Plan.from_ops(HandoffConfig(lend_kv=True), phases)
    Plan.from_ops(HandoffConfig(), phases)  # without the loan the same order is valid


def test_a_tensor_left_viewing_the_block_after_a_sleep_is_reported(caplog):
    trainer, engine = _pair()
    executor = HandoffExecutor(trainer, engine)
    plan = build_plan(peak_device="gpu", lend_kv=True)
    executor.run_phase(plan, PhaseName.INIT)
    executor.run_phase(plan, PhaseName.ROLLOUT_TO_TRAIN)
    kept = next(trainer.model.parameters()).detach()  # a reference the stash is not given
    with caplog.at_level("WARNING"):
        executor.run_phase(plan, PhaseName.TRAIN_TO_ROLLOUT)
    assert "still view the lent memory" in caplog.text
    assert engine.loan is not None and engine.loan.contains(kept)
    del kept
    trainer.close()
    engine.close()


def test_the_plan_refuses_a_loan_the_trainer_does_not_fit_and_counts_the_block_once():
    sizes = HandoffSizes(
        engine_weight_bytes=16 << 30,
        engine_kv_bytes=100 << 30,
        trainer_resident_bytes=50 << 30,
        trainer_backup_bytes=32 << 30,
        trainer_grad_buffer_bytes=16 << 30,
    )
    lent = simulate(build_plan(peak_device="gpu", lend_kv=True), sizes)
    rows = {(r.phase, r.step): r for r in lent.rows}
    base = sizes.device_baseline_bytes
    # the block (100) + the engine's weights (16) + the trainer's cache (2), never the state inside the block
    assert rows[("rollout_to_train", "trainer.wake_up")].device_peak - base == (100 + 16 + 2) << 30
    assert rows[("rollout_to_train", "engine.offload_kv")].device_after - base == (100 + 16) << 30  # not freed
    assert rows[("init", "engine.offload_kv")].device_after - base == 16 << 30  # init runs without the loan
    small = msgspec.structs.replace(sizes, engine_kv_bytes=40 << 30)
    with pytest.raises(PlanError, match="do not fit the engine's KV cache .* plan without lend_kv"):
        simulate(build_plan(peak_device="gpu", lend_kv=True), small)
    with pytest.raises(PlanError, match="needs trainer_offload=True and engine_offload=True"):
        HandoffConfig(lend_kv=True, engine_offload=False)


def test_restoring_into_memory_of_the_wrong_size_is_refused_and_changes_nothing():
    stash = TensorStash("t", "cpu", HostPool(chunk_bytes=CHUNK, pin="none"))
    tensors = [torch.arange(1000, dtype=torch.float32)]
    stash.offload(tensors, backup=True)
    with pytest.raises(StashError, match="storage holds 8192 bytes, the restore needs exactly 4096"):
        stash.restore(into=torch.zeros(8192, dtype=torch.uint8))
    assert stash.offloaded and stash.backed_up
    home = torch.zeros(8192, dtype=torch.uint8)[:4096].clone()  # a storage of exactly 4096 bytes
    stash.restore(into=home)
    assert torch.equal(tensors[0], torch.arange(1000, dtype=torch.float32))
    assert tensors[0].data_ptr() == home.data_ptr()


def _borrower(handle_bytes: bytes, conn) -> None:
    handle = msgspec.msgpack.decode(handle_bytes, type=LoanHandle)
    loan = DeviceLoan.borrow(handle, "cpu")
    view = loan.view(0, 4 * MiB)
    view.fill_(7)
    conn.send("written")
    conn.recv()  # hold the block until killed


def test_a_block_lent_to_another_process_is_shared_and_a_borrower_killed_costs_the_lender_nothing():
    before = _segments()
    loan = DeviceLoan.allocate(8 * MiB, "cpu")
    assert _segments() - before == {loan.handle.name}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_borrower, args=(msgspec.msgpack.encode(loan.handle), child))
    proc.start()
    try:
        assert parent.poll(60), "the borrower did not start"
        assert parent.recv() == "written"
        mine = loan.view(0, 8 * MiB)
        assert bool((mine[: 4 * MiB] == 7).all()) and not mine[4 * MiB :].any()  # its writes, seen here
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        mine.zero_()  # the block is still the lender's, whole
        assert not mine.any()
    finally:
        if proc.is_alive():
            proc.kill()
    del mine
    loan.close()
    assert _segments() == before  # nothing left in /dev/shm


def test_an_engine_or_trainer_without_a_loan_says_so():
    from colosync.handoff.model.participants import EngineMemory

    class Plain(EngineMemory):
        def regions(self):
            return frozenset()

        def region_bytes(self):
            return {}

        def footprint(self):
            raise NotImplementedError

        offload_kv = offload_weights = onload_weights = onload_kv = footprint

    with pytest.raises(UnsupportedOperation, match="cannot lend its KV cache's memory; use TorchEngineMemory"):
        Plain("e").lend()
    with pytest.raises(StashError, match="a loan needs a positive size"):
        DeviceLoan.allocate(0, "cpu")
