"""Pack named tensors into flat byte buckets and view them back without copying.

Transports move a few large byte ranges, never per-tensor messages: every tensor gets an
aligned offset inside a ``uint8`` bucket under a size cap (a tensor larger than the cap gets
a bucket of its own). Packing is one fused ``torch._foreach_copy_`` per bucket and unpacking
returns views, so the hot path has no Python loop of device copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from .manifest import ALIGN, TensorMeta, align_up, dtype_name

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def plan_buckets(
    specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int
) -> tuple[list[TensorMeta], list[int]]:
    """Assign each ``(name, shape, dtype)`` a bucket and an aligned offset, in the given order.

    Only shapes are needed, so a streaming source can plan before it materializes anything.
    Returns the tensor metadata and each bucket's size (padded to ``ALIGN``).
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
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
    return metas, sizes


def tensor_views(buffer: torch.Tensor, metas: Iterable[TensorMeta]) -> dict[str, torch.Tensor]:
    """Zero-copy typed views of ``metas`` inside one bucket's ``uint8`` buffer."""
    return {
        m.name: buffer[m.offset : m.offset + m.nbytes].view(m.torch_dtype).view(m.shape)
        for m in metas
    }


def pack_into(buffer: torch.Tensor, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into their slots of ``buffer`` with one fused copy."""
    if not metas:
        return
    dst = list(tensor_views(buffer, metas).values())
    with torch.no_grad():
        torch._foreach_copy_(dst, [t.detach() for t in tensors])


_FP_ROW = 1024  # int64 words per fingerprint row (8 KiB)


def fingerprint(buffer: torch.Tensor) -> int:
    """A cheap position-sensitive checksum of a bucket, computed where the bytes are.

    Integer sums wrap identically on every device, so sender (e.g. CUDA) and receiver (e.g.
    CPU) agree bit for bit. Rows of 8 KiB are summed and weighted by their index, so any
    changed word or moved row changes the result. One read pass over the bucket.
    """
    if buffer.numel() == 0:
        return 0
    words = buffer.view(torch.int64)
    rows = words.numel() // _FP_ROW
    body = words[: rows * _FP_ROW].view(rows, _FP_ROW).sum(dim=1)
    weights = torch.arange(1, rows + 1, device=buffer.device, dtype=torch.int64)
    tail = words[rows * _FP_ROW :].sum() * (rows + 1)
    return int((body * weights).sum() + tail)


__all__ = ["ALIGN", "NamedTensors", "plan_buckets", "pack_into", "tensor_views", "fingerprint"]
