"""Helpers shared by test modules (no tests here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from colosync.wire.bucket import typed_views
from colosync.wire.manifest import TensorMeta


def pack_into(buffer: torch.Tensor, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into their places in one bucket's ``uint8`` ``buffer`` (as a sender would)."""
    if metas:
        with torch.no_grad():
            torch._foreach_copy_(typed_views(buffer, metas), list(tensors))
