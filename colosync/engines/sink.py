"""An engine that keeps its weights in persistent tensors it owns, double-buffered.

What a serving engine does with an update, minus the model: it owns two sets of tensors per
layout, serves one and lends the other to the Receiver (``EngineTarget.staging``), which
copies each bucket straight from the transport into it; ``commit`` swaps the two. An update
is therefore done when its bytes are in engine-owned tensors, with no per-update allocation
or per-tensor work on the receive path. It accepts any names, shapes and dtypes (like the
``store`` engine) and is what ``colosync bench`` measures against. ``Digest`` returns the
fingerprint of every committed tensor so a caller can check the bytes without moving them.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import torch

from colosync.engines.config import EngineConfig
from colosync.engines.host import HostedTarget
from colosync.sync.target import ModelSpec, Staging
from colosync.wire.bucket import fingerprint_tensor, typed_views
from colosync.wire.manifest import TensorMeta, UpdateManifest


class Digest(msgspec.Struct, tag="digest", frozen=True):
    pass


class Digested(msgspec.Struct, tag="digested", frozen=True):
    update_id: int
    names: list[str]
    fingerprints: list[int]
    engine_bytes: int  # device bytes the engine holds for its tensors (both sets)
    receiver_bytes: int  # device bytes the Receiver keeps between updates (its bounce buffer)


def tensor_digests(tensors: list[torch.Tensor]) -> list[int]:
    """One fingerprint per tensor (its bytes, zero-padded to 8), read back in one transfer."""
    parts = []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() % 8:
            raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
        parts.append(fingerprint_tensor(raw) if raw.numel() else torch.zeros((), dtype=torch.int64, device=t.device))
    if not parts:
        return []
    return torch.stack([p.to(parts[0].device) for p in parts]).tolist()


def _allocate(tensors: tuple[TensorMeta, ...], bucket_sizes: tuple[int, ...], device: torch.device) -> Staging:
    """One flat allocation laid out like the update's buckets, viewed as the tensors."""
    bases, total = [], 0
    for size in bucket_sizes:
        bases.append(total)
        total += size
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    buckets = [flat[base : base + size] for base, size in zip(bases, bucket_sizes, strict=True)]
    return Staging([typed_views(buckets[m.bucket], [m])[0] for m in tensors], buckets)


class SinkEngine(HostedTarget):
    requests: ClassVar[tuple[type, ...]] = (Digest,)
    replies: ClassVar[tuple[type, ...]] = (Digested,)

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self._served: tuple | None = None  # (layout, tensors list)
        self._spare: tuple | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> SinkEngine:
        return cls(config.device)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(params=None, lora_modules=None)

    def staging(self, manifest: UpdateManifest) -> Staging:
        spare = self._spare
        if spare is None or (spare[0] is not manifest.layout and spare[0] != manifest.layout):
            spare = self._spare = (manifest.layout, _allocate(manifest.tensors, manifest.bucket_sizes, self.device))
        return spare[1]

    def prepare(self, manifest: UpdateManifest, tensors: dict[str, torch.Tensor]) -> tuple:
        spare, self._spare = self._spare, None  # lent tensors now belong to this prepared update
        if spare is None:  # a Receiver that did not use staging(): own a copy
            return (manifest.layout, None, {name: t.clone() for name, t in tensors.items()})
        return (spare[0], spare[1], tensors)

    def commit(self, prepared: tuple, update_id: int) -> None:
        old, self._served = self._served, prepared
        self.tensors = prepared[2]
        if old is not None and old[1] is not None:
            self._spare = (old[0], old[1])

    def discard(self, prepared: tuple) -> None:
        if prepared[1] is not None:
            self._spare = (prepared[0], prepared[1])

    def handle(self, request: Digest) -> Digested:
        held = {
            id(t.untyped_storage()): t.untyped_storage().nbytes()
            for pair in (self._served, self._spare)
            if pair is not None and pair[1] is not None
            for t in pair[1].tensors[:1]
        }
        names = list(self.tensors)
        return Digested(
            self.committed_update_id,
            names,
            tensor_digests([self.tensors[n] for n in names]),
            sum(held.values()),
            self.receiver.buffer_bytes,
        )
