"""The reference engine: transformers + PEFT in its own process.

It is colosync's embedded default and the ground truth for parity tests: a real model
serving greedy generations and per-token logprobs, updated only through the Receiver's
transaction. LoRA versions are PEFT adapters named after their update id; ``prepare`` loads
the new adapter beside the served one, ``commit`` switches to it and deletes the old one,
and generation always activates the committed adapter explicitly, so a prepared but
uncommitted update can never leak into a result. A full update writes the base weights and,
unless its manifest says ``adapters="keep"``, stops serving the adapter (generation then runs
with adapters disabled); an update that changed adapters only can be reverted.

Public API::

    engine = EngineProcess(EngineConfig(engine="hf", model_dir=path))   # spawns the process
    sender = Sender(engine.link, transport="shm")
    sender.push_peft(peft_model)
    gen = engine.call(Generate(prompts=[[1, 2, 3]], max_new_tokens=8))  # -> Generation
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import torch

from colosync.engines.config import EngineConfig, Generate, Generation, Score, Scores
from colosync.engines.host import HostedTarget
from colosync.errors import AdapterSlotsError, ConfigError, ManifestError, UnknownTensorError
from colosync.sync.staging import FullFootprint, HostStaging, full_footprint, return_cached
from colosync.sync.target import (
    Changes,
    ModelSpec,
    ParamSpec,
    ReceiverPolicy,
    Staging,
    parse_lora_name,
    tied_parameters,
)
from colosync.sync.transaction import EngineTransaction
from colosync.wire.manifest import LoraSpec, UpdateManifest

log = logging.getLogger(__name__)


class _PreparedLora(msgspec.Struct):
    adapter: str  # the PEFT adapter loaded for it; "" for a drop (a named adapter then serves none)
    changes: Changes
    lane: str = ""


@dataclass
class _Lane:
    """One adapter the engine serves: "" (the default, beside full updates) or a named one."""

    served: str | None = None  # the PEFT adapter it serves (None: none)
    # (the last commit, the adapter served before it) while a revert can undo that commit (it
    # changed adapters only); the adapter stays loaded until the next commit.
    undo: tuple[int, str | None] | None = None
    preparing: int = 0  # adapters loaded for updates not yet committed or discarded
    receiver: Any = None  # its Receiver, for the version a generation reports (None: the engine's own)


class _PreparedFull(msgspec.Struct):
    params: list[Any]
    values: list[Any]
    drop_adapter: bool  # adapters="drop": stop serving the LoRA adapter at commit


class HFEngine(HostedTarget):
    requests: ClassVar[tuple[type, ...]] = (Generate, Score)
    replies: ClassVar[tuple[type, ...]] = (Generation, Scores)

    def __init__(self, model: torch.nn.Module, max_lora_rank: int = 64, max_loras: int = 1) -> None:
        if max_loras < 1:
            raise ConfigError(f"max_loras must be at least 1, got {max_loras}")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self._base = dict(model.named_parameters())  # HF names; survive PEFT's wrapping
        self._peft: Any = None
        self._lanes: dict[str, _Lane] = {"": _Lane()}  # "" is this target's own; named ones through ``lane``
        self._spec = self._build_spec()
        # Full updates land in host memory and are copied into the weights at commit: the
        # device never holds a second copy of the model (kept between updates on a GPU).
        self._host = HostStaging(keep=self.device.type == "cuda")
        self.last_full: FullFootprint | None = None  # where the last full update's bytes sat at prepare

    @classmethod
    def from_config(cls, config: EngineConfig) -> HFEngine:
        from colosync.decoding import load_model

        if importlib.util.find_spec("peft") is not None:
            import peft  # noqa: F401  # at start-up, not in the first LoRA push (~0.5 s on two cores)

        return cls(load_model(config.model_dir, config.device), config.max_lora_rank, config.max_loras)

    # -- EngineTarget -----------------------------------------------------------------------
    def _build_spec(self) -> ModelSpec:
        params = {n: ParamSpec(tuple(p.shape), p.dtype) for n, p in self._base.items()}
        linears = {
            name: (m.in_features, m.out_features)
            for name, m in self.model.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        return ModelSpec(
            params, linears, self.max_lora_rank, next(self.model.parameters()).dtype, tied=tied_parameters(self.model)
        )

    def model_spec(self) -> ModelSpec:
        return self._spec

    def stage_full_updates_in(self, pool: Any) -> None:
        """Stage full updates in ``pool`` when it is the shared arena of a colocated job (one
        lease per update) instead of a pinned area of the engine's own; a private pool (no
        arena) changes nothing."""
        self._host.use_pool(pool if getattr(pool, "arena", None) is not None else None)

    def staging(self, manifest: UpdateManifest) -> Staging | None:
        return self._host.lend(manifest) if manifest.kind == "full" else None

    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> Any:
        if manifest.kind == "full":
            # Nothing moves to the device before commit: the staged tensors are the values
            # (a dtype the model does not use is cast where the tensor is, in host memory).
            params = [self._base[name] for name in tensors]
            values = [t if t.dtype == p.dtype else t.to(p.dtype) for p, t in zip(params, tensors.values(), strict=True)]
            self.last_full = full_footprint(manifest, self._host, [*tensors.values(), *values])
            return _PreparedFull(params, values, manifest.drops_adapter)
        return self._prepare_lora("", manifest, tensors)

    def commit(self, prepared: Any, update_id: int) -> Changes:
        if isinstance(prepared, _PreparedLora):
            return self._commit_lora(prepared, update_id)
        lane = self._lanes[""]
        self._retire_kept(lane)
        before = lane.served
        lane.undo = (update_id, before)
        changes = Changes(len(prepared.values), len(prepared.params))
        if prepared.params:  # (an empty update changes no weight; _foreach_copy_ refuses empty lists)
            lane.undo = None  # the old weights are gone: a revert cannot bring them back
            try:
                with torch.no_grad():  # host -> device straight into the served weights, no device copy
                    torch._foreach_copy_(prepared.params, prepared.values, non_blocking=True)
                return_cached(self.device)  # waits for the copies: the area may be reused after this
            finally:
                prepared.values.clear()
        if prepared.drop_adapter and before is not None:
            lane.served = None  # generation now runs with adapters disabled (_serving)
            if lane.undo is None:
                self._retire(before)
            changes = Changes(changes.changed + 1, changes.expected + 1)
        return changes

    def revert(self, update_id: int) -> bool:
        return self._revert("", update_id)

    def served_adapter(self) -> int:
        return _update_of(self._lanes[""].served)

    def discard(self, prepared: Any) -> None:
        if isinstance(prepared, _PreparedLora) and prepared.adapter:
            self._lanes[prepared.lane].preparing -= 1
            self._drop_adapter(prepared.adapter)
        elif isinstance(prepared, _PreparedFull):
            prepared.values.clear()

    def unstage(self, manifest: UpdateManifest) -> None:
        self._host.done()

    # -- named adapters: each a lane of its own -------------------------------------------------
    def lane(self, name: str) -> HostedTarget:
        """The target of named adapter ``name`` (LoRA only): its own versions, verification and rollback."""
        if not name or "__" in name or not name.replace("-", "_").isidentifier():
            raise ConfigError(f"adapter name {name!r}: use letters, digits, '-' or '_' (not '__')")
        if name not in self._lanes:
            self._lanes[name] = _Lane()
        return _LaneTarget(self, name)

    def _prepare_lora(self, lane: str, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> _PreparedLora:
        if manifest.lora is None:  # UpdateManifest guarantees it; keeps the type checker honest
            raise UnknownTensorError(f"update {manifest.update_id} is a LoRA update without a LoraSpec")
        self._check_slot(lane)
        adapter, placed = self._load_adapter(_adapter_name(lane, manifest.update_id), manifest.lora, tensors)
        self._lanes[lane].preparing += 1
        expected = len({parse_lora_name(name)[0] for name in tensors})
        return _PreparedLora(adapter, Changes(placed, expected), lane)

    def _check_slot(self, lane: str) -> None:
        """Refuse a new adapter when every slot is held by another lane (one that serves or prepares one)."""
        mine = self._lanes[lane]
        if mine.served is not None or mine.preparing:
            return
        held = {
            name or "(default)": _update_of(ln.served) for name, ln in self._lanes.items() if ln.served or ln.preparing
        }
        if len(held) >= self.max_loras:
            taken = ", ".join(f"{name} (update {uid})" for name, uid in held.items())
            raise AdapterSlotsError(
                f"adapter {lane or '(default)'!r} needs a slot, and all {self.max_loras} are held: {taken}; drop one "
                "(Sender.drop_adapter() through its connection) or start the engine with a larger max_loras"
            )

    def _commit_lora(self, prepared: _PreparedLora, update_id: int) -> Changes:
        lane = self._lanes[prepared.lane]
        self._retire_kept(lane)
        lane.undo = (update_id, lane.served)
        lane.served = prepared.adapter or None  # the switch ("": a drop, the adapter no longer served)
        lane.preparing -= bool(prepared.adapter)
        return prepared.changes

    def _retire_kept(self, lane: _Lane) -> None:
        kept = lane.undo[1] if lane.undo else None
        if kept is not None and kept != lane.served:
            self._retire(kept)  # only the adapter served right before this commit is kept

    def _revert(self, name: str, update_id: int) -> bool:
        """A commit that changed adapters only is undone by serving the adapter served before it
        again; one that wrote the base weights cannot be."""
        lane = self._lanes[name]
        if lane.undo is None or lane.undo[0] != update_id:
            return False
        failed, lane.served = lane.served, lane.undo[1]
        lane.undo = None  # reverted once; nothing further to undo
        if failed is not None and failed != lane.served:
            self._retire(failed)
        return True

    def _retire(self, adapter: str | None) -> None:
        if adapter is None:
            return
        try:
            self._drop_adapter(adapter)
        except Exception:  # the switch is done; a leftover adapter only costs memory
            log.exception("hf engine: could not delete adapter %s", adapter)

    # -- LoRA adapters ----------------------------------------------------------------------
    def _load_adapter(self, adapter: str, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
        """Load ``tensors`` as PEFT adapter ``adapter``; returns it and how many modules PEFT filled."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,  # type: ignore[arg-type]  # PEFT annotates int; a float alpha works (scale alpha/r)
            target_modules=list(spec.target_modules),
            use_rslora=spec.use_rslora,
            lora_dropout=0.0,
        )
        if self._peft is None:
            self._peft = get_peft_model(self.model, config, adapter_name=adapter)
        else:
            self._peft.add_adapter(adapter, config)
        state = {}
        for name, t in tensors.items():
            module, part = parse_lora_name(name)
            state[f"base_model.model.{module}.lora_{part}.weight"] = t
        try:
            # torch's (missing_keys, unexpected_keys); PEFT annotates the return as the `namedtuple` factory
            result: Any = set_peft_model_state_dict(self._peft, state, adapter_name=adapter)
        except BaseException:
            self._drop_adapter(adapter)
            raise
        unexpected = [k for k in result.unexpected_keys if "lora_" in k]
        if unexpected:
            self._drop_adapter(adapter)
            raise UnknownTensorError(
                f"PEFT could not place {unexpected[:5]} in the engine's model; check target_modules"
            )
        wrapped = {name for name, m in self._peft.named_modules() if adapter in getattr(m, "lora_A", {})}
        unfilled = {k.split(".lora_")[0] for k in result.missing_keys if f".{adapter}." in k}  # same naming
        return adapter, len(wrapped - unfilled)

    def _drop_adapter(self, adapter: str) -> None:
        if self._peft is None or adapter not in self._peft.peft_config:
            return
        if len(self._peft.peft_config) == 1:  # PEFT cannot delete its last adapter: unwrap
            self.model = self._peft.unload()
            self._peft = None
            return
        with warnings.catch_warnings():
            # PEFT warns when the adapter it last activated goes; _serving activates the right one per request
            warnings.simplefilter("ignore", UserWarning)
            self._peft.delete_adapter(adapter)

    def _serving(self, lane: _Lane) -> Any:
        """Activate exactly ``lane``'s committed adapter (or none) for the next forward pass."""
        if self._peft is None:
            return contextlib.nullcontext()
        if lane.served is None:
            return self._peft.disable_adapter()
        self._peft.set_adapter(lane.served)
        return contextlib.nullcontext()

    # -- requests ---------------------------------------------------------------------------
    def handle(self, request: Generate | Score) -> Generation | Scores:
        from colosync.decoding import generate, score

        lane = self._lanes.get(request.adapter)
        if lane is None:
            raise ManifestError(f"this engine serves no adapter {request.adapter!r}; it has {sorted(self._lanes)}")
        version = lane.receiver.committed_update_id if lane.receiver is not None else self.committed_update_id
        with self._serving(lane):
            if isinstance(request, Generate):
                tokens, logprobs = generate(
                    self.model, request.prompts, request.max_new_tokens, request.temperature, request.seed
                )
                return Generation(version, tokens, logprobs)
            return Scores(version, score(self.model, request.prompts, request.completions))


def _adapter_name(lane: str, update_id: int) -> str:
    """The PEFT adapter of ``lane``'s update ``update_id`` (PEFT names may not contain '.')."""
    return f"{lane}__u{update_id}" if lane else f"u{update_id}"


def _update_of(adapter: str | None) -> int:
    return int(adapter.rsplit("u", 1)[1]) if adapter else 0


class _LaneTarget(HostedTarget):
    """A named adapter of an ``HFEngine``: LoRA updates only, on the engine's base weights."""

    requests: ClassVar[tuple[type, ...]] = (Score,)  # so ``transaction`` scores probes through ``handle``

    def __init__(self, engine: HFEngine, name: str) -> None:
        self.engine, self.name, self.device = engine, name, engine.device

    def transaction(self, policy: ReceiverPolicy | None) -> EngineTransaction:
        transaction = super().transaction(policy)
        self.engine._lanes[self.name].receiver = self.receiver
        return transaction

    def model_spec(self) -> ModelSpec:
        return self.engine.model_spec()

    def check(self, manifest: UpdateManifest) -> None:
        if manifest.kind != "lora" and (manifest.tensors or not manifest.drops_adapter):
            raise ManifestError(
                f"adapter {self.name!r} takes LoRA updates only; push full weights through a connection "
                "without adapter="
            )

    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> Any:
        if manifest.kind == "full":  # an empty one that drops the adapter (``check``): serve none, free the slot
            return _PreparedLora("", Changes(1, 1), self.name)
        return self.engine._prepare_lora(self.name, manifest, tensors)

    def commit(self, prepared: Any, update_id: int) -> Changes:
        return self.engine._commit_lora(prepared, update_id)

    def revert(self, update_id: int) -> bool:
        return self.engine._revert(self.name, update_id)

    def served_adapter(self) -> int:
        return _update_of(self.engine._lanes[self.name].served)

    def discard(self, prepared: Any) -> None:
        self.engine.discard(prepared)

    def handle(self, request: Any) -> msgspec.Struct:
        return self.engine.handle(msgspec.structs.replace(request, adapter=self.name))
