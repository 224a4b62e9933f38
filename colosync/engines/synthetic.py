"""An engine of a given size with no model code: named weight tensors and a KV cache.

What the memory of a colocated step costs depends on sizes, not on what the weights
compute: a record of the handoff and the sync at 16 GB of weights and a KV cache filling
the GPU needs an engine that big, built in seconds, on a host without vLLM and without
16 GB of checkpoint to read. This one is the hf engine's full-update path (host staging,
one copy into the served weights at commit, cached blocks returned) over a module of
``layers.{i}.weight`` tensors laid out by ``SyntheticModel``; its KV cache is device
tensors the handoff drops and re-creates. It serves one request, ``Digest``: the wire
fingerprint of every served tensor, which a trainer compares with what it pushed.

Public API::

    SyntheticModel(weight_bytes=16 << 30, kv_bytes=80 << 30).save(folder)
    engine = EngineProcess(EngineConfig(engine="synthetic", model_dir=folder, device="cuda"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import msgspec
import torch

from colosync.engines.config import EngineConfig
from colosync.engines.hf import HFEngine
from colosync.errors import ConfigError
from colosync.wire.bucket import fingerprint_tensor
from colosync.wire.manifest import dtype_from_name

SPEC_FILE = "synthetic.json"
COLUMNS = 4096


class SyntheticModel(msgspec.Struct, frozen=True):
    """The sizes of a synthetic model: weights cut into ``tensor_bytes`` pieces of ``dtype``."""

    weight_bytes: int
    kv_bytes: int = 0
    tensor_bytes: int = 256 << 20
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        row = COLUMNS * dtype_from_name(self.dtype).itemsize
        if self.weight_bytes < row or self.tensor_bytes < row or self.kv_bytes < 0:
            raise ConfigError(
                f"a synthetic model needs weight_bytes and tensor_bytes >= one row of {row} bytes and kv_bytes >= 0, "
                f"got {self.weight_bytes}, {self.tensor_bytes}, {self.kv_bytes}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def layout(self) -> list[tuple[str, tuple[int, int]]]:
        """``(name, shape)`` of every weight: full ``tensor_bytes`` pieces, then the remainder."""
        row = COLUMNS * self.torch_dtype.itemsize
        rows, per = self.weight_bytes // row, max(1, self.tensor_bytes // row)
        shapes = [(per, COLUMNS)] * (rows // per) + ([(rows % per, COLUMNS)] if rows % per else [])
        return [(f"layers.{i}.weight", shape) for i, shape in enumerate(shapes)]

    def build(self, device: torch.device | str, seed: int | None = None) -> torch.nn.Module:
        """The weights on ``device``, drawn from ``seed`` (default: the model's)."""
        module = torch.nn.Module()
        layers = torch.nn.ModuleList()
        generator = torch.Generator(device=device).manual_seed(self.seed if seed is None else seed)
        for _name, shape in self.layout():
            holder = torch.nn.Module()
            weight = torch.empty(shape, dtype=self.torch_dtype, device=device)
            weight.normal_(0.0, 0.02, generator=generator)
            holder.weight = torch.nn.Parameter(weight, requires_grad=False)
            layers.append(holder)
        module.layers = layers
        return module

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SPEC_FILE).write_bytes(msgspec.json.encode(self))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> SyntheticModel:
        path = Path(folder) / SPEC_FILE
        if not path.is_file():
            raise ConfigError(f"{path} does not exist; write it with SyntheticModel(...).save({str(folder)!r})")
        return msgspec.json.decode(path.read_bytes(), type=cls)


def digest(tensors: list[torch.Tensor]) -> list[int]:
    """The wire fingerprint of each tensor's bytes (equal bytes, equal fingerprints, any device)."""
    sums = [fingerprint_tensor(t.detach().contiguous().reshape(-1).view(torch.uint8)) for t in tensors]
    return [int(s) for s in torch.stack(sums).cpu()] if sums else []


class Digest(msgspec.Struct, tag="digest", frozen=True):
    """Ask for the fingerprint of every served weight, in ``SyntheticModel.layout`` order."""


class Digests(msgspec.Struct, tag="digests", frozen=True):
    update_id: int
    fingerprints: list[int]


class SyntheticEngine(HFEngine):
    """``SyntheticModel``'s weights and KV cache behind the hf engine's update path."""

    requests: ClassVar[tuple[type, ...]] = (Digest,)
    replies: ClassVar[tuple[type, ...]] = (Digests,)

    def __init__(self, spec: SyntheticModel, device: torch.device | str) -> None:
        super().__init__(spec.build(device), max_lora_rank=1)
        self.spec = spec
        self._kv = self._new_kv()

    @classmethod
    def from_config(cls, config: EngineConfig) -> SyntheticEngine:
        return cls(SyntheticModel.load(config.model_dir), config.device)

    def _new_kv(self) -> list[torch.Tensor]:
        piece = 1 << 30
        sizes = [piece] * (self.spec.kv_bytes // piece) + (
            [self.spec.kv_bytes % piece] if self.spec.kv_bytes % piece else []
        )
        return [torch.zeros(n, dtype=torch.uint8, device=self.device) for n in sizes]

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        return self._kv

    def handle(self, request: Any) -> Any:  # Digests (the only request it registers)
        return Digests(self.committed_update_id, digest([p for _, p in self.model.named_parameters()]))


__all__ = ["Digest", "Digests", "SyntheticEngine", "SyntheticModel", "digest"]
