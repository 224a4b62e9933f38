"""A synchronous ``vllm.LLM`` that never stops generating: continuous batching from one thread.

Asynchronous RL keeps the engine busy while the trainer pushes: finished requests are replaced
at once, so requests of several versions share vLLM's batches. ``LLM.generate`` cannot do that
(one call, one batch, and never from two threads at once), so ``Rollouts`` drives vLLM's own
``LLMEngine.add_request`` / ``step`` loop on a thread of its own and keeps ``concurrency``
requests in the engine. Each request takes its version when it is added (a lease, with
``commit_mode="inflight"``; otherwise the served adapter) and returns it when it ends, and each
finished request records the version vLLM says produced it and the version it was given.

While it runs, this thread is the engine's only driver: anything else that generates through the
link (the probe of a verified commit) hands its request to this loop (``generate_one``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from colosync.errors import EngineError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    """One finished request: what it ran on and what it produced."""

    prompt: int  # index into the prompts
    adapter: str  # the named adapter it ran on ("": the default)
    leased: int  # the update whose adapter it was given when it started (0: none)
    version: int  # the update vLLM reports produced its tokens (``version_of``)
    tokens: list[int]
    started: float  # perf_counter seconds
    finished: float


class Rollouts:
    """``concurrency`` requests in the engine at all times, cycling through ``prompts``, until ``stop``.

    >>> rollouts = Rollouts(engine, prompts, SamplingParams(max_tokens=16), concurrency=8)
    >>> rollouts.start(); ...push updates...; done = rollouts.stop()
    """

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Sequence[int]],
        params: Any,
        concurrency: int = 8,
        adapters: Sequence[str] = ("",),
    ) -> None:
        if concurrency < 1 or not prompts or not adapters:
            raise EngineError(
                f"Rollouts needs prompts, adapters and concurrency >= 1, got {len(prompts)}, {len(adapters)}, "
                f"{concurrency}"
            )
        unknown = [a for a in adapters if a and a not in engine.link.lanes]
        if unknown:
            raise EngineError(f"Rollouts: this engine has no adapters {unknown}; open them first (engine.lane(name))")
        self.engine, self.prompts, self.params, self.concurrency = engine, prompts, params, concurrency
        self.adapters = list(adapters)  # each new request on the next of these ("": the default adapter)
        self.finished: list[Rollout] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._alone = 0  # callers inside ``alone`` (several adapters' probes may be scored at once)
        self._alone_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="colosync-rollouts", daemon=True)
        self._asked: queue.SimpleQueue[tuple[list[int], Any, Any, Future[Any]]] = queue.SimpleQueue()

    def start(self) -> Rollouts:
        self.engine.link.driver = self  # the link's own requests (a probe) now go through this loop
        self._thread.start()
        return self

    def generate_one(self, token_ids: list[int], params: Any, lora: Any, timeout_s: float = 300.0) -> Any:
        """One request through this loop, beside the rollouts; returns its final ``RequestOutput``."""
        if self.error is not None:
            raise EngineError(f"the rollout loop died ({type(self.error).__name__}: {self.error}); call stop()")
        if not self._thread.is_alive() or self._stop.is_set():
            raise EngineError("the rollout loop is stopping or stopped: generate through the LLM itself")
        waiter: Future[Any] = Future()
        self._asked.put((token_ids, params, lora, waiter))
        return waiter.result(timeout_s)

    def stop(self, timeout_s: float = 120.0) -> list[Rollout]:
        """Add no more requests, let the running ones finish, and return every finished one; raises what broke it."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # still driving the engine: it stays the link's driver
            raise EngineError(f"the rollout thread did not finish its requests within {timeout_s:g} s")
        if getattr(self.engine.link, "driver", None) is self:
            self.engine.link.driver = None
        if self.error is not None:
            raise self.error
        return self.finished

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Inside, no new rollout starts and an asked request runs once the running ones (asked ones included)
        have finished.

        vLLM 0.32's CPU backend fails (and its engine core dies) on a LoRA request with prompt
        logprobs batched with other requests, which is how a probe is scored; so the link scores a
        probe alone, and generation pauses only for that."""
        with self._alone_lock:
            self._alone += 1
        try:
            yield
        finally:
            with self._alone_lock:
                self._alone -= 1

    def _run(self) -> None:
        from vllm import TokensPrompt

        llm_engine = self.engine.llm.llm_engine
        ids = itertools.count()
        running: dict[str, tuple[int, str, int, float, contextlib.ExitStack]] = {}
        asked: dict[str, Future[Any]] = {}
        waiting: list[tuple[list[int], Any, Any, Future[Any]]] = []
        prompts = itertools.cycle(range(len(self.prompts)))
        adapters = itertools.cycle(self.adapters)
        try:
            while True:
                while not self._asked.empty():
                    waiting.append(self._asked.get())
                alone = self._alone > 0
                if waiting and not (alone and (running or asked)):
                    batch = waiting[:1] if alone else list(waiting)  # alone: one asked request at a time
                    for token_ids, params, lora, waiter in batch:
                        rid = f"colosync-asked-{next(ids)}"
                        llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=token_ids), params, lora_request=lora)
                        asked[rid] = waiter
                    del waiting[: len(batch)]
                while not (self._stop.is_set() or self._alone) and len(running) < self.concurrency:
                    held = contextlib.ExitStack()
                    adapter = next(adapters)
                    version = self._version(held, adapter)
                    if version is None:  # a full update drains the engine, or it fails closed: none starts
                        break
                    leased, lora = version
                    index = next(prompts)
                    rid = f"colosync-rollout-{next(ids)}"
                    prompt = TokensPrompt(prompt_token_ids=list(self.prompts[index]))
                    try:
                        llm_engine.add_request(rid, prompt, self.params, lora_request=lora)
                    except BaseException:
                        held.close()
                        raise
                    running[rid] = (index, adapter, leased, time.perf_counter(), held)
                if not running and not asked:
                    if self._stop.is_set() and self._asked.empty():
                        break
                    time.sleep(0.001)  # alone, before the asked request arrives
                    continue
                for out in llm_engine.step():
                    if out.finished and out.request_id in asked:
                        asked.pop(out.request_id).set_result(out)
                    elif out.finished and out.request_id in running:
                        self._finish(out, *running.pop(out.request_id))
        except BaseException as exc:  # surfaced by stop()
            log.exception("colosync: the rollout thread failed")
            self.error = exc
            with contextlib.suppress(Exception):  # first: a version must not retire under a running request
                llm_engine.abort_request([*running, *asked])
            for *_, held in running.values():
                held.close()
            for waiter in [*asked.values(), *(w[3] for w in waiting)]:
                waiter.set_exception(exc)
        while not self._asked.empty():  # asked after the loop's last look: nobody will run them
            self._asked.get()[3].set_exception(EngineError("the rollout loop stopped before this request ran"))

    def _finish(
        self, out: Any, index: int, adapter: str, leased: int, started: float, held: contextlib.ExitStack
    ) -> None:
        held.close()  # the request's version is free to retire
        tokens = list(out.outputs[0].token_ids)
        done = Rollout(index, adapter, leased, self.engine.version_of(out), tokens, started, time.perf_counter())
        self.finished.append(done)

    def _version(self, held: contextlib.ExitStack, adapter: str) -> tuple[int, Any] | None:
        """The version of ``adapter`` a new request runs on, held in ``held`` until it ends; None while none may
        start."""
        link = self.engine.link
        if adapter:
            lane = link.lanes.get(adapter)
            lease = lane.try_lease(held) if lane is not None else None
            return (lease.update_id, lease.lora_request) if lease is not None else None
        if not link.transaction.serving:  # failed closed: no request starts until an update commits
            return None
        if link.versions is not None:
            lease = link.versions.try_lease(held)
            return (lease.update_id, lease.lora_request) if lease is not None else None
        if link.transaction.lagging():  # max_lag: none starts until a newer update commits
            return None
        lora = link.default_lora()
        return (link.lora_update_id if lora is not None else 0), lora


__all__ = ["Rollout", "Rollouts"]
