"""Old module paths (colosync 0.1) that keep working for one release.

0.2 gave every layer its own folder. Code written against 0.1 imports ``colosync.sender``,
``colosync.receiver``, ``colosync.manifest`` and so on; this finder answers those imports with
a thin module that forwards every attribute to the new home and warns once
(``DeprecationWarning``), so the new modules themselves are never renamed or patched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

MOVED: dict[str, str | tuple[str, ...]] = {
    "colosync.manifest": "colosync.wire.manifest",
    "colosync.protocol": "colosync.wire.protocol",
    "colosync.bucket": "colosync.wire.bucket",
    "colosync.fused": "colosync.wire.fused",
    "colosync.sender": "colosync.sync.sender",
    "colosync.receiver": "colosync.sync.receiver",
    "colosync.link": "colosync.sync.link",
    "colosync.target": "colosync.sync.target",
    "colosync.models": "colosync.demo.models",
    "colosync.rl": "colosync.demo.rl",
    "colosync.ray_actors": "colosync.engines.ray_actor",
    "colosync.engines.vllm_ray": "colosync.engines.vllm.serving",
    "colosync.probe": "colosync.tools.probe",
    "colosync.bench": "colosync.tools.bench.sync",
    "colosync.cli": "colosync.tools.cli",
    "colosync.handoff.ops": "colosync.handoff.model.ops",
    "colosync.handoff.plans": "colosync.handoff.model.plans",
    "colosync.handoff.simulator": "colosync.handoff.model.simulator",
    "colosync.handoff.participants": "colosync.handoff.runtime.participants",
    "colosync.handoff.executor": "colosync.handoff.runtime.executor",
    "colosync.handoff.sampling": "colosync.handoff.runtime.sampling",
    "colosync.handoff.torch_backend": "colosync.handoff.backends.torch_trainer",
    "colosync.handoff.tms_backend": "colosync.handoff.backends.tms_trainer",
    "colosync.handoff.engine_memory": ("colosync.handoff.backends.torch_engine", "colosync.engines.vllm.memory"),
    "colosync.handoff.host_pool": "colosync.handoff.backends.host_pool",
    "colosync.handoff.stash": "colosync.handoff.backends.stash",
    "colosync.handoff.errors": "colosync.errors",
}


class _Forwarder(types.ModuleType):
    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"moved to {', '.join(targets)}")
        self.__targets = targets

    def __getattr__(self, attr: str) -> Any:
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(self.__targets)}) has no {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({name for target in self.__targets for name in dir(importlib.import_module(target))})


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        moved = MOVED[spec.name]
        targets = (moved,) if isinstance(moved, str) else moved
        warnings.warn(
            f"{spec.name} moved to {' and '.join(targets)}; the old path works until colosync 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return _Forwarder(spec.name, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Loader())
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
