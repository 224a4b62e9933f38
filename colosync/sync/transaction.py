"""The engine's side of an update, owned in one place: who may update, and what a commit must prove.

Every engine is updated through one ``EngineTransaction``, wherever it lives: in front of the
``Receiver`` of an hf engine (in an engine process, a Ray actor, or this process through a
``LocalLink``), or in front of the Receivers inside vLLM's workers (the link over
``collective_rpc``). So ownership, ``BeginAgain``, the verified commit and failing closed are
decided here once, and the Receiver(s) behind it only land and apply bytes.

Ownership. Clients arrive as sessions (a connection, a Ray caller, the trainer in this
process); the first to ``Attach`` owns the engine, and another is refused with
``EngineBusyError`` naming the owner, until the owner detaches, disconnects, dies (its pid is
watched) or is explicitly taken over. A session that ends takes only its own in-flight update
with it.

Commit. A ``Commit`` runs with serving paused (``Serving.switch``: vLLM drains and relabels
its weight version; an engine serialised by a host needs nothing), and a ``Commit`` carrying
a ``Probe`` is proven by ``sync.delivery.verified_commit``, scored by the engine's own serving
code before anything else is served. While the engine fails closed (a full update did not
verify), ``refuse_unless_serving`` refuses generation with the reason and the fix.

Staleness. Every accepted ``Begin`` is the trainer's newest version (``sync.staleness``), so an
engine with ``max_lag`` starts no request on a version too far behind it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from colosync.errors import ColosyncError, ConfigError, EngineBusyError, FailedClosedError, UnknownLayoutError
from colosync.sync.delivery import verified_commit
from colosync.sync.staleness import Staleness
from colosync.wire.manifest import UpdateManifest, manifest_digest
from colosync.wire.protocol import (
    Abort,
    Ack,
    Attach,
    Begin,
    BeginAgain,
    Commit,
    Detach,
    Probe,
    Revert,
    Status,
    TransactionRequest,
)

log = logging.getLogger(__name__)

_KEPT_LAYOUTS = 8  # as many layouts as a Receiver keeps plans for


@dataclass
class Session:
    """One client of an engine: a connection, a Ray caller, or the trainer in this process."""

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


class Applies(Protocol):
    """What lands and applies an update: a ``Receiver``, or what forwards to several (vLLM's workers)."""

    def handle(self, request: TransactionRequest) -> Ack: ...

    def check_timeout(self) -> None: ...

    def close(self) -> None: ...


Scores = tuple[Sequence[Sequence[float]], set[int]]


class Serving(Protocol):
    """What the transaction needs from the engine's serving code."""

    def switch(self, request: Commit | Revert, apply: Callable[[], Ack]) -> Ack:
        """Run ``apply`` (``request`` to the Receiver(s)) while nothing is served; afterwards serve what it left."""

    def score_probe(self, probe: Probe) -> Scores:
        """The engine's logprob of every probe completion token, and the updates that computed them."""

    def publish(self, ack: Ack) -> None:
        """The commit stands (verified, or pushed without a probe): serve it to every request from now on.

        An engine that serves what it committed at once does nothing; vLLM committing beside running
        requests (``commit_mode="inflight"``) hands the new version to new requests only here."""


class Layouts:
    """Recent Begins' manifests by digest, so an equal ``Layout`` arrives as the same object.

    Engines and the Receiver key their per-layout state on the Layout object, which an equal
    but distinct object (a sender's new connection, bytes decoded afresh in a vLLM worker)
    would find only through a deep comparison of every tensor, on every update.
    """

    def __init__(self, keep: int = _KEPT_LAYOUTS) -> None:
        self._keep = keep
        self._manifests: OrderedDict[bytes, UpdateManifest] = OrderedDict()

    def intern(self, manifest: UpdateManifest) -> tuple[UpdateManifest, bytes]:
        """``manifest`` with the Layout object of an earlier equal one, and its digest."""
        digest = manifest_digest(manifest)
        known = self._manifests.get(digest)
        if known is None:
            self._manifests[digest] = manifest
            while len(self._manifests) > self._keep:
                self._manifests.popitem(last=False)
        else:
            self._manifests.move_to_end(digest)
            if known.layout is not manifest.layout and known.layout == manifest.layout:
                manifest = msgspec.structs.replace(manifest, layout=known.layout)
        return manifest, digest


class EngineTransaction:
    """The engine's update lifecycle behind one lock: ``handle`` applies a request or raises why not.

    >>> owner = EngineTransaction(receiver, serving)   # serving=None: an engine that cannot score
    >>> session = owner.open_session(pid)
    >>> ack = owner.handle(request, session)
    """

    def __init__(self, applies: Applies, serving: Serving | None = None) -> None:
        self.applies = applies
        if getattr(applies, "transaction", False) is None:  # a Receiver: it remembers its one owner
            applies.transaction = self  # type: ignore[attr-defined]
        self.serving_code = serving
        self.owner: Session | None = None
        self.serving = True  # False while the engine fails closed
        self.committed_update_id = 0
        self.adapter = 0  # the update whose LoRA adapter the engine applies (0: none)
        self.lock = threading.RLock()  # one request at a time, from any thread (a Ray actor's tick too)
        self._displaced: Session | None = None  # the owner an Attach with takeover released, until it attaches
        self._ids = 0
        self._sessions: dict[int, Session] = {}
        self.layouts = Layouts()
        self.staleness = Staleness()  # the updates begun, and how far behind them a request may start
        self.local = self.open_session()  # callers that name no session (this process)

    # -- sessions -------------------------------------------------------------------------
    def open_session(self, pid: int | None = None) -> Session:
        """A new client; ``pid`` when the transport knows it (a Unix socket's peer credentials)."""
        with self.lock:
            self._ids += 1
            session = Session(self._ids, pid=pid, host=socket.gethostname() if pid else "", peer_pid=pid is not None)
            self._sessions[session.id] = session
            return session

    def close_session(self, session: Session, reason: str) -> None:
        """``session`` is gone: abort its in-flight update and release the engine if it owned it."""
        with self.lock:
            self._sessions.pop(session.id, None)
            if self.owner is session:
                self._release(f"its sender ({session.describe()}) is gone: {reason}")

    def tick(self) -> None:
        """Expire what a clock must: idle updates, and an owner whose process has died."""
        with self.lock:
            self.applies.check_timeout()
            owner = self.owner
            if owner is not None and not owner.alive():
                self._sessions.pop(owner.id, None)
                self._release(f"its sender ({owner.describe()}) died")

    # -- requests -------------------------------------------------------------------------
    def handle(self, request: TransactionRequest, session: Session | None = None) -> Ack:
        """Apply ``request`` for ``session`` (this process if None); raises the ``ColosyncError`` refusing it."""
        session = session or self.local
        with self.lock:
            try:
                self.applies.check_timeout()  # engines without a timer still expire abandoned updates
                ack = self._dispatch(request, session)
            except Exception as exc:  # a refused or broken commit may have failed the engine closed
                status = self.status_quietly()
                if isinstance(exc, ColosyncError) and getattr(exc, "status", None) is None:
                    exc.status = status  # type: ignore[attr-defined]  # what the engine serves now, for the reply
                raise
            return self.observe(ack)

    def status(self) -> Ack:
        with self.lock:
            return self.observe(self.applies.handle(Status()))

    def status_quietly(self) -> Ack | None:
        """``status()``, or None if asking fails too (it is a courtesy beside the error that matters)."""
        try:
            return self.status()
        except Exception:
            return None

    def refuse_unless_serving(self, what: str) -> None:
        """Raise ``FailedClosedError`` for ``what`` (a generation) while the engine fails closed."""
        if not self.serving:
            raise FailedClosedError(
                f"the engine refuses {what}: update {self.committed_update_id} committed but failed verification, "
                "and a full update cannot be rolled back, so what it would compute is unknown; push a good update "
                "(a full one: the engine serves again once it commits)"
            )

    def lagging(self) -> bool:
        """Whether the committed version lags its trainer more than ``max_lag`` (``refuse_if_behind`` would raise)."""
        return self.staleness.too_far(self.committed_update_id)

    def refuse_if_behind(self, what: str) -> None:
        """Raise ``VersionLagError`` for ``what`` while the committed version lags its trainer more than ``max_lag``
        (``staleness``); for an engine whose host serialises requests, so nothing commits while one waits."""
        self.staleness.refuse(self.committed_update_id, what)

    def close(self) -> None:
        self.applies.close()

    # -- internals --------------------------------------------------------------------------
    def _dispatch(self, request: TransactionRequest, session: Session) -> Ack:
        if isinstance(request, Status):
            return self.applies.handle(request)
        self._check_owner(request, session)
        if isinstance(request, Attach):
            return self._attach(request, session)
        if isinstance(request, Detach):
            self._release(f"its sender ({session.describe()}) detached: {request.reason or 'closed'}")
            return self.applies.handle(Status())
        if isinstance(request, BeginAgain):
            request = session.begin_again(request)
        elif isinstance(request, Begin):
            request = self._interned(request, session)
        if isinstance(request, Commit):
            return self._commit(request)
        if isinstance(request, Revert):
            return self._switch(request)
        ack = self.applies.handle(request)
        if isinstance(request, Begin):  # the trainer's newest version, whatever becomes of it
            self.staleness.begun.add(request.manifest.update_id)
        return ack

    def observe(self, ack: Ack) -> Ack:
        """Record what ``ack`` says the engine serves; returns it."""
        self.serving, self.committed_update_id, self.adapter = ack.serving, ack.committed_update_id, ack.adapter
        return ack

    def _switch(self, request: Commit | Revert) -> Ack:
        if self.serving_code is None:
            return self.applies.handle(request)
        return self.serving_code.switch(request, lambda: self.applies.handle(request))

    def _commit(self, request: Commit) -> Ack:
        serving = self.serving_code
        if request.probe is not None and serving is None:
            raise ConfigError(  # refused before anything is installed; the Sender aborts the update
                "this engine cannot score a probe; push without verify=, or use an engine that scores (hf, vllm)"
            )

        def score(probe: Probe) -> Scores:  # what the engine would serve, if it serves at all
            self.refuse_unless_serving("to score the probe")
            return serving.score_probe(probe) if serving is not None else _unscored(probe)

        # The probe never reaches the Receiver(s): it is scored here, by the engine's serving code.
        ack = verified_commit(lambda r: self.observe(self._switch(r)), request, score)
        if serving is not None:
            serving.publish(ack)
        return ack

    def _interned(self, request: Begin, session: Session) -> Begin:
        """``request`` with a known ``Layout`` object (``Layouts``); also what ``session`` begins again from now on."""
        manifest, digest = self.layouts.intern(request.manifest)
        session.begun = (manifest, digest)
        return request if manifest is request.manifest else Begin(manifest)

    def _release(self, why: str) -> None:
        try:
            in_flight = self.applies.handle(Status()).in_flight_update_id
            if in_flight is not None:
                self.applies.handle(Abort(in_flight, why))
            self.observe(self.applies.handle(Detach("the owner left")))
        finally:  # whatever failed above, the engine must not stay owned by a client that is gone
            self.owner = None
        log.info("engine: released by its owner; %s", why)

    def _check_owner(self, request: TransactionRequest, session: Session) -> None:
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
        ack = self.applies.handle(request)
        self.owner = session
        session.taken_over_by = ""
        if displaced is not None:
            displaced.taken_over_by = f"{session.describe()}; taken over at {time.strftime('%H:%M:%S')}"
            log.info("engine: %s took it over from %s", session.describe(), displaced.describe())
        return ack


def transaction_of(engine: Applies | EngineTransaction) -> EngineTransaction:
    """The one ``EngineTransaction`` in front of ``engine`` (a Receiver's, made on first use), or ``engine`` itself.

    Every client of a Receiver in this process goes through the same owner, so two senders are
    two sessions of one engine: the second is refused, or takes over, as it would be remotely."""
    if isinstance(engine, EngineTransaction):
        return engine
    known = getattr(engine, "transaction", None)
    return known if isinstance(known, EngineTransaction) else EngineTransaction(engine)


def _unscored(probe: Probe) -> Scores:
    raise AssertionError("a probe reached an engine that cannot score; _commit refuses it first")


__all__ = ["Applies", "EngineTransaction", "Layouts", "Serving", "Session", "transaction_of"]
