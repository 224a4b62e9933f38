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


class TransportError(ColosyncError):
    """A transport could not be created, attached or used."""


class TransportUnavailable(TransportError):
    """The requested transport cannot work on this machine (the message says why)."""


class EngineError(ColosyncError):
    """The engine process failed or is gone."""


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
