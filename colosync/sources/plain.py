"""Plain PyTorch trainers as a source: one process, or DDP, where every rank holds whole tensors.

Why it looks like this:

* **The engine's names, derived once.** A trainer's parameter names carry its wrappers: DDP's
  ``module.``, ``torch.compile``'s ``_orig_mod.``, activation checkpointing's
  ``_checkpoint_wrapped_module.``, FSDP1's ``_fsdp_wrapped_module.``, PEFT's
  ``base_model.model.`` and ``base_layer.``. ``select`` strips them the same way for every
  source (``FsdpSource`` uses it too): full weights get the HF names the engine's model has,
  LoRA weights the names PEFT saves (``get_peft_model_state_dict``: ``lora_A.weight``, no adapter
  name), which is what the engines' LoRA loaders read.
* **Nothing is copied to send.** Tensors go to the Sender as they are (a cast only when a
  ``dtype`` is asked for), so the sender's memory above the model is the Sender's own buckets.
* **Same contract as the collective sources.** Under DDP every rank calls ``push``; the ranks
  an ``EngineMap`` names send, and every rank learns the outcome, so a refused update raises
  everywhere. In one process it is ``Sender.push_peft`` / ``Sender.push`` behind the
  ``Source`` interface.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from colosync.errors import ConfigError, ConversionError
from colosync.sources.base import Agreement, EngineMap, Spec, global_rank

if TYPE_CHECKING:
    from colosync.sync.sender import Sender, SyncReport
    from colosync.wire.manifest import AdapterPolicy, LoraSpec
    from colosync.wire.protocol import Probe

log = logging.getLogger(__name__)

Kind = Literal["lora", "full"]
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
PEFT_PREFIX = ("base_model", "model")
LORA_HALVES = frozenset({"lora_A", "lora_B"})
UNSUPPORTED_ADAPTER_PARTS = {
    "lora_embedding_A": "LoRA on embeddings",
    "lora_embedding_B": "LoRA on embeddings",
    "lora_magnitude_vector": "DoRA",
    "modules_to_save": "modules_to_save",
}


@dataclass(frozen=True)
class Entry:
    """One parameter of the update: the engine's name for it and the trainer's."""

    name: str  # what the engine sees
    param_name: str  # the model's own name (named_parameters of the model given to the source)
    param: torch.Tensor


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP and ``torch.compile`` wrappers at the root (their parameters keep no prefix)."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
            continue
        return model


def peft_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The PEFT model (it has ``peft_config``) at the root of ``model``'s wrappers, if any."""
    root = unwrap(model)
    return root if hasattr(root, "peft_config") and hasattr(root, "base_model") else None


def lora_spec_of(model: torch.nn.Module, adapter: str) -> LoraSpec:
    """The ``LoraSpec`` of ``model``'s PEFT adapter ``adapter``, refusing what the engines cannot build."""
    from colosync.sync.sender import peft_lora_spec

    root = peft_root(model)
    if root is None:
        raise ConversionError(
            "kind='lora' needs a PEFT model (peft.get_peft_model) under the trainer's wrappers; this model has "
            "no peft_config: pass kind='full' to send its weights"
        )
    configs: Any = root.peft_config
    if adapter not in configs:
        raise ConversionError(f"the PEFT model has no adapter {adapter!r} (it has {sorted(configs)}); pass adapter=")
    cfg = configs[adapter]
    if type(cfg).__name__ != "LoraConfig":
        raise ConversionError(f"adapter {adapter!r} is a {type(cfg).__name__}; only LoRA adapters can be sent")
    if getattr(cfg, "use_dora", False):
        raise ConversionError(f"adapter {adapter!r} uses DoRA, which the engines do not load; train without use_dora")
    if getattr(cfg, "bias", "none") != "none":
        raise ConversionError(f"adapter {adapter!r} trains biases (bias={cfg.bias!r}); only bias='none' is supported")
    return peft_lora_spec(root, adapter)


def engine_name(name: str, kind: Kind, peft: bool, adapter: str) -> str | None:
    """The engine's name for parameter ``name`` in a ``kind`` update, or ``None`` if it is not part of it.

    Raises ``ConversionError`` for adapter parts the engines cannot load (embedding LoRA, DoRA,
    modules_to_save), so nothing is silently left out.
    """
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    for i, part in enumerate(parts):
        what = UNSUPPORTED_ADAPTER_PARTS.get(part)
        if what is not None and (i + 1 < len(parts) and parts[i + 1] == adapter or part == "modules_to_save"):
            raise ConversionError(f"parameter {name!r} belongs to {what}, which the engines cannot load; remove it")
    halves = [i for i, part in enumerate(parts) if part in LORA_HALVES]
    if halves:  # a LoRA half: "<module>.lora_A.<adapter>.weight"
        i = halves[-1]
        if kind == "full" or i + 1 >= len(parts) or parts[i + 1] != adapter:
            return None  # another adapter's, or a full update (base weights only)
        return ".".join(parts[: i + 1] + parts[i + 2 :])
    if kind == "lora":
        return None
    if peft and tuple(parts[:2]) == PEFT_PREFIX:
        parts = parts[2:]
    return ".".join(p for p in parts if p != "base_layer")


def select(model: torch.nn.Module, kind: Kind, adapter: str = "default") -> list[Entry]:
    """The parameters of a ``kind`` update of ``model``, under the engine's names, in ``named_parameters`` order."""
    if kind not in ("lora", "full"):
        raise ConfigError(f"kind must be 'lora' or 'full', got {kind!r}")
    root = unwrap(model)
    peft = peft_root(model) is not None
    if kind == "lora":
        lora_spec_of(model, adapter)  # refuses a model without a (loadable) adapter
    entries: list[Entry] = []
    seen: dict[str, str] = {}
    for pname, param in root.named_parameters():
        name = engine_name(pname, kind, peft, adapter)
        if name is None:
            continue
        if name in seen:
            raise ConversionError(f"parameters {seen[name]!r} and {pname!r} both map to {name!r}; rename one")
        seen[name] = pname
        entries.append(Entry(name, pname, param))
    if not entries:
        raise ConversionError(
            f"the model has no parameters for a {kind} update"
            + (f" of adapter {adapter!r}" if kind == "lora" else "")
            + "; check kind= and adapter="
        )
    return entries


class PlainSource:
    """Stream a single-process or DDP model's weights, or its PEFT LoRA, to the engine(s).

    >>> source = PlainSource(peft_model, kind="lora")          # or kind="full"
    >>> sender = Sender(link) if source.is_sender else None    # rank 0 by default
    >>> source.push(sender)                                    # on every rank
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kind: Kind = "lora",
        *,
        adapter: str = "default",
        engines: EngineMap | None = None,
        dtype: torch.dtype | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model, self.kind, self.adapter, self.dtype = model, kind, adapter, dtype
        self.engines = engines if engines is not None else EngineMap()
        self.agreement = Agreement(group, "plain source")
        self.engines.check(self.agreement.ranks)
        self.rank = global_rank()
        problems: list[str] = []
        self.lora: LoraSpec | None = None
        self._entries: list[Entry] = []
        try:
            self._entries = select(model, kind, adapter)
            self.lora = lora_spec_of(model, adapter) if kind == "lora" else None
            problems += self._check_plain()
        except ConversionError as exc:
            problems.append(str(exc))
        self.agreement.problems(problems)

    @property
    def is_sender(self) -> bool:
        return self.engines.engine_of(self.rank) is not None

    def specs(self) -> list[Spec]:
        return [(e.name, tuple(e.param.shape), self.dtype or e.param.dtype) for e in self._entries]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The update's tensors (the parameters themselves, detached; cast copies if ``dtype`` was given)."""
        for e in self._entries:
            t = e.param.detach()
            yield e.name, t if self.dtype is None else t.to(self.dtype)

    def push(
        self,
        sender: Sender | None,
        update_id: int | None = None,
        verify: Probe | None = None,
        adapters: AdapterPolicy = "drop",
    ) -> SyncReport | None:
        """On every rank: the ``EngineMap``'s ranks push through their ``sender``; all raise if one failed.
        ``adapters``: what a full update does to a served adapter (``Sender.push``)."""
        error: BaseException | None = None
        report = None
        if self.is_sender:
            try:
                if sender is None:
                    raise ConfigError(
                        f"rank {self.rank} feeds engine {self.engines.engine_of(self.rank)} but got sender=None; "
                        "create the Sender on the ranks where source.is_sender is True"
                    )
                report = sender.push(
                    list(self.tensors()), lora=self.lora, update_id=update_id, verify=verify, adapters=adapters
                )
            except BaseException as exc:  # re-raised by outcome(), after the other ranks learn of it
                error = exc
        elif sender is not None:
            log.warning("plain source: rank %d is not in %s; its Sender is not used", self.rank, self.engines)
        self.agreement.outcome(error, f"{self.kind} update")
        return report

    def _check_plain(self) -> list[str]:
        from torch.distributed.tensor import DTensor

        sharded = [e.param_name for e in self._entries if isinstance(e.param, DTensor)]
        if sharded:
            return [
                f"{len(sharded)} parameters are DTensors (e.g. {sharded[0]!r}): a sharded model needs "
                "colosync.sources.fsdp.FsdpSource"
            ]
        return []


__all__ = ["Entry", "Kind", "PlainSource", "engine_name", "lora_spec_of", "peft_root", "select", "unwrap"]
