"""Simulate a handoff plan for a model and a machine before a job runs.

A 32-node job that overflows its host cgroup during the first handoff wastes the queue time
it took to start. Given per-GPU sizes (engine weights and KV cache, trainer resident and
backup bytes) and per-node host figures, ``simulate`` walks a plan's steps with the same
operation semantics the executor checks at run time (``ops.effect``) and returns the host
and device timeline: before, peak (allocations happen before frees within a step) and after
every step. ``compare`` does it for every mode and says which fit and which to use.

Host figures are per node (``gpus_per_node`` participants share one host); device figures
are per GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from colosync import workloads
from colosync.errors import PlanError, SizesError
from colosync.handoff.model.ops import ARENA_REGIONS, HOST_COPIES, Place, Region, device_bytes, effect
from colosync.handoff.model.plans import PEAK_DEVICES, HandoffConfig, Phase, PhaseName, Plan, build_plan, start_state

R = Region

# Workload JSON keys (``*_per_gpu`` as in workloads/k3-gb300-handoff.json) -> HandoffSizes fields.
_WORKLOAD_KEYS: dict[str, str] = {
    "engine_weight_mirror_bytes_per_gpu": "engine_weight_bytes",
    "engine_weight_bytes_per_gpu": "engine_weight_bytes",
    "engine_kv_and_graph_bytes_per_gpu": "engine_kv_bytes",
    "engine_kv_bytes_per_gpu": "engine_kv_bytes",
    "trainer_resident_bytes_per_gpu": "trainer_resident_bytes",
    "trainer_backup_bytes_per_gpu": "trainer_backup_bytes",
    "trainer_grad_buffer_bytes_per_gpu": "trainer_grad_buffer_bytes",
    "trainer_load_host_bytes_per_gpu": "trainer_load_host_bytes",
    "host_baseline_bytes": "host_baseline_bytes",
    "host_budget_bytes": "host_budget_bytes",
    "gpu_bytes": "gpu_bytes",
    "gpus_per_node": "gpus_per_node",
    "device_baseline_bytes": "device_baseline_bytes",
    "sync_bytes_per_gpu": "sync_bytes",
    "name": "name",
    "description": "description",
}
_IGNORED_KEYS = {"expect"}

SYNC_KINDS = ("", "lora", "full")
SYNC_TRANSPORTS = ("shm", "cuda_ipc")
SYNC_STAGINGS = ("device", "host")

_REQUIRED = ("engine_weight_bytes", "engine_kv_bytes", "trainer_resident_bytes", "trainer_backup_bytes")
"""The sizes every workload must give (per GPU, in bytes)."""


class HandoffSizes(msgspec.Struct, frozen=True, kw_only=True):
    """The memory picture of one node. ``*_bytes`` without ``host`` are per GPU."""

    engine_weight_bytes: int
    """Engine weights on one GPU; also the size of their host mirror."""
    engine_kv_bytes: int
    """KV cache plus CUDA graphs on one GPU."""
    trainer_resident_bytes: int
    """What the awake trainer holds on one GPU (state, grad buffer, caches, activations)."""
    trainer_backup_bytes: int
    """What the sleeping trainer holds on the host, per GPU."""
    host_baseline_bytes: int = 0
    """Host memory of the node outside the two copies (processes, page cache, shm)."""
    host_budget_bytes: int | None = None
    """The node's host limit (e.g. the job's cgroup)."""
    gpu_bytes: int | None = None
    """Memory of one GPU."""
    gpus_per_node: int = 1
    trainer_grad_buffer_bytes: int = 0
    """Part of the resident bytes that is the no-backup gradient buffer."""
    trainer_load_host_bytes: int | None = None
    """Host bytes a checkpoint load stages through, per GPU (default: one trainer backup)."""
    device_baseline_bytes: int = 0
    """Device memory outside both participants (CUDA contexts, NCCL buffers), per GPU."""
    sync_kind: str = ""
    """The weight sync in ``train_to_rollout``: ``lora``, ``full``, or ``""`` (none planned)."""
    sync_bytes: int = 0
    """Bytes one sync moves, per GPU (e.g. 169 MB of LoRA, 16 GB of full weights)."""
    sync_transport: str = "shm"
    """``shm`` (slots in host shared memory) or ``cuda_ipc`` (slots on the device)."""
    sync_bucket_bytes: int = 64 << 20
    """The sender's bucket (colosync's default 64 MiB); a smaller update is one bucket."""
    sync_slots: int = 2
    sync_staging: str = "device"
    """Where a full update waits for its commit: ``device`` (the receiver's staging and the
    engine's prepared copy, twice the update on the engine's device) or ``host`` (a bounded
    full update: host staging, in the shared arena when there is one, then one copy into the
    served weights at commit; the device holds one bucket beside the transport's slots)."""
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        for name in (*_REQUIRED, "host_baseline_bytes", "trainer_grad_buffer_bytes", "device_baseline_bytes"):
            if getattr(self, name) < 0:
                raise SizesError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise SizesError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.sync_kind not in SYNC_KINDS:
            raise SizesError(
                f"sync_kind must be one of {list(SYNC_KINDS)}, got {self.sync_kind!r} (e.g. --sync lora:169MB)"
            )
        if (self.sync_bytes > 0) != bool(self.sync_kind):
            raise SizesError("give sync_kind and sync_bytes together (e.g. --sync full:16GB), or neither")
        if self.sync_transport not in SYNC_TRANSPORTS:
            raise SizesError(f"sync_transport must be one of {list(SYNC_TRANSPORTS)}, got {self.sync_transport!r}")
        if self.sync_staging not in SYNC_STAGINGS or (self.sync_staging == "host" and self.sync_kind == "lora"):
            raise SizesError(
                f"sync_staging must be one of {list(SYNC_STAGINGS)} (host only for a full sync), got "
                f"{self.sync_staging!r} with sync_kind {self.sync_kind!r}"
            )
        if self.sync_bytes < 0 or self.sync_bucket_bytes <= 0 or self.sync_slots < 1:
            raise SizesError("sync_bytes must be >= 0, sync_bucket_bytes > 0 and sync_slots >= 1")
        if self.trainer_backup_bytes + self.trainer_grad_buffer_bytes > self.trainer_resident_bytes:
            raise SizesError(
                f"trainer_backup_bytes ({self.trainer_backup_bytes}) + trainer_grad_buffer_bytes "
                f"({self.trainer_grad_buffer_bytes}) exceed trainer_resident_bytes ({self.trainer_resident_bytes}): "
                f"the backup is a copy of part of what the awake trainer holds; raise trainer_resident_bytes"
            )

    @classmethod
    def from_workload(cls, doc: Mapping[str, Any]) -> HandoffSizes:
        """Read a handoff workload document (see ``workloads/k3-gb300-handoff.json``): its
        ``*_per_gpu`` keys or the field names themselves; ``expect`` is ignored."""
        kwargs: dict[str, Any] = {}
        for key, value in doc.items():
            if key in _IGNORED_KEYS:
                continue
            if key in _WORKLOAD_KEYS:
                kwargs[_WORKLOAD_KEYS[key]] = value
            elif key in cls.__struct_fields__:
                kwargs[key] = value
            else:
                raise SizesError(f"unknown workload key {key!r}; known: {sorted(set(_WORKLOAD_KEYS) | _IGNORED_KEYS)}")
        missing = [f for f in _REQUIRED if f not in kwargs]
        if missing:
            raise SizesError(f"workload lacks {missing}; give them (per GPU, in bytes)")
        return cls(**kwargs)

    def sync_region_bytes(self) -> dict[Region, int]:
        """What one sync holds while it runs, per GPU: the transport's slots (``slots`` buckets,
        a bucket no larger than the update), the receiver's staging of the whole update on the
        engine's device, and the engine's prepared copy (a LoRA adapter beside the served one,
        or a full update's prepared weights) -- so a full update staged on the device needs twice
        its bytes free (see ``sync_staging`` for the bounded one)."""
        if not self.sync_bytes:
            return {R.SYNC_TRANSPORT: 0, R.SYNC_STAGING: 0, R.SYNC_PREPARED: 0, R.SYNC_HOST_STAGING: 0}
        bucket = min(self.sync_bucket_bytes, self.sync_bytes)
        slots = bucket * self.sync_slots
        host_slots = slots if self.sync_transport == "shm" else 0
        if self.sync_staging == "host":  # a bounded full update: one bucket on the device at a time
            return {
                R.SYNC_TRANSPORT: host_slots,
                R.SYNC_STAGING: bucket + (slots - host_slots),
                R.SYNC_PREPARED: 0,
                R.SYNC_HOST_STAGING: self.sync_bytes,
            }
        return {
            R.SYNC_TRANSPORT: host_slots,
            R.SYNC_STAGING: self.sync_bytes + (slots - host_slots),
            R.SYNC_PREPARED: self.sync_bytes,
            R.SYNC_HOST_STAGING: 0,
        }

    def region_bytes(self) -> dict[Region, int]:
        """Bytes of each region on one GPU (device regions) or for one GPU's share (host)."""
        load = self.trainer_backup_bytes if self.trainer_load_host_bytes is None else self.trainer_load_host_bytes
        return {
            **self.sync_region_bytes(),
            R.ENGINE_WEIGHTS: self.engine_weight_bytes,
            R.ENGINE_KV: self.engine_kv_bytes,
            R.ENGINE_MIRROR: self.engine_weight_bytes,
            R.TRAINER_STATE: self.trainer_backup_bytes,
            R.TRAINER_GRADS: self.trainer_grad_buffer_bytes,
            R.TRAINER_CACHE: self.trainer_resident_bytes - self.trainer_backup_bytes - self.trainer_grad_buffer_bytes,
            R.TRAINER_BACKUP: self.trainer_backup_bytes,
            R.TRAINER_LOAD: load,
        }

    def host_bytes(self, held: frozenset[Region]) -> int:
        sizes = self.region_bytes()
        return self.host_baseline_bytes + self.gpus_per_node * sum(sizes[r] for r in held if r.place is Place.HOST)

    def device_bytes(self, held: frozenset[Region], *, lent: bool = False) -> int:
        """Device bytes of ``held``; ``lent``: the KV cache's block is lent to the trainer (``ops.LENT``)."""
        return self.device_baseline_bytes + device_bytes(held, self.region_bytes(), lent=lent)

    def check_loan(self) -> None:
        """Raise ``PlanError`` unless the trainer's state and gradient buffer fit the KV cache it borrows."""
        align = 1 << 21  # the grad buffer starts on the block's next 2 MiB boundary (``loan.ALIGN``)
        need = -(-self.trainer_backup_bytes // align) * align + self.trainer_grad_buffer_bytes
        if need > self.engine_kv_bytes:
            raise PlanError(
                f"lend_kv: the trainer's state and gradient buffer ({need / 1e9:.2f} GB) do not fit the engine's KV "
                f"cache ({self.engine_kv_bytes / 1e9:.2f} GB) they would wake up in; give the engine a KV cache of "
                "at least that size, or plan without lend_kv"
            )


def load_handoff_sizes(name_or_path: str) -> HandoffSizes:
    """The sizes of a handoff workload: a preset name (``k3-gb300``) or a workload JSON file.

    ``colosync.workloads.load(name_or_path, kind="handoff")`` gives the raw document (with its
    ``expect`` block, which the sizes do not keep)."""
    return HandoffSizes.from_workload(workloads.load(name_or_path, kind="handoff"))


@dataclass(frozen=True)
class TimelineRow:
    phase: str
    index: int
    step: str
    why: str
    host_before: int
    host_peak: int
    host_after: int
    device_before: int
    device_peak: int
    device_after: int
    host_copies: tuple[str, ...]
    """Large host copies held at the step's peak."""
    over_host: bool
    over_device: bool


@dataclass(frozen=True)
class Simulation:
    peak_device: str
    sizes: HandoffSizes
    rows: list[TimelineRow]
    host_peak: int
    device_peak: int
    host_peak_step: str
    device_peak_step: str
    both_host_copies: bool
    """Some step holds the engine mirror and the trainer backup on the host together."""

    @property
    def fits_host(self) -> bool:
        return self.sizes.host_budget_bytes is None or self.host_peak <= self.sizes.host_budget_bytes

    @property
    def fits_device(self) -> bool:
        return self.sizes.gpu_bytes is None or self.device_peak <= self.sizes.gpu_bytes

    @property
    def fits(self) -> bool:
        return self.fits_host and self.fits_device

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_device": self.peak_device,
            "host_peak_bytes": self.host_peak,
            "host_peak_step": self.host_peak_step,
            "device_peak_bytes": self.device_peak,
            "device_peak_step": self.device_peak_step,
            "both_host_copies": self.both_host_copies,
            "fits_host": self.fits_host,
            "fits_device": self.fits_device,
            "fits": self.fits,
            "timeline": [row.__dict__ | {"host_copies": list(row.host_copies)} for row in self.rows],
        }


def simulate(plan: Plan, sizes: HandoffSizes, *, cycles: int = 1) -> Simulation:
    """Walk ``plan`` (init, then ``cycles`` rounds) and record host and device at every step."""
    phases: list[Phase] = plan.schedule(cycles)
    if plan.config.lend_kv:
        sizes.check_loan()
    held = start_state(plan.config, phases[0].name)
    rows: list[TimelineRow] = []
    budget, gpu = sizes.host_budget_bytes, sizes.gpu_bytes
    start_host, start_dev = sizes.host_bytes(held), sizes.device_bytes(held)
    rows.append(
        TimelineRow(
            "start",
            0,
            "start",
            "engine up, trainer not loaded",
            start_host,
            start_host,
            start_host,
            start_dev,
            start_dev,
            start_dev,
            _copies(held),
            budget is not None and start_host > budget,
            gpu is not None and start_dev > gpu,
        )
    )
    for phase in phases:
        lent = plan.config.lend_kv and phase.name is not PhaseName.INIT  # the engine lends once init is done
        for i, step in enumerate(phase.steps, 1):
            alloc, free = effect(step.op, held, step.backup)
            peak = held | alloc
            after = peak - free
            hp, dp = sizes.host_bytes(peak), sizes.device_bytes(peak, lent=lent)
            rows.append(
                TimelineRow(
                    phase=phase.name.value,
                    index=i,
                    step=step.label,
                    why=step.why,
                    host_before=sizes.host_bytes(held),
                    host_peak=hp,
                    host_after=sizes.host_bytes(after),
                    device_before=sizes.device_bytes(held, lent=lent),
                    device_peak=dp,
                    device_after=sizes.device_bytes(after, lent=lent),
                    host_copies=_copies(peak),
                    over_host=budget is not None and hp > budget,
                    over_device=gpu is not None and dp > gpu,
                )
            )
            held = after
    host_row = max(rows, key=lambda r: r.host_peak)
    dev_row = max(rows, key=lambda r: r.device_peak)
    return Simulation(
        peak_device=plan.peak_device,
        sizes=sizes,
        rows=rows,
        host_peak=host_row.host_peak,
        device_peak=dev_row.device_peak,
        host_peak_step=f"{host_row.phase}:{host_row.step}",
        device_peak_step=f"{dev_row.phase}:{dev_row.step}",
        both_host_copies=any(len(r.host_copies) == len(HOST_COPIES) for r in rows),
    )


def _copies(held: frozenset[Region]) -> tuple[str, ...]:
    return tuple(r.value for r in Region if r in held and r in HOST_COPIES)


@dataclass(frozen=True)
class Comparison:
    sizes: HandoffSizes
    simulations: dict[str, Simulation]
    rejected: dict[str, str] = field(default_factory=dict)
    """Modes whose configuration is invalid, with the reason."""
    recommended: str | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": msgspec.to_builtins(self.sizes),
            "modes": {m: s.to_dict() for m, s in self.simulations.items()},
            "rejected": self.rejected,
            "recommended": self.recommended,
            "reason": self.reason,
        }


def compare(
    sizes: HandoffSizes, *, cycles: int = 1, modes: tuple[str, ...] = PEAK_DEVICES, config: HandoffConfig | None = None
) -> Comparison:
    """Simulate each mode in ``modes`` and recommend one that fits."""
    base = config or HandoffConfig()
    if sizes.sync_bytes and not base.sync:
        base = msgspec.structs.replace(base, sync=True)  # sizes that give a sync plan it
    sims: dict[str, Simulation] = {}
    rejected: dict[str, str] = {}
    for mode in modes:
        try:
            plan = build_plan(msgspec.structs.replace(base, peak_device=mode))
        except PlanError as exc:
            rejected[mode] = str(exc)
            continue
        sims[mode] = simulate(plan, sizes, cycles=cycles)
    recommended, reason = _recommend(sims, sizes)
    return Comparison(sizes=sizes, simulations=sims, rejected=rejected, recommended=recommended, reason=reason)


def _recommend(sims: dict[str, Simulation], sizes: HandoffSizes) -> tuple[str | None, str]:
    fitting = [m for m, s in sims.items() if s.fits]
    if len(fitting) > 1:
        best = min(fitting, key=lambda m: (sims[m].device_peak, m != "cpu"))
        return best, (
            f"every mode fits; '{best}' keeps the lower GPU peak "
            f"({_gb(sims[best].device_peak)} vs "
            f"{', '.join(_gb(sims[m].device_peak) for m in fitting if m != best)})"
        )
    if fitting:
        (best,) = fitting
        others = "; ".join(_shortfall(m, s, sizes) for m, s in sims.items() if m != best)
        return best, f"only '{best}' fits ({others})" if others else f"'{best}' fits"
    if not sims:
        return None, "no mode is valid for this configuration"
    return None, "no mode fits: " + "; ".join(_shortfall(m, s, sizes) for m, s in sims.items())


def _shortfall(mode: str, sim: Simulation, sizes: HandoffSizes) -> str:
    parts = []
    if not sim.fits_host:
        parts.append(
            f"host peak {_gb(sim.host_peak)} at {sim.host_peak_step} is "
            f"{_gb(sim.host_peak - (sizes.host_budget_bytes or 0))} over the {_gb(sizes.host_budget_bytes or 0)} budget"
        )
    if not sim.fits_device:
        parts.append(
            f"GPU peak {_gb(sim.device_peak)} at {sim.device_peak_step} is "
            f"{_gb(sim.device_peak - (sizes.gpu_bytes or 0))} over the {_gb(sizes.gpu_bytes or 0)} GPU"
        )
    return f"'{mode}': " + (", ".join(parts) if parts else "fits")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def arena_bytes(
    plan: Plan, sizes: Mapping[Region, int], *, chunk_bytes: int, slack_bytes: int = 0, cycles: int = 1
) -> int:
    """Bytes of a shared host arena that holds every host copy ``plan`` holds at once.

    Walks the plan (init, then ``cycles`` rounds) with the operations' semantics; at each
    step's peak the held host copies (engine mirror, trainer backup) each take whole chunks
    of ``chunk_bytes`` (after ``slack_bytes`` for the alignment of their tensors). In
    ``gpu`` mode that is the larger copy; in ``cpu`` mode both. A host-staged full update takes
    its turn in the arena too (the copies are gone while the sync runs).
    """
    if chunk_bytes <= 0:
        raise SizesError(f"chunk_bytes must be > 0, got {chunk_bytes}")

    def chunks(region: Region) -> int:
        n = sizes.get(region, 0)
        return -(-(n + slack_bytes) // chunk_bytes) if n else 0

    held = start_state(plan.config, PhaseName.INIT)
    need = sum(chunks(r) for r in held if r in ARENA_REGIONS)
    for phase in plan.schedule(cycles):
        for step in phase.steps:
            alloc, free = effect(step.op, held, step.backup)
            need = max(need, sum(chunks(r) for r in held | alloc if r in ARENA_REGIONS))
            held = (held | alloc) - free
    return need * chunk_bytes
