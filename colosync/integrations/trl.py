"""TRL's colocated vLLM, synced by colosync: adapter-only LoRA pushes instead of merge + reload + unmerge.

Why it replaces a class. TRL's ``GRPOTrainer`` (and RLOO, Distillation, ... which share
``trl.generation.vllm_generation.VLLMGeneration``) builds its ``vllm.LLM`` in
``VLLMGeneration._init_vllm`` with fixed arguments (no LoRA, no worker extension), calls
``llm.generate`` without a ``lora_request``, and at every step calls ``sync_weights`` directly,
which for a PEFT model merges the adapter into the base, pushes every merged tensor with one
``load_weights`` call each, and unmerges. No callback or argument changes that, so this
module swaps the trainer's ``VLLMGeneration`` for a subclass while the trainer is built:

- the engine is built with LoRA on (``max_lora_rank`` from the PEFT config) and colosync's
  worker extension, plus ``ColosyncOptions.engine_kwargs``; TRL's own arguments are kept;
- TRL sees the engine through ``ColosyncLLM``, which generates with colosync's stable
  ``lora_request`` and, for a LoRA run, sleeps at level 1 where TRL asks for 2 (level 2
  discards the base weights, which an adapter-only push does not resend);
- ``sync_weights`` is one colosync transaction: ``Sender.push_peft`` (verified with a probe
  scored by the trainer) for a PEFT model, a full update through TRL's own parameter iterator
  otherwise, then ``reset_prefix_cache`` as TRL does; the ``SyncReport`` lands in the trainer's
  metrics (``colosync/sync_seconds``, ``colosync/bytes``, ``colosync/update_id``, ...). The
  verify cadence, the probe and the kept reports are the colocated step's own sync phase
  (``colosync.colocated.sync.VerifiedSync``, ``colosync.colocated.probe``): TRL drives its loop,
  so it calls that phase, not the whole step.

Several ranks: in colocate mode every rank owns its in-process engine (vLLM's
``external_launcher``), so every rank pushes its own adapter into its own engine; each rank's
Sender and transport are its own. Sleep mode: with a LoRA, levels 0 and 1 keep working (the
base weights survive level 1 on the host; the adapter is pushed again after every wake-up);
level 2 is used only for full fine-tuning, whose push resends every weight. vLLM's CPU
backend has no sleep mode at all (``vllm_sleep_support``).

Version check. ``trl_check.check_trl`` runs before the trainer builds anything and refuses a
TRL whose internals this module relies on are missing. TRL and vLLM are imported only inside
functions.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from colosync.colocated.probe import random_probe, scored
from colosync.colocated.sync import REPORTS_KEPT, VerifiedSync
from colosync.engines.vllm.client import VllmEngine
from colosync.engines.vllm.worker import WORKER_EXTENSION
from colosync.errors import ConfigError
from colosync.integrations.trl_check import GENERATION_MODULE, check_trl, generation_module_of, mismatch, trl_version
from colosync.sync.sender import DEFAULT_BUCKET_BYTES, Sender, peft_lora_spec, peft_lora_tensors
from colosync.wire.protocol import Probe

if TYPE_CHECKING:  # pragma: no cover - typing only
    from colosync.sync.pipeline import SyncReport

log = logging.getLogger(__name__)

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank choices
_RESERVED_ENGINE_KWARGS = ("worker_extension_cls", "enable_lora", "max_lora_rank", "max_loras")


@dataclass(frozen=True)
class ColosyncOptions:
    """How colosync syncs a TRL trainer's colocated vLLM engine.

    ``verify``: a push carries a probe (``probe_sequences`` random prompts of
    ``probe_prompt_tokens`` with ``probe_completion_tokens`` completions, drawn once from
    ``seed``) scored by the trainer; the engine scores it after installing the update and a
    deviation over ``tolerance`` rolls the LoRA back (``DeliveryError``). ``verify_every=n``
    verifies the first push and every n-th after it (the engine's scoring is most of a verified
    push's cost: one vLLM pass per probe sequence). ``tolerance=None``:
    1e-2 when trainer and engine both compute in float32, else 0.25 (bf16/fp16 kernels differ
    that much on single tokens). ``max_lora_rank=None``: the adapter's rank, rounded up to a
    rank vLLM accepts. ``sleep_level=None``: 1 for a LoRA, TRL's 2 for full fine-tuning.
    ``engine_kwargs`` go to ``vllm.LLM`` on top of TRL's (e.g. ``enforce_eager``, ``dtype``);
    colosync's own LoRA and extension arguments cannot be overridden.
    """

    transport: str = "auto"
    verify: bool = True
    verify_every: int = 1
    tolerance: float | None = None
    probe_sequences: int = 1
    probe_prompt_tokens: int = 8
    probe_completion_tokens: int = 8
    seed: int = 0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    max_lora_rank: int | None = None
    sleep_level: int | None = None
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tolerance is not None and not (self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ConfigError(f"tolerance must be a positive number or None (automatic), got {self.tolerance!r}")
        for name in ("verify_every", "probe_sequences", "probe_prompt_tokens", "probe_completion_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}; or pass verify=False")
        if self.bucket_bytes < 1 << 12:
            raise ConfigError(f"bucket_bytes must be >= 4096, got {self.bucket_bytes}")
        if self.max_lora_rank is not None and self.max_lora_rank not in _VLLM_LORA_RANKS:
            raise ConfigError(f"max_lora_rank must be one of vLLM's {_VLLM_LORA_RANKS}, got {self.max_lora_rank}")
        if self.sleep_level not in (None, 1, 2):
            raise ConfigError(f"sleep_level must be 1, 2 or None (automatic), got {self.sleep_level!r}")
        reserved = sorted(set(self.engine_kwargs) & set(_RESERVED_ENGINE_KWARGS))
        if reserved:
            raise ConfigError(
                f"engine_kwargs may not set {reserved}: colosync sets them (use max_lora_rank= for the rank)"
            )
        object.__setattr__(self, "engine_kwargs", MappingProxyType(dict(self.engine_kwargs)))


# -- what TRL sees as its engine ------------------------------------------------------------


class ColosyncLLM:
    """A ``vllm.LLM`` as TRL's ``VLLMGeneration`` uses it under colosync.

    ``generate`` uses the served colosync adapter unless a ``lora_request`` is given (none
    before the first LoRA commit; ``FailedClosedError`` while the engine refuses to serve);
    ``sleep(level=2)`` becomes level 1 when ``keep_weights`` (a LoRA run: the base weights
    must survive). Everything else is the real ``LLM`` (``.llm``).
    """

    def __init__(self, llm: Any, engine: VllmEngine, keep_weights: bool) -> None:
        self.llm = llm
        self.engine = engine
        self.keep_weights = keep_weights

    def __getattr__(self, name: str) -> Any:
        try:
            llm = self.__dict__["llm"]
        except KeyError:  # not yet set (copy, unpickling): nothing to forward to
            raise AttributeError(name) from None
        return getattr(llm, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_request") is None:
            kwargs["lora_request"] = self.engine.link.default_lora()
        return self.llm.generate(*args, **kwargs)

    def sleep(self, level: int = 1, **kwargs: Any) -> Any:
        if self.keep_weights and level >= 2:
            level = 1
        return self.llm.sleep(level=level, **kwargs)


def _lora_rank(rank: int) -> int:
    for allowed in _VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {_VLLM_LORA_RANKS[-1]}")


def _check_adapter(model: Any, adapter: str) -> int:
    """The adapter's rank; ``ConfigError`` for what an adapter-only vLLM push cannot carry."""
    cfg = model.peft_config[adapter]
    kind = str(getattr(cfg, "peft_type", ""))
    if not kind.endswith("LORA"):
        raise ConfigError(f"colosync syncs LoRA adapters; adapter {adapter!r} is {kind}: use a peft LoraConfig")
    if getattr(cfg, "modules_to_save", None):
        raise ConfigError(
            f"adapter {adapter!r} trains modules_to_save={list(cfg.modules_to_save)}, full modules an adapter-only "
            "push does not carry; drop modules_to_save, or train without PEFT (colosync then pushes full weights)"
        )
    if getattr(cfg, "use_dora", False):
        raise ConfigError(f"adapter {adapter!r} uses DoRA, which vLLM does not serve; set use_dora=False")
    targets = cfg.target_modules
    targets = {targets} if isinstance(targets, str) else set(targets or ())
    embedding = sorted(t for t in targets if t.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens"))
    if embedding:
        raise ConfigError(
            f"adapter {adapter!r} targets {embedding}; colosync's vLLM engine takes LoRA on linear layers "
            "only: drop them from target_modules"
        )
    return int(cfg.r)


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _attribute(generation: Any, name: str) -> Any:
    try:
        return getattr(generation, name)
    except AttributeError:
        raise mismatch(trl_version(), f"attribute VLLMGeneration.{name}") from None


# -- the replacement VLLMGeneration -----------------------------------------------------------


class _ColosyncGeneration:
    """Mixed in before TRL's ``VLLMGeneration`` (see ``generation_class``); the module docstring says why."""

    colosync_options: ColosyncOptions
    colosync_engine: VllmEngine | None
    colosync_sender: Sender | None
    colosync_sync: VerifiedSync
    colosync_reports: collections.deque[SyncReport]
    colosync_lora: bool
    _colosync_module: Any
    _colosync_probe: Probe | None

    def __init__(self, *args: Any, colosync_options: ColosyncOptions, **kwargs: Any) -> None:
        self.colosync_options = colosync_options
        self.colosync_engine = None
        self.colosync_sender = None
        self._colosync_specs: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        every = colosync_options.verify_every if colosync_options.verify else 0
        self.colosync_sync = VerifiedSync(verify_every=every, keep=REPORTS_KEPT)
        self.colosync_reports = self.colosync_sync.reports
        self.colosync_lora = False
        self._colosync_probe = None
        super().__init__(*args, **kwargs)

    # -- engine build ----------------------------------------------------------------------
    def _init_vllm(self) -> None:
        options, module = self.colosync_options, self._colosync_module
        mode = _attribute(self, "mode")
        if mode != "colocate":
            raise ConfigError(
                f"colosync syncs TRL's colocated vLLM (vllm_mode='colocate'), not vllm_mode={mode!r}; set "
                "vllm_mode='colocate', or use the plain TRL trainer for a vLLM server"
            )
        model = _attribute(self, "model")
        dist = _attribute(self, "_dist")
        self.colosync_lora = _is_peft(model)
        extra: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
        if self.colosync_lora:
            if dist.is_fsdp:
                raise ConfigError(
                    "colosync's TRL integration pushes PEFT adapters without FSDP; train the LoRA with DDP or "
                    "DeepSpeed, or use the plain TRL trainer under FSDP"
                )
            rank = _check_adapter(model, model.active_adapter)
            extra.update(enable_lora=True, max_loras=1, max_lora_rank=options.max_lora_rank or _lora_rank(rank))
            if options.sleep_level == 2 and _attribute(self, "enable_sleep_mode"):
                raise ConfigError(
                    "sleep level 2 discards vLLM's base weights and a LoRA push does not resend them; "
                    "leave sleep_level=None (level 1 for a LoRA) or train without PEFT"
                )
        extra.update(options.engine_kwargs)
        keep_weights = (options.sleep_level or (1 if self.colosync_lora else 2)) == 1
        real_llm_cls = module.LLM
        built: list[ColosyncLLM] = []

        def build(*args: Any, **kwargs: Any) -> ColosyncLLM:
            llm = real_llm_cls(*args, **{**kwargs, **extra})
            engine = VllmEngine(llm)  # checks every worker runs colosync's extension
            built.append(ColosyncLLM(llm, engine, keep_weights))
            return built[-1]

        with _LLM_LOCK:
            module.LLM = build
            try:
                super()._init_vllm()  # type: ignore[misc]  # TRL's VLLMGeneration, after this mixin in the MRO
            finally:
                module.LLM = real_llm_cls
        if not built or getattr(self, "llm", None) is not built[-1]:
            raise mismatch(trl_version(), f"VLLMGeneration._init_vllm building self.llm through {module.__name__}.LLM")
        self.colosync_engine = built[-1].engine
        self.colosync_sender = Sender(
            self.colosync_engine.link, transport=options.transport, bucket_bytes=options.bucket_bytes
        )
        log.info(
            "colosync: TRL's colocated vLLM built with %s; every sync is a colosync %s push",
            sorted(extra),
            "LoRA" if self.colosync_lora else "full",
        )

    # -- sync ------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """One colosync transaction (LoRA or full), verified if asked, then TRL's prefix-cache reset."""
        llm: Any = _attribute(self, "llm")
        if _attribute(self, "enable_sleep_mode"):  # as TRL: map the weights before writing them
            empty_cache = getattr(self._colosync_module, "empty_cache", None)
            if empty_cache is not None:
                empty_cache()
            llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        sender = self.colosync_sender
        if sender is None:
            raise ConfigError("colosync's sender is closed (colosync_close()); build a new trainer to train again")
        model = _attribute(self, "model")
        push: Callable[[Probe | None], SyncReport]
        if self.colosync_lora:
            push = functools.partial(self._colosync_push_lora, sender, model)
        else:
            push = functools.partial(self._colosync_push_full, sender)
        sync = self.colosync_sync  # the colocated step's sync phase: verify when due, push, report
        sync.push(push, sync.probe(functools.partial(self._colosync_verify, model)))
        llm.reset_prefix_cache()  # TRL's own step (the commit already dropped cached KV)

    def _colosync_push_lora(self, sender: Sender, model: Any, verify: Probe | None) -> SyncReport:
        adapter = model.active_adapter
        lora = [p for n, p in model.named_parameters() if ".lora_" in n]
        with _attribute(self, "_dist").gather_params(lora):  # ZeRO-3: the adapter whole, for the push only
            tensors = peft_lora_tensors(model, adapter)
            return sender.push(tensors, lora=peft_lora_spec(model, adapter), verify=verify)

    def _colosync_push_full(self, sender: Sender, verify: Probe | None) -> SyncReport:
        # TRL's own iterator: names as vLLM expects them, gathered one at a time under ZeRO-3/FSDP.
        copy = bool(_attribute(self, "_dist").is_zero3)  # a gathered ZeRO-3 tensor is freed on the next step

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _attribute(self, "_iter_named_params")():
                yield name, (tensor.detach().clone() if copy else tensor.detach())

        if self._colosync_specs is None:  # constant over a run; one pass of the iterator finds them
            self._colosync_specs = [(n, tuple(t.shape), t.dtype) for n, t in named()]
        return sender.push_stream(self._colosync_specs, named(), verify=verify)

    def _colosync_verify(self, model: Any) -> Probe:
        """The fixed probe with the trainer's logprobs under its current weights (eval mode, no grad)."""
        o = self.colosync_options
        if self._colosync_probe is None:
            config = model.config
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            vocab = int(config.vocab_size)
            self._colosync_probe = random_probe(
                vocab, o.probe_sequences, o.probe_prompt_tokens, o.probe_completion_tokens, o.seed
            )
        return scored(model, self._colosync_probe, self._colosync_tolerance(model))

    def _colosync_tolerance(self, model: Any) -> float:
        if self.colosync_options.tolerance is not None:
            return self.colosync_options.tolerance
        engine = self.colosync_engine
        engine_dtype = engine.llm.llm_engine.model_config.dtype if engine is not None else None
        trainer_dtype = next(model.parameters()).dtype
        return 1e-2 if engine_dtype == torch.float32 and trainer_dtype == torch.float32 else 0.25

    def colosync_close(self) -> None:
        """Detach colosync's Sender (the engine keeps serving the last committed update)."""
        if self.colosync_sender is not None:
            self.colosync_sender.close()
            self.colosync_sender = None


@functools.cache
def generation_class() -> type:
    """TRL's ``VLLMGeneration`` with colosync's engine build and sync (built once, on first use)."""
    import sys

    check_trl()
    module = sys.modules[GENERATION_MODULE]
    return type(
        "ColosyncVLLMGeneration",
        (_ColosyncGeneration, module.VLLMGeneration),
        {"__module__": __name__, "_colosync_module": module, "__doc__": _ColosyncGeneration.__doc__},
    )


_LLM_LOCK = threading.RLock()  # the module-global names this module swaps while an engine or trainer is built


@contextlib.contextmanager
def _building(module: Any, options: ColosyncOptions) -> Iterator[None]:
    """While a trainer is built, its module's ``VLLMGeneration`` is colosync's (with ``options``)."""
    generation = generation_class()
    original = module.VLLMGeneration
    with _LLM_LOCK:
        module.VLLMGeneration = functools.partial(generation, colosync_options=options)
        try:
            yield
        finally:
            module.VLLMGeneration = original


# -- the trainers -----------------------------------------------------------------------------


def _record(trainer: Any, report: SyncReport) -> None:
    """A ``SyncReport`` as trainer metrics, averaged over the logging interval like TRL's own."""
    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]
    metrics["colosync/sync_seconds"].append(report.seconds.get("total", 0.0))
    metrics["colosync/bytes"].append(float(report.bytes))
    metrics["colosync/tensors"].append(float(report.tensors))
    metrics["colosync/update_id"].append(float(report.update_id))
    delivery = report.delivery
    if delivery is not None:
        metrics["colosync/changed"].append(float(delivery.changed))
        if delivery.max_deviation is not None:
            metrics["colosync/deviation"].append(delivery.max_deviation)
            metrics["colosync/verify_seconds"].append(delivery.seconds)


@functools.cache
def with_colosync(trainer_cls: type) -> type:
    """``trainer_cls`` (``GRPOTrainer``, ``RLOOTrainer``, ...) whose colocated vLLM colosync syncs.

    The subclass takes one more keyword, ``colosync=ColosyncOptions(...)``; everything else is
    ``trainer_cls``'s. TRL is checked (``check_trl``) before anything is built. After
    construction ``trainer.vllm_generation`` is colosync's, ``trainer.colosync_reports`` holds
    the recent ``SyncReport``s and ``trainer.colosync_close()`` detaches the Sender.
    """
    module = generation_module_of(trainer_cls)
    base: Any = trainer_cls

    def __init__(self: Any, *args: Any, colosync: ColosyncOptions | None = None, **kwargs: Any) -> None:
        options = colosync if colosync is not None else ColosyncOptions()
        if not isinstance(options, ColosyncOptions):
            raise ConfigError(f"colosync= takes a ColosyncOptions, got {type(options).__name__}")
        check_trl()
        with _building(module, options):
            base.__init__(self, *args, **kwargs)
        generation = getattr(self, "vllm_generation", None)
        if not getattr(self, "use_vllm", False) or not isinstance(generation, _ColosyncGeneration):
            raise ConfigError(
                f"{type(self).__name__} syncs TRL's colocated vLLM engine: pass args with use_vllm=True, "
                "vllm_mode='colocate'"
            )
        if not isinstance(getattr(self, "_metrics", None), dict):
            raise mismatch(trl_version(), f"{trainer_cls.__name__}._metrics (the dict TRL logs metrics from)")
        generation.colosync_sync.on_report = functools.partial(_record, self)

    def colosync_reports(self: Any) -> collections.deque[SyncReport]:
        reports: collections.deque[SyncReport] = self.vllm_generation.colosync_reports
        return reports

    def colosync_close(self: Any) -> None:
        self.vllm_generation.colosync_close()

    name = f"Colosync{trainer_cls.__name__}"
    return type(
        name,
        (trainer_cls,),
        {
            "__init__": __init__,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{trainer_cls.__name__} whose colocated vLLM is synced by colosync "
            "(adapter-only LoRA pushes); see colosync.integrations.trl.",
            "colosync_reports": property(colosync_reports),
            "colosync_close": colosync_close,
        },
    )


def __getattr__(name: str) -> type:
    """``ColosyncGRPOTrainer`` and ``ColosyncRLOOTrainer``, built when first imported (TRL loads then)."""
    trainers = {"ColosyncGRPOTrainer": "GRPOTrainer", "ColosyncRLOOTrainer": "RLOOTrainer"}
    if name not in trainers:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    trl_version()
    import trl

    return with_colosync(getattr(trl, trainers[name]))


__all__ = [
    "ColosyncLLM",
    "ColosyncOptions",
    "generation_class",
    "with_colosync",
]
