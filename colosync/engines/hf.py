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
from typing import Any, ClassVar

import msgspec
import torch

from colosync.engines.config import EngineConfig, Generate, Generation, Score, Scores
from colosync.engines.host import HostedTarget
from colosync.errors import UnknownTensorError
from colosync.sync.staging import FullFootprint, HostStaging, full_footprint, return_cached
from colosync.sync.target import (
    Changes,
    ModelSpec,
    ParamSpec,
    Staging,
    parse_lora_name,
    tied_parameters,
)
from colosync.wire.manifest import LoraSpec, UpdateManifest

log = logging.getLogger(__name__)


class _PreparedLora(msgspec.Struct):
    adapter: str
    changes: Changes


class _PreparedFull(msgspec.Struct):
    params: list[Any]
    values: list[Any]
    drop_adapter: bool  # adapters="drop": stop serving the LoRA adapter at commit


class HFEngine(HostedTarget):
    requests: ClassVar[tuple[type, ...]] = (Generate, Score)
    replies: ClassVar[tuple[type, ...]] = (Generation, Scores)

    def __init__(self, model: torch.nn.Module, max_lora_rank: int = 64) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_lora_rank = max_lora_rank
        self._base = dict(model.named_parameters())  # HF names; survive PEFT's wrapping
        self._peft: Any = None
        self._served_adapter: str | None = None
        # (the last commit, the adapter served before it) while a revert can undo that commit (it
        # changed adapters only); the adapter stays loaded until the next commit.
        self._undo: tuple[int, str | None] | None = None
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

        return cls(load_model(config.model_dir, config.device), config.max_lora_rank)

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
        if manifest.lora is None:  # UpdateManifest guarantees it; keeps the type checker honest
            raise UnknownTensorError(f"update {manifest.update_id} is a LoRA update without a LoraSpec")
        adapter, placed = self._load_adapter(f"u{manifest.update_id}", manifest.lora, tensors)
        expected = len({parse_lora_name(name)[0] for name in tensors})
        return _PreparedLora(adapter, Changes(placed, expected))

    def commit(self, prepared: Any, update_id: int) -> Changes:
        kept = self._undo[1] if self._undo else None
        if kept is not None and kept != self._served_adapter:
            self._retire(kept)  # only the adapter served right before this commit is kept
        before = self._served_adapter
        self._undo = (update_id, before)
        if isinstance(prepared, _PreparedLora):
            self._served_adapter = prepared.adapter  # the switch
            return prepared.changes
        changes = Changes(len(prepared.values), len(prepared.params))
        if prepared.params:  # (an empty update changes no weight; _foreach_copy_ refuses empty lists)
            self._undo = None  # the old weights are gone: a revert cannot bring them back
            try:
                with torch.no_grad():  # host -> device straight into the served weights, no device copy
                    torch._foreach_copy_(prepared.params, prepared.values, non_blocking=True)
                return_cached(self.device)  # waits for the copies: the area may be reused after this
            finally:
                prepared.values.clear()
        if prepared.drop_adapter and before is not None:
            self._served_adapter = None  # generation now runs with adapters disabled (_serving)
            if self._undo is None:
                self._retire(before)
            changes = Changes(changes.changed + 1, changes.expected + 1)
        return changes

    def revert(self, update_id: int) -> bool:
        """A commit that changed adapters only is undone by serving the adapter served before it
        again; one that wrote the base weights cannot be."""
        if self._undo is None or self._undo[0] != update_id:
            return False
        failed, self._served_adapter = self._served_adapter, self._undo[1]
        self._undo = None  # reverted once; nothing further to undo
        if failed is not None and failed != self._served_adapter:
            self._retire(failed)
        return True

    def served_adapter(self) -> int:
        return int(self._served_adapter[1:]) if self._served_adapter else 0

    def discard(self, prepared: Any) -> None:
        if isinstance(prepared, _PreparedLora):
            self._drop_adapter(prepared.adapter)
        elif isinstance(prepared, _PreparedFull):
            prepared.values.clear()

    def unstage(self, manifest: UpdateManifest) -> None:
        self._host.done()

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

    def _serving(self) -> Any:
        """Activate exactly the committed adapter (or none) for the next forward pass."""
        if self._peft is None:
            return contextlib.nullcontext()
        if self._served_adapter is None:
            return self._peft.disable_adapter()
        self._peft.set_adapter(self._served_adapter)
        return contextlib.nullcontext()

    # -- requests ---------------------------------------------------------------------------
    def handle(self, request: Generate | Score) -> Generation | Scores:
        from colosync.decoding import generate, score

        with self._serving():
            if isinstance(request, Generate):
                tokens, logprobs = generate(
                    self.model, request.prompts, request.max_new_tokens, request.temperature, request.seed
                )
                return Generation(self.committed_update_id, tokens, logprobs)
            return Scores(self.committed_update_id, score(self.model, request.prompts, request.completions))
