"""The colosync adapter's versions a vLLM engine holds at once, and the requests running on each.

Asynchronous RL never stops generating for a sync. With ``commit_mode="inflight"`` a LoRA commit
does not pause vLLM: the workers install the new version beside the served one, under an adapter
id of its own (``worker.VERSIONED_ID_BASE`` + its update id), and once it is verified every new
request gets it, while requests already running finish on the version they started with. A
request holds its version through a ``lease``; a superseded version is retired (removed from the
workers) when its last lease ends. ``limit`` bounds how many versions are installed at once (each
takes one of vLLM's ``max_loras`` slots): a commit beyond it waits for a retirement and says how
long it waited. A full update still drains every request first (one set of base weights):
``exclusive`` lets no new lease start until it is applied. With ``max_lag`` (``sync.staleness``)
no lease starts while the newest published version lags the trainer's newest begun update by more:
``lease`` waits for a newer commit (up to ``room_timeout_s``, then ``VersionLagError``), and the
thread that drives the engine (``try_lease``) starts none meanwhile.

Leases are counted here, in the driver, because only the driver knows when a request ends; so
in this mode generate through a lease (``VllmEngine.lease``, ``VllmServing``), never with a
``LoRARequest`` kept from an earlier call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from colosync.engines.vllm.worker import IN_MEMORY_PATH, VERSIONED_ID_BASE
from colosync.errors import ConfigError, EngineError
from colosync.sync.staleness import Staleness, UpdateIds

log = logging.getLogger(__name__)

ROOM_TIMEOUT_S = 600.0  # how long a commit waits for a slot, a full update or a probe for requests to end


def versioned_lora_request(update_id: int) -> Any:
    """The ``LoRARequest`` of the LoRA version that update ``update_id`` installed (``commit_mode="inflight"``)."""
    from vllm.lora.request import LoRARequest

    uid = VERSIONED_ID_BASE + update_id
    return LoRARequest(lora_name=f"colosync-u{update_id}", lora_int_id=uid, lora_path=IN_MEMORY_PATH)


class Slots:
    """vLLM's ``max_loras`` adapter slots, shared by the default adapter's versions and every named adapter's.

    Every ``Versions`` of one engine waits on this one condition, so a version retired by one adapter
    makes room for a commit of another. ``total`` is None until the workers said how many they have."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.total: int | None = None
        self.members: list[Versions] = []
        self.fixed: Callable[[], int] = lambda: 0  # slots held outside any ``Versions`` (a stable-id adapter)
        self.quiet = 0  # callers inside ``alone``: no lease of any adapter starts
        self._alone = threading.Lock()  # one ``alone`` section at a time

    @contextlib.contextmanager
    def alone(self, timeout_s: float) -> Iterator[None]:
        """Inside, no request of any adapter runs: new leases wait, running ones ended first. vLLM 0.32's CPU
        backend fails on a LoRA request with prompt logprobs (a probe) batched with other requests."""
        deadline = time.monotonic() + timeout_s
        with self._alone:
            with self.cond:
                self.quiet += 1
            try:
                with self.cond:
                    while any(sum(m._leases.values()) for m in self.members):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            running = {m.name or "(default)": dict(m._leases) for m in self.members if m._leases}
                            raise EngineError(
                                f"a probe is scored with no other request running (vLLM's CPU backend cannot batch "
                                f"it), and after {timeout_s:g} s requests still hold versions {running} (adapter: "
                                "{update: requests}); end them, or push without verify="
                            )
                        self.cond.wait(left)
                yield
            finally:
                with self.cond:
                    self.quiet -= 1
                    self.cond.notify_all()

    def held(self) -> int:
        """Slots taken now (call with ``cond`` held)."""
        return self.fixed() + sum(m._taken() for m in self.members)

    def full(self) -> bool:
        return self.total is not None and self.held() + 1 > self.total

    def describe(self) -> str:
        """Which adapter holds which versions, for an error."""
        with self.cond:
            held = {m.name or "(default)": sorted(m._holding()) for m in self.members if m._holding()}
        fixed = ["(default): its stable-id adapter"] if self.fixed() else []
        return ", ".join([*fixed, *(f"{name}: versions {uids}" for name, uids in held.items())]) or "none"


@dataclass(frozen=True)
class Lease:
    """One request's version: generate with ``lora_request`` (None: the base weights, no adapter served)."""

    update_id: int  # the update whose adapter the request runs on (0: none)
    lora_request: Any


class Versions:
    """The installed LoRA versions and their leases; ``retire(update_id)`` removes one from the workers."""

    def __init__(
        self,
        limit: int,
        retire: Callable[[int], None],
        room_timeout_s: float = ROOM_TIMEOUT_S,
        slots: Slots | None = None,
        name: str = "",
        request_of: Callable[[int], Any] = versioned_lora_request,
        retire_in_thread: bool = False,
        staleness: Staleness | None = None,
    ) -> None:
        if limit < 2:
            raise ConfigError(
                f"versions_in_flight must be at least 2 (the served version and the one being committed), got {limit}"
            )
        self.limit = limit
        self.room_timeout_s = room_timeout_s
        self._retire = retire
        self.name = name  # the named adapter these are versions of ("": the default one)
        self.request_of = request_of  # update id -> the LoRARequest of its version
        # AsyncLLM: a lease ends on the engine's event loop, which the retirement's collective_rpc needs free
        self.retire_in_thread = retire_in_thread
        self.staleness = staleness or Staleness()  # the transaction's: the updates its trainer began
        self.slots = slots or Slots()
        self.slots.members.append(self)
        self._cond = self.slots.cond
        self.current = 0  # the served version (0: none); what a new lease gets
        self.pending = 0  # committed on the workers, not yet verified: served to nobody yet
        self._leases: Counter[int] = Counter()
        self._superseded: set[int] = set()  # installed, no longer current, leases may still run on them
        self._retiring: set[int] = set()
        self._stuck: set[int] = set()  # superseded versions whose retirement failed: still in a slot, retried
        self._exclusive = False
        self._reserved = False  # a commit made room and has not installed (or failed) yet: its slot is taken
        self._published = UpdateIds()  # the versions handed to requests (LoRA ones and full updates)

    # -- requests ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, bounded: bool = True) -> Iterator[Lease]:
        """The served version for one request, held until the request ends (waits out a full update, and a
        version too far behind its trainer for ``room_timeout_s``; ``bounded=False``: a scoring request, which
        the staleness bound does not hold up)."""
        deadline = time.monotonic() + self.room_timeout_s
        with self._cond:
            while self._closed(bounded):  # a full update drains or applies, a probe is scored alone, or a lag
                left = deadline - time.monotonic()
                if left <= 0:
                    self._refuse_lag()
                self._cond.wait(left if left > 0 else None)  # a commit (what ends a lag) notifies
            uid = self._take()
        try:
            yield Lease(uid, self.request_of(uid) if uid else None)
        finally:
            self._release(uid)

    @contextlib.asynccontextmanager
    async def lease_async(self, poll_s: float = 0.005) -> AsyncIterator[Lease]:
        """``lease`` for a coroutine on an ``AsyncLLM``'s event loop: waits without blocking the loop (polled,
        so a cancelled waiter holds nothing)."""
        deadline = time.monotonic() + self.room_timeout_s
        held = contextlib.ExitStack()
        with held:
            while (lease := self.try_lease(held)) is None:
                if time.monotonic() > deadline:
                    self._refuse_lag()
                await asyncio.sleep(poll_s)
            yield lease

    def try_lease(self, held: contextlib.ExitStack) -> Lease | None:
        """``lease`` entered into ``held`` (released when it closes), or None at once while a full update lets
        no request start: for the thread that drives the engine, which must go on stepping the running
        requests for that update to drain them."""
        with self._cond:
            if self._closed():
                return None
            uid = self._take()
        held.callback(self._release, uid)
        return Lease(uid, self.request_of(uid) if uid else None)

    def _closed(self, bounded: bool = True) -> bool:
        return self._exclusive or self.slots.quiet > 0 or (bounded and self._lagging())

    def _lagging(self) -> bool:
        """Whether ``max_lag`` holds new requests off (the served version is read only under a bound)."""
        return self.staleness.max_lag is not None and self.staleness.too_far(self.served())

    def served(self) -> int:
        """The newest version published (a LoRA one, or a full update's): what a new request runs on."""
        with self._cond:
            newest = self._published.newest
            return self.current if newest is None else newest

    def _refuse_lag(self) -> None:
        """Raise ``VersionLagError`` if no lease starts because the served version lags too far."""
        self.staleness.refuse(self.served(), "request")

    def _take(self) -> int:
        self._leases[self.current] += 1
        return self.current

    def _release(self, uid: int) -> None:
        with self._cond:
            self._leases[uid] -= 1
            if self._leases[uid] > 0:
                return
            del self._leases[uid]
            retire = uid in self._superseded
            if retire:
                self._superseded.discard(uid)
                self._retiring.add(uid)
            self._cond.notify_all()
        if retire:
            self._retire_soon(uid)

    def in_flight(self) -> dict[int, int]:
        """Requests running now, by the version they run on."""
        with self._cond:
            return dict(self._leases)

    def lag(self, update_id: int) -> int:
        """How many versions were published after ``update_id`` (LoRA versions and full updates): the staleness
        of a sample it produced (0: it ran on the newest)."""
        with self._cond:
            return self._published.after(update_id)

    def installed(self) -> list[int]:
        """Every version the workers hold now: the served one, superseded ones still running, one being committed."""
        with self._cond:
            return sorted({self.pending, *self._holding()} - {0})

    def _holding(self) -> set[int]:
        return {self.current, *self._superseded, *self._retiring, *self._stuck} - {0}

    def _taken(self) -> int:
        """Slots this adapter takes now, a commit's reserved one included (call with ``_cond`` held)."""
        return len(self._holding() | {self.pending} - {0}) + self._reserved

    # -- commits (one at a time: the engine's transaction lock) -----------------------------
    def make_room(self) -> float:
        """Wait until one more version fits (``limit`` and the engine's free slots) and reserve its slot until
        ``staged`` or ``unreserve``; returns the seconds waited."""
        for uid in sorted(self._stuck):  # a retirement that failed before: try again
            self._retire_now(uid)
        started = time.perf_counter()
        deadline = time.monotonic() + self.room_timeout_s
        waited = False
        with self._cond:
            while len(self._holding()) + 1 > self.limit or self.slots.full():
                waited = True
                left = deadline - time.monotonic()
                if left <= 0:
                    running = {uid: self._leases[uid] for uid in sorted(self._superseded | self._retiring)}
                    stuck = f"; versions {sorted(self._stuck)} could not be retired (the log says why)" * bool(
                        self._stuck
                    )
                    if self.slots.full():
                        raise EngineError(
                            f"no free LoRA slot for adapter {self.name or '(default)'!r}: all {self.slots.total} of "
                            f"vLLM's max_loras are held ({self.slots.describe()}) after {self.room_timeout_s:g} s; let "
                            "the requests on superseded versions finish, or start the engine with a larger max_loras"
                        )
                    raise EngineError(
                        f"no room for another LoRA version: {self.limit} are installed and requests still run on "
                        f"superseded ones {running} (update: requests) after {self.room_timeout_s:g} s{stuck}; let "
                        "them finish, or start the engine with more versions_in_flight (and vLLM max_loras)"
                    )
                self._cond.wait(left)
            self._reserved = True  # until staged or unreserved: another adapter's commit cannot take this slot
        seconds = time.perf_counter() - started if waited else 0.0
        if waited:
            log.info("colosync: the commit waited %.3f s for a LoRA version to retire", seconds)
        return seconds

    def staged(self, update_id: int) -> None:
        """The workers committed ``update_id``'s adapter (0: they serve none): verification may score it."""
        with self._cond:
            self.pending = update_id if update_id != self.current else 0
            self._reserved = False
            self._cond.notify_all()

    def unreserve(self) -> None:
        """The commit that made room failed: its slot is free again."""
        with self._cond:
            self._reserved = False
            self._cond.notify_all()

    def reverted(self, update_id: int) -> None:
        """The workers reverted the pending version and serve ``update_id``'s adapter again."""
        with self._cond:
            self.pending = 0
            self.current = update_id
            self._cond.notify_all()

    def probe_version(self) -> int:
        """The version a probe scores: the one just committed, else the served one."""
        with self._cond:
            return self.pending or self.current

    def publish(self) -> None:
        """The pending version is verified: new requests get it, the one it replaces retires once idle."""
        with self._cond:
            if not self.pending:
                return
            old, self.current, self.pending = self.current, self.pending, 0
            self._published.add(self.current)
            retire = bool(old) and self._leases[old] == 0
            if old and not retire:
                self._superseded.add(old)
            elif retire:
                self._retiring.add(old)
            self._cond.notify_all()
        if retire:
            self._retire_soon(old)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No request runs inside: wait for every lease to end, retire every superseded version, let none start."""
        deadline = time.monotonic() + self.room_timeout_s
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while sum(self._leases.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    running = dict(self._leases)
                    self._exclusive = False
                    self._cond.notify_all()
                    raise EngineError(
                        f"a full update waits for every running request to end, and after {self.room_timeout_s:g} s "
                        f"requests still hold versions {running} (update: requests); end them (a lease is released "
                        "when its `with` block ends), then push again"
                    )
                self._cond.wait(left)
            superseded, self._superseded = sorted(self._superseded | self._stuck), set()
            self._stuck.clear()
            self._retiring.update(superseded)
        try:
            for uid in superseded:
                self._retire_now(uid)
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def reset(self, adapter: int, committed: int) -> None:
        """After a full update: the workers serve ``adapter``'s LoRA (0: none) on the weights of ``committed``."""
        with self._cond:
            self.current, self.pending = adapter, 0
            self._published.add(committed)

    def _retire_soon(self, uid: int) -> None:
        """Retire ``uid`` now, or from a thread of its own (``retire_in_thread``); its slot counts until done."""
        if self.retire_in_thread:
            threading.Thread(target=self._retire_now, args=(uid,), name="colosync-retire", daemon=True).start()
        else:
            self._retire_now(uid)

    def _retire_now(self, uid: int) -> None:
        failed = False
        try:
            self._retire(uid)
        except Exception:  # it still takes a slot: counted, and tried again before the next commit
            log.exception("colosync: could not retire LoRA version %d", uid)
            failed = True
        finally:
            with self._cond:
                self._retiring.discard(uid)
                if failed:
                    self._stuck.add(uid)
                else:
                    self._stuck.discard(uid)
                self._cond.notify_all()


__all__ = ["ROOM_TIMEOUT_S", "Lease", "Slots", "Versions", "versioned_lora_request"]
