"""Plans as data: the built-in orders, and validation of bad configurations and custom plans."""

from __future__ import annotations

import msgspec
import pytest

from colosync.handoff import (
    HandoffConfig,
    Op,
    PhaseName,
    Plan,
    PlanError,
    Region,
    build_plan,
    validate_plan,
)
from colosync.handoff.model.ops import HOST_COPIES, apply, effect

# ids avoid the bare word "gpu": the suite's conftest skips items whose keywords contain it
MODES = [pytest.param("cpu", id="peak-cpu"), pytest.param("gpu", id="peak-gpu")]


def ops(plan: Plan, phase: str) -> list[str]:
    return [s.label for s in plan.phase(phase).steps]


def test_gpu_plan_is_the_seed_order():
    plan = build_plan(peak_device="gpu")
    assert ops(plan, "rollout_to_train") == [
        "engine.offload_kv",
        "trainer.wake_up",
        "engine.offload_weights(backup=True)",
    ]
    assert ops(plan, "train_to_rollout") == [
        "trainer.clear_memory",
        "trainer.offload_grad_buffer",
        "engine.onload_weights",
        "trainer.sleep",
        "engine.onload_kv",
    ]
    # init: engine weights stay resident through the trainer's load
    assert ops(plan, "init") == ["engine.offload_kv", "trainer.load", "trainer.sleep", "engine.onload_kv"]


def test_cpu_plan_is_the_usual_order():
    plan = build_plan(peak_device="cpu")
    assert ops(plan, "rollout_to_train") == [
        "engine.offload_kv",
        "engine.offload_weights(backup=True)",
        "trainer.wake_up",
    ]
    assert ops(plan, "train_to_rollout") == ["trainer.sleep", "engine.onload_weights", "engine.onload_kv"]
    assert ops(plan, "init")[:3] == ["engine.offload_kv", "engine.offload_weights(backup=True)", "trainer.load"]


@pytest.mark.parametrize("mode", MODES)
def test_steps_carry_their_expected_effects(mode):
    plan = build_plan(peak_device=mode)
    for phase in plan.phases:
        held = frozenset(phase.start)
        for step in phase.steps:
            alloc, free = effect(step.op, held, step.backup)
            assert (set(step.allocates), set(step.frees)) == (alloc, free)
            held = apply(step.op, held, step.backup)
        assert held == frozenset(phase.end)


def test_only_cpu_mode_ever_holds_both_host_copies():
    def holds_both(plan: Plan) -> bool:
        for phase in plan.phases:
            held = frozenset(phase.start)
            for step in phase.steps:
                alloc, _ = effect(step.op, held, step.backup)
                if held | alloc >= HOST_COPIES:
                    return True
                held = apply(step.op, held, step.backup)
        return False

    assert holds_both(build_plan(peak_device="cpu"))
    assert not holds_both(build_plan(peak_device="gpu"))


@pytest.mark.parametrize(
    "kwargs, missing",
    [
        ({"trainer_offload": False}, "trainer_offload"),
        ({"engine_offload": False}, "engine_offload"),
        ({"trainer_offload": False, "engine_offload": False}, "trainer_offload and engine_offload"),
    ],
)
def test_gpu_mode_without_offload_is_rejected(kwargs, missing):
    with pytest.raises(PlanError, match=f"{missing}.*peak_device='cpu'"):
        HandoffConfig(peak_device="gpu", **kwargs)


def test_unknown_mode_is_rejected():
    with pytest.raises(PlanError, match="choose one of"):
        build_plan(peak_device="nvme")


def test_cpu_mode_without_offloads_is_valid_and_does_less():
    plan = build_plan(peak_device="cpu", trainer_offload=False)
    assert Op.TRAINER_SLEEP not in [s.op for p in plan.phases for s in p.steps]
    end = frozenset(plan.phase("train_to_rollout").end)
    assert Region.TRAINER_STATE in end and Region.ENGINE_WEIGHTS in end
    nothing = build_plan(peak_device="cpu", trainer_offload=False, engine_offload=False)
    assert ops(nothing, "init") == ["trainer.load"] and ops(nothing, "rollout_to_train") == []


def test_custom_plan_is_validated():
    config = HandoffConfig(peak_device="gpu")
    good = Plan.from_ops(
        config,
        {
            "init": ["engine.offload_kv", "trainer.load", "trainer.sleep", "engine.onload_kv"],
            "rollout_to_train": [Op.ENGINE_OFFLOAD_KV, Op.TRAINER_WAKE_UP, (Op.ENGINE_OFFLOAD_WEIGHTS, True)],
            "train_to_rollout": ["engine.onload_weights", "trainer.sleep", "engine.onload_kv"],
        },
    )
    assert ops(good, "train_to_rollout")[0] == "engine.onload_weights"
    # the usual order does not satisfy gpu mode
    with pytest.raises(
        PlanError, match=r"rollout_to_train step 2 engine.offload_weights\(backup=True\).*never coexist"
    ):
        Plan.from_ops(
            config,
            {
                "init": ["engine.offload_kv", "trainer.load", "trainer.sleep", "engine.onload_kv"],
                "rollout_to_train": ["engine.offload_kv", "engine.offload_weights", "trainer.wake_up"],
                "train_to_rollout": ["engine.onload_weights", "trainer.sleep", "engine.onload_kv"],
            },
        )


def test_custom_plan_errors_name_the_problem():
    config = HandoffConfig()
    base = {
        "init": [
            "engine.offload_kv",
            "engine.offload_weights",
            "trainer.load",
            "trainer.sleep",
            "engine.onload_weights",
            "engine.onload_kv",
        ],
        "rollout_to_train": ["engine.offload_kv", "engine.offload_weights", "trainer.wake_up"],
        "train_to_rollout": ["trainer.sleep", "engine.onload_weights", "engine.onload_kv"],
    }
    Plan.from_ops(config, base)
    with pytest.raises(PlanError, match="step 2 trainer.sleep does nothing"):
        Plan.from_ops(config, {**base, "train_to_rollout": ["trainer.sleep", "trainer.sleep"]})
    with pytest.raises(PlanError, match=r"ends holding .*missing \['engine.kv'\]"):
        Plan.from_ops(config, {**base, "train_to_rollout": ["trainer.sleep", "engine.onload_weights"]})
    with pytest.raises(PlanError, match="unknown operation 'engine.teleport'"):
        Plan.from_ops(config, {**base, "init": ["engine.teleport"]})
    with pytest.raises(PlanError, match="lacks phase 'init'"):
        Plan.from_ops(config, {k: v for k, v in base.items() if k != "init"})
    gpu = HandoffConfig(peak_device="gpu")
    with pytest.raises(PlanError, match="engine weights stay resident through the trainer's load"):
        Plan.from_ops(
            gpu,
            {
                **base,
                "init": [
                    "engine.offload_kv",
                    "engine.offload_weights",
                    "trainer.load",
                    "engine.onload_weights",
                    "trainer.sleep",
                    "engine.onload_kv",
                ],
            },
        )


def test_tampered_plan_is_caught_by_validate():
    plan = build_plan(peak_device="gpu")
    phase = plan.phase("rollout_to_train")
    swapped = msgspec.structs.replace(phase, steps=(phase.steps[0], phase.steps[2], phase.steps[1]))
    bad = msgspec.structs.replace(
        plan, phases=tuple(swapped if p.name is PhaseName.ROLLOUT_TO_TRAIN else p for p in plan.phases)
    )
    with pytest.raises(PlanError):
        validate_plan(bad)


@pytest.mark.parametrize("mode", MODES)
def test_plan_round_trips_as_json(mode):
    plan = build_plan(peak_device=mode)
    data = msgspec.json.encode(plan)
    again = msgspec.json.decode(data, type=Plan)
    assert again == plan
    validate_plan(again)
    assert b'"engine.offload_kv"' in data


def test_schedule_orders_phases():
    plan = build_plan()
    names = [p.name.value for p in plan.schedule(2)]
    assert names == ["init", "rollout_to_train", "train_to_rollout", "rollout_to_train", "train_to_rollout"]
    with pytest.raises(PlanError):
        plan.schedule(-1)


@pytest.mark.parametrize("options", [{"peak_device": "cpu"}, {"peak_device": "gpu"}, {"engine_weight_backup": False}])
def test_a_built_plan_round_trips_through_json_as_data(options):
    """A handoff is a plan, not a code path: it can be written out and read back, typed, unchanged."""
    plan = build_plan(**options)
    again = msgspec.json.decode(msgspec.json.encode(plan), type=Plan)
    assert again == plan
    assert all(isinstance(step.why, str) for phase in plan.phases for step in phase.steps)
