"""Pack named tensors into flat byte buckets and view them back without copying.

Transports move a few large byte ranges, never per-tensor messages: every tensor gets an
aligned offset inside a ``uint8`` bucket under a size cap (a tensor larger than the cap gets
a bucket of its own). Packing is one fused ``torch._foreach_copy_`` per bucket and unpacking
returns views, so the hot path has no Python loop of device copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from colosync.errors import ManifestError
from colosync.wire.manifest import ALIGN, Layout, TensorMeta, align_up, dtype_name

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class TensorSpec(NamedTuple):
    """A tensor as a plan sees it: its name, shape and dtype, before any byte exists."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


def plan_buckets(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> Layout:
    """Assign each ``TensorSpec`` a bucket and an aligned offset, in the given order.

    Only shapes are needed, so a streaming source can plan before it materializes anything.
    Each bucket's size is padded to ``ALIGN``.
    """
    if bucket_bytes < ALIGN:
        raise ManifestError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}; use a larger bucket")
    metas: list[TensorMeta] = []
    sizes: list[int] = []
    used = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        padded = align_up(nbytes)
        if not sizes or (used + padded > bucket_bytes and used > 0):
            sizes.append(0)
            used = 0
        metas.append(
            TensorMeta(
                name=name,
                dtype=dtype_name(dtype),
                shape=tuple(shape),
                bucket=len(sizes) - 1,
                offset=used,
                nbytes=nbytes,
            )
        )
        used += padded
        sizes[-1] = used
    return Layout(tuple(metas), tuple(sizes))


def tensor_views(buffer: torch.Tensor, metas: Iterable[TensorMeta]) -> dict[str, torch.Tensor]:
    """Zero-copy typed views of ``metas`` inside one bucket's ``uint8`` buffer."""
    return {m.name: buffer[m.offset : m.offset + m.nbytes].view(m.torch_dtype).view(m.shape) for m in metas}


def typed_views(buffer: torch.Tensor, metas: Iterable[TensorMeta]) -> list[torch.Tensor]:
    """Like ``tensor_views`` but a list, in ``metas`` order."""
    return [buffer[m.offset : m.offset + m.nbytes].view(m.torch_dtype).view(m.shape) for m in metas]


_FP_ROW = 1024  # int64 words per fingerprint row (8 KiB)


def fingerprint_tensor(buffer: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """The fingerprint of ``buffer`` as a 0-d int64 tensor on its device, without a sync.

    ``buffer`` holds bytes ``[offset, offset + len)`` of a bucket (``offset`` and the length are
    multiples of 8): word ``i`` of the bucket counts ``word * (i // 1024 + 1)``, so the
    fingerprints of consecutive chunks add up to the bucket's (integer sums wrap identically
    on every device). Sender and receiver can therefore fingerprint a bucket chunk by chunk,
    wherever each chunk's bytes already are.
    """
    words = buffer.view(torch.int64)
    first = offset // 8
    head = min((-first) % _FP_ROW, words.numel())
    parts = []
    if head:
        parts.append(words[:head].sum() * (first // _FP_ROW + 1))
    rest = words[head:]
    row0 = (first + head) // _FP_ROW
    rows = rest.numel() // _FP_ROW
    if rows:
        body = rest[: rows * _FP_ROW].view(rows, _FP_ROW).sum(dim=1)
        weights = torch.arange(row0 + 1, row0 + rows + 1, device=buffer.device, dtype=torch.int64)
        parts.append((body * weights).sum())
    if rest.numel() > rows * _FP_ROW:
        parts.append(rest[rows * _FP_ROW :].sum() * (row0 + rows + 1))
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=buffer.device)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def fingerprint(buffer: torch.Tensor) -> int:
    """A cheap position-sensitive checksum of a bucket, computed where the bytes are.

    Integer sums wrap identically on every device, so sender (e.g. CUDA) and receiver (e.g.
    CPU) agree bit for bit. Rows of 8 KiB are summed and weighted by their index, so any
    changed word or moved row changes the result. One read pass over the bucket.
    """
    if buffer.numel() == 0:
        return 0
    return int(fingerprint_tensor(buffer))


def float_runs(metas: Sequence[TensorMeta], base: int = 0) -> list[tuple[int, int, torch.dtype]] | None:
    """Byte ranges ``[start, end)`` (relative to ``base``) of consecutive same-dtype floating tensors.

    A non-finite check can then read a whole run (padding between its tensors included) as
    one tensor instead of one view per parameter. ``None`` if some floating tensor is 1-byte
    (fp8 has no reduction kernels), so the caller checks tensor by tensor.
    """
    runs: list[tuple[int, int, torch.dtype]] = []
    open_run = False  # may the next tensor extend the last run (nothing else in between)?
    for m in sorted(metas, key=lambda m: m.offset):
        dtype = m.torch_dtype
        if not dtype.is_floating_point:
            open_run = False
            continue
        if m.nbytes == 0:
            continue
        if dtype.itemsize == 1:
            return None
        start, end = m.offset - base, m.offset - base + m.nbytes
        if open_run and runs[-1][2] == dtype and (start - runs[-1][1]) % dtype.itemsize == 0:
            runs[-1] = (runs[-1][0], end, dtype)
        else:
            runs.append((start, end, dtype))
        open_run = True
    return runs


__all__ = [
    "ALIGN",
    "NamedTensors",
    "TensorSpec",
    "plan_buckets",
    "tensor_views",
    "fingerprint",
    "fingerprint_tensor",
    "typed_views",
    "float_runs",
]
