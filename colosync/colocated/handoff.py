"""A colocated job's memory handoff: one plan, one host arena, one executor for the whole job.

The engine and the trainer live in their own processes (``colosync.colocated.cluster``); this
process is the controller. ``Handoff`` sizes one node-wide ``HostArena`` from the plan (pinned
once for the job), has both participants map it, and runs each phase of the plan through a
``HandoffExecutor`` that measures every process's host memory and the device while it runs,
so each phase comes back as a ``PhaseStats``: its seconds and peaks against what the plan
expects, and every broken invariant. The weight sync is the plan's ``sync.weights`` step
inside ``train_to_rollout``: ``push()`` runs there, once the engine's weights are back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from colosync.colocated.cluster import Cluster
from colosync.colocated.trainer import TrainerPlan
from colosync.handoff import Region, build_plan
from colosync.handoff.backends.arena import HostArena
from colosync.handoff.model.participants import WeightSync
from colosync.handoff.model.simulator import HandoffSizes
from colosync.handoff.runtime.executor import HandoffExecutor
from colosync.handoff.runtime.records import StepRecord
from colosync.sync.sender import DEFAULT_BUCKET_BYTES, SyncReport

log = logging.getLogger(__name__)

PEAK_DEVICES = ("cpu", "gpu")


@dataclass
class PhaseStats:
    """One phase of the plan as it ran."""

    phase: str
    seconds: float
    host_copies_peak_bytes: int  # measured over every process, above the baseline
    plan_host_copies_bytes: int  # the most the plan expects at any of the phase's steps
    device_peak_bytes: int
    sync_seconds: float = 0.0  # the sync.weights step (train_to_rollout only)
    sync_device_extra_bytes: int = 0  # device memory the sync added at its peak (all processes)
    bytes_to_host: int = 0  # what the participants' operations copied device -> host
    bytes_to_device: int = 0  # and host -> device (the sync's bytes are in its SyncReport)
    steps: list[str] = field(default_factory=list)  # the operations, in order
    op_seconds: dict[str, float] = field(default_factory=dict)  # each operation's seconds
    op_bytes: dict[str, int] = field(default_factory=dict)  # and the bytes it copied, both ways
    op_device_allocated: dict[str, int] = field(default_factory=dict)  # device bytes it allocated
    op_device_freed: dict[str, int] = field(default_factory=dict)  # and freed
    violations: list[str] = field(default_factory=list)


class Handoff:
    """The handoff of ``cluster``'s trainer and engine in ``peak_device`` order (``cpu``: both
    host copies may coexist; ``gpu``: one at a time); ``push()`` is the sync the plan's
    ``sync.weights`` step runs (see module docstring); what it raises stops the phase there,
    so a caller that wants the phase finished after a failed push keeps the error and returns.
    ``lend_kv``: after init the trainer wakes up in the engine's KV cache block
    (``HandoffConfig.lend_kv``)."""

    def __init__(
        self,
        cluster: Cluster,
        peak_device: str,
        push: Callable[[], SyncReport | None],
        pin: Any = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        host_scope: str = "processes",
        lend_kv: bool = False,
    ) -> None:
        self.plan = build_plan(peak_device=peak_device, sync=True, lend_kv=lend_kv)
        engine_sizes = cluster.engine_memory(pin="none").region_bytes()  # a private pool, to read its sizes
        planned = msgspec.convert(cluster.trainer.call("planned_sizes"), TrainerPlan, from_attributes=True)
        lora = planned.sync_bytes if planned.sync_kind == "lora" else 0  # the adapter the first sync installs
        self.sizes = HandoffSizes(
            engine_weight_bytes=engine_sizes[Region.ENGINE_MIRROR] + lora,
            engine_kv_bytes=engine_sizes.get(Region.ENGINE_KV, 0),
            trainer_resident_bytes=planned.resident,
            trainer_backup_bytes=planned.backup,
            trainer_grad_buffer_bytes=planned.grad_buffer,
            sync_kind=planned.sync_kind,
            sync_bytes=planned.sync_bytes,
            sync_transport="shm" if cluster.device.type == "cpu" else "cuda_ipc",
            sync_bucket_bytes=bucket_bytes,
            # colosync's engines stage a full update in host memory (the arena) and install it at commit
            sync_staging="host" if planned.sync_kind == "full" else "device",
        )
        if lend_kv:
            self.sizes.check_loan()  # before anything is mapped or moved
        self.arena = HostArena.for_plan(self.plan, self.sizes.region_bytes(), pin=pin)  # pinned once per job
        try:
            engine = cluster.engine_memory(arena=self.arena, pin=pin)
            trainer = cluster.trainer_memory(arena=self.arena, pin=pin)
            self.arena.seal()  # both processes mapped it: nothing left to leak
            self.sync = WeightSync(
                lambda _mark: push(), self.sizes.sync_region_bytes(), device_type=cluster.device.type
            )
            self.executor = HandoffExecutor(
                trainer,
                engine,
                sync=self.sync,
                pools=[self.arena.pool()],
                watch_interval_s=0.005,
                fail_fast=False,
                host_scope=host_scope,
            )
        except BaseException:
            self.arena.close()
            raise
        log.info("handoff: %s plan, arena of %.1f MB", peak_device, self.arena.nbytes / 1e6)

    def phase(self, name: str) -> PhaseStats:
        """Run one phase; its seconds, peaks against the plan, and broken invariants."""
        result = self.executor.result
        first_record = len(result.records) if result is not None else 0
        first_violation = len(result.violations) if result is not None else 0
        result = self.executor.run_phase(self.plan, name)
        records = result.records[first_record:]
        stats = PhaseStats(
            phase=name,
            seconds=sum(r.seconds for r in records),
            host_copies_peak_bytes=max((r.host_peak for r in records), default=0),
            plan_host_copies_bytes=max((r.expected_host_peak for r in records), default=0),
            device_peak_bytes=max((r.device_peak for r in records), default=0),
            sync_seconds=sum(r.seconds for r in records if r.report.participant == "sync"),
            sync_device_extra_bytes=max(
                (r.device_peak - r.device_before for r in records if r.report.participant == "sync"), default=0
            ),
            bytes_to_host=sum(r.report.bytes_to_host for r in records),
            bytes_to_device=sum(r.report.bytes_to_device for r in records),
            steps=[r.step for r in records],
            op_seconds=_per_op(records, lambda r: r.seconds),
            op_bytes=_per_op(records, lambda r: r.report.bytes_to_host + r.report.bytes_to_device),
            op_device_allocated=_per_op(records, lambda r: r.report.device_allocated),
            op_device_freed=_per_op(records, lambda r: r.report.device_freed),
            violations=[str(v) for v in result.violations[first_violation:]],
        )
        for violation in stats.violations:
            log.warning("handoff %s: %s", name, violation)
        return stats

    def close(self) -> None:
        self.arena.close()


def _per_op(records: list[StepRecord], value: Callable[[StepRecord], Any]) -> dict[str, Any]:
    """``value`` of each operation, summed where an operation runs more than once in a phase."""
    out: dict[str, Any] = {}
    for r in records:
        out[r.step] = out.get(r.step, 0) + value(r)
    return out


__all__ = ["PEAK_DEVICES", "Handoff", "PhaseStats"]
