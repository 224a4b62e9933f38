"""Engine registry: name -> the class that adapts that engine to the Receiver.

Engines load lazily (transformers, vLLM) so ``import colosync`` stays light. A new engine is
one file plus one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from colosync.errors import EngineError

if TYPE_CHECKING:
    import msgspec

    from colosync.engines.config import EngineConfig
    from colosync.engines.host import EngineHost, ServedEngine, Session

_REGISTRY: dict[str, str] = {
    "hf": "colosync.engines.hf:HFEngine",
    "store": "colosync.engines.store:StoreEngine",
    "synthetic": "colosync.engines.synthetic:SyntheticEngine",
    "sink": "colosync.engines.sink:SinkEngine",
    "vllm": "colosync.engines.vllm.serving:VllmServing",
}


def names() -> list[str]:
    return list(_REGISTRY)


def engine_class(name: str) -> type[ServedEngine]:
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise EngineError(f"unknown engine {name!r}; choose one of {names()}") from None
    engine: type[ServedEngine] = getattr(importlib.import_module(module), cls)  # a class named in _REGISTRY
    return engine


def build_host(
    config: EngineConfig, handlers: dict[type, Callable[[Any, Session], msgspec.Struct]] | None = None
) -> EngineHost:
    """The host for an ``EngineConfig``: the registry's engine class, built from the config."""
    from colosync.engines.host import EngineHost

    engine = engine_class(config.engine).from_config(config)
    return EngineHost(engine.transactions(config.policy()), engine, handlers)
