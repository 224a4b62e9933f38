"""Handoff plans: the ordered steps of each handoff phase, as data.

A trainer and an inference engine that share GPUs hand memory to each other three times:
at ``init`` (the engine is up, the trainer loads its checkpoint), ``rollout_to_train`` and
``train_to_rollout``. The *order* of the offload/onload operations decides what coexists:

* ``peak_device="cpu"`` (the usual order) offloads one side fully before the other side
  comes back, so both large host copies — the engine's weight mirror and the trainer's
  backup — are briefly on the host together.
* ``peak_device="gpu"`` (radixark/miles #2781) overlaps the two sides on the GPU instead: drop the KV
  cache, wake the trainer while the engine's weights are still resident, and only then
  release the weights (their mirror takes the place of the trainer's just-freed backup);
  on the way back, the trainer returns its caches and grad buffer, the engine resumes its
  weights, and only then does the trainer sleep. At init the engine weights stay resident
  through the trainer's load. The two host copies never coexist.

A plan is a value: it can be printed, serialised, simulated for a model and machine before a
job starts (``simulator``) and executed against real participants with invariants checked
while it runs (``executor``). ``build_plan`` makes the two built-in orders; ``Plan.from_ops``
validates a custom one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, Literal, get_args

import msgspec

from colosync.errors import PlanError
from colosync.handoff.model.ops import HOST_COPIES, Op, Region, effect

PeakDevice = Literal["cpu", "gpu"]
PEAK_DEVICES: tuple[str, ...] = get_args(PeakDevice)
R = Region


class PhaseName(StrEnum):
    INIT = "init"
    ROLLOUT_TO_TRAIN = "rollout_to_train"
    TRAIN_TO_ROLLOUT = "train_to_rollout"


class HandoffConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which participants offload, and where the handoff's peak may live."""

    peak_device: str = "cpu"
    trainer_offload: bool = True
    """The trainer sleeps (backs its state up to the host) while the engine generates."""
    engine_offload: bool = True
    """The engine releases its weights and KV cache while the trainer trains."""
    engine_weight_backup: bool = True
    """The engine keeps a host mirror of its weights when it releases them (needed when the
    trainer does not push every weight back, e.g. LoRA training of a frozen base)."""
    sync: bool = False
    """``train_to_rollout`` includes the weight sync as a step (``sync.weights``), placed where
    both the trainer's and the engine's weights are on the device, with its memory planned."""
    lend_kv: bool = False
    """After init, the engine keeps its KV cache in one block that it never frees and lends to the
    trainer, whose state and grad buffer wake up inside it while the KV cache is dropped: the
    handoff then allocates and frees no device memory for them (``handoff.backends.loan``)."""

    def __post_init__(self) -> None:
        if self.lend_kv and not (self.trainer_offload and self.engine_offload):
            raise PlanError(
                "lend_kv=True lends the engine's KV cache to the trainer while the engine is offloaded and the "
                "trainer awake; it needs trainer_offload=True and engine_offload=True, or set lend_kv=False"
            )
        if self.peak_device not in PEAK_DEVICES:
            raise PlanError(
                f"peak_device={self.peak_device!r} is not a handoff mode; choose one of "
                f"{list(PEAK_DEVICES)} ('cpu' is the usual order, 'gpu' overlaps on the GPU)"
            )
        if self.peak_device == "gpu" and not (self.trainer_offload and self.engine_offload):
            missing = [
                n
                for n, on in (("trainer_offload", self.trainer_offload), ("engine_offload", self.engine_offload))
                if not on
            ]
            raise PlanError(
                f"peak_device='gpu' reorders the trainer's and the engine's offloads so their host "
                f"copies never coexist; it needs both, but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} off. Set "
                f"{' and '.join(m + '=True' for m in missing)}, or use peak_device='cpu'."
            )


class Step(msgspec.Struct, frozen=True):
    """One operation of one participant, with the memory effect the plan expects of it."""

    op: Op
    why: str = ""
    backup: bool = True
    """For ``engine.offload_weights``: keep a host mirror of the weights."""
    allocates: tuple[Region, ...] = ()
    frees: tuple[Region, ...] = ()

    @property
    def label(self) -> str:
        if self.op is Op.ENGINE_OFFLOAD_WEIGHTS:
            return f"{self.op.value}(backup={self.backup})"
        return self.op.value


class Phase(msgspec.Struct, frozen=True):
    name: PhaseName
    start: tuple[Region, ...]
    steps: tuple[Step, ...]
    end: tuple[Region, ...]


class Plan(msgspec.Struct, frozen=True):
    config: HandoffConfig
    phases: tuple[Phase, ...]

    @property
    def peak_device(self) -> str:
        return self.config.peak_device

    def phase(self, name: PhaseName | str) -> Phase:
        name = PhaseName(name)
        for phase in self.phases:
            if phase.name is name:
                return phase
        raise PlanError(f"plan has no phase {name.value!r}")

    def schedule(self, cycles: int = 1, *, include_init: bool = True) -> list[Phase]:
        """The phases in the order a job runs them: init, then ``cycles`` train/rollout rounds."""
        if cycles < 0:
            raise PlanError(f"cycles must be >= 0, got {cycles}")
        out = [self.phase(PhaseName.INIT)] if include_init else []
        for _ in range(cycles):
            out += [self.phase(PhaseName.ROLLOUT_TO_TRAIN), self.phase(PhaseName.TRAIN_TO_ROLLOUT)]
        return out

    @classmethod
    def from_ops(
        cls,
        config: HandoffConfig,
        phases: Mapping[PhaseName | str, Sequence[Op | str | tuple[Op | str, bool]]],
    ) -> Plan:
        """Build and validate a custom plan from ``{phase: [op, (op, backup), ...]}``."""
        built = []
        for name in PhaseName:
            if name not in phases and name.value not in phases:
                raise PlanError(f"custom plan lacks phase {name.value!r}; give all of {[p.value for p in PhaseName]}")
            raw = phases.get(name, phases.get(name.value, ()))
            ops: list[tuple[Op, bool]] = []
            for item in raw:
                op, backup = item if isinstance(item, tuple) else (item, config.engine_weight_backup)
                try:
                    ops.append((Op(op), bool(backup)))
                except ValueError:
                    raise PlanError(f"unknown operation {op!r}; known: {[o.value for o in Op]}") from None
            built.append(_phase(config, name, ops))
        plan = cls(config=config, phases=tuple(built))
        validate_plan(plan)
        return plan


def start_state(config: HandoffConfig, phase: PhaseName) -> frozenset[Region]:
    """What is held when ``phase`` starts, by the end state of the phase before it."""
    if phase is PhaseName.INIT:
        return frozenset({R.ENGINE_WEIGHTS, R.ENGINE_KV})
    if phase is PhaseName.ROLLOUT_TO_TRAIN:
        return rollout_ready(config)
    return train_ready(config)


def rollout_ready(config: HandoffConfig) -> frozenset[Region]:
    """The engine can generate: weights and KV cache on the device."""
    trainer = {R.TRAINER_BACKUP} if config.trainer_offload else {R.TRAINER_STATE, R.TRAINER_GRADS, R.TRAINER_CACHE}
    return frozenset({R.ENGINE_WEIGHTS, R.ENGINE_KV} | trainer)


def train_ready(config: HandoffConfig) -> frozenset[Region]:
    """The trainer can step: its state, grad buffer and working memory on the device."""
    if not config.engine_offload:
        engine = {R.ENGINE_WEIGHTS, R.ENGINE_KV}
    else:
        engine = {R.ENGINE_MIRROR} if config.engine_weight_backup else set()
    return frozenset({R.TRAINER_STATE, R.TRAINER_GRADS, R.TRAINER_CACHE} | engine)


def expected_end(config: HandoffConfig, phase: PhaseName) -> frozenset[Region]:
    return train_ready(config) if phase is PhaseName.ROLLOUT_TO_TRAIN else rollout_ready(config)


_WHY: dict[tuple[str, PhaseName, Op], str] = {
    ("cpu", PhaseName.INIT, Op.ENGINE_OFFLOAD_KV): "free the device for the trainer's load",
    ("cpu", PhaseName.INIT, Op.ENGINE_OFFLOAD_WEIGHTS): "engine weights to the host before the trainer loads",
    ("cpu", PhaseName.INIT, Op.TRAINER_LOAD): "load the trainer's checkpoint onto the device",
    ("cpu", PhaseName.INIT, Op.TRAINER_SLEEP): "trainer state to the host (both host copies now coexist)",
    ("cpu", PhaseName.INIT, Op.ENGINE_ONLOAD_WEIGHTS): "engine weights back for the first rollout",
    ("cpu", PhaseName.INIT, Op.ENGINE_ONLOAD_KV): "KV cache back for the first rollout",
    ("cpu", PhaseName.ROLLOUT_TO_TRAIN, Op.ENGINE_OFFLOAD_KV): "drop the KV cache and CUDA graphs",
    ("cpu", PhaseName.ROLLOUT_TO_TRAIN, Op.ENGINE_OFFLOAD_WEIGHTS): "engine weights to the host mirror",
    (
        "cpu",
        PhaseName.ROLLOUT_TO_TRAIN,
        Op.TRAINER_WAKE_UP,
    ): "trainer state back (mirror and backup coexist until it frees)",
    ("cpu", PhaseName.TRAIN_TO_ROLLOUT, Op.TRAINER_SLEEP): "trainer state to the host (mirror and backup coexist)",
    ("cpu", PhaseName.TRAIN_TO_ROLLOUT, Op.ENGINE_ONLOAD_WEIGHTS): "engine weights back from the mirror",
    ("cpu", PhaseName.TRAIN_TO_ROLLOUT, Op.ENGINE_ONLOAD_KV): "KV cache back for rollout",
    (
        "cpu",
        PhaseName.TRAIN_TO_ROLLOUT,
        Op.SYNC_WEIGHTS,
    ): "push the trained weights while both sides' weights are on the device",
    (
        "gpu",
        PhaseName.TRAIN_TO_ROLLOUT,
        Op.SYNC_WEIGHTS,
    ): "push the trained weights while both sides' weights are on the device",
    ("gpu", PhaseName.INIT, Op.ENGINE_OFFLOAD_KV): "drop the KV cache; weights stay resident",
    (
        "gpu",
        PhaseName.INIT,
        Op.TRAINER_LOAD,
    ): "load the trainer next to the resident engine weights (no mirror beside the load)",
    ("gpu", PhaseName.INIT, Op.TRAINER_SLEEP): "trainer state to the host (the only host copy)",
    ("gpu", PhaseName.INIT, Op.ENGINE_ONLOAD_KV): "KV cache back for the first rollout",
    ("gpu", PhaseName.ROLLOUT_TO_TRAIN, Op.ENGINE_OFFLOAD_KV): "drop the KV cache and CUDA graphs (pure device memory)",
    (
        "gpu",
        PhaseName.ROLLOUT_TO_TRAIN,
        Op.TRAINER_WAKE_UP,
    ): "wake the trainer while engine weights are still resident; its backup frees",
    (
        "gpu",
        PhaseName.ROLLOUT_TO_TRAIN,
        Op.ENGINE_OFFLOAD_WEIGHTS,
    ): "release the weights; their mirror replaces the trainer's freed backup",
    ("gpu", PhaseName.TRAIN_TO_ROLLOUT, Op.TRAINER_CLEAR_MEMORY): "return the trainer's allocator caches to the device",
    (
        "gpu",
        PhaseName.TRAIN_TO_ROLLOUT,
        Op.TRAINER_OFFLOAD_GRAD_BUFFER,
    ): "return the no-backup grad buffer to the device",
    (
        "gpu",
        PhaseName.TRAIN_TO_ROLLOUT,
        Op.ENGINE_ONLOAD_WEIGHTS,
    ): "resume the engine weights next to the trainer; the mirror frees",
    (
        "gpu",
        PhaseName.TRAIN_TO_ROLLOUT,
        Op.TRAINER_SLEEP,
    ): "only now the trainer sleeps, into the space the mirror vacated",
    ("gpu", PhaseName.TRAIN_TO_ROLLOUT, Op.ENGINE_ONLOAD_KV): "KV cache back for rollout",
}


def _phase(config: HandoffConfig, name: PhaseName, ops: Sequence[tuple[Op, bool]]) -> Phase:
    held = start_state(config, name)
    start = held
    steps = []
    for op, backup in ops:
        alloc, free = effect(op, held, backup)
        text = _WHY.get((config.peak_device, name, op), "")
        steps.append(Step(op=op, why=text, backup=backup, allocates=_ordered(alloc), frees=_ordered(free)))
        held = (held | alloc) - free
    return Phase(name=name, start=_ordered(start), steps=tuple(steps), end=_ordered(held))


def _ordered(regions: frozenset[Region] | set[Region]) -> tuple[Region, ...]:
    return tuple(r for r in Region if r in regions)


def build_plan(config: HandoffConfig | None = None, **options: Any) -> Plan:
    """The built-in plan for ``config`` (or ``HandoffConfig(**options)``), validated."""
    if config is None:
        config = HandoffConfig(**options)
    elif options:
        raise PlanError("give either a HandoffConfig or keyword options, not both")
    b = config.engine_weight_backup
    engine_off = [(Op.ENGINE_OFFLOAD_KV, b), (Op.ENGINE_OFFLOAD_WEIGHTS, b)] if config.engine_offload else []
    engine_on = [(Op.ENGINE_ONLOAD_WEIGHTS, b), (Op.ENGINE_ONLOAD_KV, b)] if config.engine_offload else []
    sleep = [(Op.TRAINER_SLEEP, b)] if config.trainer_offload else []
    wake = [(Op.TRAINER_WAKE_UP, b)] if config.trainer_offload else []
    sync = [(Op.SYNC_WEIGHTS, b)] if config.sync else []
    if config.peak_device == "cpu":
        init = engine_off + [(Op.TRAINER_LOAD, b)] + sleep + engine_on
        r2t = engine_off + wake
        # With the sync: the engine's weights come back before the trainer sleeps (the sync
        # needs both on the device), the way verl and miles order it; its KV cache after.
        t2r = (engine_on[:1] + sync + sleep + engine_on[1:]) if config.sync else sleep + engine_on
    else:  # gpu: both offloads are on (HandoffConfig checked it)
        init = [(Op.ENGINE_OFFLOAD_KV, b), (Op.TRAINER_LOAD, b), (Op.TRAINER_SLEEP, b), (Op.ENGINE_ONLOAD_KV, b)]
        r2t = [(Op.ENGINE_OFFLOAD_KV, b), (Op.TRAINER_WAKE_UP, b), (Op.ENGINE_OFFLOAD_WEIGHTS, b)]
        t2r = [
            (Op.TRAINER_CLEAR_MEMORY, b),
            (Op.TRAINER_OFFLOAD_GRAD_BUFFER, b),
            (Op.ENGINE_ONLOAD_WEIGHTS, b),
            *sync,
            (Op.TRAINER_SLEEP, b),
            (Op.ENGINE_ONLOAD_KV, b),
        ]
    plan = Plan(
        config=config,
        phases=(
            _phase(config, PhaseName.INIT, init),
            _phase(config, PhaseName.ROLLOUT_TO_TRAIN, r2t),
            _phase(config, PhaseName.TRAIN_TO_ROLLOUT, t2r),
        ),
    )
    validate_plan(plan)
    return plan


def validate_plan(plan: Plan) -> None:
    """Raise ``PlanError`` unless every phase of ``plan`` is consistent and does its job.

    Checked: every step changes something (a no-op step is a mistake in a plan even though
    operations are idempotent at run time); every step's declared effect is what the
    operation does from the state the steps before it leave; each phase ends where the next
    one starts; in ``gpu`` mode no step holds both host copies (or the engine mirror beside
    the trainer's checkpoint-load staging), even transiently; with ``lend_kv``, no step after init
    holds the KV cache beside the trainer's state or grad buffer (they share one block).
    """
    config = plan.config
    names = [p.name for p in plan.phases]
    if sorted(n.value for n in names) != sorted(p.value for p in PhaseName):
        raise PlanError(
            f"a plan needs exactly the phases {[p.value for p in PhaseName]}, got {[n.value for n in names]}"
        )
    for phase in plan.phases:
        held = start_state(config, phase.name)
        if set(phase.start) != held:
            raise PlanError(
                f"phase {phase.name.value}: declared start {_names(phase.start)} but the phase before "
                f"it leaves {_names(held)}"
            )
        for i, step in enumerate(phase.steps, 1):
            where = f"phase {phase.name.value} step {i} {step.label}"
            if step.op is Op.ENGINE_OFFLOAD_WEIGHTS and step.backup != config.engine_weight_backup:
                raise PlanError(
                    f"{where}: backup={step.backup} disagrees with engine_weight_backup="
                    f"{config.engine_weight_backup}; make them agree"
                )
            alloc, free = effect(step.op, held, step.backup)
            if not alloc and not free:
                raise PlanError(
                    f"{where} does nothing: it needs a state it is not in (holding {_names(held)}); remove or move it"
                )
            if set(step.allocates) != alloc or set(step.frees) != free:
                raise PlanError(
                    f"{where}: declares allocates={_names(step.allocates)} frees={_names(step.frees)} but from "
                    f"{_names(held)} it allocates {_names(alloc)} and frees {_names(free)}"
                )
            peak = held | alloc
            clash = peak & {R.TRAINER_STATE, R.TRAINER_GRADS} if R.ENGINE_KV in peak else frozenset()
            if config.lend_kv and phase.name is not PhaseName.INIT and clash:
                raise PlanError(
                    f"{where}: with lend_kv the engine's KV cache and the trainer's {_names(clash)} share one "
                    "block, but this step holds both; put engine.offload_kv before trainer.wake_up and "
                    "trainer.sleep before engine.onload_kv"
                )
            if config.peak_device == "gpu":
                if peak >= HOST_COPIES:
                    raise PlanError(
                        f"{where}: in peak_device='gpu' the engine mirror and the trainer backup must never "
                        f"coexist on the host, but this step holds both; release one before this step"
                    )
                if {R.ENGINE_MIRROR, R.TRAINER_LOAD} <= peak:
                    raise PlanError(
                        f"{where}: in peak_device='gpu' the engine weights stay resident through the trainer's "
                        f"load; do not offload the engine weights before trainer.load"
                    )
            held = (held | alloc) - free
        want = expected_end(config, phase.name)
        if held != want:
            raise PlanError(
                f"phase {phase.name.value} ends holding {_names(held)} but must end holding {_names(want)} "
                f"(missing {_names(want - held)}, extra {_names(held - want)})"
            )
        if set(phase.end) != held:
            raise PlanError(
                f"phase {phase.name.value}: declared end {_names(phase.end)} but the steps end at {_names(held)}"
            )


def _names(regions: Sequence[Region] | frozenset[Region] | set[Region]) -> list[str]:
    return [r.value for r in Region if r in set(regions)]
