"""Engine registry: the name an ``EngineConfig`` or a link gives -> the class that serves that engine.

Engines load lazily (transformers, vLLM) so ``import colosync`` stays light, and a link to an
engine in another process needs only its message types, never the engine's code. A new
engine is one file plus one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from colosync.errors import EngineError

_REGISTRY: dict[str, str] = {
    "hf": "colosync.engines.hf:HFEngine",
    "store": "colosync.engines.store:StoreEngine",
    "synthetic": "colosync.engines.synthetic:SyntheticEngine",
    "sink": "colosync.engines.sink:SinkEngine",
    "vllm": "colosync.engines.vllm.serving:VllmServing",
}


def names() -> list[str]:
    return list(_REGISTRY)


def engine_class(name: str) -> type[Any]:
    """The class registered as ``name`` (a ``colosync.engines.host.ServedEngine``), imported now."""
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise EngineError(f"unknown engine {name!r}; choose one of {names()}") from None
    engine: type[Any] = getattr(importlib.import_module(module), cls)  # a class named in _REGISTRY
    return engine


__all__ = ["engine_class", "names"]
