"""The operations' semantics (``ops.effect``): what each allocates and frees, and when it is a no-op."""

from __future__ import annotations

import pytest

from colosync.handoff import Op, PlanError, Region
from colosync.handoff.model.ops import apply, effect

R = Region
RESIDENT = frozenset({R.ENGINE_WEIGHTS, R.ENGINE_KV})


def test_offload_weights_allocates_the_mirror_before_freeing():
    alloc, free = effect(Op.ENGINE_OFFLOAD_WEIGHTS, RESIDENT, backup=True)
    assert (alloc, free) == ({R.ENGINE_MIRROR}, {R.ENGINE_WEIGHTS})
    assert effect(Op.ENGINE_OFFLOAD_WEIGHTS, RESIDENT, backup=False) == (frozenset(), {R.ENGINE_WEIGHTS})
    assert apply(Op.ENGINE_OFFLOAD_WEIGHTS, RESIDENT) == {R.ENGINE_MIRROR, R.ENGINE_KV}


def test_an_operation_without_its_precondition_does_nothing():
    assert effect(Op.TRAINER_WAKE_UP, RESIDENT) == (frozenset(), frozenset())
    assert apply(Op.ENGINE_ONLOAD_KV, RESIDENT) == RESIDENT


def test_unknown_operation_names_the_known_ones():
    with pytest.raises(PlanError, match=r"unknown operation 'engine.teleport'.*engine.offload_kv.*Op\(name\)"):
        effect("engine.teleport", RESIDENT)  # type: ignore[arg-type]  # deliberately not an Op
