"""Exception types for colosync.

Every rejection a user can hit has its own type so callers can catch precisely, and every
message names what was wrong, what was expected and how to fix it. The types also cross
process boundaries: a receiver replies with the type's name and the message, and the
trainer side re-raises the same type (see ``error_from_wire``).
"""

from __future__ import annotations


class ColosyncError(Exception):
    """Base class of every error colosync raises on purpose."""


class ManifestError(ColosyncError, ValueError):
    """A manifest or wire message is malformed (bad sizes, offsets, names, types)."""


class UnknownLayoutError(ManifestError):
    """A ``BeginAgain`` names a manifest this engine did not see last on this connection (a Sender
    then sends the full ``Begin`` once, by itself)."""


class UpdateRejected(ColosyncError):
    """The engine refused an update; it keeps serving its last committed version."""


class UnknownTensorError(UpdateRejected):
    """A tensor name does not map to anything the engine's model has."""


class ShapeMismatchError(UpdateRejected):
    """A tensor's shape disagrees with the engine's module or the adapter rank."""


class DtypeError(UpdateRejected):
    """A tensor's dtype cannot be cast to the engine's dtype."""


class RankError(UpdateRejected):
    """The adapter rank is larger than the engine was started to accept."""


class FingerprintMismatchError(UpdateRejected):
    """The bytes that arrived are not the bytes that were sent."""


class NonFiniteError(UpdateRejected):
    """A tensor holds NaN or Inf values."""


class StaleUpdateError(UpdateRejected):
    """The update id is not newer than the engine's committed or in-flight update."""


class TransactionStateError(UpdateRejected):
    """A transaction step arrived out of order (e.g. commit before prepare)."""


class UpdateTimeoutError(UpdateRejected):
    """The sender went silent mid-update and the receiver aborted it."""


class IncompleteUpdateError(UpdateRejected):
    """An update that must be whole is not (an empty LoRA, modules of its targets missing)."""


class TiedWeightError(UpdateRejected):
    """A tied parameter (``lm_head.weight`` of a model that ties it to the embedding) disagrees with its tie."""


class DeliveryError(UpdateRejected):
    """The engine committed the bytes but does not compute what the trainer computes.

    A LoRA update is rolled back to the previous adapter; a full update leaves the engine
    refusing to serve (failed closed) until a verified update commits.
    """


class EngineBusyError(UpdateRejected):
    """Another sender owns this engine; the message names it and how to take over."""


class TransportError(ColosyncError):
    """A transport could not be created, attached or used."""


class TransportUnavailable(TransportError):
    """The requested transport cannot work on this machine (the message says why)."""


class EngineError(ColosyncError):
    """The engine process failed or is gone."""


class FailedClosedError(EngineError):
    """The engine refuses to serve: a full update failed verification (push a good one)."""


class AuthenticationError(EngineError):
    """A client could not prove it holds the engine's key."""


class ConfigError(ColosyncError, ValueError):
    """An argument or configuration value is out of range (the message names the fix)."""


class ConversionError(ColosyncError, ValueError):
    """A trainer's weights cannot be converted to the engine's layout (names the parameter)."""


class ParityError(ColosyncError):
    """The engine computes something other than the trainer for the update it says it serves."""


# -- memory handoff -----------------------------------------------------------------------
# A handoff fails in a few distinct ways (a plan that cannot work, an operation a backend
# cannot perform, a host pool that ran dry, an invariant that broke while running) and a
# caller reacts differently to each, so each has a type.


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


def _all_error_types() -> dict[str, type[ColosyncError]]:
    found: dict[str, type[ColosyncError]] = {}
    stack: list[type[ColosyncError]] = [ColosyncError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def error_from_wire(name: str, message: str) -> ColosyncError:
    """Rebuild the exception a peer reported; unknown names become ``EngineError``."""
    cls = _all_error_types().get(name, EngineError)
    return cls(message)


class IntegrationError(ColosyncError):
    """A framework's internals are not what a colosync integration expects (``colosync.integrations``).

    Raised before any training step; the message names the version found, the range colosync
    was tested with, and what is missing.
    """


class ParticipantError(HandoffError):
    """A handoff participant in another process failed or vanished during an operation.

    ``participant`` and ``op`` name it and the operation; ``phase`` and ``step`` the plan's
    step when an executor ran it. Whatever the other participant held stays with it."""

    def __init__(self, message: str, *, participant: str = "", op: str = "", phase: str = "", step: int = 0) -> None:
        super().__init__(message)
        self.participant, self.op, self.phase, self.step = participant, op, phase, step


class PeerFailedError(ColosyncError):
    """Another rank of a collective source failed its part of a sync; this rank raises too, so none
    carries on as if the engine had the update (the message names the ranks whose log says why)."""
