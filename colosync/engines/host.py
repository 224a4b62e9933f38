"""An engine served in a process of its own (an ``EngineProcess``, a Ray actor): the host in front of it.

A host is a thin adapter. It gives the engine's ``EngineTransaction`` (``sync.transaction``:
ownership, ``BeginAgain``, the verified commit, fail closed) the engine's own serving code to
score a probe, serves the engine's own requests (``Generate``, ``Score``) while it serves, and
answers everything through a ``Door`` (``control.door``): bytes in, a typed reply out, never
an exception. Calls may come from several threads (a connection's, a Ray actor's tick); the
transaction's lock orders them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import msgspec
import torch

from colosync.control.door import Door
from colosync.engines.config import EngineConfig, Generate, Score, Scores
from colosync.errors import ConfigError, EngineError, ManifestError
from colosync.sync.receiver import Receiver
from colosync.sync.target import EngineTarget, ReceiverPolicy
from colosync.sync.transaction import Applies, EngineTransaction, Session
from colosync.sync.transaction import Scores as ProbeScores
from colosync.wire.protocol import Ack, Commit, Hello, Probe, Revert, TransactionRequest

log = logging.getLogger(__name__)

Handler = Callable[[Any, Session], msgspec.Struct]


class ServedEngine(Protocol):
    """An engine a host can serve: its own requests, and the transaction that updates it."""

    requests: ClassVar[tuple[type, ...]]
    replies: ClassVar[tuple[type, ...]]

    @classmethod
    def from_config(cls, config: EngineConfig) -> ServedEngine: ...

    def transaction(self, policy: ReceiverPolicy | None) -> EngineTransaction: ...

    def handle(self, request: Any) -> msgspec.Struct: ...


class ScoredByEngine:
    """``Serving`` for an engine whose host serialises every request: nothing to pause; ``Score`` scores."""

    def __init__(self, handle: Callable[[Score], msgspec.Struct]) -> None:
        self.handle = handle  # the engine's own request handler

    def switch(self, request: Commit | Revert, apply: Callable[[], Ack]) -> Ack:
        return apply()

    def score_probe(self, probe: Probe) -> ProbeScores:
        scores = self.handle(Score(probe.prompts, probe.completions))
        if not isinstance(scores, Scores):
            raise EngineError(f"the engine answered Score with {type(scores).__name__}")
        return scores.logprobs, {scores.update_id}

    def publish(self, ack: Ack) -> None:
        pass  # what the engine committed it serves from the next request on


class HostedTarget(EngineTarget):
    """An ``EngineTarget`` served by a host: its ``Receiver`` on ``device``, scored by its own ``Score``."""

    requests: ClassVar[tuple[type, ...]] = ()
    replies: ClassVar[tuple[type, ...]] = ()
    device: torch.device
    receiver: Receiver

    def transaction(self, policy: ReceiverPolicy | None) -> EngineTransaction:
        self.receiver = Receiver(self, self.device, policy)
        return EngineTransaction(self.receiver, ScoredByEngine(self.handle) if Score in self.requests else None)

    @property
    def committed_update_id(self) -> int:
        return self.receiver.committed_update_id

    def handle(self, request: Any) -> msgspec.Struct:
        raise ManifestError(f"this engine serves no {type(request).__name__} requests")


class EngineHost:
    """Decode, check, dispatch, reply; never raises.

    >>> host = EngineHost(engine.transaction(policy), engine)   # an engine with its own requests
    >>> host = EngineHost(receiver)                             # transactions only
    >>> session = host.open_session()
    >>> reply = host.handle_bytes(data, session)

    ``handlers`` serve host-level requests (``Shutdown`` of the engine process, memory). ``max_lag``
    (``sync.staleness``): a ``Generate`` of an adapter whose committed version lags its trainer's newest
    begun update by more is refused at once (requests are served one at a time, so waiting here would
    hold off the commit it waits for).
    """

    def __init__(
        self,
        transaction: EngineTransaction | Applies,
        engine: ServedEngine | None = None,
        handlers: dict[type, Handler] | None = None,
        policy: ReceiverPolicy | None = None,
        max_lag: int | None = None,
    ) -> None:
        self.transaction = transaction if isinstance(transaction, EngineTransaction) else EngineTransaction(transaction)
        self.max_lag = max_lag
        if max_lag is not None:
            self.transaction.staleness.limit(max_lag)
        self.engine = engine
        self.handlers = dict(handlers or {})
        self.policy = policy
        requests = (Hello, *(engine.requests if engine else ()), *self.handlers)
        self.door = Door(requests, engine.replies if engine else (), status=self.transaction.status_quietly)
        self.open_session = self.transaction.open_session
        # Named adapters (``Hello.adapter``): each its own transaction, made on first use; "" is the default.
        self.lanes: dict[str, EngineTransaction] = {"": self.transaction}
        self._bound: dict[int, tuple[EngineTransaction, Session]] = {}  # session id -> its lane, its session there

    def close_session(self, session: Session, reason: str) -> None:
        bound = self._bound.pop(session.id, None)
        if bound is not None:
            bound[0].close_session(bound[1], reason)
        self.transaction.close_session(session, reason)

    def tick(self) -> None:
        for lane in list(self.lanes.values()):
            lane.tick()

    @property
    def serving(self) -> bool:
        return self.transaction.serving

    def handle(self, request: msgspec.Struct, session: Session | None = None) -> msgspec.Struct:
        return self.door.answer(request, lambda r: self._dispatch(r, session or self.transaction.local))

    def handle_bytes(self, data: bytes, session: Session | None = None) -> bytes:
        return self.door.encode(self.handle(self.door.decode(data), session))

    def _dispatch(self, request: msgspec.Struct, session: Session) -> msgspec.Struct:
        with self.transaction.lock:  # engine work one request at a time, in the order it arrived
            return self._serve(request, session)

    def _serve(self, request: msgspec.Struct, session: Session) -> msgspec.Struct:
        if isinstance(request, Hello):
            if not session.peer_pid:  # the socket's peer credentials beat what a client says of itself
                session.pid, session.host = request.pid, request.host
            session.name = request.name
            if request.adapter:
                return self._bind(session, request.adapter).status()
            return self.transaction.status()
        handler = self.handlers.get(type(request))
        if handler is not None:
            return handler(request, session)
        if isinstance(request, TransactionRequest):  # the union of the transaction messages
            lane, lane_session = self._bound.get(session.id, (self.transaction, session))
            return lane.handle(request, lane_session)
        if self.engine is None:
            raise ManifestError(f"this host serves transaction messages only, not {type(request).__name__}")
        self.transaction.refuse_unless_serving(type(request).__name__)
        if isinstance(request, Generate) and request.adapter in self.lanes:  # else the engine names what it has
            self.lanes[request.adapter].refuse_if_behind(f"Generate of adapter {request.adapter!r}")
        return self.engine.handle(request)

    def _bind(self, session: Session, adapter: str) -> EngineTransaction:
        """The transaction of the named adapter ``adapter`` (made now if new), with a session of ``session`` there."""
        lane = self.lanes.get(adapter)
        if lane is None:
            make = getattr(self.engine, "lane", None)
            if make is None:
                raise ConfigError(
                    f"this engine serves one adapter, so a connection cannot name adapter {adapter!r}: connect "
                    "without adapter=, or use an engine that serves several (hf with EngineConfig(max_loras=N))"
                )
            lane = self.lanes[adapter] = make(adapter).transaction(self.policy)
            if self.max_lag is not None:
                lane.staleness.limit(self.max_lag)
        there = lane.open_session()
        there.pid, there.host, there.name, there.peer_pid = session.pid, session.host, session.name, session.peer_pid
        before = self._bound.get(session.id)
        if before is not None:  # a second Hello: the connection leaves the adapter it named first
            before[0].close_session(before[1], f"the connection named adapter {adapter!r} instead")
        self._bound[session.id] = (lane, there)
        return lane

    def close(self) -> None:
        for lane in self.lanes.values():
            if lane is not self.transaction:
                lane.close()
        self.transaction.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def build_host(config: EngineConfig, handlers: dict[type, Handler] | None = None) -> EngineHost:
    """The host for an ``EngineConfig``: the registry's engine class, built from the config."""
    from colosync.control.registry import engine_class

    engine: ServedEngine = engine_class(config.engine).from_config(config)
    return EngineHost(engine.transaction(config.policy()), engine, handlers, config.policy(), config.max_lag)


__all__ = ["EngineHost", "HostedTarget", "ScoredByEngine", "ServedEngine", "build_host"]
