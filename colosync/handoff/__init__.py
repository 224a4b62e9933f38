"""Colocated memory handoff between an RL trainer and its inference engine.

When trainer and engine share GPUs, every rollout->train and train->rollout switch moves
gigabytes between device and host, and the *order* of those moves decides the peaks: the
usual order briefly holds two large host copies (the engine's weight mirror and the
trainer's backup), which is what overflowed a 898 GiB host budget on GB300 nodes. Here a
handoff is a plan, simulated before a job and executed against real participants with
invariants checked while it runs. Three floors, each importing only the ones below it:

* ``model`` -- pure planning (its modules import no torch): the regions and operations (``ops``), the plans
  (``plans``), the simulator that predicts a plan's peaks for given sizes (``simulator``), and the
  interfaces of the two participants (``participants``);
* ``backends`` -- participants on real memory: ``torch_trainer``, ``torch_engine``, the
  optional ``tms_trainer`` (torch_memory_saver), and their ``host_pool`` and ``stash``; the
  node-wide shared ``arena`` that trainer and engine processes map together;
* ``runtime`` -- the ``executor`` that runs a plan, its ``invariants``, ``meter`` and ``records``,
  and host/device ``sampling``.

Participants in other processes (an engine process, a Ray actor, a trainer run by a
controller) are ``runtime.remote``'s ``RemoteEngineMemory`` / ``RemoteTrainerMemory``, served
by a ``MemoryService`` beside the real participant.

vLLM's sleep mode is a participant too, but it depends on vLLM, so it lives with the engines
(``colosync.engines.vllm.memory``). Light imports only here: torch-heavy modules load when
used.
"""

from __future__ import annotations

from colosync.errors import (
    HandoffError,
    HandoffInvariantError,
    HostPoolExhausted,
    ParticipantError,
    PlanError,
    SizesError,
    SleepModeUnavailable,
    StashError,
    UnsupportedOperation,
)
from colosync.handoff.model.ops import Op, Place, Region
from colosync.handoff.model.participants import EngineMemory, Footprint, OpReport, TrainerMemory
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
    load_handoff_sizes,
    simulate,
)

__all__ = [
    "Comparison",
    "EngineMemory",
    "Footprint",
    "HandoffConfig",
    "HandoffError",
    "HandoffInvariantError",
    "HandoffSizes",
    "HostPoolExhausted",
    "Op",
    "OpReport",
    "ParticipantError",
    "Phase",
    "PhaseName",
    "Place",
    "Plan",
    "PlanError",
    "Region",
    "Simulation",
    "SizesError",
    "SleepModeUnavailable",
    "StashError",
    "Step",
    "TrainerMemory",
    "UnsupportedOperation",
    "build_plan",
    "compare",
    "load_handoff_sizes",
    "simulate",
    "validate_plan",
]
