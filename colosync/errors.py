"""Exception types for colosync.

Every rejection a user can hit has its own type so callers can catch precisely, and every
message names what was wrong, what was expected and how to fix it. The types also cross
process boundaries: a receiver replies with the type's name and the message, and the
trainer side re-raises the same type (see ``error_from_wire``).
"""

from __future__ import annotations


class ColosyncError(Exception):
    """Base class of every error colosync raises on purpose.

    Fix: Catch it to handle every refusal colosync makes; the subclass says which, and its message names what to
    change.
    """


class ManifestError(ColosyncError, ValueError):
    """A manifest or wire message is malformed (bad sizes, offsets, names, types).

    Fix: Build manifests and messages with colosync's own types (``Sender`` does); an engine answers hostile or
    truncated bytes with this error and touches no state, so check that both sides run the same colosync
    version.
    """


class UnknownLayoutError(ManifestError):
    """A ``BeginAgain`` names a manifest this engine did not see last on this connection.

    Fix: Nothing to do: a Sender that receives it sends the full ``Begin`` once, by itself. Seen outside a
    Sender, send the full manifest.
    """


class UpdateRejected(ColosyncError):
    """The engine refused an update; it keeps serving its last committed version.

    Fix: Read the subclass and its message, which name the tensor, what was expected and what came; fix the
    trainer side and push again.
    """


class UnknownTensorError(UpdateRejected):
    """A tensor name does not map to anything the engine's model has.

    Fix: Send the engine's names: HF names for full weights, PEFT's saved names (``...q_proj.lora_A.weight``)
    for a LoRA; strip wrapper prefixes (``module.``, ``_orig_mod.``) or use a source (``colosync.sources``),
    which does.
    """


class ShapeMismatchError(UpdateRejected):
    """A tensor's shape disagrees with the engine's module or the adapter rank.

    Fix: Check the rank in the ``LoraSpec`` and that tensor-parallel shards were gathered before sending (a
    Megatron or FSDP source gathers them).
    """


class DtypeError(UpdateRejected):
    """A tensor's dtype cannot be cast to the engine's dtype.

    Fix: Cast on the trainer side to a dtype the engine accepts (a source's ``dtype=`` does it on the way), or
    start the engine with a dtype that can hold the trainer's.
    """


class RankError(UpdateRejected):
    """The adapter rank is larger than the engine was started to accept.

    Fix: Start the engine with a larger maximum rank (vLLM: ``max_lora_rank``) or train a smaller adapter.
    """


class FingerprintMismatchError(UpdateRejected):
    """The bytes that arrived are not the bytes that were sent.

    Fix: A tensor changed while it was being sent, or the transport is broken: do not modify the tensors during
    a push, and run ``colosync probe`` to check the transport; ``transport="shm"`` avoids CUDA IPC.
    """


class NonFiniteError(UpdateRejected):
    """A tensor holds NaN or Inf values.

    Fix: Fix the training step that produced them (the message names the tensor); the engine keeps serving its
    previous version. ``ReceiverPolicy(reject_nonfinite=False)`` turns the check off.
    """


class StaleUpdateError(UpdateRejected):
    """The update id is not newer than the engine's committed or in-flight update.

    Fix: Let the Sender pick ids (it resynchronises from the engine's reply and retries once); an explicit
    ``update_id`` must be above every id the engine has begun.
    """


class TransactionStateError(UpdateRejected):
    """A transaction step arrived out of order (e.g. commit before prepare).

    Fix: Drive the transaction through a ``Sender``, which sends ``begin``, ``stage``, ``prepare`` and
    ``commit`` in order; a hand-written client must follow the same order.
    """


class UpdateTimeoutError(UpdateRejected):
    """The sender went silent mid-update and the receiver aborted it.

    Fix: Push again; if the trainer is slow to produce tensors on purpose, raise ``ReceiverPolicy.timeout_s``.
    """


class IncompleteUpdateError(UpdateRejected):
    """An update that must be whole is not (an empty LoRA, modules of its targets missing).

    Fix: Send the whole adapter: every module its ``target_modules`` (and ``LoraSpec.layers``) name in the
    engine's model, both ``lora_A`` and ``lora_B``; or narrow the ``LoraSpec`` to what the adapter has.
    """


class TiedWeightError(UpdateRejected):
    """A tied parameter (``lm_head.weight`` of a model that ties it to the embedding) disagrees with its tie.

    Fix: Send ``lm_head.weight`` equal to ``model.embed_tokens.weight`` (a tied model's ``state_dict()`` does),
    or leave it out.
    """


class DeliveryError(UpdateRejected):
    """The engine committed the bytes but does not compute what the trainer computes.

    A LoRA update is rolled back to the previous adapter; a full update leaves the engine
    refusing to serve (failed closed) until a verified update commits.

    Fix: The message names the largest deviation and where it is. Check that the probe was recorded from the
    model that was pushed, that the tolerance fits the two sides' dtypes, and, for a full update over a served
    adapter, the ``adapters=`` choice; then push again.
    """


class EngineBusyError(UpdateRejected):
    """Another sender owns this engine; the message names it and how to take over.

    Fix: Close the other Sender (``Sender.close()``), or pass ``Sender(..., takeover=True)`` to take the engine
    over and abort its in-flight update.
    """


class AdapterSlotsError(UpdateRejected):
    """An engine's adapter slots are all held by other adapters; the message names them and their versions.

    Fix: Drop an adapter the job no longer needs (``Sender.drop_adapter()`` on its connection), or start the
    engine with more slots (``EngineConfig(max_loras=N)``).
    """


class TransportError(ColosyncError):
    """A transport could not be created, attached or used.

    Fix: Run ``colosync probe`` to see what the machine allows, and use ``transport="auto"``, which falls back
    to a transport that works.
    """


class TransportUnavailable(TransportError):
    """The requested transport cannot work on this machine (the message says why).

    Fix: Use ``transport="auto"`` (it logs why it passed over each transport, in ``Sender.transport_log``) or
    the transport ``colosync probe`` recommends; in containers CUDA IPC usually needs ``pidfd_getfd`` permitted.
    """


class GroupJoinError(TransportError):
    """A rank of a broadcast group did not join it within the timeout (the message lists who did).

    Fix: Check that every engine of the set is up and can reach the trainer's address (``EngineSet(host=...)``),
    that no firewall blocks the port the message names, or raise ``EngineSet(join_timeout_s=...)`` for a slow start.
    """


class EngineSetError(UpdateRejected):
    """An update across an ``EngineSet`` did not commit on every engine; ``outcomes`` says what each serves now.

    Fix: Drop or replace the engines the message names (``EngineSet.remove``/``add``) and push again: the next
    update id resynchronises every engine, whatever version each serves now.
    """

    outcomes: tuple[object, ...] = ()  # the EngineOutcome of every engine of the set, when known


class EngineError(ColosyncError):
    """The engine process failed or is gone.

    Fix: Read the engine's log (it goes to the trainer's stderr; raise ``EngineConfig.log_level`` for more) and
    start a new engine; a script that starts an engine process needs an ``if __name__ == "__main__":`` guard.
    """


class FailedClosedError(EngineError):
    """The engine refuses to serve: a full update failed verification.

    Fix: Push a full update that verifies; a LoRA on top of unknown base weights cannot reopen the engine.
    """


class VersionLagError(EngineError):
    """No request starts on the served version: it is more than ``max_lag`` updates behind the newest one its
    trainer began (asynchronous RL's bound on staleness).

    Fix: Let the trainer's next update commit (requests start again as soon as it does); if pushes keep failing,
    read why in the Sender's error, or raise ``max_lag``.
    """


class AuthenticationError(EngineError):
    """A client could not prove it holds the engine's key.

    Fix: Connect with the engine's own ``engine.address`` (it carries the key), passed unchanged to ``connect``.
    """


class ConfigError(ColosyncError, ValueError):
    """An argument or configuration value is out of range.

    Fix: Change the argument the message names to one of the values it lists.
    """


class ConversionError(ColosyncError, ValueError):
    """A trainer's weights cannot be converted to the engine's layout (names the parameter).

    Fix: Pick the architecture that matches the model (``ConversionContext(arch=...)``), attach the adapter the
    ``LoraSpec`` names, or drop what the message says is not converted.
    """


class ParityError(ColosyncError):
    """The engine computes something other than the trainer for the update it says it serves.

    Fix: Check that the engine serves the update id the sync committed and that both sides compute in the dtypes
    the tolerance assumes; push with ``verify=`` to have the engine refuse such an update.
    """


# -- memory handoff -----------------------------------------------------------------------
# A handoff fails in a few distinct ways (a plan that cannot work, an operation a backend
# cannot perform, a host pool that ran dry, an invariant that broke while running) and a
# caller reacts differently to each, so each has a type.


class HandoffError(ColosyncError):
    """Base class of the handoff's errors.

    Fix: Catch it to handle every handoff failure at once; the subclass and its message say what to change.
    """


class PlanError(HandoffError, ValueError):
    """A handoff plan or configuration is invalid.

    Fix: Change the option the message names (e.g. ``peak_device="gpu"`` needs both offloads), or fix the custom
    order's phase and step it names.
    """


class SizesError(HandoffError, ValueError):
    """Sizes given to the simulator are inconsistent or missing.

    Fix: Give a ``--workload`` preset or file, or every size the message lists, each >= 0.
    """


class UnsupportedOperation(HandoffError):
    """A participant cannot perform an operation on this backend or platform.

    Fix: Run the plan without that operation (e.g. ``engine_offload=False``), or use a backend that has it.
    """


class SleepModeUnavailable(UnsupportedOperation):
    """The engine has no sleep mode here (e.g. vLLM's CPU backend, or sleep mode not enabled).

    Fix: Start vLLM with ``enable_sleep_mode=True`` on CUDA; on vLLM's CPU backend run with
    ``engine_offload=False`` or without the handoff.
    """


class HostPoolExhausted(HandoffError, MemoryError):
    """The pinned host pool would exceed its ``max_bytes``.

    Fix: Size the pool or arena from the plan (``HostArena.for_plan``) and share one between trainer and engine;
    the message names who holds the chunks.
    """


class StashError(HandoffError):
    """Tensors cannot be offloaded or restored safely (e.g. restored twice, wrong device).

    Fix: Give the participant a ``HostPool`` when it backs tensors up, and offload and restore each set once, in
    order.
    """


class HandoffInvariantError(HandoffError):
    """An invariant broke while a plan ran; ``violation`` holds the step and the figures.

    Fix: The message names the phase, step, moment and figures, and what to change (e.g. share one ``HostPool``
    between trainer and engine).
    """

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

    Fix: Install a version of the framework in the tested range the message names (TRL: ``pip install
    'colosync[trl]'``).
    """


class ParticipantError(HandoffError):
    """A handoff participant in another process failed or vanished during an operation.

    ``participant`` and ``op`` name it and the operation; ``phase`` and ``step`` the plan's
    step when an executor ran it. Whatever the other participant held stays with it.

    Fix: Read the named participant's log for why it failed, then restart it; the other participant keeps what
    it held.
    """

    def __init__(self, message: str, *, participant: str = "", op: str = "", phase: str = "", step: int = 0) -> None:
        super().__init__(message)
        self.participant, self.op, self.phase, self.step = participant, op, phase, step


class PeerFailedError(ColosyncError):
    """Another rank of a collective source failed its part of a sync; this rank raises too, so none
    carries on as if the engine had the update.

    Fix: Read the log of the ranks the message names: the sending rank raised the engine's own error there.
    """
