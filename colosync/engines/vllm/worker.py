"""The engine side of colosync inside vLLM: a Receiver in every vLLM worker process.

Why this shape (the trainer side is ``colosync.engines.vllm.link`` and ``client``):

* vLLM runs the model in worker processes the trainer cannot reach directly. The only
  supported door is ``collective_rpc``, which runs a named method of every worker between
  engine steps. So the engine side is a *worker extension* (``worker_extension_cls``) that
  hosts one ``Receiver`` per worker, and the trainer side is a ``Link`` that sends each
  control message as msgpack bytes through ``collective_rpc``. Arguments are manifests and
  transport handles, never tensors: bytes move through the transport (``shm`` or ``cuda_ipc``).
* LoRA updates never touch the filesystem. ``prepare`` builds a ``LoRAModel`` from the
  staged tensors with a ``PEFTHelper`` validated against the engine's LoRA config;
  ``commit`` swaps it into the worker's adapter manager under one stable adapter id and pins
  it, so users keep generating with the same ``LoRARequest``. vLLM folds alpha/rank into
  ``lora_b`` when an adapter is added; every version is built from freshly copied tensors
  and folded exactly once, so reloads never compound the scaling.
* Full updates are validated whole before a byte moves (including vLLM's fused groups: q/k/v
  and gate/up must travel together), then applied on commit through the model's own
  ``load_weights`` inside vLLM's in-place reload, which stacks qkv / gate_up, shards for
  tensor parallelism and re-runs the CPU backend's weight prepacking -- for every layer it
  loaded. A tied ``lm_head`` loads nothing (it *is* the embedding), so the reload leaves its
  GEMM prepacked from the old weights (and may leave it untied from a re-materialized
  embedding): after a reload colosync re-ties it and re-runs its weight processing.
* Commits count what they changed (``Changes``): LoRA modules that really landed in vLLM's
  LoRA slots, or vLLM layers ``load_weights`` really loaded, against what the manifest
  names; the Receiver reverts on a mismatch. A LoRA commit can be reverted (the previous
  ``LoRAModel`` stays referenced until the next commit); a full one cannot, so the
  Receiver fails closed (``Ack.serving=False``) until an update commits.
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

from colosync.control.door import Door
from colosync.errors import ConfigError, RankError, UnknownTensorError, UpdateRejected
from colosync.sync.receiver import Receiver
from colosync.sync.staging import FullFootprint, HostStaging, full_footprint, return_cached
from colosync.sync.target import (
    Changes,
    EngineTarget,
    ModelSpec,
    ParamSpec,
    ReceiverPolicy,
    Staging,
    parse_lora_name,
    tied_parameters,
    untie,
)
from colosync.sync.transaction import Layouts
from colosync.wire.manifest import UpdateManifest
from colosync.wire.protocol import Ack, Begin, Failed, TransactionRequest

log = logging.getLogger(__name__)

WORKER_EXTENSION = "colosync.engines.vllm.worker.ColosyncWorkerExtension"
"""Pass this as ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``."""

ADAPTER_NAME = "colosync"
ADAPTER_ID = 0xC010
"""The stable vLLM adapter id every colosync LoRA version is served under (``commit_mode`` "wait" or "keep")."""

VERSIONED_ID_BASE = 0xC0100000
"""With ``commit_mode="inflight"`` each LoRA version has an id of its own: this plus its update id."""


def versioned_update_id(lora_int_id: int) -> int | None:
    """The update whose own adapter id ``lora_int_id`` is (``commit_mode="inflight"``), else None."""
    uid = lora_int_id - VERSIONED_ID_BASE
    return uid if 0 < uid < 1 << 31 else None


LANE_ID_BASE = 1 << 40
"""A named adapter's versions: this plus its lane number times 2**32 plus the update id (vLLM keeps ids in int64)."""


def lane_lora_id(lane: int, update_id: int) -> int:
    """The vLLM adapter id of named adapter number ``lane``'s version ``update_id``."""
    if not 0 < lane < 1 << 16 or not 0 < update_id < 1 << 32:
        raise ConfigError(f"no adapter id for lane {lane}, update {update_id}: lanes 1..65535, updates 1..2**32-1")
    return LANE_ID_BASE + (lane << 32) + update_id


def lane_update_id(lora_int_id: int) -> tuple[int, int] | None:
    """(lane, update id) of a named adapter's version id (``lane_lora_id``), else None."""
    rest = lora_int_id - LANE_ID_BASE
    lane, uid = rest >> 32, rest & 0xFFFFFFFF
    return (lane, uid) if rest > 0 and 0 < lane < 1 << 16 and uid else None


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
    serving: bool = True  # False: failed closed (a full update did not verify); push a good update
    last_full: FullFootprint | None = None  # where the last full update's bytes sat at prepare
    max_loras: int = 1  # adapters vLLM holds in its slots at once
    keep_versions: bool = False  # each LoRA version under an id of its own, kept until retired


# =========================================================================================
# Engine side: runs inside every vLLM worker process.
# =========================================================================================


class _PreparedLora:
    def __init__(self, lora: Any, expected: int) -> None:
        self.lora = lora  # vllm.lora.lora_model.LoRAModel, built in memory
        self.expected = expected  # distinct HF modules the manifest puts a LoRA on


class _PreparedFull:
    def __init__(self, named: list[tuple[str, torch.Tensor]], layers: set[str], drop_adapter: bool) -> None:
        self.named = named
        self.layers = layers  # the vLLM layers these HF parameters load into (``_group_of``)
        self.drop_adapter = drop_adapter  # adapters="drop": stop serving the LoRA adapter at commit


def loaded_layers(layers: set[str], loaded: set[str]) -> set[str]:
    """Which of ``layers`` (``_group_of`` names) vLLM's ``load_weights`` loaded into.

    A layer counts when vLLM reports loading it or a module inside it: a fused MoE block
    (``mlp.experts``, what HF's 3D ``experts.gate_up_proj`` / ``down_proj`` belong to) loads
    into its runner's ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight``. A layer
    nothing was loaded into, itself or below, does not count.
    """
    reached: set[str] = set()
    for name in loaded:
        parts = name.split(".")
        reached.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return layers & reached


def placed_lora_modules(manager: Any, lora: Any) -> int:
    """How many HF modules of ``lora`` sit in the adapter manager's LoRA slots.

    Counted from the ``LoRAModel`` after ``add_adapter`` (which packs q/k/v into ``qkv_proj``
    and gate/up into ``gate_up_proj``) against the modules the manager really has a slot
    for, as ``activate_adapter`` places them: a packed module counts each of its non-empty
    sub-LoRAs, a plain one counts once. An adapter that is not active counts nothing.
    """
    active = getattr(manager, "_active_adapters", None)
    if active is not None and lora.id not in active:
        return 0
    count = 0
    for name in manager.modules:
        weights = lora.get_lora(name)
        if weights is None:
            continue
        parts = weights.lora_a if isinstance(weights.lora_a, (list, tuple)) else [weights.lora_a]
        count += sum(part is not None for part in parts)
    return count


class VllmTarget(EngineTarget):
    """``EngineTarget`` over one vLLM worker's model and LoRA manager.

    ``lane`` > 0: a named adapter's target (``lanes.VllmLane``), LoRA only, every version under an id of
    its own (``lane_lora_id``) beside the other adapters', on the base target's model description."""

    def __init__(self, worker: Any, lane: int = 0, base: VllmTarget | None = None) -> None:
        self.worker = worker
        self.lane = lane
        self.vllm_config = worker.vllm_config
        self.model_config = self.vllm_config.model_config
        self.lora_config = self.vllm_config.lora_config
        self.hf_config = self.model_config.hf_config
        _check_cpu_head_size(self.model_config, _receiver_device(worker))
        self._spec: ModelSpec = base._spec if base is not None else self._build_spec()
        self._packed = dict(getattr(self._model(), "packed_modules_mapping", {}) or {})
        self._groups: dict[str, set[str]] = {}  # vLLM layer -> the HF parameters it loads
        for name in self._spec.params or {}:  # this target always describes its parameters
            self._groups.setdefault(self._group_of(name), set()).add(name)
        self._served: Any = None  # the LoRAModel currently served (under ADAPTER_ID unless keep_versions)
        self.lora_update_id = 0
        # keep_versions (commit_mode="inflight"): every LoRA version is installed under an id of its
        # own, and a superseded one stays installed (``_kept``, by update id) for the requests still
        # running on it until the driver retires it. Otherwise one id, swapped at each commit.
        self.keep_versions = lane > 0
        self._kept: dict[int, Any] = {}
        self.siblings: list[VllmTarget] = []  # the named adapters' targets: a full reload puts theirs back
        # What a revert of the last commit reinstates (kept until the next commit): the
        # LoRAModel served before it and the update that installed that one.
        self._last_commit: tuple[str, int] | None = None  # (kind, update_id)
        self._previous: Any = None
        self._previous_lora_update_id = 0
        # Full updates land in host memory and vLLM's reload copies them into the weights at
        # commit (layer by layer): no staged or prepared copy of the model on the device.
        self._device = _receiver_device(worker)
        self._host = HostStaging(keep=self._device.type == "cuda")
        self.last_full: FullFootprint | None = None

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
            log.warning(
                "colosync: cannot describe %s on meta (%s); full updates disabled", type(text_config).__name__, exc
            )
            return ModelSpec({}, {}, self._max_rank(), self._lora_dtype())
        # named_parameters() lists a tied lm_head once, as the embedding; ``tied`` lets a full
        # state_dict() through (its lm_head.weight must equal the embedding and is dropped).
        params = {name: ParamSpec(tuple(p.shape), dtype) for name, p in hf_model.named_parameters()}
        lora_modules: dict[str, tuple[int, int]] = {}
        leaves = self._lora_leaves()
        for name, module in hf_model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in leaves:
                lora_modules[name] = (module.in_features, module.out_features)
        return ModelSpec(params, lora_modules, self._max_rank(), self._lora_dtype(), tied=tied_parameters(hf_model))

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
        if self.lane and manifest.kind != "lora" and (manifest.tensors or not manifest.drops_adapter):
            raise UpdateRejected(
                f"a named adapter takes LoRA updates (and drop_adapter) only, and update {manifest.update_id} writes "
                "weights: push full weights through a connection without adapter="
            )
        if manifest.kind == "lora":
            self._adapter_manager()  # raises if LoRA is off
            self._peft_helper(manifest)  # rank / features against vLLM's LoRA config
            return
        if not manifest.tensors:
            return  # changes adapters only (drop_adapter)
        if not self._spec.params:
            raise UpdateRejected(
                f"full updates need the model's HF layout, which transformers cannot build for "
                f"{type(self.hf_config).__name__}; send LoRA updates or upgrade transformers"
            )
        experts = sorted(t.name for t in manifest.tensors if ".experts." in t.name)
        if experts and self._device.type == "cpu":
            raise UpdateRejected(
                f"full update {manifest.update_id} sends {len(experts)} MoE expert weights (e.g. {experts[0]!r}) "
                "to vLLM's CPU backend, whose in-place reload (vLLM 0.32) leaves routed experts unlike a fresh load: "
                "reloading the served experts unchanged changes its outputs. Refused before any byte moved; update "
                "the experts on a GPU engine, or leave them out of CPU updates (the other layers reload correctly)"
            )
        names = {self._spec.tied.get(t.name, t.name) for t in manifest.tensors}  # a tied alias is its tie
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
            raise cls(
                f"vLLM refuses this adapter: {exc} Restart the engine with a matching LoRA config or change the adapter"
            ) from None
        return helper

    # -- EngineTarget -----------------------------------------------------------------------
    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> Any:
        if manifest.kind == "lora":
            expected = len({parse_lora_name(name)[0] for name in tensors})
            return _PreparedLora(self._build_lora(manifest, tensors), expected)
        # The Receiver drops tied aliases (``untie``) before prepare; this is then a no-op,
        # and keeps a state_dict() with lm_head.weight working under a Receiver that does not.
        tensors = untie(manifest, tensors, self._spec)
        params = self._spec.params or {}
        # The staged (host) tensors go to the reload as they are; only a dtype the model does
        # not use is cast, where the tensor is. vLLM's loaders copy into its own storage.
        named = [
            (name, t if t.dtype == params[name].dtype else t.to(params[name].dtype)) for name, t in tensors.items()
        ]
        self.last_full = full_footprint(manifest, self._host, [*tensors.values(), *(t for _, t in named)])
        return _PreparedFull(named, {self._group_of(name) for name in tensors}, manifest.drops_adapter)

    def staging(self, manifest: UpdateManifest) -> Staging | None:
        return self._host.lend(manifest) if manifest.kind == "full" else None

    def unstage(self, manifest: UpdateManifest) -> None:
        self._host.done()

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
                lora_model_id=self._lora_id(manifest.update_id),
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

    def _lora_id(self, update_id: int) -> int:
        if self.lane:
            return lane_lora_id(self.lane, update_id)
        return VERSIONED_ID_BASE + update_id if self.keep_versions else ADAPTER_ID

    def commit(self, prepared: Any, update_id: int) -> Changes:
        if isinstance(prepared, _PreparedLora):
            previous, previous_id = self._served, self.lora_update_id
            self._install(prepared.lora)
            self._previous, self._previous_lora_update_id = previous, previous_id
            self.lora_update_id = update_id
            self._last_commit = ("lora", update_id)
            changes = Changes(placed_lora_modules(self._adapter_manager(), prepared.lora), prepared.expected)
        else:
            changes = self._commit_full(prepared, update_id)
        if changes.changed != changes.expected:
            log.warning(
                "colosync: update %d changed %d of the %d %s its manifest names",
                update_id,
                changes.changed,
                changes.expected,
                "LoRA modules" if isinstance(prepared, _PreparedLora) else "vLLM layers",
            )
        return changes

    def _commit_full(self, prepared: _PreparedFull, update_id: int) -> Changes:
        """Reload the weights (if any) and, for ``adapters="drop"``, stop serving the adapter."""
        dropping = prepared.drop_adapter and self._served is not None
        writes = bool(prepared.named)
        try:
            loaded = self._load_full(prepared.named, restore_adapter=not dropping) if writes else set()
        except BaseException:
            # vLLM's reload drops every registered LoRA first: if the served one is not back, say so
            if self._served is not None and self._served.id not in self._adapter_manager().list_adapters():
                self._served, self.lora_update_id = None, 0
            raise
        finally:
            if writes:  # the reload drops every registered adapter; superseded ones are not put back
                self._kept.clear()
        covered = loaded_layers(prepared.layers, loaded)
        changes = Changes(len(covered), len(prepared.layers))
        if changes.changed != changes.expected:
            log.warning(
                "colosync: full update %d did not load vLLM layers %s (vLLM reported %s)",
                update_id,
                sorted(prepared.layers - covered)[:8],
                sorted(loaded - prepared.layers)[:8],
            )
        # Adapters only: a revert serves the adapter again. Weights written: nothing to revert to.
        self._previous, self._last_commit = None, ("adapters" if not writes else "full", update_id)
        if not writes:
            self._previous, self._previous_lora_update_id = self._served, self.lora_update_id
        if dropping:
            manager = self._adapter_manager()
            served = self._served.id
            manager.remove_adapter(served)
            self._served, self.lora_update_id = None, 0
            changes = Changes(changes.changed + (served not in manager.list_adapters()), changes.expected + 1)
        return changes

    def served_adapter(self) -> int:
        return self.lora_update_id

    def revert(self, update_id: int) -> bool:
        """Serve again the LoRA served before update ``update_id`` (or none) when that update changed
        adapters only (a LoRA, or a drop); False for one that wrote the weights."""
        if self._last_commit not in (("lora", update_id), ("adapters", update_id)):
            return False
        manager = self._adapter_manager()
        previous = self._previous
        self._last_commit, self._previous = None, None
        if self._served is not None:
            manager.remove_adapter(self._served.id)
        self._served = None
        # keeping versions, the previous one is still installed: serving it again is the whole revert
        installed = previous is not None and self._kept.pop(self._previous_lora_update_id, None) is previous
        if previous is not None and not installed:
            try:
                self._add_and_pin(manager, previous)  # already packed and folded: adding again folds nothing
            except Exception:
                log.exception("colosync: could not reinstate the LoRA of update %d", self._previous_lora_update_id)
                manager.remove_adapter(previous.id)
                self.lora_update_id = 0
                return False
        self._served = previous
        self.lora_update_id = self._previous_lora_update_id
        log.info("colosync: reverted LoRA update %d; serving the LoRA of update %d", update_id, self.lora_update_id)
        return True

    def _install(self, lora: Any) -> None:
        """Swap ``lora`` in under ADAPTER_ID (or, keeping versions, add it beside the served one); on
        failure put the previous version back."""
        manager = self._adapter_manager()
        previous = self._served
        if self.keep_versions:
            try:
                self._add_and_pin(manager, lora)
            except BaseException:
                manager.remove_adapter(lora.id)
                raise
            if previous is not None:
                self._kept[self.lora_update_id] = previous  # requests started on it finish on it
            self._served = lora
            return
        manager.remove_adapter(ADAPTER_ID)
        try:
            self._add_and_pin(manager, lora)
        except BaseException:
            manager.remove_adapter(ADAPTER_ID)
            if previous is not None:
                self._add_and_pin(manager, previous)  # already folded: adding again is a no-op fold
            raise
        self._served = lora

    def retire(self, update_id: int) -> bool:
        """Remove the superseded LoRA version of ``update_id`` (no request runs on it any more); False if
        it is not a superseded version this worker keeps."""
        lora = self._kept.pop(update_id, None)
        if lora is None:
            return False
        if self._previous is lora:  # a revert can no longer bring it back
            self._previous, self._last_commit = None, None
        self._adapter_manager().remove_adapter(lora.id)
        return True

    def kept_versions(self) -> list[int]:
        """The superseded LoRA versions still installed (``keep_versions``), by update id."""
        return sorted(self._kept)

    @staticmethod
    def _add_and_pin(manager: Any, lora: Any) -> None:
        manager.add_adapter(lora)  # packs q/k/v, gate/up and folds scaling once
        manager.pin_adapter(lora.id)  # activate into a slot; never evicted by the LRU

    def _load_full(self, named: list[tuple[str, torch.Tensor]], restore_adapter: bool = True) -> set[str]:
        """Reload ``named`` in place; returns the vLLM layers ``load_weights`` loaded.

        ``restore_adapter``: put the served adapter back (the reload drops every registered LoRA)."""
        runner = self.worker.model_runner
        model: Any = self._model()  # vLLM's model class: load_weights is its own method, wrapped below
        loaded: set[str] = set()
        load_weights = model.load_weights

        def counted(weights: Any) -> Any:
            result = load_weights(weights)
            loaded.update(result or ())
            return result

        # vLLM's in-place reload drives model.load_weights (stacking, TP sharding) and then
        # re-runs per-layer post-processing (the CPU backend prepacks linear weights); it
        # also drops every registered LoRA, so the served adapter is put back afterwards. It
        # does not pass on what load_weights loaded, so the call is observed on its way.
        model.load_weights = counted
        try:
            runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        finally:
            del model.load_weights
            named.clear()
        if self._host.disown_if_aliased([*model.parameters(), *model.buffers()]):
            log.info("colosync: vLLM kept staged tensors as weights; the next full update stages afresh")
        return_cached(self._device)  # what the reload materialized per layer goes back to the driver
        layers = {name.replace(".base_layer.", ".").rpartition(".")[0] for name in loaded}
        self._refresh_tied(model, layers)
        if self._served is not None and restore_adapter:
            self._add_and_pin(self._adapter_manager(), self._served)
        for sibling in self.siblings:  # the named adapters run on the new weights, every version they hold
            sibling.reinstall()
        return layers

    def reinstall(self) -> None:
        """Add back every version this target holds (served and kept): vLLM's reload dropped them all."""
        manager = self._adapter_manager()
        for lora in [self._served, *self._kept.values()]:
            if lora is not None and lora.id not in manager.list_adapters():
                self._add_and_pin(manager, lora)  # already packed and folded: adding again folds nothing

    def _refresh_tied(self, model: torch.nn.Module, reloaded: set[str]) -> None:
        """Re-tie each tied layer (``lm_head``) to its tie and re-run its weight processing.

        The reload processes only layers it loaded into; a tied ``lm_head`` loads nothing,
        so its CPU GEMM stays prepacked from the old embedding (vLLM 0.32 keeps the tie
        itself; a reload that re-materializes the embedding would also leave the head on
        the old parameter). ``reloaded``: the layers the reload loaded.
        """
        for alias, canonical in self._spec.tied.items():
            try:
                layer = _unwrap(model.get_submodule(alias.rpartition(".")[0]))
                tie = _unwrap(model.get_submodule(canonical.rpartition(".")[0]))
            except AttributeError:  # not on this rank (pipeline parallel) or laid out otherwise
                continue
            leaf, tie_leaf = alias.rpartition(".")[2], canonical.rpartition(".")[2]
            weight, tie_weight = getattr(layer, leaf, None), getattr(tie, tie_leaf, None)
            if not isinstance(tie_weight, torch.nn.Parameter) or weight is None:
                continue
            retie = weight is not tie_weight
            if retie:
                log.info("colosync: the reload untied %s from %s; tying it again", alias, canonical)
                setattr(layer, leaf, tie_weight)
            elif canonical.rpartition(".")[0] not in reloaded:
                continue  # the tie did not change: the head's packed GEMM is still right
            method = getattr(layer, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(layer)  # the CPU backend re-packs its GEMM here

    def discard(self, prepared: Any) -> None:
        if isinstance(prepared, _PreparedFull):
            prepared.named.clear()
        elif isinstance(prepared, _PreparedLora):
            prepared.lora = None


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The layer under vLLM's LoRA wrapper (``base_layer``), or the layer itself."""
    return getattr(module, "base_layer", module)


class WorkerDoor:
    """What each worker runs: its Receiver behind a ``Door`` (bytes in, a reply out, never a raise).

    Ownership and verification are the driver's (the link's ``EngineTransaction``); a worker
    only lands and applies what every worker is sent.
    """

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self._door = Door(status=receiver.status)
        self._layouts = Layouts()  # each Begin arrives as bytes: its Layout becomes the known object again
        self.lock = threading.Lock()  # messages, and the worker's other calls on the same target, one at a time

    def serve(self, data: bytes) -> bytes:
        with self.lock:
            return self._door.serve(data, self._handle)

    def _handle(self, request: TransactionRequest) -> Ack:
        if isinstance(request, Begin):
            request = Begin(self._layouts.intern(request.manifest)[0])
        return self.receiver.handle(request)


class _WorkerState:
    """The default adapter's target (full weights too) and each named adapter's, by name ("": the default)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.target = VllmTarget(worker)
        self.receiver = Receiver(self.target, device=_receiver_device(worker), policy=ReceiverPolicy())
        self.door = WorkerDoor(self.receiver)
        self.lanes: dict[str, tuple[VllmTarget, WorkerDoor]] = {"": (self.target, self.door)}

    def open_lane(self, name: str) -> int:
        """Named adapter ``name``'s lane number, opened now if new (numbers are never reused: ids stay unique)."""
        known = self.lanes.get(name)
        if known is not None:
            return known[0].lane
        target = VllmTarget(self.worker, lane=len(self.lanes), base=self.target)
        self.lanes[name] = (target, WorkerDoor(Receiver(target, device=target._device, policy=ReceiverPolicy())))
        self.target.siblings.append(target)
        return target.lane

    def lane(self, name: str) -> tuple[VllmTarget, WorkerDoor]:
        found = self.lanes.get(name)
        if found is None:
            raise ConfigError(f"this worker has no adapter {name!r}: the link opens it (colosync_lane) first")
        return found


CPU_MIN_HEAD_SIZE = 32
"""vLLM 0.32's CPU attention has no kernel for smaller heads: generation kills the engine."""


def _check_cpu_head_size(model_config: Any, device: torch.device) -> None:
    """Refuse, at start, a model vLLM's CPU backend would load and then crash on at the first generate."""
    if device.type != "cpu":
        return
    head = model_config.get_head_size() if hasattr(model_config, "get_head_size") else None
    if head is not None and head < CPU_MIN_HEAD_SIZE:
        raise ConfigError(
            f"this model's attention head size is {head}, and vLLM's CPU backend needs at least "
            f"{CPU_MIN_HEAD_SIZE} (its attention kernels crash the engine at the first generate); use a model "
            f"with hidden_size / num_attention_heads >= {CPU_MIN_HEAD_SIZE}, e.g. "
            "make_tiny_llama(path, hidden_size=128, intermediate_size=256)"
        )


def _receiver_device(worker: Any) -> torch.device:
    device = getattr(worker, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


class ColosyncWorkerExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls``; reached by ``collective_rpc``.

    vLLM copies every callable of this class onto the worker class and refuses names the
    worker already has, so everything here is prefixed ``colosync_``.
    """

    def colosync_handle(self, data: bytes, adapter: str = "") -> bytes:
        """Decode one control message, apply it to the Receiver of ``adapter`` ("": the default), encode the reply."""
        try:
            door = self.colosync_state().lane(adapter)[1]
        except Exception as exc:
            log.exception("colosync: cannot set up the receiver in this worker")
            return Door().encode(Failed.from_exception(exc))
        return door.serve(data)

    def colosync_lane(self, adapter: str) -> int:
        """Named adapter ``adapter``'s lane number (its own Receiver and versions), opened now if new."""
        state = self.colosync_state()
        with state.door.lock:
            return state.open_lane(adapter)

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
            serving=state.receiver.status().serving,
            last_full=target.last_full,
            max_loras=int(target.lora_config.max_loras) if target.lora_config else 0,
            keep_versions=target.keep_versions,
        )
        return msgspec.msgpack.encode(info)

    def colosync_keep_versions(self, keep: bool) -> bytes:
        """Install each LoRA version under an id of its own and keep superseded ones until retired
        (``commit_mode="inflight"``); answers ``colosync_info``. Refused while an update is in flight."""
        state = self.colosync_state()
        with state.door.lock:
            if state.receiver.status().in_flight_update_id is not None:
                raise ConfigError("an update is in flight: choose the commit mode before the first push")
            state.target.keep_versions = keep
        return self.colosync_info()

    def colosync_retire(self, update_id: int, adapter: str = "") -> bool:
        """Remove the superseded LoRA version of ``update_id`` of ``adapter``: no request runs on it any more."""
        target, door = self.colosync_state().lane(adapter)
        with door.lock:
            return target.retire(update_id)

    def colosync_kept_versions(self, adapter: str = "") -> list[int]:
        target, door = self.colosync_state().lane(adapter)
        with door.lock:
            return target.kept_versions()

    def colosync_state(self) -> _WorkerState:
        state = self.__dict__.get("_colosync_state")
        if state is None:
            state = self.__dict__["_colosync_state"] = _WorkerState(self)
        return state


__all__ = [
    "ADAPTER_ID",
    "ADAPTER_NAME",
    "ColosyncWorkerExtension",
    "IN_MEMORY_PATH",
    "LANE_ID_BASE",
    "VERSIONED_ID_BASE",
    "VllmTarget",
    "WORKER_EXTENSION",
    "WorkerDoor",
    "WorkerInfo",
    "loaded_layers",
    "lane_lora_id",
    "lane_update_id",
    "placed_lora_modules",
    "versioned_update_id",
]
