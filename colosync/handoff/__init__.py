"""Colocated memory handoff between an RL trainer and its inference engine.

When trainer and engine share GPUs, every rollout->train and train->rollout switch moves
gigabytes between device and host, and the *order* of those moves decides the peaks: the
usual order briefly holds two large host copies (the engine's weight mirror and the
trainer's backup), which is what overflowed a 898 GiB host budget on GB300 nodes. Here a
handoff is a plan (``plans``), simulated before a job (``simulator``), executed against
real participants with invariants checked while it runs (``executor``), on fast backends
(``torch_backend``, ``engine_memory``, optional ``tms_backend``).

Light imports only here: torch-heavy modules load when used.
"""

from __future__ import annotations

from colosync.errors import (
    HandoffError,
    HandoffInvariantError,
    HostPoolExhausted,
    PlanError,
    SizesError,
    SleepModeUnavailable,
    StashError,
    UnsupportedOperation,
)
from colosync.handoff.model.ops import Op, Place, Region
from colosync.handoff.runtime.participants import EngineMemory, Footprint, OpReport, TrainerMemory
from colosync.handoff.model.plans import (
    HandoffConfig,
    Phase,
    PhaseName,
    Plan,
    Step,
    build_plan,
    validate_plan,
)
from colosync.handoff.model.simulator import (
    Comparison,
    HandoffSizes,
    Simulation,
    compare,
    load_workload,
    simulate,
)

__all__ = [
    "Comparison", "EngineMemory", "Footprint", "HandoffConfig", "HandoffError", "HandoffInvariantError",
    "HandoffSizes", "HostPoolExhausted", "Op", "OpReport", "Phase", "PhaseName", "Place", "Plan", "PlanError",
    "Region", "Simulation", "SizesError", "SleepModeUnavailable", "StashError", "Step", "TrainerMemory",
    "UnsupportedOperation", "build_plan", "compare", "load_workload", "simulate", "validate_plan",
]
