"""Several engines updated as one transaction: a ``Link`` that is a set of links, with a two-phase commit.

Separated mode runs a trainer beside many engines (other GPUs, other nodes). Moving bytes to
all of them is the transport's job (``broadcast`` reaches every engine with one collective);
this module makes the update all or nothing. Every request goes to every engine, and a reply
is good only when every engine's is. The exception is the commit: ``Prepare`` is each
engine's vote (everything landed and checked, nothing served yet), and ``Commit`` goes out to
no engine until every engine has voted yes. So an engine that fails or dies before its vote
leaves every engine on its previous version (the Sender aborts the update on all). An engine
that fails or dies *during* the commit cannot be undone by the others: the set reports what
each engine serves now (``EngineSetError.outcomes``, ``SyncReport.engines``), and the next
push, under a higher update id, brings every engine it reaches to one version again.

Each engine's requests are submitted on a thread of its own, in order, so a link that answers
as it submits (an in-process vLLM ``LLM``, whose workers wait in the broadcast) never keeps the
next engine from joining the same collective.

A Sender needs nothing else: ``Sender(EngineSet({...}), transport="broadcast")``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from colosync.errors import (
    ColosyncError,
    ConfigError,
    DeliveryError,
    EngineError,
    EngineSetError,
    TransactionStateError,
    error_from_wire,
)
from colosync.sync.link import Done, EngineOutcome, Link, Pending
from colosync.transports.base import Peers
from colosync.wire.protocol import (
    Ack,
    Attach,
    Begin,
    BeginAgain,
    Commit,
    Detach,
    Prepare,
    Revert,
    Status,
    TransactionRequest,
)

log = logging.getLogger(__name__)

Replies = dict[str, Ack | ColosyncError]


class EngineSet:
    """``EngineSet({"a": link_a, "b": link_b})``: every engine gets every update, or none keeps it.

    ``host``: the address the engines reach this process at (for a transport that forms a
    group: ``broadcast``); ``join_timeout_s``: how long that group waits for every engine.
    A link that receives in several processes (a vLLM engine with tensor parallelism) says
    how many in its ``receivers`` attribute.
    """

    def __init__(self, engines: Mapping[str, Link], *, host: str = "127.0.0.1", join_timeout_s: float = 60.0) -> None:
        if not engines:
            raise ConfigError("an EngineSet needs at least one engine: EngineSet({'name': link, ...})")
        self._members: dict[str, _Member] = {name: _Member(name, link) for name, link in engines.items()}
        self.host, self.join_timeout_s = host, join_timeout_s
        self._generation = 0
        self._votes: tuple[int, dict[str, Pending]] | None = None  # the update in flight and its Prepare replies
        self._begun_at = time.perf_counter()
        self._outcomes: tuple[EngineOutcome, ...] = ()
        if not join_timeout_s > 0:
            raise ConfigError(f"join_timeout_s must be positive, got {join_timeout_s}")

    # -- members ------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._members)

    @property
    def peers(self) -> Peers:
        """The receiving processes a transport must reach; changes whenever a member is added or removed."""
        receivers = sum(int(getattr(member.link, "receivers", 1)) for member in self._members.values())
        return Peers(receivers, self.host, self.join_timeout_s, self._generation)

    def add(self, name: str, link: Link) -> None:
        """A new engine (or a restarted one under its old name); the next push attaches and updates it too."""
        if name in self._members:
            raise ConfigError(f"this EngineSet already has an engine {name!r}; remove it first, or pick another name")
        self._members[name] = _Member(name, link)
        self._generation += 1

    def remove(self, name: str) -> None:
        """Drop an engine (a dead one included) and close its link; the next push forms the set anew."""
        if name not in self._members:
            raise ConfigError(f"this EngineSet has no engine {name!r}; it has {self.names}")
        if len(self._members) == 1:
            raise ConfigError(f"{name!r} is the last engine of this EngineSet; close the set instead")
        member = self._members.pop(name)
        self._generation += 1
        _quiet(member, Detach(reason="removed from its EngineSet"))  # a live engine lets its next sender attach
        member.close()

    def outcomes(self) -> tuple[EngineOutcome, ...]:
        """What each engine serves after the last commit (``ReportsEngines``)."""
        return self._outcomes

    def statuses(self) -> Replies:
        """Each engine's ``Status`` now, or the error asking it raised (a dead engine's)."""
        return _collect(self._fan(Status()))

    # -- Link ---------------------------------------------------------------------------------
    def submit(self, request: TransactionRequest) -> Pending:
        if isinstance(request, Commit):
            return self._commit(request)
        if isinstance(request, Begin | BeginAgain):
            self._begun_at, self._votes = time.perf_counter(), None
        sent = self._fan(request)
        if isinstance(request, Prepare):
            self._votes = (request.update_id, sent)
        return _All(request, sent, self._undo_attach if isinstance(request, Attach) else None)

    def submit_batch(self, requests: list[Any]) -> list[Pending]:
        """The Stages and Prepare as one Batch per engine; the Commit only once every engine voted."""
        commit = requests[-1] if requests and isinstance(requests[-1], Commit) else None
        head = requests[:-1] if commit is not None else requests
        per_engine = {name: member.submit_batch(head) for name, member in self._members.items()}
        parts: list[Pending] = []
        for i, request in enumerate(head):
            sent = {name: pendings[i] for name, pendings in per_engine.items()}
            if isinstance(request, Prepare):
                self._votes = (request.update_id, sent)
            parts.append(_All(request, sent))
        if commit is not None:
            parts.append(self._commit(commit))
        return parts

    def close(self) -> None:
        for member in self._members.values():
            member.close()

    # -- internals ----------------------------------------------------------------------------
    def _fan(self, request: TransactionRequest) -> dict[str, Pending]:
        """``request`` submitted to every engine before any reply is read (a group forms only when all join)."""
        return {name: member.submit(request) for name, member in self._members.items()}

    def _commit(self, request: Commit) -> Pending:
        """Phase two: Commit everywhere if every engine prepared this update, else nowhere."""
        uid, (voted, votes) = request.update_id, self._votes or (None, {})
        self._votes = None
        if voted != uid or set(votes) != set(self._members):
            return Done(
                error=TransactionStateError(
                    f"Commit of update {uid} without a Prepare of it to every engine of the set; a Sender sends "
                    "Prepare first"
                )
            )
        refused = {name: reply for name, reply in _collect(votes).items() if isinstance(reply, ColosyncError)}
        if refused:  # (the Sender has read these refusals already; this only keeps the Commit from going out)
            return Done(error=_set_error(f"update {uid} was committed nowhere: {_list(refused)} did not prepare it"))
        sent = self._fan(request)
        return _All(request, sent, on_done=lambda replies, read: self._committed(uid, replies, read))

    def _committed(self, uid: int, replies: Replies, read: dict[str, float]) -> None:
        """Record each engine's outcome; raise if any did not commit ``uid``.

        A probe that failed on some engines only (they rolled back) is reverted on the others too: the
        update is wrong, and every engine goes back to what it served before (or, for a full update it
        cannot undo, fails closed like the engine that refused)."""
        failed = {name: reply for name, reply in replies.items() if isinstance(reply, ColosyncError)}
        verification = any(isinstance(e, DeliveryError) for e in failed.values())
        undone = [name for name in replies if name not in failed] if verification else []
        for name in undone:
            reason = f"engine(s) {', '.join(failed)} of its set failed verification of update {uid}"
            _quiet(self._members[name], Revert(uid, reason=reason))
        kept = {name: reply for name, reply in replies.items() if name not in undone}
        self._outcomes = self._describe(uid, failed, kept, read)
        if undone:
            served = ", ".join(f"{o.engine}: {o.committed_update_id}" for o in self._outcomes)
            error = DeliveryError(
                f"update {uid} failed verification on {_list(failed)}; it was reverted on {', '.join(undone)} too, "
                f"so no engine serves it (each serves: {served})"
            )
            error.outcomes = self._outcomes  # type: ignore[attr-defined]  # as EngineSetError's
            raise error
        if len(failed) == len(replies):  # refused alike everywhere: as from one engine
            _combined(Commit(uid), replies, self._outcomes)
        if failed:
            served = ", ".join(f"{o.engine}: {o.committed_update_id}" for o in self._outcomes)
            raise _set_error(
                f"update {uid} committed on some engines only: {_list(failed)} failed during the commit; each "
                f"serves now ({served}); push again (the next update id resynchronises every engine), after "
                "EngineSet.remove of any engine that is gone",
                self._outcomes,
            )

    def _describe(
        self,
        uid: int,
        failed: Mapping[str, ColosyncError],
        replies: Replies | None = None,
        read: Mapping[str, float] | None = None,
    ) -> tuple[EngineOutcome, ...]:
        """Each engine's outcome of update ``uid``; ``read``: when each reply was read (in order, so an upper bound)."""
        now = time.perf_counter()
        out = []
        for name, member in self._members.items():
            reply, seconds = (replies or {}).get(name), (read or {}).get(name, now) - self._begun_at
            if name not in failed and isinstance(reply, Ack):
                out.append(EngineOutcome(name, reply.committed_update_id, reply.serving, seconds))
                continue
            status = _quiet_status(member)
            committed = status.committed_update_id if status is not None else None
            error = str(failed.get(name, "")) or f"it did not commit update {uid}"
            out.append(EngineOutcome(name, committed, status.serving if status else False, seconds, error))
        return tuple(out)

    def _undo_attach(self, replies: Replies, read: dict[str, float]) -> None:
        """Some engines could not open the transport: detach the ones that did, so another can be tried."""
        if all(isinstance(r, Ack) for r in replies.values()):
            return
        for name, reply in replies.items():
            if isinstance(reply, Ack):
                _quiet(self._members[name], Detach(reason="another engine of its set could not open this transport"))


class _Member:
    """One engine of the set: its link, and the one thread its requests are submitted from, in order."""

    def __init__(self, name: str, link: Link) -> None:
        self.name, self.link = name, link
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"colosync-set-{name}")

    def submit(self, request: TransactionRequest) -> Pending:
        return _Later(self._pool.submit(_submit, self.link, request))

    def submit_batch(self, requests: list[Any]) -> list[Pending]:
        sent = self._pool.submit(_send_batch, self.link, requests)
        return [_Later(sent, i) for i in range(len(requests))]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # a request stuck on a gone engine holds nothing up
        try:
            self.link.close()
        except Exception as exc:
            log.debug("engine %s: closing its link failed: %s", self.name, exc)


class _Later:
    """The reply to a request still being submitted on its engine's thread."""

    def __init__(self, submitted: Future[Any], index: int | None = None) -> None:
        self._submitted, self._index = submitted, index

    def wait(self) -> Ack:
        pending = self._submitted.result()
        return (pending if self._index is None else pending[self._index]).wait()


class _All:
    """The replies of every engine to one request: an ``Ack`` only if all of them are."""

    def __init__(
        self,
        request: TransactionRequest,
        sent: dict[str, Pending],
        on_done: Callable[[Replies, dict[str, float]], None] | None = None,
    ) -> None:
        self._request, self._sent, self._on_done = request, sent, on_done
        self._reply: Ack | None = None
        self._error: ColosyncError | None = None
        self._waited = False

    def wait(self) -> Ack:
        if not self._waited:
            self._waited = True
            read: dict[str, float] = {}
            replies = _collect(self._sent, read)
            try:
                if self._on_done is not None:
                    self._on_done(replies, read)
                self._reply = _combined(self._request, replies)
            except ColosyncError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply


def _combined(request: TransactionRequest, replies: Replies, outcomes: tuple[EngineOutcome, ...] = ()) -> Ack:
    """One Ack for the set: ids such that the next update id is fresh on every engine; else the error."""
    failed = {name: r for name, r in replies.items() if isinstance(r, ColosyncError)}
    if failed:
        kinds = {type(e).__name__ for e in failed.values()}
        what = f"{type(request).__name__} refused by {_list(failed)}"
        # One kind of refusal (a stale id, a layout an engine lost): the Sender reacts as it would to one engine.
        error = error_from_wire(kinds.pop(), what) if len(kinds) == 1 else _set_error(what, outcomes)
        statuses = [getattr(e, "status", None) for e in failed.values()]
        acks = [r for r in replies.values() if isinstance(r, Ack)] + [s for s in statuses if isinstance(s, Ack)]
        if acks:
            error.status = _merge(acks)  # type: ignore[attr-defined]  # read by a Sender resynchronising ids
        raise error from next(iter(failed.values()))
    return _merge([r for r in replies.values() if isinstance(r, Ack)])


def _merge(acks: list[Ack]) -> Ack:
    in_flight = [a.in_flight_update_id for a in acks if a.in_flight_update_id is not None]
    deliveries = [a.delivery for a in acks if a.delivery is not None]
    worst = max(deliveries, key=lambda d: d.max_deviation or 0.0) if deliveries else None
    return Ack(
        committed_update_id=min(a.committed_update_id for a in acks),
        in_flight_update_id=max(in_flight) if in_flight else None,
        highest_update_id=max(max(a.highest_update_id, a.committed_update_id) for a in acks),
        serving=all(a.serving for a in acks),
        delivery=worst,
        adapter=min(a.adapter for a in acks),
    )


def _collect(sent: Mapping[str, Pending], read: dict[str, float] | None = None) -> Replies:
    """Every engine's reply or error, read in order; ``read``: when each was read."""
    out: Replies = {}
    for name, pending in sent.items():
        try:
            out[name] = pending.wait()
        except ColosyncError as exc:
            out[name] = exc
        except Exception as exc:
            out[name] = EngineError(f"engine {name}: {type(exc).__name__}: {exc}")
        if read is not None:
            read[name] = time.perf_counter()
    return out


def _submit(link: Link, request: TransactionRequest) -> Pending:
    try:
        return link.submit(request)
    except ColosyncError as exc:  # a dead engine's link fails at once; its reply is that error
        return Done(error=exc)
    except Exception as exc:
        return Done(error=EngineError(f"{type(exc).__name__}: {exc}"))


def _send_batch(link: Link, requests: list[Any]) -> list[Pending]:
    batch = getattr(link, "submit_batch", None)
    if batch is None:
        return [_submit(link, r) for r in requests]
    try:
        return list(batch(requests))
    except Exception as exc:
        error = exc if isinstance(exc, ColosyncError) else EngineError(f"{type(exc).__name__}: {exc}")
        return [Done(error=error) for _ in requests]


def _quiet_status(member: _Member) -> Ack | None:
    try:
        return member.submit(Status()).wait()
    except Exception:
        return None


def _quiet(member: _Member, request: TransactionRequest) -> None:
    try:
        member.submit(request).wait()
    except Exception as exc:
        log.debug("%s not acknowledged: %s", type(request).__name__, exc)


def _list(errors: Mapping[str, BaseException]) -> str:
    return "; ".join(f"engine {name} ({type(e).__name__}: {e})" for name, e in errors.items())


def _set_error(message: str, outcomes: tuple[EngineOutcome, ...] = ()) -> EngineSetError:
    error = EngineSetError(message)
    error.outcomes = outcomes
    return error


__all__ = ["EngineSet"]
