"""The Megatron -> HF architectures colosync converts, one declarative file each.

An architecture is one file defining ``ARCH`` (a :class:`~.base.Architecture`) plus one line
in ``_MODULES`` below. Families that exist but are not converted are listed in
:data:`REFUSED` with the reason, so that asking for one fails by name before any byte moves
instead of streaming a model the engine would compute differently.
"""

from __future__ import annotations

import functools
import importlib

from colosync.errors import ConversionError
from colosync.sources.architectures.base import Architecture

_MODULES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_next",
)

REFUSED: dict[str, str] = {
    "qwen2_moe": "Qwen2-MoE has a gated shared expert (shared_expert_gate), which is not converted yet",
    "deepseek_v3": "DeepSeek-V3 uses multi-latent attention (MLA), which is not converted",
}
"""Known architectures that are refused, and why."""


@functools.cache
def _registry() -> dict[str, Architecture]:
    archs = [importlib.import_module(f"colosync.sources.architectures.{m}").ARCH for m in _MODULES]
    return {a.name: a for a in archs}


def names() -> tuple[str, ...]:
    return tuple(_registry())


def supported() -> tuple[Architecture, ...]:
    return tuple(_registry().values())


def get(name: str) -> Architecture:
    """The architecture called ``name``; an unknown or refused one raises, naming what is supported."""
    found = _registry().get(name)
    if found is not None:
        return found
    if name in REFUSED:
        raise ConversionError(f"architecture {name!r} is not supported: {REFUSED[name]}; supported: {list(names())}")
    raise ConversionError(f"unknown architecture {name!r}; supported: {list(names())}")


__all__ = ["REFUSED", "Architecture", "get", "names", "supported"]
