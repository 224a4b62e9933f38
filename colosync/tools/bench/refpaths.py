"""Two sync paths RL frameworks commonly use, rebuilt as references for ``colosync bench`` -- nothing else.

Both are the paths the public reports alibaba/ROLL #484 and radixark/miles #2781 describe.

* ``fresh_ipc`` -- the common default: every update flattens each bucket into a fresh CUDA
  tensor and pickles it with ``ForkingPickler``, which exports a new CUDA IPC handle (plus
  PyTorch's reference-counting file and event); the engine unpickles it, which opens the
  handle, copies the bytes into its own tensors and replies.
* ``pickle`` -- the common CPU staging fallback: ``bucket.to("cpu")``, ``pickle``,
  an RPC carrying the bytes, ``pickle.loads`` and one ``.to(device)`` on the engine.

Both engines end an update the way colosync's ``sink`` engine does: the bytes are in
persistent engine-owned tensors. These paths unpickle on the receive path on purpose -- that
is what is being measured against; colosync's own receive path never imports this module.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import msgspec
import torch

from colosync.errors import ConfigError, EngineError
from colosync.wire.manifest import dtype_from_name, dtype_name

MODES = ("fresh_ipc", "pickle")


def _engine(conn: Connection, device: str, mode: str) -> None:
    torch.cuda.set_device(torch.device(device))
    own: dict[str, torch.Tensor] = {}
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            break
        if data == b"digest":
            from colosync.engines.sink import tensor_digests

            names = sorted(own)
            conn.send_bytes(msgspec.msgpack.encode([names, tensor_digests([own[n] for n in names])]))
            continue
        flat, metas = pickle.loads(data)  # fresh_ipc: opens the CUDA IPC handle; pickle: CPU bytes
        if mode == "pickle":
            flat = flat.to(device)
        views, dests = [], []
        for name, dtype, shape, offset, nbytes in metas:
            views.append(flat[offset : offset + nbytes].view(dtype_from_name(dtype)).view(shape))
            dest = own.get(name)
            if dest is None:
                dest = own[name] = torch.empty(shape, dtype=dtype_from_name(dtype), device=device)
            dests.append(dest)
        torch._foreach_copy_(dests, views)
        torch.cuda.synchronize()
        del flat, views
        conn.send_bytes(b"ok")


class EngineOverPipe:
    """A spawned engine process answering on a pipe: ``digest`` for its tensors' digests, ``stop`` to end."""

    def _spawn(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self._process.start()
        child.close()

    def digests(self) -> dict[str, int]:
        self._conn.send_bytes(b"digest")
        names, fps = msgspec.msgpack.decode(self._conn.recv_bytes())
        return dict(zip(names, fps, strict=False))

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send_bytes(b"stop")
            self._process.join(30)
            if self._process.is_alive():
                self._process.terminate()
        self._conn.close()


class ReferencePath(EngineOverPipe):
    """One reference engine process and the trainer side of its path."""

    def __init__(self, mode: str, device: torch.device, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown reference path {mode!r}; choose from {list(MODES)} (or --references none)")
        import torch.multiprocessing  # noqa: F401 - registers ForkingPickler's CUDA tensor reductions

        self.mode, self.device, self.buckets = mode, device, buckets
        self._spawn(_engine, str(device), mode)

    def push(self) -> float:
        """One update through the reference path; returns seconds, engine side done."""
        start = time.perf_counter()
        for bucket in self.buckets:
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])  # a fresh flattened bucket
            metas, offset = [], 0
            for name, t in bucket:
                metas.append((name, dtype_name(t.dtype), tuple(t.shape), offset, t.nbytes))
                offset += t.nbytes
            payload: bytes | memoryview
            if self.mode == "fresh_ipc":
                payload = ForkingPickler.dumps((flat, metas))  # a new CUDA IPC handle every time
            else:
                payload = pickle.dumps((flat.to("cpu"), metas))
            self._conn.send_bytes(payload)
            reply = self._conn.recv_bytes()
            if reply != b"ok":
                raise EngineError(
                    f"reference engine ({self.mode}) answered {reply[:60]!r} to a bucket instead of b'ok'"
                )
            del flat, payload
        return time.perf_counter() - start
