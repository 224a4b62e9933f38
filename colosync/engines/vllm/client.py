"""The trainer side of the vLLM engine: a ``Link`` over ``collective_rpc`` and the user-facing client.

vLLM runs the model in worker processes the trainer cannot reach directly; the one
supported door is ``collective_rpc``, which runs a named method of every worker between
engine steps. Every control message goes to every worker as msgpack bytes (each receives the
full update; vLLM shards it) and all must agree. A commit is choreographed here: pause
scheduling until in-flight requests drain (new ones queue), commit on every worker, label
the engine's weight version with the ``update_id``, reset the prefix cache (cached KV was
computed by the old version), resume. Every output therefore ran with exactly one committed
version, and vLLM's own ``weight_versions`` on each output say which (``version_of``).

vLLM is imported only inside functions that need it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from colosync.engines.host import codecs
from colosync.engines.vllm.worker import ADAPTER_ID, ADAPTER_NAME, IN_MEMORY_PATH, WORKER_EXTENSION, WorkerInfo
from colosync.errors import ColosyncError, ConfigError, EngineError
from colosync.sync.link import Done
from colosync.wire.protocol import Ack, Begin, Commit, Failed, Status, TransactionRequest

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

CommitMode = Literal["wait", "keep"]

_INFO = msgspec.msgpack.Decoder(WorkerInfo)


class _VllmLinkBase:
    """``colosync.sync.link.Link`` over ``collective_rpc``; subclasses say how to reach vLLM.

    Every worker gets every message (each receives the full update; vLLM shards it) and all
    must agree. ``Commit`` is wrapped in pause -> commit -> label version -> reset prefix
    cache -> resume, so no request ever sees two versions.
    """

    def __init__(self, commit_mode: CommitMode = "wait") -> None:
        if commit_mode not in ("wait", "keep"):
            raise ConfigError(f"commit_mode must be 'wait' or 'keep', got {commit_mode!r}")
        self.commit_mode = commit_mode
        self._requests, self._replies = codecs()  # one pair per link: the codec caches the last Begin
        self._lock = threading.Lock()
        self._kinds: dict[int, str] = {}
        self.lora_update_id = 0
        self.committed_update_id = 0

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

    # -- Link -------------------------------------------------------------------------------
    def submit(self, request: TransactionRequest) -> Done:
        try:
            with self._lock:
                if isinstance(request, Commit):
                    return Done(self._commit(request))
                if isinstance(request, Begin):
                    self._kinds[request.manifest.update_id] = request.manifest.kind
                return Done(self._call(request))
        except ColosyncError as exc:
            return Done(error=exc)
        except Exception as exc:  # vLLM itself failed: the engine is gone or broken
            return Done(error=EngineError(f"vLLM collective_rpc failed: {type(exc).__name__}: {exc}"))

    def close(self) -> None:
        pass

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
        with self._lock:
            self.committed_update_id = max(i.committed_update_id for i in infos)
            self.lora_update_id = max(i.lora_update_id for i in infos)
        return infos

    # -- internals --------------------------------------------------------------------------
    def _call(self, request: TransactionRequest) -> Ack:
        data = self._requests.encode(request)
        replies = [self._replies.decode(bytes(r)) for r in self._rpc("colosync_handle", data)]
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
        ack = replies[0]
        self.committed_update_id = ack.committed_update_id
        return ack

    def _commit(self, request: Commit) -> Ack:
        self._pause()
        try:
            ack = self._call(request)
            self._label(str(ack.committed_update_id))
            if not self._reset_prefix_cache():
                log.warning("colosync: vLLM did not reset its prefix cache after update %d",
                            request.update_id)
        finally:
            self._resume()
        if self._kinds.pop(request.update_id, None) == "lora":
            self.lora_update_id = request.update_id
        return ack


class VllmLink(_VllmLinkBase):
    """Link to a synchronous ``vllm.LLM``."""

    def __init__(self, llm: Any, commit_mode: CommitMode = "wait") -> None:
        super().__init__(commit_mode)
        self.llm = llm
        self._engine_core = llm.llm_engine.engine_core
        self._can_pause = _serialize_client_sends(self._engine_core)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def _pause(self) -> None:
        if self._can_pause:
            self.llm.sleep(level=0, mode=self.commit_mode)

    def _resume(self) -> None:
        if self._can_pause:
            self.llm.wake_up(tags=["scheduling"])

    def _label(self, version: str) -> None:
        self.llm.llm_engine.set_weight_version(version)

    def _reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())


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

    Build it on the engine's event loop (``AsyncVllmEngine.create``), use it from a thread.
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, commit_mode: CommitMode = "wait") -> None:
        super().__init__(commit_mode)
        self.engine = engine
        self._bridge = _AsyncBridge(loop)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self._bridge.run(self.engine.collective_rpc(method, args=args))

    def _pause(self) -> None:
        self._bridge.run(self.engine.pause_generation(mode=self.commit_mode, clear_cache=False))

    def _resume(self) -> None:
        self._bridge.run(self.engine.resume_generation())

    def _label(self, version: str) -> None:
        self._bridge.run(self.engine.update_weight_version(version))

    def _reset_prefix_cache(self) -> bool:
        return bool(self._bridge.run(self.engine.reset_prefix_cache()))


# -- the user-facing clients --------------------------------------------------------------


class _EngineClient:
    link: _VllmLinkBase

    @property
    def committed_update_id(self) -> int:
        """The update the engine serves (asks the workers)."""
        return self.link.submit(Status()).wait().committed_update_id

    @property
    def lora_request(self) -> LoRARequest:
        """The request to generate with the committed colosync adapter (stable across versions)."""
        from vllm.lora.request import LoRARequest

        if not self.link.lora_update_id:
            raise EngineError(
                "no colosync LoRA has been committed to this engine yet; push one "
                "(Sender(engine.link).push_peft(model)) before generating with it"
            )
        return LoRARequest(lora_name=ADAPTER_NAME, lora_int_id=ADAPTER_ID, lora_path=IN_MEMORY_PATH)

    @staticmethod
    def version_of(output: Any) -> int:
        """The ``update_id`` whose weights produced ``output`` (a RequestOutput or CompletionOutput).

        0 means the engine's initial weights. Raises ``EngineError`` if the tokens came from
        more than one version (only possible with ``commit_mode="keep"``).
        """
        completions = getattr(output, "outputs", None) or [output]
        versions: set[int] = set()
        for completion in completions:
            spans = getattr(completion, "weight_versions", None)
            if spans is None:
                raise EngineError(
                    "this output carries no weight_versions; pass the finished output that "
                    "LLM.generate returned (vLLM sets them on the final output only)"
                )
            for span in spans:
                versions.add(0 if span.version == "default" else int(span.version))
        if len(versions) > 1:
            raise EngineError(f"output tokens came from several updates {sorted(versions)}")
        return versions.pop() if versions else 0


class VllmEngine(_EngineClient):
    """Trainer-side handle on a ``vllm.LLM`` built with ``worker_extension_cls=WORKER_EXTENSION``.

    >>> engine = VllmEngine(llm)
    >>> Sender(engine.link, transport="shm").push_peft(peft_model)
    >>> outs = llm.generate(prompts, params, lora_request=engine.lora_request)
    >>> engine.version_of(outs[0])   # the update_id the tokens came from
    """

    def __init__(self, llm: Any, commit_mode: CommitMode = "wait") -> None:
        self.llm = llm
        self.link = VllmLink(llm, commit_mode)
        self.workers = self.link.info()
        log.info("colosync: attached to vLLM with %d worker(s), committed update %d",
                 len(self.workers), self.link.committed_update_id)


class AsyncVllmEngine(_EngineClient):
    """Trainer-side handle on a ``vllm.AsyncLLM``; push from a thread:

    >>> engine = await AsyncVllmEngine.create(async_llm)
    >>> await asyncio.to_thread(Sender(engine.link).push_peft, peft_model)
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, commit_mode: CommitMode = "wait") -> None:
        self.engine = engine
        self.link = AsyncVllmLink(engine, loop, commit_mode)
        self.workers: list[WorkerInfo] = []

    @classmethod
    async def create(cls, engine: Any, commit_mode: CommitMode = "wait") -> AsyncVllmEngine:
        client = cls(engine, asyncio.get_running_loop(), commit_mode)
        client.workers = await asyncio.to_thread(client.link.info)
        return client


__all__ = ["AsyncVllmEngine", "AsyncVllmLink", "CommitMode", "VllmEngine", "VllmLink"]
