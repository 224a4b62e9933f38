"""What an engine exposes to the Receiver, and the checks every update must pass against it.

An engine adapter (``hf``, ``vllm``, ...) describes its model once as a ``ModelSpec`` and
implements ``prepare`` / ``commit`` / ``discard``. Everything that can be decided from the
manifest alone -- unknown names, wrong shapes, a rank over the engine's maximum, dtypes that
cannot be cast -- is checked here, before a single byte moves, with messages that name the
tensor, the expectation and the fix.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from colosync.errors import (
    DtypeError,
    IncompleteUpdateError,
    ManifestError,
    RankError,
    ShapeMismatchError,
    TiedWeightError,
    UnknownTensorError,
)
from colosync.wire.manifest import LoraSpec, TensorMeta, UpdateManifest


@dataclass(frozen=True)
class ReceiverPolicy:
    """What the engine accepts, checked as each bucket lands and by the Receiver's clock. Defaults are safe."""

    reject_nonfinite: bool = True
    verify_fingerprints: bool = True
    timeout_s: float = 60.0


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ModelSpec:
    """What an engine's model accepts.

    ``params`` maps HF parameter names to their shape and dtype (full-weight updates);
    ``lora_modules`` maps HF module paths (``model.layers.0.self_attn.q_proj``) to
    ``(in_features, out_features)`` for every module a LoRA may wrap. ``None`` means "any
    name and shape" (a plain tensor store); only structural checks apply then. ``tied`` maps
    a parameter name the model ties to another (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` when embeddings are tied) so a full ``state_dict()`` can be
    pushed as is: the tied copy must equal its tie and is not applied twice.
    """

    params: Mapping[str, ParamSpec] | None
    lora_modules: Mapping[str, tuple[int, int]] | None = field(default_factory=dict)
    max_lora_rank: int | None = None
    lora_dtype: torch.dtype = torch.float32
    tied: Mapping[str, str] = field(default_factory=dict)


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for every state-dict entry that is another parameter (tied weights)."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    return {
        name: canonical[id(p)]
        for name, p in model.state_dict(keep_vars=True).items()
        if id(p) in canonical and canonical[id(p)] != name
    }


@dataclass(frozen=True)
class Staging:
    """Engine-owned tensors to receive an update into (see ``StagingTarget``).

    ``tensors``: one per ``manifest.tensors`` entry, in that order, same shape and dtype,
    contiguous, on the Receiver's device or in host memory (``HostStaging``), none of them
    served. ``buckets`` (optional): for each bucket, one ``uint8`` tensor of ``bucket_sizes[b]`` bytes in which bytes
    ``[offset, offset + nbytes)`` of each tensor *are* that tensor's storage and the padding between them
    belongs to nothing else -- then each bucket lands with one flat copy and no
    per-tensor work at all.
    """

    tensors: Sequence[torch.Tensor]
    buckets: Sequence[torch.Tensor] | None = None


@dataclass(frozen=True)
class Changes:
    """What a commit changed in the served model, counted by the engine itself.

    ``expected`` is what the manifest says should change, in the same unit (LoRA modules,
    parameters, or the engine's layers); the Receiver rolls the update back (or fails
    closed) when the two differ.
    """

    changed: int
    expected: int


class EngineTarget(abc.ABC):
    """The engine half of a transaction. ``prepare`` builds, ``commit`` installs.

    An engine adapter subclasses this and implements the four abstract methods; ``check``,
    ``staging`` and ``revert`` are optional refinements with safe defaults.
    """

    @abc.abstractmethod
    def model_spec(self) -> ModelSpec:
        """What the engine's model accepts (names, shapes, LoRA modules, max rank)."""

    @abc.abstractmethod
    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> Any:
        """Build the update (cast, shard, assemble) without changing what is served."""

    @abc.abstractmethod
    def commit(self, prepared: Any, update_id: int) -> Changes | None:
        """Install a prepared update; must either fully succeed or change nothing.

        Return what it changed (``Changes``) if the engine can count it; ``None`` skips the
        structural check.
        """

    @abc.abstractmethod
    def discard(self, prepared: Any) -> None:
        """Free a prepared update that will not be committed."""

    def revert(self, update_id: int) -> bool:
        """Undo the commit of ``update_id`` (the last one; it failed verification).

        Reinstate the version served before it and return True, or return False when that is
        impossible (a full update overwrote the weights): the Receiver then fails closed.
        """
        return False

    def served_adapter(self) -> int:
        """The update id whose LoRA adapter the engine applies now, or 0 when it serves none.

        An engine that serves adapters reports it so every ``Ack`` says what is applied; a full
        update with ``adapters="drop"`` (``UpdateManifest.drops_adapter``) must leave it at 0 and
        count the drop in its ``Changes`` (one change expected when an adapter was served).
        """
        return 0

    def check(self, manifest: UpdateManifest) -> None:  # noqa: B027 - optional hook, no-op by default
        """Engine-specific rejections beyond ``validate_manifest``, before any byte moves.

        Raise an ``UpdateRejected`` subclass. Called once per distinct (layout, kind, LoRA spec).
        """

    def staging(self, manifest: UpdateManifest) -> Staging | Sequence[torch.Tensor] | None:
        """Engine-owned tensors to receive ``manifest`` into, or ``None`` to let the Receiver allocate.

        The Receiver copies each bucket straight from the transport into them (with fused
        copies, or one flat copy per bucket when ``Staging.buckets`` is given) and passes the
        same tensors to ``prepare``: no per-update allocation and no per-tensor view on the
        receive path. An engine that double-buffers its weights (serve one set, stage into
        the other, swap on ``commit``) gets an update in with nothing but those copies.
        """
        return None

    def unstage(self, manifest: UpdateManifest) -> None:  # noqa: B027 - optional hook, no-op by default
        """The update ``staging()`` lent tensors for has ended, committed or not: they are the engine's again.

        Called once per update that reached ``begin``, after ``commit`` or ``discard`` (or when
        it ended before ``prepare``), so an engine can free or recycle its staging area.
        """


_LORA_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[\w-]+)?\.weight$")


def parse_lora_name(name: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (module, "A")."""
    match = _LORA_NAME.match(name)
    if not match:
        raise UnknownTensorError(
            f"tensor {name!r} is not a LoRA weight; expected PEFT names like "
            "'base_model.model.<module>.lora_A.weight' / '.lora_B.weight'"
        )
    return match["module"], match["part"]


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src.is_floating_point and dst.is_floating_point


def validate_manifest(manifest: UpdateManifest, spec: ModelSpec) -> None:
    """Raise the specific ``UpdateRejected`` subclass for the first problem found."""
    if manifest.kind == "lora":
        if manifest.lora is None:
            raise ManifestError(f"update {manifest.update_id} is a LoRA update without a LoraSpec")
        _validate_lora(manifest.tensors, manifest.lora, spec)
    else:
        _validate_full(manifest.tensors, spec)


def peft_base_name(name: str) -> str:
    """The HF name behind a PEFT-wrapped one: ``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def untie(manifest: UpdateManifest, tensors: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """``tensors`` without the tied copies, after checking each equals its tie (bytes arrived)."""
    if not spec.tied:
        return tensors
    aliases = [name for name in tensors if name in spec.tied]
    for alias in aliases:
        canonical = spec.tied[alias]
        if not torch.equal(tensors[alias], tensors[canonical]):
            raise TiedWeightError(
                f"update {manifest.update_id}: {alias!r} differs from {canonical!r}, but the engine's model ties "
                f"them (one tensor); send equal values, or only {canonical!r}"
            )
    return {name: t for name, t in tensors.items() if name not in spec.tied} if aliases else tensors


def _validate_full(tensors: tuple[TensorMeta, ...], spec: ModelSpec) -> None:
    if spec.params is None:
        return
    names = {t.name for t in tensors}
    for t in tensors:
        canonical = spec.tied.get(t.name)
        if canonical is not None:
            if canonical not in names:
                raise TiedWeightError(
                    f"full update sends {t.name!r} without {canonical!r}: the engine's model ties {t.name!r} to "
                    f"{canonical!r} (tie_word_embeddings), so send {canonical!r} (the tie follows it), or both, equal"
                )
            t = msgspec.structs.replace(t, name=canonical)  # checked against the parameter it is tied to
        want = spec.params.get(t.name)
        if want is None:
            unwrapped = peft_base_name(t.name)
            if unwrapped != t.name and unwrapped in spec.params:
                raise UnknownTensorError(
                    f"full update names {t.name!r}, a PEFT wrapper's name for {unwrapped!r}: push the base model's "
                    "own names, e.g. sender.push(peft_model.merge_and_unload().named_parameters()) for the merged "
                    "weights (the engine then stops applying its adapter, adapters='drop', so it does not count "
                    "twice), or push_peft(peft_model) to send the adapter instead"
                )
            close = [n for n in spec.params if n.endswith(t.name.split(".")[-1])][:3]
            raise UnknownTensorError(
                f"full update names {t.name!r}, which the engine's model does not have; "
                f"send HF parameter names (e.g. {close or list(spec.params)[:3]})"
            )
        if tuple(t.shape) != want.shape:
            raise ShapeMismatchError(
                f"tensor {t.name!r}: got shape {list(t.shape)}, the engine's parameter is "
                f"{list(want.shape)}; send the unsharded HF-layout tensor"
            )
        if not _castable(t.torch_dtype, want.dtype):
            raise DtypeError(
                f"tensor {t.name!r}: {t.dtype} cannot be cast to the engine's "
                f"{str(want.dtype).removeprefix('torch.')}; send a floating-point tensor"
            )


def _validate_lora(tensors: tuple[TensorMeta, ...], lora: LoraSpec, spec: ModelSpec) -> None:
    if not tensors:
        raise IncompleteUpdateError(
            "an empty LoRA update would leave the engine with no adapter: a LoRA update replaces the whole "
            "adapter, so send all of its tensors (Sender.push_peft(model)) for target_modules "
            f"{list(lora.target_modules)}"
        )
    if spec.max_lora_rank is not None and lora.rank > spec.max_lora_rank:
        raise RankError(
            f"adapter rank {lora.rank} exceeds the engine's max_lora_rank={spec.max_lora_rank}; "
            f"restart the engine with max_lora_rank >= {lora.rank} or train a smaller adapter"
        )
    parts: dict[str, set[str]] = {}
    for t in tensors:
        module, part = parse_lora_name(t.name)
        dims: tuple[int, int] | None
        if spec.lora_modules is None:  # any module: the rank must still match the spec
            dims = (t.shape[1], t.shape[1]) if part == "A" and len(t.shape) == 2 else (t.shape[0], t.shape[0])
        else:
            dims = spec.lora_modules.get(module)
        if dims is None:
            raise UnknownTensorError(
                f"tensor {t.name!r}: the engine's model has no LoRA-capable module {module!r}; "
                "check the name prefix and that the trainer and engine use the same architecture"
            )
        if module.rsplit(".", 1)[-1] not in lora.target_modules:
            raise UnknownTensorError(
                f"tensor {t.name!r}: module {module!r} is not among the manifest's target_modules "
                f"{list(lora.target_modules)}; add it to LoraSpec.target_modules or drop the tensor"
            )
        in_f, out_f = dims
        expected = (lora.rank, in_f) if part == "A" else (out_f, lora.rank)
        if tuple(t.shape) != expected:
            raise ShapeMismatchError(
                f"tensor {t.name!r}: got shape {list(t.shape)}, expected {list(expected)} "
                f"(lora_{part} of a {in_f}->{out_f} module at rank {lora.rank}); check the rank in "
                "the LoraSpec and that TP shards were gathered before sending"
            )
        if not _castable(t.torch_dtype, spec.lora_dtype):
            raise DtypeError(
                f"tensor {t.name!r}: {t.dtype} cannot be cast to the engine's LoRA dtype "
                f"{str(spec.lora_dtype).removeprefix('torch.')}; send floating-point adapter weights"
            )
        parts.setdefault(module, set()).add(part)
    for module, have in parts.items():
        if have != {"A", "B"}:
            missing = ({"A", "B"} - have).pop()
            raise UnknownTensorError(f"module {module!r} has lora_{have.pop()} but no lora_{missing}; send both halves")
    if spec.lora_modules is not None:
        wrapped = {m for m in spec.lora_modules if _wrapped(m, lora)}
        missing_modules = sorted(wrapped - parts.keys())
        if missing_modules:
            raise IncompleteUpdateError(
                f"the LoRA update sends {len(parts)} of the {len(wrapped)} modules its target_modules "
                f"{list(lora.target_modules)} name in the engine's model; missing {len(missing_modules)}: "
                f"{missing_modules[:8]}{' ...' if len(missing_modules) > 8 else ''}. A LoRA update replaces the "
                "whole adapter, so unsent modules would lose theirs: send every module, or narrow target_modules "
                "(or LoraSpec.layers) to what the adapter wraps"
            )


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def _wrapped(module: str, lora: LoraSpec) -> bool:
    """Does an adapter of ``lora`` wrap ``module`` (leaf name in its targets, layer in its layers)?"""
    if module.rsplit(".", 1)[-1] not in lora.target_modules:
        return False
    if lora.layers is None:
        return True
    found = _LAYER_INDEX.search(f".{module}.")
    return found is not None and int(found.group(1)) in lora.layers
