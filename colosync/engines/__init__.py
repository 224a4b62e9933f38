"""The engines colosync updates; which name serves which class is ``colosync.control.registry``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from colosync.control.registry import engine_class

if TYPE_CHECKING:
    import msgspec

    from colosync.engines.config import EngineConfig
    from colosync.engines.host import EngineHost
    from colosync.sync.transaction import Session


def build_host(
    config: EngineConfig, handlers: dict[type, Callable[[Any, Session], msgspec.Struct]] | None = None
) -> EngineHost:
    """The host for an ``EngineConfig``: the registry's engine class, built from the config."""
    from colosync.engines.host import EngineHost

    engine = engine_class(config.engine).from_config(config)
    return EngineHost(engine.transaction(config.policy()), engine, handlers)
