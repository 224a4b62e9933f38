"""One serving loop for every place an engine lives.

An engine is reached through a Unix socket (``EngineProcess``), a Ray actor, or vLLM's
collective RPC into its workers, and each of them moves msgpack bytes. ``EngineHost`` is the
one place where those bytes become a typed request, go to the transaction side (a
``Receiver``, or a link to the Receivers inside vLLM's workers) or to the engine's own
serving code, and come back as a typed reply, a failure included (``Failed``, never a
raised exception and never a crash). So every host refuses garbage, reports a rejected
update and expires an abandoned one the same way.

It also decides who may update the engine. Clients arrive as sessions (a connection, a Ray
caller); the first to ``Attach`` owns the update channel, and another is refused with
``EngineBusyError`` naming the owner, until the owner disconnects, dies (its pid is watched)
or is explicitly taken over. A session that ends takes only its own in-flight update with
it. And it turns a ``Commit`` that carries a ``Probe`` into a verified commit
(``sync.delivery.verified_commit``, the sequence the vLLM link runs too), the probe scored by
the engine's own serving code before anything else is served.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Union

import msgspec
import torch

from colosync.engines.config import EngineConfig, Score, Scores
from colosync.errors import (
    ColosyncError,
    ConfigError,
    EngineBusyError,
    EngineError,
    FailedClosedError,
    ManifestError,
    UnknownLayoutError,
)
from colosync.sync.delivery import verified_commit
from colosync.sync.link import Link
from colosync.sync.receiver import Receiver
from colosync.sync.target import EngineTarget
from colosync.wire.manifest import UpdateManifest, manifest_digest
from colosync.wire.protocol import (
    Abort,
    Ack,
    Attach,
    Batch,
    BatchReply,
    Begin,
    BeginAgain,
    Codec,
    Commit,
    Detach,
    Failed,
    Hello,
    Probe,
    Status,
    TransactionRequest,
)

log = logging.getLogger(__name__)

TRANSACTION_TYPES: tuple[type, ...] = TransactionRequest.__args__
_OWNER_ONLY: tuple[type, ...] = tuple(t for t in TRANSACTION_TYPES if t is not Status)


@dataclass
class Session:
    """One client of a host: a connection, a Ray caller, or the host's own process."""

    id: int
    pid: int | None = None
    host: str = ""
    name: str = ""
    opened: float = field(default_factory=time.time)
    peer_pid: bool = False  # the pid came from the kernel (SO_PEERCRED), not from the client
    begun: tuple[UpdateManifest, bytes] | None = None  # its last Begin's manifest and digest (for BeginAgain)
    taken_over_by: str = ""  # who took this client's ownership away, and when

    def begin_again(self, request: BeginAgain) -> Begin:
        """The ``Begin`` a ``BeginAgain`` stands for: this client's last Begin under a new update id."""
        begun = self.begun
        if begun is None or begun[1] != request.digest:
            raise UnknownLayoutError(
                f"BeginAgain names manifest {request.digest.hex()}, but this connection's last Begin was "
                f"{begun[1].hex() if begun else 'none'}; send the full Begin (a Sender does on its own)"
            )
        return Begin(msgspec.structs.replace(begun[0], update_id=request.update_id))

    def describe(self) -> str:
        who = f"pid {self.pid}" + (f" on {self.host}" if self.host else "") if self.pid else f"session {self.id}"
        named = f" ({self.name})" if self.name else ""
        return f"{who}{named}, connected at {time.strftime('%H:%M:%S', time.localtime(self.opened))}"

    def alive(self) -> bool:
        """False only when this client's process is known to have exited (same host, pid gone)."""
        if not self.pid or (self.host and self.host != socket.gethostname()):
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class Transactions(Protocol):
    """The transaction side of an engine: a ``Receiver`` or anything that forwards to one."""

    def handle(self, request: TransactionRequest) -> Ack: ...

    def status(self) -> Ack: ...

    def abort(self, update_id: int, reason: str) -> None: ...

    def detach(self) -> None: ...

    def check_timeout(self) -> None: ...

    def close(self) -> None: ...


class ServedEngine(Protocol):
    """An engine a host can serve: its own requests, and a transaction side."""

    requests: ClassVar[tuple[type, ...]]
    replies: ClassVar[tuple[type, ...]]

    @classmethod
    def from_config(cls, config: EngineConfig) -> ServedEngine: ...

    def transactions(self, policy: Any) -> Transactions: ...

    def handle(self, request: Any) -> msgspec.Struct: ...


class HostedTarget(EngineTarget):
    """An ``EngineTarget`` served by a host: the host builds its ``Receiver`` on ``device``."""

    requests: ClassVar[tuple[type, ...]] = ()
    replies: ClassVar[tuple[type, ...]] = ()
    device: torch.device
    receiver: Receiver

    def transactions(self, policy: Any) -> Receiver:
        self.receiver = Receiver(self, self.device, policy)
        return self.receiver

    @property
    def committed_update_id(self) -> int:
        return self.receiver.committed_update_id

    def handle(self, request: Any) -> msgspec.Struct:
        raise ManifestError(f"this engine serves no {type(request).__name__} requests")


class LinkTransactions:
    """Transactions forwarded over a ``Link`` (the vLLM workers' Receivers behind collective RPC);
    ``on_close`` ends what serves them when the host closes (an engine the host built)."""

    def __init__(self, link: Link, on_close: Callable[[], None] | None = None) -> None:
        self.link = link
        self._on_close = on_close

    def handle(self, request: TransactionRequest) -> Ack:
        return self.link.submit(request).wait()

    def status(self) -> Ack:
        return self.handle(Status())

    def abort(self, update_id: int, reason: str) -> None:
        self.handle(Abort(update_id, reason))

    def detach(self) -> None:
        self.handle(Detach("the owner left"))

    def check_timeout(self) -> None:
        pass  # the Receivers at the far end keep their own clocks

    def close(self) -> None:
        self.link.close()
        if self._on_close is not None:
            self._on_close()


def codecs(requests: tuple[type, ...] = (), replies: tuple[type, ...] = ()) -> tuple[Codec, Codec]:
    """Request and reply codecs for the transaction messages plus an engine's own."""
    # Unions built at run time from the engine's own message types.
    return (
        Codec(Union[(*TRANSACTION_TYPES, Batch, *requests)]),
        Codec(Union[(Ack, Failed, BatchReply, *replies)]),
    )


class EngineHost:
    """Bytes in, bytes out: decode, check who asks, dispatch, reply; never raises.

    >>> host = EngineHost(receiver)                             # a vLLM worker: transactions only
    >>> host = EngineHost(engine.transactions(policy), engine)  # an engine with its own requests
    >>> session = host.open_session()
    >>> reply = host.handle_bytes(data, session)

    ``handlers`` serve host-level requests (``Shutdown`` of the engine process). Calls may
    come from several threads (a Ray actor's tick); one lock orders them.
    """

    def __init__(
        self,
        transactions: Transactions,
        engine: ServedEngine | None = None,
        handlers: dict[type, Callable[[Any, Session], msgspec.Struct]] | None = None,
    ) -> None:
        self.transactions = transactions
        self.engine = engine
        self.handlers = dict(handlers or {})
        requests = (Hello, *(engine.requests if engine else ()), *self.handlers)
        self.request_codec, self.reply_codec = codecs(requests, engine.replies if engine else ())
        self.owner: Session | None = None
        self._displaced: Session | None = None  # the owner an Attach with takeover released, until it attaches
        self.serving = True
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._sessions: dict[int, Session] = {}
        self._manifests: OrderedDict[bytes, UpdateManifest] = OrderedDict()  # recent Begins by digest (_interned)
        self._local = self.open_session()  # callers that name no session (in-process use)

    # -- sessions -------------------------------------------------------------------------
    def open_session(self, pid: int | None = None) -> Session:
        """A new client; ``pid`` when the transport knows it (a Unix socket's peer credentials)."""
        session = Session(next(self._ids), pid=pid, host=socket.gethostname() if pid else "", peer_pid=pid is not None)
        self._sessions[session.id] = session
        return session

    def close_session(self, session: Session, reason: str) -> None:
        """``session`` is gone: abort its in-flight update and release the engine if it owned it."""
        with self._lock:
            self._sessions.pop(session.id, None)
            if self.owner is not session:
                return
            self._release(f"its sender ({session.describe()}) is gone: {reason}")

    def tick(self) -> None:
        """Expire what a clock must: idle updates, and an owner whose process has died."""
        with self._lock:
            self.transactions.check_timeout()
            owner = self.owner
            if owner is not None and not owner.alive():
                self._sessions.pop(owner.id, None)
                self._release(f"its sender ({owner.describe()}) died")

    def _release(self, why: str) -> None:
        try:
            in_flight = self.transactions.status().in_flight_update_id
            if in_flight is not None:
                self.transactions.abort(in_flight, why)
            self.transactions.detach()
            self.serving = self.transactions.status().serving
        finally:  # whatever failed above, the engine must not stay owned by a client that is gone
            self.owner = None
        log.info("engine: released by its owner; %s", why)

    # -- requests -------------------------------------------------------------------------
    def decode(self, data: bytes) -> msgspec.Struct:
        """The request in ``data``, or the ``Failed`` reply that says why it is not one."""
        try:
            return self.request_codec.decode(bytes(data))
        except ColosyncError as exc:
            return Failed.from_exception(exc)

    def handle(self, request: msgspec.Struct, session: Session | None = None) -> msgspec.Struct:
        if isinstance(request, Failed):  # what decode returned for bytes that were not a request
            return request
        session = session or self._local
        if type(request) is Batch:  # each request exactly as if it had come alone
            replies = [self.handle(part, session) for part in request.requests]
            return BatchReply([r if isinstance(r, Ack | Failed) else _not_a_transaction_reply(r) for r in replies])
        with self._lock:
            try:
                self.transactions.check_timeout()  # hosts without a timer still expire abandoned updates
                return self._dispatch(request, session)
            except ColosyncError as exc:
                status = self._status_after(exc)
                if status is not None:
                    self.serving = status.serving  # a refused commit may have failed the engine closed
                return Failed.from_exception(exc, status)
            except Exception as exc:
                log.exception("engine: request %s failed", type(request).__name__)
                return Failed.from_exception(exc)

    def _dispatch(self, request: msgspec.Struct, session: Session) -> msgspec.Struct:
        if isinstance(request, Hello):
            if not session.peer_pid:  # the socket's peer credentials beat what a client says of itself
                session.pid, session.host = request.pid, request.host
            session.name = request.name
            return self.transactions.status()
        handler = self.handlers.get(type(request))
        if handler is not None:
            return handler(request, session)
        if isinstance(request, TransactionRequest):  # the union of TRANSACTION_TYPES
            if isinstance(request, _OWNER_ONLY):
                self._check_owner(request, session)
            if isinstance(request, Begin):
                request = self._interned(request, session)
            elif isinstance(request, BeginAgain):
                request = session.begin_again(request)
            if isinstance(request, Attach):
                return self._attach(request, session)
            if isinstance(request, Detach):
                self._release(f"its sender ({session.describe()}) detached: {request.reason or 'closed'}")
                return self.transactions.status()
            ack = self._commit(request) if isinstance(request, Commit) else self.transactions.handle(request)
            self.serving = ack.serving
            return ack
        if self.engine is None:
            raise ManifestError(f"this host serves transaction messages only, not {type(request).__name__}")
        if not self.serving:
            raise FailedClosedError(
                f"the engine refuses {type(request).__name__}: its last full update failed verification, so "
                "what it would compute is unknown; push a good full update (it serves again once one commits)"
            )
        return self.engine.handle(request)

    def _interned(self, request: Begin, session: Session) -> Begin:
        """``request`` with the ``Layout`` object of an earlier Begin of the same manifest, from any client.

        Engines and the Receiver key their per-layout state on the Layout object, which an equal
        but distinct object (a sender's new connection) would find only through a deep comparison
        of every tensor, on every update. Also what ``session`` begins again from now on."""
        manifest = request.manifest
        digest = manifest_digest(manifest)
        known = self._manifests.get(digest)
        if known is None:
            self._manifests[digest] = manifest
            while len(self._manifests) > 8:  # as many layouts as a Receiver keeps plans for
                self._manifests.popitem(last=False)
        else:
            self._manifests.move_to_end(digest)
            if known.layout is not manifest.layout and known.layout == manifest.layout:
                manifest = msgspec.structs.replace(manifest, layout=known.layout)
                request = Begin(manifest)
        session.begun = (manifest, digest)
        return request

    def _check_owner(self, request: msgspec.Struct, session: Session) -> None:
        owner = self.owner
        if owner is session:
            return
        if owner is not None and not owner.alive():
            self._sessions.pop(owner.id, None)
            self._release(f"its sender ({owner.describe()}) died")
            owner = None
        if isinstance(request, Attach):
            if owner is not None and not request.takeover:
                raise EngineBusyError(
                    f"this engine is owned by another sender: {owner.describe()}. One sender updates an engine at "
                    "a time; wait until it closes or exits (ownership is released at once), or take over with "
                    "Sender(..., takeover=True), which aborts its in-flight update"
                )
            self._displaced = owner  # released, and told so, once the taker's transport opened (_attach)
            return
        if session.taken_over_by:
            raise EngineBusyError(
                f"{type(request).__name__} refused: this sender no longer owns the engine; another sender took it "
                f"over (Sender(..., takeover=True)): {session.taken_over_by}, and any update this sender had in "
                "flight was aborted. Nothing it sends changes the engine now: close this Sender. Let one sender "
                "update the engine; to make this process that sender again, open a new Sender with takeover=True"
            )
        if owner is None:
            raise EngineBusyError(
                f"{type(request).__name__} from a sender that does not own this engine (nobody does now): "
                "send Attach first (a Sender does this on its first push)"
            )
        raise EngineBusyError(
            f"{type(request).__name__} refused: this engine is owned by {owner.describe()}, not by this sender; "
            "a Sender attaches on its first push: push through a Sender, or send Attach first"
        )

    def _attach(self, request: Attach, session: Session) -> Ack:
        displaced, self._displaced = self._displaced, None
        # Raises if the transport cannot be opened: the owner, if any, then keeps the engine. With
        # takeover, the Receiver aborts the owner's in-flight update and drops its transport itself.
        ack = self.transactions.handle(request)
        self.owner = session
        session.taken_over_by = ""
        if displaced is not None:
            displaced.taken_over_by = f"{session.describe()}; taken over at {time.strftime('%H:%M:%S')}"
            log.info("engine: %s took it over from %s", session.describe(), displaced.describe())
        return ack

    def _commit(self, request: Commit) -> Ack:
        if request.probe is not None and (self.engine is None or Score not in self.engine.requests):
            raise ConfigError(  # refused before anything is installed; the Sender aborts the update
                "this engine cannot score a probe (it serves no Score requests); push without verify=, or use "
                "an engine that scores (hf, vllm)"
            )
        return verified_commit(self.transactions.handle, request, self._score)

    def _score(self, probe: Probe) -> tuple[list[list[float]], set[int]]:
        """The engine's own serving code scores the probe (checked by ``_commit`` to serve ``Score``)."""
        assert self.engine is not None
        scores = self.engine.handle(Score(probe.prompts, probe.completions))
        if not isinstance(scores, Scores):
            raise EngineError(f"the engine answered Score with {type(scores).__name__}")
        return scores.logprobs, {scores.update_id}

    def _status_after(self, exc: ColosyncError) -> Ack | None:
        try:
            return self.transactions.status()
        except Exception:  # the status is a courtesy; the error itself matters
            return None

    def encode(self, reply: msgspec.Struct) -> bytes:
        return self.reply_codec.encode(reply)

    def handle_bytes(self, data: bytes, session: Session | None = None) -> bytes:
        reply = self.handle(self.decode(data), session)
        try:
            return self.encode(reply)
        except Exception as exc:  # a reply msgspec cannot encode must still be a reply
            log.exception("engine: cannot encode a %s reply", type(reply).__name__)
            return self.encode(Failed.from_exception(exc))

    def close(self) -> None:
        self.transactions.close()


def _not_a_transaction_reply(reply: msgspec.Struct) -> Failed:
    return Failed.from_exception(EngineError(f"a batched request was answered with {type(reply).__name__}"))


__all__ = [
    "EngineHost",
    "HostedTarget",
    "LinkTransactions",
    "ServedEngine",
    "Session",
    "Transactions",
    "codecs",
]
