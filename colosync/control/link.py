"""A ``Link`` to an engine in this process, taking the path a remote engine's requests take.

Tests, benchmarks and an engine embedded in the trainer reach the engine without a socket,
but not around what a socket leads to: requests go through an ``EngineTransaction`` (the
engine's owner, ``BeginAgain``, the verified commit), and ``submit_batch`` answers a
``Batch``'s parts in order as a host does, so a Sender takes the same path here as against
an engine process.
"""

from __future__ import annotations

from colosync.errors import ColosyncError
from colosync.sync.link import Done
from colosync.sync.transaction import Applies, EngineTransaction, transaction_of
from colosync.wire.protocol import TransactionRequest


class LocalLink:
    """``LocalLink(receiver)`` or ``LocalLink(engine_transaction)``: the engine's side in this process.

    Each link is one client (its own session) of the engine's one ``EngineTransaction``: a second
    link's sender is refused while the first owns the engine, or takes it over, as remotely.
    ``close`` ends the session, which releases the engine if this link's sender still owned it.
    """

    def __init__(self, engine: Applies | EngineTransaction) -> None:
        self.transaction = transaction_of(engine)
        self.session = self.transaction.open_session()

    @property
    def receiver(self) -> Applies:
        """What applies the updates behind the transaction (a ``Receiver``)."""
        return self.transaction.applies

    def submit(self, request: TransactionRequest) -> Done:
        try:
            return Done(self.transaction.handle(request, self.session))
        except ColosyncError as exc:
            return Done(error=exc)

    def submit_batch(self, requests: list[TransactionRequest]) -> list[Done]:
        """Each request in order, as an engine host answers a ``Batch``: one reply each, failures included."""
        return [self.submit(request) for request in requests]

    def close(self) -> None:
        self.transaction.close_session(self.session, "its LocalLink closed")


__all__ = ["LocalLink"]
