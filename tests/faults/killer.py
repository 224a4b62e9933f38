"""A trainer that SIGKILLs itself at a chosen instruction of a push (run as a child process).

``python -m tests.faults.killer ADDRESS_HEX POINT TRANSPORT MODEL_DIR SCALE DEVICE [FIRST_SCALE]`` connects
to the engine, pushes the deterministic full update ``update_for(MODEL_DIR, SCALE)`` from tensors on
DEVICE and kills itself with SIGKILL
(a real, uncatchable death: no ``finally``, no ``atexit``, sockets closed by the kernel) at
``POINT``. A point is ``WHEN:Message:INDEX``: ``before`` or ``after`` submitting the INDEX-th
message of that type (``mid`` for the middle Stage), or ``replied`` once its reply was read. The
link batches like the engine's socket does, so the update's tail (its last Stage, Prepare and
Commit) is one message, ``Batch``. With FIRST_SCALE the child first pushes that version without
dying, so the push that dies begins with ``BeginAgain``. Only the moment is chosen here; the death
and everything the engine does about it are real.
"""

from __future__ import annotations

import os
import signal
import sys

import msgspec


class KillAt:
    """A Link that forwards to ``inner`` and kills this process at ``point`` once ``armed``."""

    def __init__(self, inner, point: str, stages: int) -> None:
        self.inner = inner
        self.when, self.kind, index = point.split(":")
        self.index = {"mid": (stages - 1) // 2}.get(index)  # (the last Stage travels in the Batch)
        if self.index is None:
            self.index = int(index)
        self.seen: dict[str, int] = {}
        self.armed = True

    def _hit(self, name: str) -> bool:
        if not self.armed:
            return False
        count = self.seen.get(name, 0)
        self.seen[name] = count + 1
        return name == self.kind and count == self.index

    def _around(self, hit: bool, send, wait):
        if hit and self.when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        sent = send()
        if hit and self.when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and self.when == "replied":
            wait(sent)
            os.kill(os.getpid(), signal.SIGKILL)
        return sent

    def submit(self, request):
        hit = self._hit(type(request).__name__)
        return self._around(hit, lambda: self.inner.submit(request), lambda pending: pending.wait())

    def submit_batch(self, requests):
        hit = self._hit("Batch")
        return self._around(hit, lambda: self.inner.submit_batch(requests), lambda parts: parts[-1].wait())

    def close(self) -> None:
        self.inner.close()


def main() -> None:
    address_hex, point, transport, model_dir, scale, device = sys.argv[1:7]
    first_scale = sys.argv[7] if len(sys.argv) > 7 else None
    from colosync.control.channel import EngineAddress
    from colosync.engines.process import connect
    from colosync.sync.sender import Sender
    from colosync.wire.bucket import plan_buckets
    from tests.faults.updates import BUCKET_BYTES, update_for

    address = msgspec.msgpack.decode(bytes.fromhex(address_hex), type=EngineAddress)
    named = [(n, t.to(device)) for n, t in update_for(model_dir, float(scale))]
    stages = len(plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], BUCKET_BYTES).bucket_sizes)
    link = KillAt(connect(address, "hf", name=f"killer {point}"), point, stages)
    sender = Sender(link, transport=transport, bucket_bytes=BUCKET_BYTES)
    if first_scale is not None:  # the engine already serves this version: a push that changes nothing
        link.armed = False
        sender.push([(n, t.to(device)) for n, t in update_for(model_dir, float(first_scale))])
        link.armed = True
    sender.push(named)
    print("pushed without being killed", flush=True)
    sys.exit(3)  # the point was never reached: the test must notice


if __name__ == "__main__":
    main()
