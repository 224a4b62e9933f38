"""Is the installed TRL the one ``colosync.integrations.trl`` replaces a class of?

The integration swaps TRL's ``VLLMGeneration`` for a subclass, so it relies on that class's
module, methods and constructor arguments, which TRL may change in any release. This check
runs before the trainer builds anything and raises ``IntegrationError`` naming the TRL version
found and the tested range when any of them is missing; a version outside the range whose
internals match only logs a warning.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from colosync.errors import IntegrationError

log = logging.getLogger(__name__)

TRL_TESTED = (">=1.16.0", "<1.17")
"""The TRL versions this module was tested with (``pip install 'colosync[trl]'`` pins them)."""

GENERATION_MODULE = "trl.generation.vllm_generation"
_METHODS = ("_init_vllm", "sync_weights", "generate", "_iter_named_params")
_INIT_ARGUMENTS = ("model", "accelerator", "mode", "enable_sleep_mode", "tensor_parallel_size")
_GENERATE_ARGUMENTS = ("prompts", "num_generations")


def trl_version() -> str:
    """The installed TRL's version; ``IntegrationError`` if TRL is not importable."""
    try:
        import trl
    except ImportError as exc:
        raise IntegrationError(
            f"TRL is not importable ({exc}); install the tested range: pip install 'colosync[trl]' "
            f"(trl{','.join(TRL_TESTED)})"
        ) from exc
    return str(getattr(trl, "__version__", "unknown"))


def tested(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        found = Version(version)
    except InvalidVersion:
        return False
    low, high = (Version(bound.lstrip("<>=")) for bound in TRL_TESTED)
    return low <= found < high


def mismatch(version: str, what: str) -> IntegrationError:
    return IntegrationError(
        f"TRL {version} does not have what colosync.integrations.trl relies on: {what} (tested with "
        f"trl{','.join(TRL_TESTED)}); install that range (pip install 'colosync[trl]') or train without "
        "colosync's sync (the plain TRL trainer)"
    )


def check_trl() -> str:
    """Check that TRL's ``VLLMGeneration`` is what this module replaces; returns TRL's version.

    Raises ``IntegrationError`` (naming the version and the tested range) when the module,
    the class, one of its methods or one of the constructor arguments it relies on is missing.
    """
    import importlib

    version = trl_version()
    try:
        module = importlib.import_module(GENERATION_MODULE)
    except ImportError as exc:
        raise mismatch(version, f"module {GENERATION_MODULE} ({exc})") from exc
    base = getattr(module, "VLLMGeneration", None)
    if not isinstance(base, type):
        raise mismatch(version, f"class {GENERATION_MODULE}.VLLMGeneration")
    if getattr(module, "LLM", None) is None:
        raise mismatch(version, f"{GENERATION_MODULE}.LLM (vLLM imported by TRL: is vllm installed?)")
    for method in _METHODS:
        if not callable(getattr(base, method, None)):
            raise mismatch(version, f"method VLLMGeneration.{method}")
    for method, names in (("__init__", _INIT_ARGUMENTS), ("generate", _GENERATE_ARGUMENTS)):
        params = inspect.signature(getattr(base, method)).parameters
        missing = [n for n in names if n not in params]
        if missing:
            raise mismatch(version, f"argument(s) {missing} of VLLMGeneration.{method}")
    if not tested(version):
        log.warning(
            "colosync: TRL %s is outside the tested range trl%s; its internals look as expected, proceeding",
            version,
            ",".join(TRL_TESTED),
        )
    return version


def generation_module_of(trainer_cls: type) -> Any:
    """The module whose ``VLLMGeneration`` name ``trainer_cls`` (or a base) builds its engine through."""
    import sys

    version = check_trl()
    base = sys.modules[GENERATION_MODULE].VLLMGeneration
    for cls in trainer_cls.__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and getattr(module, "VLLMGeneration", None) is base:
            return module
    raise mismatch(version, f"{trainer_cls.__name__} (or a base class) building trl's VLLMGeneration")


__all__ = ["GENERATION_MODULE", "TRL_TESTED", "check_trl", "generation_module_of", "mismatch", "trl_version"]
