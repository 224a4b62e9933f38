"""Named adapters of one vLLM engine: each its own versions, verification and rollback, beside the others.

Several policies or tasks share an engine (multi-LoRA RL, a policy beside a reference, several
agents), and their trainers push independently. So each named adapter is a lane of its own: a
Receiver in every worker (``worker._WorkerState.lanes``), an ``EngineTransaction`` here with its own
owner and update ids, and ``Versions`` under adapter ids of its own (``worker.lane_lora_id``).
Pushing one adapter never pauses, changes or evicts another: a lane's commit always goes in beside
the running requests (new requests get the new version once it is verified, running ones finish on
theirs), the way ``commit_mode="inflight"`` commits the default adapter; a drop (``drop_adapter``)
waits for this adapter's requests only. All lanes share vLLM's
``max_loras`` slots (``versions.Slots``); one slot is kept free for a commit beside a served version,
so an engine takes ``max_loras - 1`` adapters, and an adapter beyond them is refused by name.

A full update stays the default connection's: it drains every request (one set of base weights)
and every worker puts each lane's versions back on the new weights (``VllmTarget.reinstall``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import msgspec

from colosync.engines.vllm.versions import Lease, Slots, Versions
from colosync.engines.vllm.worker import IN_MEMORY_PATH, lane_lora_id
from colosync.errors import ColosyncError, ConfigError, EngineError
from colosync.sync.link import Done
from colosync.sync.transaction import Applies, EngineTransaction
from colosync.wire.protocol import Ack, Commit, Probe, Revert, Status, TransactionRequest

log = logging.getLogger(__name__)

ScoreWith = Callable[[Probe, Any], Any]
"""``(probe, lora_request) -> (logprobs, updates)``: a probe scored on one adapter version."""


def check_adapter_name(name: str) -> str:
    if not name or "__" in name or not name.replace("-", "_").isidentifier():
        raise ConfigError(f"adapter name {name!r}: use letters, digits, '-' or '_' (not '__')")
    return name


class Submits:
    """``Link.submit``/``submit_batch`` through ``self.transaction``: an in-process client of the engine."""

    transaction: EngineTransaction

    def submit(self, request: TransactionRequest) -> Done:
        try:
            return Done(self.transaction.handle(request))
        except ColosyncError as exc:
            return Done(error=exc)
        except Exception as exc:  # vLLM itself failed: the engine is gone or broken
            return Done(error=EngineError(f"vLLM collective_rpc failed: {type(exc).__name__}: {exc}"))

    def submit_batch(self, requests: list[TransactionRequest]) -> list[Done]:
        """Each request in order, as an engine host answers a ``Batch``: one reply each, failures included."""
        return [self.submit(request) for request in requests]

    def close(self) -> None:
        pass


def committing_lora(transaction: EngineTransaction) -> bool:
    """Whether the update being committed is a LoRA one (its owner's last Begin says)."""
    owner = transaction.owner
    return owner is not None and owner.begun is not None and owner.begun[0].kind == "lora"


def commit_beside(
    transaction: EngineTransaction,
    workers: Applies,
    versions: Versions,
    request: Commit | Revert,
    apply: Callable[[], Ack],
) -> Ack:
    """A LoRA commit, or the revert of one not yet published, while requests run on the versions before it."""
    reverting = isinstance(request, Revert)
    if reverting and not versions.pending:
        raise ConfigError(
            f"update {request.update_id} is served to new requests already, and requests may still run on it: "
            "push the adapter to go back to as a new update instead of a Revert"
        )
    waited = 0.0 if reverting else versions.make_room()
    try:
        ack = transaction.observe(apply())
    except Exception:  # e.g. the workers found it wrong and reverted it themselves: what do they serve?
        if not reverting:
            versions.unreserve()
        try:
            transaction.observe(workers.handle(Status()))
        except Exception:
            log.exception("colosync: could not read what the vLLM workers serve after a failed switch")
        raise
    finally:
        if reverting:
            versions.reverted(transaction.adapter)
    if not reverting:
        versions.staged(ack.adapter)
    return msgspec.structs.replace(ack, waited_s=waited) if waited else ack


class VllmLane(Submits):
    """One named adapter of a vLLM engine: a ``Link`` for its Sender and the ``Serving`` of its transaction.

    >>> sender = Sender(engine.lane("policy"))            # in-process; or EngineProcess.connect(adapter=...)
    >>> with engine.lane("policy").lease() as lease:      # a request's version, until it ends
    ...     llm.generate(prompts, params, lora_request=lease.lora_request)
    >>> async with engine.lane("policy").lease_async() as lease:   # the same on an AsyncLLM's event loop
    ...     async for out in async_llm.generate(prompt, params, request_id, lora_request=lease.lora_request): ...
    """

    def __init__(
        self,
        name: str,
        index: int,
        workers: Applies,
        rpc: Callable[..., list[Any]],
        score_with: ScoreWith,
        slots: Slots,
        versions_in_flight: int = 2,
        retire_in_thread: bool = False,
        max_lag: int | None = None,
    ) -> None:
        self.name, self.index = check_adapter_name(name), index
        self.workers = workers
        self._rpc = rpc
        self._score_with = score_with
        self.transaction = EngineTransaction(workers, self)
        self.transaction.staleness.limit(max_lag)
        self.versions = Versions(
            versions_in_flight,
            self._retire,
            slots=slots,
            name=name,
            request_of=self.lora_request,
            retire_in_thread=retire_in_thread,
            staleness=self.transaction.staleness,
        )

    def lora_request(self, update_id: int) -> Any:
        """The ``LoRARequest`` of this adapter's version ``update_id``."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=f"colosync-{self.name}-u{update_id}",
            lora_int_id=lane_lora_id(self.index, update_id),
            lora_path=IN_MEMORY_PATH,
        )

    def lease(self, bounded: bool = True) -> AbstractContextManager[Lease]:
        """``with lane.lease() as lease``: this adapter's served version for one request, held until it ends
        (``bounded=False``: one that ``max_lag`` does not hold up, a scoring one)."""
        self.transaction.refuse_unless_serving("generation")
        return self.versions.lease(bounded)

    def lease_async(self) -> AbstractAsyncContextManager[Lease]:
        """``async with lane.lease_async() as lease``: ``lease`` on an ``AsyncLLM``'s event loop."""
        self.transaction.refuse_unless_serving("generation")
        return self.versions.lease_async()

    def try_lease(self, held: Any) -> Lease | None:
        return self.versions.try_lease(held) if self.transaction.serving else None

    @property
    def committed_update_id(self) -> int:
        return self.transaction.committed_update_id

    # -- Serving --------------------------------------------------------------------------------
    def switch(self, request: Commit | Revert, apply: Callable[[], Ack]) -> Ack:
        if committing_lora(self.transaction):
            return commit_beside(self.transaction, self.workers, self.versions, request, apply)
        with self.versions.exclusive():  # a drop: this adapter's requests end first, the others' run on
            try:
                return self.transaction.observe(apply())
            finally:
                self.versions.reset(self.transaction.adapter, self.transaction.committed_update_id)

    def publish(self, ack: Ack) -> None:
        self.versions.publish()

    def score_probe(self, probe: Probe) -> Any:
        self.transaction.refuse_unless_serving("to score the probe")
        uid = self.versions.probe_version()
        return self._score_with(probe, self.lora_request(uid) if uid else None)

    def _retire(self, update_id: int) -> None:
        if not all(self._rpc("colosync_retire", update_id, self.name)):
            log.warning("colosync: adapter %r version %d was not on every worker at retirement", self.name, update_id)


__all__ = ["Submits", "VllmLane", "check_adapter_name", "commit_beside", "committing_lora"]
