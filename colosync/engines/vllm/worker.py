"""The engine side of colosync inside vLLM: a Receiver in every vLLM worker process.

Why this shape (the trainer side is ``colosync.engines.vllm.client``):

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

import logging
import threading
from typing import Any

import msgspec
import torch

from colosync.engines.host import EngineHost, codecs
from colosync.errors import RankError, UnknownTensorError, UpdateRejected
from colosync.sync.receiver import Receiver, ReceiverPolicy
from colosync.sync.target import EngineTarget, ModelSpec, ParamSpec, parse_lora_name
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Failed

log = logging.getLogger(__name__)

WORKER_EXTENSION = "colosync.engines.vllm.worker.ColosyncWorkerExtension"
"""Pass this as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``."""

ADAPTER_NAME = "colosync"
ADAPTER_ID = 0xC010
"""The stable vLLM adapter id every colosync LoRA version is served under."""

IN_MEMORY_PATH = "colosync://in-memory"
"""``LoRARequest.lora_path`` is mandatory in vLLM; colosync adapters never live on disk."""


class WorkerInfo(msgspec.Struct, frozen=True):
    """What one vLLM worker reports about itself (answer to ``colosync_info``)."""

    rank: int
    tensor_parallel_size: int
    device: str
    lora_enabled: bool
    max_lora_rank: int
    committed_update_id: int
    lora_update_id: int  # the update that installed the served adapter; 0 if none




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
        if spec is None:
            raise UpdateRejected(f"update {manifest.update_id} is a LoRA update without a LoraSpec")
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
        self.host = EngineHost(self.receiver)  # one per worker: its codec caches the last Begin
        self.lock = threading.Lock()


def _receiver_device(worker: Any) -> torch.device:
    device = getattr(worker, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


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
            return codecs()[1].encode(Failed.from_exception(exc))
        with state.lock:
            return state.host.handle_bytes(data)

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


__all__ = ["ADAPTER_ID", "ADAPTER_NAME", "ColosyncWorkerExtension", "IN_MEMORY_PATH", "VllmTarget",
           "WORKER_EXTENSION", "WorkerInfo"]
