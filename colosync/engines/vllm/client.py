"""The user-facing vLLM clients (``VllmEngine``, ``AsyncVllmEngine``) and what they share with serving.

``version_of`` reads which update produced an output from vLLM's own ``weight_versions``;
``score_completions`` is the one way colosync scores completions through vLLM (the link's
verification and ``VllmServing``'s ``Score`` both use it); ``colosync_lora_request`` is the
stable request every colosync adapter version is served under. The links over
``collective_rpc`` and the commit choreography are in ``colosync.engines.vllm.link``.
vLLM is imported only inside functions that need it.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import TYPE_CHECKING, Any

from colosync.engines.vllm.lanes import VllmLane
from colosync.engines.vllm.link import AsyncVllmLink, CommitMode, VllmLink, _VllmLinkBase
from colosync.engines.vllm.outputs import colosync_lora_request, score_completions, version_of
from colosync.engines.vllm.versions import Lease
from colosync.engines.vllm.worker import WorkerInfo
from colosync.errors import EngineError
from colosync.wire.protocol import Status

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)


# -- the user-facing clients --------------------------------------------------------------


class _EngineClient:
    link: _VllmLinkBase

    @property
    def committed_update_id(self) -> int:
        """The update the engine serves (asks the workers)."""
        return self.link.submit(Status()).wait().committed_update_id

    @property
    def serving(self) -> bool:
        """False while the engine fails closed (a full update did not verify); push a good update."""
        return self.link.serving

    @property
    def lora_request(self) -> LoRARequest:
        """The request to generate with the committed colosync adapter (stable across versions).

        Raises ``FailedClosedError`` while the engine refuses to serve.
        """
        self.link.transaction.refuse_unless_serving("generation with the colosync adapter")
        if self.link.versions is not None:
            self.link.default_lora()  # raises: in this mode a request's version is held by a lease
        self.link.transaction.refuse_if_behind("generation with the colosync adapter")
        if not self.link.lora_update_id:
            raise EngineError(
                "this engine serves no colosync LoRA adapter: none was committed yet, or a full update dropped it "
                "(adapters='drop' is its default); push one (Sender(engine.link).push_peft(model)) before "
                "generating with it, or generate without a lora_request to use the engine's weights alone"
            )
        return colosync_lora_request()

    def lease(self) -> AbstractContextManager[Lease]:
        """``commit_mode="inflight"``: the served adapter version for one request, held until it ends.

        >>> with engine.lease() as lease:
        ...     outs = llm.generate(prompts, params, lora_request=lease.lora_request)
        >>> engine.version_of(outs[0]) == lease.update_id
        """
        return self.link.lease()

    def lease_async(self) -> AbstractAsyncContextManager[Lease]:
        """``lease`` for a coroutine on an ``AsyncLLM``'s event loop (``AsyncVllmEngine``):

        >>> async with engine.lease_async() as lease:
        ...     async for out in async_llm.generate(prompt, params, request_id, lora_request=lease.lora_request): ...
        """
        return self.link.lease_async()

    def lag(self, update_id: int) -> int:
        """``commit_mode="inflight"``: how many versions were published after ``update_id`` (a sample's staleness)."""
        if self.link.versions is None:
            raise EngineError("lag() counts versions published beside running requests: use commit_mode='inflight'")
        return self.link.versions.lag(update_id)

    def lane(self, name: str) -> VllmLane:
        """Named adapter ``name``: its own versions, committed beside running requests and the other adapters.

        >>> sender = Sender(engine.lane("policy"))
        >>> with engine.lane("policy").lease() as lease:
        ...     outs = llm.generate(prompts, params, lora_request=lease.lora_request)
        """
        return self.link.lane(name)

    version_of = staticmethod(version_of)


class VllmEngine(_EngineClient):
    """Trainer-side handle on a ``vllm.LLM`` built with ``worker_extension_cls=WORKER_EXTENSION``.

    >>> engine = VllmEngine(llm)
    >>> Sender(engine.link, transport="shm").push_peft(peft_model)
    >>> outs = llm.generate(prompts, params, lora_request=engine.lora_request)
    >>> engine.version_of(outs[0])   # the update_id the tokens came from

    ``commit_mode="inflight"`` (asynchronous RL): LoRA commits do not wait for running requests,
    which finish on their version; up to ``versions_in_flight`` versions are installed at once
    (vLLM's ``max_loras`` must hold them). Generate through ``lease()``. ``max_lag=N``: no request
    starts on a version more than N updates behind the newest one the trainer began (a lease
    waits for a newer commit); every adapter (``lane``) gets the same bound.
    """

    def __init__(
        self, llm: Any, commit_mode: CommitMode = "wait", versions_in_flight: int = 2, max_lag: int | None = None
    ) -> None:
        self.llm = llm
        self.link = VllmLink(llm, commit_mode, versions_in_flight, max_lag)
        self.workers = self.link.info()
        log.info(
            "colosync: attached to vLLM with %d worker(s), committed update %d",
            len(self.workers),
            self.link.committed_update_id,
        )


class AsyncVllmEngine(_EngineClient):
    """Trainer-side handle on a ``vllm.AsyncLLM``; push from a thread:

    >>> engine = await AsyncVllmEngine.create(async_llm)
    >>> await asyncio.to_thread(Sender(engine.link).push_peft, peft_model)

    ``commit_mode="inflight"`` and named adapters (``lane``) as for ``VllmEngine``; requests on the
    loop hold their version with ``async with engine.lease_async()``.
    """

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        commit_mode: CommitMode = "wait",
        versions_in_flight: int = 2,
        max_lag: int | None = None,
    ) -> None:
        self.engine = engine
        self.link = AsyncVllmLink(engine, loop, commit_mode, versions_in_flight, max_lag)
        self.workers: list[WorkerInfo] = []

    @classmethod
    async def create(
        cls, engine: Any, commit_mode: CommitMode = "wait", versions_in_flight: int = 2, max_lag: int | None = None
    ) -> AsyncVllmEngine:
        client = cls(engine, asyncio.get_running_loop(), commit_mode, versions_in_flight, max_lag)
        client.workers = await asyncio.to_thread(client.link.info)
        return client


__all__ = [
    "AsyncVllmEngine",
    "AsyncVllmLink",
    "CommitMode",
    "VllmEngine",
    "VllmLink",
    "colosync_lora_request",
    "score_completions",
    "version_of",
]
