"""Device memory the engine lends the trainer, so that a handoff frees and allocates nothing.

In both built-in orders the engine's KV cache and the trainer's state are never on the device
at once: ``engine.offload_kv`` comes before ``trainer.wake_up``, ``trainer.sleep`` before
``engine.onload_kv``. Through the allocator, each handoff is still a free of the whole KV cache
in one process and a fresh allocation in the other, and on an H200 the driver's work on 124 GB
of freed memory made the trainer's wake-up copies 0.27 s slower than its pinned floor
(``benchmarks/colocated-step``). A loan takes the allocator out: the engine allocates its KV
cache once in a block it can export, the trainer maps that block once and wakes its state and
gradient buffer up inside it, and neither process ever frees it while the job runs.

``DeviceLoan`` is that block. On CUDA it is one ``cudaMalloc`` outside PyTorch's pools,
exported with ``cudaIpcGetMemHandle`` and opened once by the borrower (the ``cuda_ipc``
transport's calls); on the CPU it is a POSIX shared-memory segment, so the same code runs
across real processes in CPU-only jobs and tests. A borrower in the lender's own process uses
the block directly. ``view(offset, nbytes)`` gives a ``uint8`` tensor whose storage is exactly
that span, which a ``TensorStash`` restores into as it would into its own allocation.

The loan only moves memory; who uses it when is the plan's business. The executor hands it
over for plans built with ``HandoffConfig(lend_kv=True)``, whose order keeps the two users
apart, and each operation synchronises its device before it returns.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from multiprocessing import resource_tracker
from typing import Any

import torch

from colosync.errors import StashError
from colosync.transports import cuda_ipc, shm
from colosync.wire.protocol import LoanHandle

log = logging.getLogger(__name__)

PREFIX = "colosync-loan-"
ALIGN = 1 << 21  # views start on 2 MiB boundaries, the GPU's large-page size

_LENT: weakref.WeakValueDictionary[bytes | str, DeviceLoan] = weakref.WeakValueDictionary()
"""This process's own loans, by handle: a borrower in the lender's process uses the block itself."""


class _Span:
    """``nbytes`` of device memory at ``ptr``, seen by torch as one storage; keeps its block alive."""

    def __init__(self, block: cuda_ipc.DeviceBuffer, ptr: int, nbytes: int) -> None:
        self.block, self.ptr, self.nbytes = block, ptr, nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}


class DeviceLoan:
    """A block of device memory lent across processes (see module docstring).

    ``DeviceLoan.allocate(nbytes, device)`` in the lender, ``DeviceLoan.borrow(handle, device)``
    in the borrower; ``close()`` on each side when the job ends.
    """

    def __init__(self, handle: LoanHandle, device: torch.device, block: Any, *, lender: bool) -> None:
        self.handle = handle
        self.device = device
        self.lender = lender
        self._block = block  # cuda_ipc.DeviceBuffer or shm.Segment
        self._base = block.ptr if handle.kind == "cuda_ipc" else block.span(0, 1).data_ptr()
        self._linked = lender and handle.kind == "shm"

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device | str) -> DeviceLoan:
        device = torch.device(device)
        if nbytes <= 0:
            raise StashError(f"a loan needs a positive size, got {nbytes} bytes")
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            block: Any = cuda_ipc.allocate(nbytes, index)
            raw = cuda_ipc.runtime().export(block.ptr)
            handle = LoanHandle("cuda_ipc", nbytes, os.getpid(), handle=raw, device_uuid=cuda_ipc.device_uuid(index))
            key: bytes | str = raw
        elif device.type == "cpu":
            name = PREFIX + secrets.token_hex(12)
            resource_tracker.register("/" + name, "shared_memory")  # unlinked if this process is killed
            try:
                block = shm.Segment(name, nbytes, create=True, pin=False)
            except BaseException:
                _forget(name)
                raise
            handle = LoanHandle("shm", nbytes, os.getpid(), name=name)
            key = name
        else:
            raise StashError(f"a loan lives on a CUDA device or the CPU, not on {device}")
        loan = cls(handle, device, block, lender=True)
        _LENT[key] = loan
        log.info("loan: %.3f GB on %s to lend (%s)", nbytes / 1e9, device, handle.kind)
        return loan

    @classmethod
    def borrow(cls, handle: LoanHandle, device: torch.device | str) -> DeviceLoan:
        device = torch.device(device)
        if handle.kind not in ("cuda_ipc", "shm"):
            raise StashError(f"unknown loan kind {handle.kind!r}: the lender runs another colosync; upgrade both")
        own = (
            _LENT.get(handle.handle if handle.kind == "cuda_ipc" else handle.name)
            if handle.pid == os.getpid()
            else None
        )
        if own is not None and own._block is not None:
            return cls(handle, device, own._block, lender=False)
        if handle.kind == "cuda_ipc":
            if device.type != "cuda":
                raise StashError(f"the engine lends GPU memory; the trainer's device is {device}: put it on that GPU")
            index = cuda_ipc.index_of(handle.device_uuid)
            if device.index is not None and device.index != index:
                raise StashError(
                    f"the engine lends memory on cuda:{index}, the trainer runs on {device}: a loan needs both "
                    "on one GPU; turn lend_kv off for this pair"
                )
            block: Any = cuda_ipc.open_handle(handle.handle, index, handle.nbytes)
        else:
            if device.type != "cpu":
                raise StashError(f"the engine lends host memory (a CPU job); the trainer's device is {device}")
            if not handle.name.startswith(PREFIX):
                raise StashError(f"refusing to map {handle.name!r}: not a colosync loan (names start with {PREFIX!r})")
            block = shm.Segment(handle.name, handle.nbytes, create=False, pin=False)
        return cls(handle, device, block, lender=False)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the block from ``offset``, as a ``uint8`` tensor whose storage is exactly that span."""
        if self._block is None:
            raise StashError("the loan is closed")
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise StashError(
                f"a view of {nbytes} bytes at {offset} does not fit the {self.nbytes}-byte loan; what lives in the "
                "block (the engine's KV cache, or the trainer's state and grad buffer) must fit it"
            )
        if self.handle.kind == "cuda_ipc":
            span = _Span(self._block, self._block.ptr + offset, nbytes)
            t = torch.as_tensor(span, device=self.device)
            if t.data_ptr() != span.ptr:
                raise StashError("torch copied the lent memory instead of viewing it")
            return t
        segment: shm.Segment = self._block
        return segment.span(offset, nbytes)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies inside the block."""
        return self._block is not None and self._base <= tensor.data_ptr() < self._base + self.nbytes

    def close(self) -> None:
        """Drop this side's hold; the memory goes once no tensor views it any more. The borrower
        closes first: a lender that frees the block under a borrower awake in it leaves the
        borrower's tensors undefined (on CUDA as on the CPU)."""
        block, self._block = self._block, None
        if block is None:
            return
        if self._linked:
            _forget(self.handle.name)
            self._linked = False
        if isinstance(block, shm.Segment) and (self.lender or self.handle.pid != os.getpid()):
            block.close()

    def __enter__(self) -> DeviceLoan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        side = "lent" if self.lender else "borrowed"
        return f"DeviceLoan({self.nbytes / 1e9:.3f} GB {side}, {self.handle.kind}, {self.device})"


def _forget(name: str) -> None:
    shm._unlink(name)
    resource_tracker.unregister("/" + name, "shared_memory")
