"""Helpers shared by test modules (no tests here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from colosync.engines.sink import SinkEngine
from colosync.wire.bucket import fingerprint, typed_views
from colosync.wire.manifest import TensorMeta, UpdateManifest
from colosync.wire.protocol import Stage

if TYPE_CHECKING:
    from colosync import LocalLink, Receiver
    from colosync.handoff.backends.host_pool import HostPool
    from colosync.sync.link import Link
    from colosync.wire.protocol import Ack, Probe


def pack_into(buffer: torch.Tensor, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` into their places in one bucket's ``uint8`` ``buffer`` (as a sender would)."""
    if metas:
        with torch.no_grad():
            torch._foreach_copy_(typed_views(buffer, metas), list(tensors))


def pack_bucket(manifest: UpdateManifest, bucket: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Bucket ``bucket`` of ``manifest`` as a sender packs it: a zeroed CPU ``uint8`` buffer, tensors in place."""
    metas = manifest.layout.bucket_tensors(bucket)
    buffer = torch.zeros(manifest.bucket_sizes[bucket], dtype=torch.uint8)
    pack_into(buffer, metas, [tensors[m.name] for m in metas])
    return buffer


def stage_bytes(
    receiver,
    transport,
    update_id: int,
    bucket: int,
    data: torch.Tensor,
    chunk: int | None = None,
    fingerprint_delta: int = 0,
    send_fingerprint: bool = True,
) -> None:
    """Stage ``data`` as bucket ``bucket``, ``chunk`` bytes at a time through the transport's slots in turn.

    The last chunk carries the fingerprint of ``data`` (plus ``fingerprint_delta``, to fake
    corruption in transit), or none at all without ``send_fingerprint``.
    """
    size = data.numel()
    chunk = chunk or max(size, 1)
    sent = fingerprint(data) + fingerprint_delta if send_fingerprint else None
    for i, offset in enumerate(range(0, max(size, 1), chunk)):
        piece = data[offset : offset + chunk]
        slot = i % transport.num_slots
        transport.slot(slot)[: piece.numel()].copy_(piece)
        last = offset + piece.numel() == size
        receiver.handle(Stage(update_id, bucket, offset, piece.numel(), slot, sent if last else None))


# -- handoff: small real participants (tens of MB of CPU tensors) ----------------------------
# Sizes are multiples of the pool chunk so pool rounding stays small, and large enough
# (>= 4 MiB per tensor, ~50 MB per host copy) that host-memory sampling sees them clearly above
# interpreter noise, yet small enough to stay fast on two shared cores.

MiB = 1 << 20
CHUNK = 4 * MiB
GB = 10**9  # decimal, as the handoff simulator's sizes are given


def make_trainer_state(layers: int = 4, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``layers`` x 4 MiB fp32 weights, their grads and AdamW state (48 MiB backed up + 16 MiB grads)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return model, opt


def make_engine_state(
    layers: int = 3, width: int = 2048, kv_tensors: int = 2
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """``layers`` x 16 MiB weights (48 MiB) and ``kv_tensors`` x 16 MiB KV cache."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for p in model.parameters():
        p.requires_grad_(False)
    kv = [torch.ones(16 * MiB // 4) for _ in range(kv_tensors)]
    return model, kv


def cpu_host_pool(**kw: Any) -> HostPool:
    """An unpinned ``HostPool`` of ``CHUNK``-byte chunks (``chunk_bytes=`` overrides)."""
    from colosync.handoff.backends.host_pool import HostPool

    return HostPool(chunk_bytes=kw.pop("chunk_bytes", CHUNK), pin="none", **kw)


# -- verified commits: a probe on the Commit of the next push ---------------------------------


class _Recorded:
    def __init__(self, pending, acks: list) -> None:
        self._pending, self._acks = pending, acks

    def wait(self) -> Ack:
        ack = self._pending.wait()
        self._acks.append(ack)
        return ack


class ProbingLink:
    """A ``Link`` in front of ``link`` that puts ``probe`` on every ``Commit`` and keeps the Commits' Acks.

    A Sender sends ``Commit(update_id)``; this is how a test makes that a verified commit.
    """

    def __init__(self, link: Link, probe: Probe) -> None:
        self.link, self.probe = link, probe
        self.acks: list = []

    def submit(self, request):
        from colosync.wire.protocol import Commit

        if isinstance(request, Commit):
            return _Recorded(self.link.submit(Commit(request.update_id, probe=self.probe)), self.acks)
        return self.link.submit(request)

    def close(self) -> None:
        self.link.close()


class probing:  # lower case: used like contextlib's context managers
    """``with probing(sender, probe) as link:`` -- the sender's pushes commit with ``probe``; ``link.acks``."""

    def __init__(self, sender, probe) -> None:
        self.sender, self.link = sender, ProbingLink(sender.link, probe)

    def __enter__(self) -> ProbingLink:
        self.sender.link = self.link
        return self.link

    def __exit__(self, *exc: object) -> None:
        self.sender.link = self.link.link


# -- sync: sink engines that record, tie or miscount, behind a Receiver in this process -------------


def local_receiver(engine) -> tuple[Receiver, LocalLink]:
    """``engine`` behind a CPU ``Receiver`` in this process, and the ``LocalLink`` to it (close the receiver)."""
    from colosync import LocalLink, Receiver

    receiver = Receiver(engine, "cpu")
    return receiver, LocalLink(receiver)


def lora_named(rank: int = 4) -> list[tuple[str, torch.Tensor]]:
    """A PEFT-named LoRA pair (``lora_A`` / ``lora_B``) of one ``q_proj``, at ``rank``."""
    g = torch.Generator().manual_seed(3)
    module = "model.layers.0.self_attn.q_proj"
    return [
        (f"base_model.model.{module}.lora_A.weight", torch.randn(rank, 16, generator=g)),
        (f"base_model.model.{module}.lora_B.weight", torch.randn(16, rank, generator=g)),
    ]


class MiscountingSink(SinkEngine):
    """A sink whose commit reports that it changed nothing of a full update (while ``miscount``), and cannot revert."""

    miscount = True

    def commit(self, prepared, update_id):
        from colosync.sync.target import Changes

        super().commit(prepared, update_id)
        expected = len(prepared[2])
        return Changes(changed=0 if self.miscount else expected, expected=expected)


class TiedSink(SinkEngine):
    """A sink whose model ties ``head.weight`` to ``embed.weight`` (one tensor, two names)."""

    def model_spec(self):
        from colosync.sync.target import ModelSpec

        return ModelSpec(params=None, lora_modules=None, tied={"head.weight": "embed.weight"})
