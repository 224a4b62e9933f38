"""The ``cuda_ipc`` mechanism alone, as a floor row of ``colosync bench``: what the library adds is the rest.

colosync's ``cuda_ipc`` path is a persistent exported buffer, an interprocess event and a
fused copy-out with a check, wrapped in a manifest, a transaction and its messages. This path
keeps only the mechanism: the trainer packs every tensor into one buffer exported once
(a CUDA graph of copies, then a checksum into the buffer's tail), records an interprocess
event and sends one byte through a pipe; the engine makes its stream wait for that event,
replays a CUDA graph that copies every tensor out into its own and checks the checksum, and
answers once its verdict is on the host. No manifest, no fingerprint per bucket, no NaN/Inf
check, no commit: a lower bound for the same two processes on the same GPU, in the same run.
"""

from __future__ import annotations

import pickle
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import msgspec
import torch

from colosync.errors import EngineError
from colosync.tools.bench.refpaths import EngineOverPipe
from colosync.wire.manifest import align_up, dtype_from_name, dtype_name

Meta = tuple[str, str, tuple[int, ...], int]  # name, dtype, shape, byte offset in the buffer


def _views(buffer: torch.Tensor, metas: list[Meta]) -> list[torch.Tensor]:
    return [
        buffer[offset : offset + torch.Size(shape).numel() * dtype_from_name(dtype).itemsize]
        .view(dtype_from_name(dtype))
        .view(shape)
        for _, dtype, shape, offset in metas
    ]


def _checksum(buffer: torch.Tensor, payload: int, out: torch.Tensor) -> None:
    """The sum of the payload's int32 words into ``out`` (a 0-d int64), on the current stream."""
    torch.sum(buffer[:payload].view(torch.int32), dim=0, dtype=torch.int64, out=out)


def _engine(conn: Connection, device: str) -> None:
    torch.cuda.set_device(torch.device(device))
    buffer, event_handle, metas, payload = pickle.loads(conn.recv_bytes())  # the buffer's handle, opened once
    event = torch.cuda.Event.from_ipc_handle(torch.device(device), event_handle)
    sent = buffer[payload : payload + 8].view(torch.int64)[0]
    # The engine's own tensors, laid out as in the buffer (zeroed: padding sums the same on both sides).
    own_flat = torch.zeros(payload, dtype=torch.uint8, device=device)
    own = _views(own_flat, metas)
    mine = torch.zeros((), dtype=torch.int64, device=device)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch._foreach_copy_(own, _views(buffer, metas))  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            torch._foreach_copy_(own, _views(buffer, metas))  # one copy per tensor, as an engine must
            _checksum(own_flat, payload, mine)
            ok = torch.eq(mine, sent)
    stream.synchronize()
    conn.send_bytes(b"ready")
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            break
        if data == b"digest":
            from colosync.engines.sink import tensor_digests

            conn.send_bytes(msgspec.msgpack.encode([[m[0] for m in metas], tensor_digests(own)]))
            continue
        stream.wait_event(event)  # the trainer's pack, on its own context, is done
        graph.replay()
        conn.send_bytes(b"ok" if bool(ok.item()) else b"bad")  # .item(): the verdict is on the host


class MechanismPath(EngineOverPipe):
    """The trainer side and one engine process of the bare ``cuda_ipc`` mechanism."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
        import torch.multiprocessing

        metas: list[Meta] = []
        offset = 0
        for name, t in named:
            metas.append((name, dtype_name(t.dtype), tuple(t.shape), offset))
            offset = align_up(offset + t.nbytes)
        self.payload = offset
        self.buffer = torch.zeros(offset + 8, dtype=torch.uint8, device=device)  # checksum in the tail
        self.event = torch.cuda.Event(interprocess=True)
        self.stream = torch.cuda.Stream(device)
        self._graph = torch.cuda.CUDAGraph()
        sources = [t for _, t in named]
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(_views(self.buffer, metas), sources)
            with torch.cuda.graph(self._graph, stream=self.stream):
                torch._foreach_copy_(_views(self.buffer, metas), sources)
                _checksum(self.buffer, self.payload, self.buffer[offset : offset + 8].view(torch.int64)[0])
        self.stream.synchronize()
        self._spawn(_engine, str(device))
        self._conn.send_bytes(ForkingPickler.dumps((self.buffer, self.event.ipc_handle(), metas, self.payload)))
        try:
            ready = self._conn.recv_bytes()
        except EOFError:
            self._process.join(10)
            raise EngineError(
                f"the mechanism's engine process exited (code {self._process.exitcode}) before it was ready; "
                f"it and this process hold {2 * self.payload / 2**30:.1f} GiB on {device} (see its traceback above), "
                "so pass --no-floor where the device cannot hold that beside the trainer's tensors"
            ) from None
        if ready != b"ready":
            raise EngineError("the mechanism's engine process did not get ready")

    def push(self) -> float:
        """One update: pack + checksum, event, one message; returns seconds until the engine's verdict."""
        start = time.perf_counter()
        self._graph.replay()
        self.event.record(self.stream)
        self._conn.send_bytes(b"go")
        reply = self._conn.recv_bytes()
        if reply != b"ok":
            raise EngineError(f"the mechanism's engine answered {reply!r}: its checksum did not match")
        return time.perf_counter() - start
