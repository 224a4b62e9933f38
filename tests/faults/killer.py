"""A trainer that SIGKILLs itself at a chosen instruction of a push (run as a child process).

``python -m tests.faults.killer ADDRESS_HEX POINT TRANSPORT MODEL_DIR SCALE DEVICE`` connects to the
engine, pushes the deterministic full update ``update_for(MODEL_DIR, SCALE)`` from tensors on
DEVICE and kills itself with SIGKILL
(a real, uncatchable death: no ``finally``, no ``atexit``, sockets closed by the kernel) at
``POINT``. A point is ``WHEN:Message:INDEX``: ``before`` or ``after`` submitting the INDEX-th
message of that type (``last`` for the final Stage, ``mid`` for the middle one), or ``replied``
once its reply was read. Only the moment is chosen here; the death and everything the engine
does about it are real.
"""

from __future__ import annotations

import os
import signal
import sys

import msgspec


class KillAt:
    """A Link that forwards to ``inner`` and kills this process at ``point``."""

    def __init__(self, inner, point: str, stages: int) -> None:
        self.inner = inner
        self.when, self.kind, index = point.split(":")
        self.index = {"last": stages - 1, "mid": stages // 2}.get(index)
        if self.index is None:
            self.index = int(index)
        self.seen: dict[str, int] = {}

    def _hit(self, request) -> bool:
        name = type(request).__name__
        count = self.seen.get(name, 0)
        self.seen[name] = count + 1
        return name == self.kind and count == self.index

    def submit(self, request):
        hit = self._hit(request)
        if hit and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        pending = self.inner.submit(request)
        if hit and self.when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and self.when == "replied":
            pending.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return pending

    def close(self) -> None:
        self.inner.close()


def main() -> None:
    address_hex, point, transport, model_dir, scale, device = sys.argv[1:7]
    from colosync.engines.config import EngineAddress
    from colosync.engines.process import connect
    from colosync.sync.sender import Sender
    from colosync.wire.bucket import plan_buckets
    from tests.faults.updates import BUCKET_BYTES, update_for

    address = msgspec.msgpack.decode(bytes.fromhex(address_hex), type=EngineAddress)
    named = [(n, t.to(device)) for n, t in update_for(model_dir, float(scale))]
    stages = len(plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], BUCKET_BYTES).bucket_sizes)
    link = KillAt(connect(address, "hf", name=f"killer {point}"), point, stages)
    sender = Sender(link, transport=transport, bucket_bytes=BUCKET_BYTES)
    sender.push(named)
    print("pushed without being killed", flush=True)
    sys.exit(3)  # the point was never reached: the test must notice


if __name__ == "__main__":
    main()
