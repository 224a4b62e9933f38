"""Exceptions of the memory handoff.

A handoff fails in a few distinct ways — a plan that cannot work, an operation a backend
cannot perform, a host pool that ran dry, an invariant that broke while running — and a
caller reacts differently to each, so each has a type. Messages name the step, the figures
and the change that fixes it.
"""

from __future__ import annotations

from colosync.errors import ColosyncError


class HandoffError(ColosyncError):
    """Base class of the handoff's errors."""


class PlanError(HandoffError, ValueError):
    """A handoff plan or configuration is invalid (the message says which option to change)."""


class SizesError(HandoffError, ValueError):
    """Sizes given to the simulator are inconsistent or missing."""


class UnsupportedOperation(HandoffError):
    """A participant cannot perform an operation on this backend or platform."""


class SleepModeUnavailable(UnsupportedOperation):
    """The engine has no sleep mode here (e.g. vLLM's CPU backend, or sleep mode not enabled)."""


class HostPoolExhausted(HandoffError, MemoryError):
    """The pinned host pool would exceed its ``max_bytes``."""


class StashError(HandoffError):
    """Tensors cannot be offloaded or restored safely (e.g. restored twice, wrong device)."""


class HandoffInvariantError(HandoffError):
    """An invariant broke while a plan ran; ``violation`` holds the step and the figures."""

    def __init__(self, message: str, violation: object | None = None) -> None:
        super().__init__(message)
        self.violation = violation
