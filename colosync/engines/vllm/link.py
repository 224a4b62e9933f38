"""A ``Link`` to vLLM's workers over ``collective_rpc``, and the commit choreography around it.

vLLM runs the model in worker processes the trainer cannot reach directly; the one
supported door is ``collective_rpc``, which runs a named method of every worker between
engine steps. Every control message goes to every worker as msgpack bytes (each receives the
full update; vLLM shards it) and all must agree. A commit is choreographed here: pause
scheduling until in-flight requests drain (new ones queue), commit on every worker, label
the engine's weight version with the ``update_id``, reset the prefix cache (cached KV was
computed by the old version), resume. Every output therefore ran with exactly one committed
version, and vLLM's own ``weight_versions`` on each output say which (``version_of``).

Verified commits. A ``Commit`` carrying a ``Probe`` goes to the workers without it; after
resume the link scores the probe itself (``score_completions``, the scoring ``VllmServing``
uses too) and runs the same sequence as a host (``sync.delivery.verified_commit``): each
worker's Receiver checks what its commit changed and reverts a shortfall before it replies,
and a probe that deviates sends ``Revert`` to every worker. A LoRA update is rolled back to
the previous adapter, a full one leaves the engine failed closed (``serving=False``:
``lora_request`` raises ``FailedClosedError``) until an update commits; either way the push
fails with ``DeliveryError``. The probe is scored the way the engine serves by default: with
the colosync adapter the workers apply (``Ack.adapter``; a full update drops it unless pushed
with ``adapters="keep"``), else with the base model. The probe runs after resume, so with a
synchronous ``LLM`` do not generate from another thread during a verified commit
(``LLM.generate`` is not thread-safe); ``AsyncLLM`` has no such limit.

With ``commit_mode="inflight"`` (asynchronous RL) a LoRA commit does not pause vLLM: the new
version is installed beside the served one, verified, then published to new requests, and running
requests finish on their version (``versions.Versions``); a full update still pauses, drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Literal

import msgspec

from colosync.control.door import codecs
from colosync.engines.vllm.lanes import Submits, VllmLane, check_adapter_name, commit_beside, committing_lora
from colosync.engines.vllm.outputs import colosync_lora_request, score_completions
from colosync.engines.vllm.versions import ROOM_TIMEOUT_S, Lease, Slots, Versions, versioned_lora_request
from colosync.engines.vllm.worker import WORKER_EXTENSION, WorkerInfo
from colosync.errors import AdapterSlotsError, ConfigError, DeliveryError, EngineError
from colosync.sync.transaction import EngineTransaction
from colosync.wire.protocol import Ack, Commit, Failed, Probe, Revert, Status, TransactionRequest

log = logging.getLogger(__name__)

CommitMode = Literal["wait", "keep", "inflight"]
"""How a commit meets running requests: "wait" drains them first (vLLM's pause), "keep" holds them in
place (their later tokens come from the new version), "inflight" lets them finish on their version."""

_INFO = msgspec.msgpack.Decoder(WorkerInfo)


class _Workers:
    """The Receivers in vLLM's workers as one (of the named adapter ``adapter``, "" the default): every message
    to every worker, and all must agree."""

    def __init__(self, rpc: Callable[..., list[Any]], adapter: str = "") -> None:
        self._rpc = rpc
        self._adapter = adapter
        self._requests, self._replies = codecs()

    def handle(self, request: TransactionRequest) -> Ack:
        args = (self._requests.encode(request), self._adapter) if self._adapter else (self._requests.encode(request),)
        sent = self._rpc("colosync_handle", *args)
        replies = [self._replies.decode(bytes(r)) for r in sent]
        if not replies:
            raise EngineError("collective_rpc returned no worker replies; is the engine running?")
        for reply in replies:
            if isinstance(reply, Failed):
                raise reply.to_exception()
        committed = {r.committed_update_id for r in replies}
        if len(committed) != 1:
            raise EngineError(
                f"vLLM workers disagree on the committed update ({sorted(committed)}); a commit "
                "failed on some ranks: restart the engine, then push a full update"
            )
        return msgspec.structs.replace(replies[0], serving=all(r.serving for r in replies))

    def check_timeout(self) -> None:
        pass  # every worker's Receiver keeps its own clock

    def close(self) -> None:
        pass


class _VllmLinkBase(Submits):
    """``colosync.sync.link.Link`` over ``collective_rpc``; subclasses say how to reach vLLM.

    The engine's ``EngineTransaction`` lives here, in front of the workers' Receivers, and this
    link is its ``Serving``: ``switch`` wraps a commit or revert in pause -> apply -> label
    version -> reset prefix cache -> resume, so no request ever sees two versions; ``score``
    scores a probe after resume (see the module docstring).
    """

    retire_in_thread = False  # AsyncLLM: a lease ends on the loop a retirement's collective_rpc needs

    def __init__(
        self, commit_mode: CommitMode = "wait", versions_in_flight: int = 2, max_lag: int | None = None
    ) -> None:
        if commit_mode not in ("wait", "keep", "inflight"):
            raise ConfigError(f"commit_mode must be 'wait', 'keep' or 'inflight', got {commit_mode!r}")
        self.commit_mode = commit_mode
        # vLLM's pause mode for the commits that pause: with "inflight" only full updates pause, once drained
        self.pause_mode = "wait" if commit_mode == "inflight" else commit_mode
        self.workers = _Workers(self._rpc)
        self.transaction = EngineTransaction(self.workers, self)
        self.transaction.staleness.limit(max_lag)  # each named adapter's transaction gets the same (limit_lag)
        self.slots = Slots()  # vLLM's max_loras, shared by the default adapter and the named ones
        self.versions: Versions | None = None
        if commit_mode == "inflight":
            self.versions = Versions(
                versions_in_flight,
                self._retire,
                slots=self.slots,
                retire_in_thread=self.retire_in_thread,
                staleness=self.transaction.staleness,
            )
        else:  # the default adapter under its stable id holds a slot while it serves
            self.slots.fixed = lambda: int(bool(self.transaction.adapter))
        self.lanes: dict[str, VllmLane] = {}  # the named adapters, by name
        self.driver: Any = None  # a ``Rollouts`` loop driving the LLM, which then runs the link's requests
        self.probe_alone = True  # score a probe in a batch of its own (vLLM 0.32's CPU LoRA path); set by info()

    # -- what subclasses provide ------------------------------------------------------------
    def _rpc(self, method: str, *args: Any) -> list[Any]:
        raise NotImplementedError

    def _pause(self) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def _label(self, version: str) -> None:
        raise NotImplementedError

    def _reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    def _generate_one(self, token_ids: list[int], params: Any, lora: Any) -> Any:
        """One sequence through the engine; returns its final ``RequestOutput``."""
        raise NotImplementedError

    # -- what the engine serves -----------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """False while the workers fail closed."""
        return self.transaction.serving

    @property
    def committed_update_id(self) -> int:
        return self.transaction.committed_update_id

    @property
    def lora_update_id(self) -> int:
        """The update whose adapter the workers apply (0: none)."""
        return self.transaction.adapter

    def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], lora: Any = None
    ) -> tuple[list[list[float]], set[int]]:
        """``score_completions`` through this engine: per-token logprobs and the updates that computed them."""
        return score_completions(self._generate_one, prompts, completions, lora)

    def default_lora(self) -> Any:
        """What generation uses by default: the committed colosync adapter, else the base model (None)."""
        self.transaction.refuse_unless_serving("generation")
        if self.versions is not None:
            raise ConfigError(
                "with commit_mode='inflight' a request's adapter version is held by a lease, so that it is retired "
                "only after the request ends: generate inside `with engine.lease() as lease:` with "
                "lora_request=lease.lora_request"
            )
        return colosync_lora_request() if self.transaction.adapter else None

    def lease(self, bounded: bool = True) -> AbstractContextManager[Lease]:
        """``with link.lease() as lease``: the served version for one request (``commit_mode="inflight"``;
        ``bounded=False``: one that ``max_lag`` does not hold up, a scoring one)."""
        return self._leased_versions().lease(bounded)

    def lease_async(self) -> AbstractAsyncContextManager[Lease]:
        """``async with link.lease_async() as lease``: ``lease`` on an ``AsyncLLM``'s event loop."""
        return self._leased_versions().lease_async()

    def _leased_versions(self) -> Versions:
        self.transaction.refuse_unless_serving("generation")
        if self.versions is None:
            raise ConfigError("leases are for commit_mode='inflight'; this engine pauses to commit: use default_lora()")
        return self.versions

    # -- Serving ------------------------------------------------------------------------------
    def switch(self, request: Commit | Revert, apply: Callable[[], Ack]) -> Ack:
        """Run ``apply`` (``request``) so that no request sees two versions (the module docstring)."""
        versions = self.versions
        if versions is None:
            return self._paused(apply)
        if not committing_lora(self.transaction):
            with versions.exclusive():  # a full update: no request runs while the base weights change
                try:
                    return self._paused(apply)
                except Exception:
                    self._refresh()
                    raise
                finally:
                    versions.reset(self.transaction.adapter, self.transaction.committed_update_id)
        return commit_beside(self.transaction, self.workers, versions, request, apply)

    def _refresh(self) -> None:
        """What the workers serve now, after a failure (best effort: the failure is what gets raised)."""
        try:
            self.transaction.observe(self.workers.handle(Status()))
        except Exception:
            log.exception("colosync: could not read what the vLLM workers serve after a failed switch")

    def publish(self, ack: Ack) -> None:
        if self.versions is not None:
            self.versions.publish()

    def _retire(self, update_id: int) -> None:
        results = self._rpc("colosync_retire", update_id)
        if not all(results):
            log.warning("colosync: LoRA version %d was not installed on every worker when it retired", update_id)

    def _paused(self, apply: Callable[[], Ack]) -> Ack:
        """Run ``apply`` with generation paused; label the version it leaves and drop stale KV."""
        self._pause()
        try:
            try:
                ack = self.transaction.observe(apply())  # what the workers serve, before anything can fail
            except DeliveryError:  # the workers committed, found it wrong and undid it (or failed closed)
                self._relabel(self.transaction.observe(self.workers.handle(Status())))  # what they serve now
                raise
            self._relabel(ack)
        finally:
            self._resume()
        return ack

    def _relabel(self, ack: Ack) -> None:
        self._label(str(ack.committed_update_id))
        if not self._reset_prefix_cache():
            log.warning("colosync: vLLM did not reset its prefix cache at update %d", ack.committed_update_id)

    def score_probe(self, probe: Probe) -> tuple[list[list[float]], set[int]]:
        """The probe scored the way the engine serves by default (``default_lora``), or, committing beside
        running requests, by the version just committed."""
        if self.versions is None:
            lora = self.default_lora()
        else:
            self.transaction.refuse_unless_serving("to score the probe")
            uid = self.versions.probe_version()
            lora = versioned_lora_request(uid) if uid else None
        return self._score_with(probe, lora)

    def _score_with(self, probe: Probe, lora: Any) -> tuple[list[list[float]], set[int]]:
        alone: AbstractContextManager[None] = contextlib.nullcontext()
        if self.probe_alone:  # no other request beside it: through the driving loop, else through the leases
            alone = self.driver.alone() if self.driver is not None else self.slots.alone(ROOM_TIMEOUT_S)
        with alone:
            return self.score(probe.prompts, probe.completions, lora)

    def limit_lag(self, max_lag: int | None) -> None:
        """``max_lag`` (``sync.staleness``) from now on, for the default adapter and every named one."""
        for transaction in (self.transaction, *(lane.transaction for lane in self.lanes.values())):
            transaction.staleness.limit(max_lag)
        with self.slots.cond:  # a waiting lease looks again
            self.slots.cond.notify_all()

    # -- named adapters -------------------------------------------------------------------------
    def lane(self, name: str) -> VllmLane:
        """Named adapter ``name`` (opened on first use): a ``Link`` of its own, committed beside the others."""
        lane = self.lanes.get(check_adapter_name(name))
        if lane is not None:
            return lane
        infos = self.info()
        if not all(i.lora_enabled for i in infos):
            raise ConfigError(
                f"adapter {name!r} is a LoRA adapter and this vLLM engine was started without LoRA: start it with "
                "LLM(..., enable_lora=True, max_loras=<adapters + 1>, max_lora_rank=<your rank>)"
            )
        total = min(i.max_loras for i in infos)
        adapters = [*self.lanes, name] + ["(default)"] * bool(self.versions or self.transaction.adapter)
        if len(adapters) > total - 1:
            held = self.slots.describe()
            raise AdapterSlotsError(
                f"adapter {name!r} needs a LoRA slot, and this engine's {total} (max_loras) are taken: one stays free "
                f"for a commit beside a served version, and adapters {[*self.lanes]} hold the rest (installed now: "
                f"{held}); start vLLM with LLM(..., max_loras={len(adapters) + 1}) or push to one of those adapters"
            )
        numbers = set(self._rpc("colosync_lane", name))
        if len(numbers) != 1:
            raise EngineError(f"vLLM workers numbered adapter {name!r} apart ({sorted(numbers)}): restart the engine")
        lane = VllmLane(
            name,
            numbers.pop(),
            _Workers(self._rpc, name),
            self._rpc,
            self._score_with,
            self.slots,
            retire_in_thread=self.retire_in_thread,
            max_lag=self.transaction.staleness.max_lag,
        )
        self.lanes[name] = lane
        return lane

    @functools.cached_property
    def receivers(self) -> int:
        """The processes an update's bytes reach, one per worker (what an ``EngineSet`` counts)."""
        return len(self.info())

    def info(self) -> list[WorkerInfo]:
        """One ``WorkerInfo`` per worker; fails with the fix if the extension is missing."""
        try:
            replies = self._rpc("colosync_info")
        except Exception as exc:
            if "colosync_info" in str(exc) or isinstance(exc, AttributeError):
                raise EngineError(
                    "the vLLM workers lack colosync's extension; build the engine with "
                    f"LLM(..., worker_extension_cls={WORKER_EXTENSION!r})"
                ) from exc
            raise EngineError(f"vLLM collective_rpc failed: {type(exc).__name__}: {exc}") from exc
        infos = [_INFO.decode(bytes(r)) for r in replies]
        self.probe_alone = any(i.device == "cpu" for i in infos)
        self.slots.total = min(i.max_loras for i in infos)
        if self.versions is not None:
            infos = self._keep_versions(infos)
        self.transaction.status()  # what the workers serve now
        return infos

    def _keep_versions(self, infos: list[WorkerInfo]) -> list[WorkerInfo]:
        """Have every worker keep a version per update id (``commit_mode="inflight"``), if vLLM has the slots."""
        assert self.versions is not None
        slots = min(i.max_loras for i in infos)
        if slots < self.versions.limit:
            raise ConfigError(
                f"commit_mode='inflight' holds up to {self.versions.limit} LoRA versions at once (versions_in_flight), "
                f"but this vLLM engine has {slots} LoRA slot(s): start it with LLM(..., max_loras="
                f"{self.versions.limit}) or lower versions_in_flight"
            )
        if all(i.keep_versions for i in infos):
            return infos
        if any(i.lora_update_id for i in infos):
            raise ConfigError(
                "this vLLM engine already serves a colosync adapter under the stable id; choose "
                "commit_mode='inflight' before the first LoRA push (or push a full update with adapters='drop' first)"
            )
        return [_INFO.decode(bytes(r)) for r in self._rpc("colosync_keep_versions", True)]


class VllmLink(_VllmLinkBase):
    """Link to a synchronous ``vllm.LLM``."""

    def __init__(
        self, llm: Any, commit_mode: CommitMode = "wait", versions_in_flight: int = 2, max_lag: int | None = None
    ) -> None:
        super().__init__(commit_mode, versions_in_flight, max_lag)
        self.llm = llm
        self._engine_core = llm.llm_engine.engine_core
        self._can_pause = _serialize_client_sends(self._engine_core)
        if commit_mode == "inflight" and not self._can_pause:
            raise ConfigError(
                "commit_mode='inflight' commits while another thread generates, which an in-process vLLM engine "
                "core cannot do: run the engine core in its own process (leave VLLM_ENABLE_V1_MULTIPROCESSING on)"
            )

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def _pause(self) -> None:
        if self._can_pause:
            self.llm.sleep(level=0, mode=self.pause_mode)

    def _resume(self) -> None:
        if self._can_pause:
            self.llm.wake_up(tags=["scheduling"])

    def _label(self, version: str) -> None:
        self.llm.llm_engine.set_weight_version(version)

    def _reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def _generate_one(self, token_ids: list[int], params: Any, lora: Any) -> Any:
        from vllm import TokensPrompt

        if self.driver is not None:  # another thread drives the LLM (``Rollouts``): it runs this request too
            return self.driver.generate_one(token_ids, params, lora)
        [out] = self.llm.generate(TokensPrompt(prompt_token_ids=token_ids), params, lora_request=lora, use_tqdm=False)
        return out


def _serialize_client_sends(engine_core: Any) -> bool:
    """Make the engine client safe for one generating thread plus colosync's control calls.

    ``SyncMPClient`` writes every request to one ZeroMQ socket, and ZeroMQ sockets must not
    be used by two threads at once; an RL loop that generates in one thread while the
    trainer pushes updates from another would do exactly that. Wrap the send in a lock
    (idempotent). Returns whether the engine runs out of process, i.e. whether it can be
    paused while another thread waits on it.
    """
    send = getattr(engine_core, "_send_input", None)
    if send is None:  # in-process engine core: no background loop, nothing runs concurrently
        log.info("colosync: in-process vLLM engine core; commits cannot overlap generation")
        return False
    if not getattr(engine_core, "_colosync_send_lock", None):
        lock = threading.Lock()

        def locked_send(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return send(*args, **kwargs)

        engine_core._send_input = locked_send
        engine_core._colosync_send_lock = lock
    return True


class _AsyncBridge:
    """Run an ``AsyncLLM`` coroutine from the Sender's thread and wait for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def run(self, coro: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise EngineError(
                "a colosync Sender blocks, so it cannot run on the AsyncLLM's event loop; run it "
                "in a thread: await asyncio.to_thread(sender.push_peft, peft_model)"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


class AsyncVllmLink(_VllmLinkBase):
    """Link to a ``vllm.AsyncLLM`` through its async collective RPC.

    Build it on the engine's event loop (``AsyncVllmEngine.create``), use it from a thread. Requests on
    the loop hold their version with ``async with lease_async()`` (``commit_mode="inflight"``, named
    adapters); a version's retirement then runs from a thread of its own, off the loop.
    """

    retire_in_thread = True

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        commit_mode: CommitMode = "wait",
        versions_in_flight: int = 2,
        max_lag: int | None = None,
    ) -> None:
        super().__init__(commit_mode, versions_in_flight, max_lag)
        self.engine = engine
        self._bridge = _AsyncBridge(loop)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self._bridge.run(self.engine.collective_rpc(method, args=args))

    def _pause(self) -> None:
        self._bridge.run(self.engine.pause_generation(mode=self.pause_mode, clear_cache=False))

    def _resume(self) -> None:
        self._bridge.run(self.engine.resume_generation())

    def _label(self, version: str) -> None:
        self._bridge.run(self.engine.update_weight_version(version))

    def _reset_prefix_cache(self) -> bool:
        return bool(self._bridge.run(self.engine.reset_prefix_cache()))

    _probe_ids = itertools.count()

    def _generate_one(self, token_ids: list[int], params: Any, lora: Any) -> Any:
        from vllm import TokensPrompt

        async def final() -> Any:
            out = None
            async for item in self.engine.generate(
                TokensPrompt(prompt_token_ids=token_ids),
                params,
                f"colosync-score-{next(self._probe_ids)}",
                lora_request=lora,
            ):
                out = item  # keep the last (final) output
            return out

        return self._bridge.run(final())
