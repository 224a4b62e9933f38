"""Drive a real vLLM engine through colosync's transaction: LoRA and full weights, in memory.

Why this shape:

* vLLM runs the model in worker processes the trainer cannot reach directly. The only
  supported door is ``collective_rpc``, which runs a named method of every worker between
  engine steps. So the engine side is a *worker extension* (``worker_extension_cls``) that
  hosts one ``Receiver`` per worker, and the trainer side is a ``Link`` that sends each
  control message as msgpack bytes through ``collective_rpc``. Arguments are manifests and
  transport handles, never tensors: bytes move through the transport (``shm`` today).
* LoRA updates never touch the filesystem. ``prepare`` builds a ``LoRAModel`` from the
  staged tensors with a ``PEFTHelper`` validated against the engine's LoRA config;
  ``commit`` swaps it into the worker's adapter manager under one stable adapter id and pins
  it, so users keep generating with the same ``LoRARequest``. vLLM folds alpha/rank into
  ``lora_b`` when an adapter is added; every version is built from freshly copied tensors
  and folded exactly once, so reloads never compound the scaling.
* Full updates are validated whole before a byte moves (including vLLM's fused groups: q/k/v
  and gate/up must travel together), then applied on commit through the model's own
  ``load_weights`` inside vLLM's in-place reload, which stacks qkv / gate_up, shards for
  tensor parallelism and re-runs the CPU backend's weight prepacking.
* Atomicity. A commit is choreographed by the trainer side: pause scheduling until in-flight
  requests drain (new ones queue), commit on every worker, label the engine's weight version
  with the ``update_id``, reset the prefix cache (cached KV was computed by the old version),
  resume. Every output therefore ran with exactly one committed version, and vLLM's own
  ``weight_versions`` spans on each output say which (``VllmEngine.version_of``).

vLLM is imported only inside this module, and only inside functions that need it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from colosync.errors import (
    ColosyncError,
    EngineError,
    RankError,
    UnknownTensorError,
    UpdateRejected,
)
from colosync.sync.link import Done
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Ack, Begin, Codec, Commit, Failed, Status, TransactionRequest
from colosync.sync.receiver import Receiver, ReceiverPolicy
from colosync.sync.target import EngineTarget, ModelSpec, ParamSpec, parse_lora_name

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

WORKER_EXTENSION = "colosync.engines.vllm.worker.ColosyncWorkerExtension"
"""Pass this as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``."""

ADAPTER_NAME = "colosync"
ADAPTER_ID = 0xC010
"""The stable vLLM adapter id every colosync LoRA version is served under."""

IN_MEMORY_PATH = "colosync://in-memory"
"""``LoRARequest.lora_path`` is mandatory in vLLM; colosync adapters never live on disk."""

CommitMode = Literal["wait", "keep"]


class WorkerInfo(msgspec.Struct, frozen=True):
    """What one vLLM worker reports about itself (answer to ``colosync_info``)."""

    rank: int
    tensor_parallel_size: int
    device: str
    lora_enabled: bool
    max_lora_rank: int
    committed_update_id: int
    lora_update_id: int  # the update that installed the served adapter; 0 if none


_INFO = msgspec.msgpack.Decoder(WorkerInfo)


def _codecs() -> tuple[Codec, Codec]:
    """Request and reply codecs; one pair per link and per worker (codecs cache the last Begin)."""
    return Codec(TransactionRequest), Codec(Ack | Failed)


# =========================================================================================
# Engine side: runs inside every vLLM worker process.
# =========================================================================================


class _PreparedLora:
    def __init__(self, lora: Any) -> None:
        self.lora = lora  # vllm.lora.lora_model.LoRAModel, built in memory


class _PreparedFull:
    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named = named


class VllmTarget(EngineTarget):
    """``EngineTarget`` over one vLLM worker's model and LoRA manager."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.vllm_config = worker.vllm_config
        self.model_config = self.vllm_config.model_config
        self.lora_config = self.vllm_config.lora_config
        self.hf_config = self.model_config.hf_config
        self._spec = self._build_spec()
        self._packed = dict(getattr(self._model(), "packed_modules_mapping", {}) or {})
        self._groups: dict[str, set[str]] = {}  # vLLM layer -> the HF parameters it loads
        for name in self._spec.params:
            self._groups.setdefault(self._group_of(name), set()).add(name)
        self._served: Any = None  # the LoRAModel currently installed under ADAPTER_ID
        self.lora_update_id = 0

    # -- model description ------------------------------------------------------------------
    def _model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def _adapter_manager(self) -> Any:
        runner = self.worker.model_runner
        manager = getattr(runner, "lora_manager", None)
        if manager is None or self.lora_config is None:
            raise UpdateRejected(
                "this vLLM engine was started without LoRA; start it with "
                "LLM(..., enable_lora=True, max_lora_rank=<your rank>) to accept LoRA updates"
            )
        return manager._adapter_manager

    def _build_spec(self) -> ModelSpec:
        """HF (unfused) parameter names and shapes, from the HF config on the meta device.

        vLLM fuses q/k/v and gate/up, and on CPU it even drops the original weight after
        prepacking, so its own parameters cannot describe what a trainer sends. The HF
        model class built on ``meta`` can, at no memory cost.
        """
        from transformers import AutoModelForCausalLM

        dtype = self.model_config.dtype
        text_config = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        try:
            with torch.device("meta"):
                hf_model = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
        except Exception as exc:  # an architecture transformers cannot build
            log.warning("colosync: cannot describe %s on meta (%s); full updates disabled",
                        type(text_config).__name__, exc)
            return ModelSpec({}, {}, self._max_rank(), self._lora_dtype())
        params = {name: ParamSpec(tuple(p.shape), dtype) for name, p in hf_model.named_parameters()}
        lora_modules: dict[str, tuple[int, int]] = {}
        leaves = self._lora_leaves()
        for name, module in hf_model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in leaves:
                lora_modules[name] = (module.in_features, module.out_features)
        return ModelSpec(params, lora_modules, self._max_rank(), self._lora_dtype())

    def _lora_leaves(self) -> set[str]:
        """Leaf module names vLLM can put a LoRA on (q_proj, ..., with packed ones unfolded)."""
        if self.lora_config is None:
            return set()
        manager = self._adapter_manager()
        packed = manager.packed_modules_mapping
        leaves: set[str] = set()
        for module in manager.supported_lora_modules:
            leaves.update(packed.get(module, [module]))
        return leaves - {"lm_head", "embed_tokens"}

    def _max_rank(self) -> int | None:
        return self.lora_config.max_lora_rank if self.lora_config is not None else None

    def _lora_dtype(self) -> torch.dtype:
        if self.lora_config is not None and isinstance(self.lora_config.lora_dtype, torch.dtype):
            return self.lora_config.lora_dtype
        return self.model_config.dtype

    def model_spec(self) -> ModelSpec:
        return self._spec

    # -- checks the generic validator cannot make ------------------------------------------
    def check(self, manifest: UpdateManifest) -> None:
        """Engine-specific rejections, before any byte moves."""
        if manifest.kind == "lora":
            self._adapter_manager()  # raises if LoRA is off
            self._peft_helper(manifest)  # rank / features against vLLM's LoRA config
            return
        if not self._spec.params:
            raise UpdateRejected(
                f"full updates need the model's HF layout, which transformers cannot build for "
                f"{type(self.hf_config).__name__}; send LoRA updates or upgrade transformers"
            )
        names = {t.name for t in manifest.tensors}
        for key in sorted({self._group_of(n) for n in names}):
            missing = sorted(self._groups.get(key, set()) - names)  # unknown names: validate_manifest
            if missing:
                raise UpdateRejected(
                    f"full update sends part of vLLM's layer {key!r} but not {missing}: vLLM reloads a "
                    "layer whole (q/k/v and gate/up are fused), so send every parameter of it"
                )

    def _group_of(self, name: str) -> str:
        """The vLLM layer an HF parameter loads into: ``...q_proj.weight`` -> ``...qkv_proj``."""
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        for fused, members in self._packed.items():
            if leaf in members:
                return f"{parent}.{fused}" if parent else fused
        return module

    def _peft_helper(self, manifest: UpdateManifest) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        spec = manifest.lora
        assert spec is not None
        helper = PEFTHelper.from_dict(
            {
                "r": spec.rank,
                "lora_alpha": spec.alpha,
                "target_modules": list(spec.target_modules),
                "use_rslora": spec.use_rslora,
                "bias": spec.bias,
                "vllm_max_position_embeddings": getattr(
                    self.hf_config.get_text_config(), "max_position_embeddings", None
                ),
            }
        )
        try:
            helper.validate_legal(self.lora_config)
        except ValueError as exc:
            cls = RankError if "max_lora_rank" in str(exc) else UpdateRejected
            raise cls(f"vLLM refuses this adapter: {exc} Restart the engine with a matching "
                      "LoRA config or change the adapter") from None
        return helper

    # -- EngineTarget -----------------------------------------------------------------------
    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> Any:
        if manifest.kind == "lora":
            return _PreparedLora(self._build_lora(manifest, tensors))
        named = [
            (name, t.to(dtype=self._spec.params[name].dtype, copy=True)) for name, t in tensors.items()
        ]
        return _PreparedFull(named)

    def _build_lora(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> Any:
        from vllm.lora.lora_model import LoRAModel

        helper = self._peft_helper(manifest)
        dtype = self._lora_dtype()
        # Fresh copies: vLLM folds the alpha/rank scaling into lora_b *in place* when the
        # adapter is added, so it must own its tensors (never views of staged buffers).
        peft_named = {}
        for name, t in tensors.items():
            module, part = parse_lora_name(name)
            peft_named[f"base_model.model.{module}.lora_{part}.weight"] = t.to(dtype=dtype, copy=True)
        model = self._model()
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "get_rename_mapper"):
            mapper = mapper.get_rename_mapper()
        try:
            lora = LoRAModel.from_lora_tensors(
                lora_model_id=ADAPTER_ID,
                tensors=peft_named,
                peft_helper=helper,
                device="cpu",
                dtype=dtype,
                model_vocab_size=self.model_config.get_vocab_size(),
                weights_mapper=mapper,
                skip_prefixes=getattr(model, "lora_skip_prefixes", None),
            )
        except (ValueError, RuntimeError) as exc:
            raise UnknownTensorError(f"vLLM could not build the adapter: {exc}") from None
        manager = self._adapter_manager()
        known = set(manager.modules) | {m for ms in manager.packed_modules.values() for m in ms}
        unknown = sorted(set(lora.loras) - known)
        if unknown:
            raise UnknownTensorError(
                f"vLLM's model has no LoRA slot for modules {unknown[:5]}; check the module "
                "names and that trainer and engine run the same architecture"
            )
        return lora

    def commit(self, prepared: Any, update_id: int) -> None:
        if isinstance(prepared, _PreparedLora):
            self._install(prepared.lora)
            self.lora_update_id = update_id
        else:
            self._load_full(prepared.named)

    def _install(self, lora: Any) -> None:
        """Swap ``lora`` in under ADAPTER_ID; on failure put the previous version back."""
        manager = self._adapter_manager()
        previous = self._served
        manager.remove_adapter(ADAPTER_ID)
        try:
            self._add_and_pin(manager, lora)
        except BaseException:
            manager.remove_adapter(ADAPTER_ID)
            if previous is not None:
                self._add_and_pin(manager, previous)  # already folded: adding again is a no-op fold
            raise
        self._served = lora

    @staticmethod
    def _add_and_pin(manager: Any, lora: Any) -> None:
        manager.add_adapter(lora)  # packs q/k/v, gate/up and folds scaling once
        manager.pin_adapter(ADAPTER_ID)  # activate into a slot; never evicted by the LRU

    def _load_full(self, named: list[tuple[str, torch.Tensor]]) -> None:
        runner = self.worker.model_runner
        # vLLM's in-place reload drives model.load_weights (stacking, TP sharding) and then
        # re-runs per-layer post-processing (the CPU backend prepacks linear weights); it
        # also drops every registered LoRA, so the served adapter is put back afterwards.
        runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        if self._served is not None:
            self._add_and_pin(self._adapter_manager(), self._served)

    def discard(self, prepared: Any) -> None:
        if isinstance(prepared, _PreparedFull):
            prepared.named.clear()
        elif isinstance(prepared, _PreparedLora):
            prepared.lora = None


class _WorkerState:
    def __init__(self, worker: Any) -> None:
        self.target = VllmTarget(worker)
        self.receiver = Receiver(self.target, device=_receiver_device(worker), policy=ReceiverPolicy())
        self.requests, self.replies = _codecs()
        self.lock = threading.Lock()


def _receiver_device(worker: Any) -> torch.device:
    device = getattr(worker, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def handle_bytes(receiver: Receiver, data: bytes, codecs: tuple[Codec, Codec], check: Any = None) -> bytes:
    """One msgpack control message in, one msgpack ``Ack`` or ``Failed`` out; never raises.

    ``codecs`` is the (requests, replies) pair from ``_codecs``; ``check(manifest)`` runs on
    ``Begin`` before the Receiver's generic validation.
    """
    requests, replies = codecs
    try:
        request = requests.decode(bytes(data))
        if check is not None and isinstance(request, Begin):
            check(request.manifest)
        reply: msgspec.Struct = receiver.handle(request)
    except Exception as exc:  # every failure travels back typed, never as a crash
        if not isinstance(exc, ColosyncError):
            log.exception("colosync: worker failed on a control message")
        reply = Failed.from_exception(exc)
    return replies.encode(reply)


class ColosyncWorkerExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls``; reached by ``collective_rpc``.

    vLLM copies every callable of this class onto the worker class and refuses names the
    worker already has, so everything here is prefixed ``colosync_``.
    """

    def colosync_handle(self, data: bytes) -> bytes:
        """Decode one control message, apply it to this worker's Receiver, encode the reply."""
        try:
            state = self.colosync_state()
        except Exception as exc:
            log.exception("colosync: cannot set up the receiver in this worker")
            return _codecs()[1].encode(Failed.from_exception(exc))
        with state.lock:
            return handle_bytes(state.receiver, data, (state.requests, state.replies))

    def colosync_info(self) -> bytes:
        state = self.colosync_state()
        target = state.target
        parallel = target.vllm_config.parallel_config
        info = WorkerInfo(
            rank=int(getattr(self, "rank", 0)),
            tensor_parallel_size=int(parallel.tensor_parallel_size),
            device=str(state.receiver.device),
            lora_enabled=target.lora_config is not None,
            max_lora_rank=int(target.lora_config.max_lora_rank) if target.lora_config else 0,
            committed_update_id=state.receiver.committed_update_id,
            lora_update_id=target.lora_update_id,
        )
        return msgspec.msgpack.encode(info)

    def colosync_state(self) -> _WorkerState:
        state = self.__dict__.get("_colosync_state")
        if state is None:
            state = self.__dict__["_colosync_state"] = _WorkerState(self)
        return state


# =========================================================================================
# Trainer side: drives the workers through collective RPC.
# =========================================================================================


class _VllmLinkBase:
    """``colosync.sync.link.Link`` over ``collective_rpc``; subclasses say how to reach vLLM.

    Every worker gets every message (each receives the full update; vLLM shards it) and all
    must agree. ``Commit`` is wrapped in pause -> commit -> label version -> reset prefix
    cache -> resume, so no request ever sees two versions.
    """

    def __init__(self, commit_mode: CommitMode = "wait") -> None:
        if commit_mode not in ("wait", "keep"):
            raise ValueError(f"commit_mode must be 'wait' or 'keep', got {commit_mode!r}")
        self.commit_mode = commit_mode
        self._requests, self._replies = _codecs()
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


__all__ = [
    "ADAPTER_ID",
    "ADAPTER_NAME",
    "AsyncVllmEngine",
    "AsyncVllmLink",
    "ColosyncWorkerExtension",
    "VllmEngine",
    "VllmLink",
    "VllmTarget",
    "WORKER_EXTENSION",
    "WorkerInfo",
]
