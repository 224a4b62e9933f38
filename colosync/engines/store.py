"""An engine whose model is a plain dict of named tensors.

It accepts any names, shapes and dtypes, which is what the transport contract suite needs
(fp8, int8, 10,000 tiny tensors, a tensor larger than a bucket) and what a checkpoint or
parameter-server sink looks like. It goes through the same Receiver transaction as a real
engine: ``commit`` swaps the whole dict at once; ``Fetch`` returns committed bytes so tests
can compare them with what was sent.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import torch

from colosync.engines.config import EngineConfig
from colosync.engines.host import HostedTarget
from colosync.sync.target import ModelSpec
from colosync.wire.manifest import UpdateManifest, dtype_name


class Fetch(msgspec.Struct, tag="fetch", frozen=True):
    names: list[str] | None = None  # None: every tensor


class StoredTensor(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


class Fetched(msgspec.Struct, tag="fetched", frozen=True):
    update_id: int
    tensors: list[StoredTensor]


class StoreEngine(HostedTarget):
    requests: ClassVar[tuple[type, ...]] = (Fetch,)
    replies: ClassVar[tuple[type, ...]] = (Fetched,)

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> StoreEngine:
        return cls(config.device)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(params=None, lora_modules=None)

    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The staged views alias the Receiver's buffers, which are freed after commit: own a copy.
        return {name: t.clone() for name, t in tensors.items()}

    def commit(self, prepared: dict[str, torch.Tensor], update_id: int) -> None:
        self.tensors = prepared

    def discard(self, prepared: dict[str, torch.Tensor]) -> None:
        prepared.clear()

    def handle(self, request: Fetch) -> Fetched:
        names = request.names if request.names is not None else list(self.tensors)
        out = []
        for name in names:
            t = self.tensors[name].contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            out.append(StoredTensor(name, dtype_name(t.dtype), tuple(t.shape), raw))
        return Fetched(self.committed_update_id, out)
