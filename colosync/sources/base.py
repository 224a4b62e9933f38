"""What every trainer-side source shares, so a framework can change sources without changing its loop.

* **One interface.** ``Source`` is what ``MegatronSource``, ``FsdpSource`` and ``PlainSource``
  all are: ``specs()`` before anything moves, ``tensors()`` as a collective stream, and
  ``push(sender)`` on every rank, returning the ``SyncReport`` where a Sender sent and ``None``
  elsewhere.
* **One rank per engine.** ``EngineMap`` says which global rank feeds which engine, validated
  when it is built and against the world when a source uses it, so each engine receives the
  payload exactly once however many ranks hold it.
* **One outcome for all.** ``Agreement`` runs the two small collectives a source needs: every
  rank reports its problems before anything moves, and every rank learns after a push whether
  any sender failed. A rank never raises alone and leaves the others inside a collective.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from colosync.errors import ConfigError, ConversionError, PeerFailedError

if TYPE_CHECKING:
    from colosync.sync.sender import Sender, SyncReport
    from colosync.wire.manifest import AdapterPolicy

log = logging.getLogger(__name__)

Spec = tuple[str, tuple[int, ...], torch.dtype]
"""One tensor of an update as the engine will see it: its name, full shape and dtype."""


@runtime_checkable
class Source(Protocol):
    """A trainer's weights as a stream of named tensors for a ``Sender`` (see the module docstring)."""

    @property
    def is_sender(self) -> bool:
        """Whether this rank talks to an engine (and must pass its ``Sender`` to ``push``)."""
        ...

    def specs(self) -> list[Spec]:
        """Every tensor of the update, in stream order; the same on every rank."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every rank iterates it to the end; tensors come out on sending ranks only."""
        ...

    def push(
        self, sender: Sender | None, update_id: int | None = None, adapters: AdapterPolicy = "drop"
    ) -> SyncReport | None:
        """Collective: one update through ``sender`` on each sending rank; raises on every rank if any failed.
        ``adapters``: what a full update does to the adapter the engine serves (``Sender.push``)."""
        ...


@dataclass(frozen=True)
class EngineMap:
    """Which trainer rank feeds which engine: ``senders[i]`` is the global rank that pushes to engine ``i``.

    >>> EngineMap()                        # global rank 0 feeds the one engine
    >>> EngineMap((0, 8))                  # two engines (one per node of 8 GPUs, say)
    >>> EngineMap.first_of([[0, 1], [2, 3]])  # the first rank of each group feeds its own engine
    """

    senders: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.senders:
            raise ConfigError("an EngineMap needs at least one sending rank; EngineMap() sends from rank 0")
        bad = [r for r in self.senders if not isinstance(r, int) or isinstance(r, bool) or r < 0]
        if bad:
            raise ConfigError(f"EngineMap senders must be global ranks (ints >= 0), got {bad}")
        twice = sorted({r for r in self.senders if self.senders.count(r) > 1})
        if twice:
            raise ConfigError(
                f"rank(s) {twice} appear twice in EngineMap{self.senders}: a rank feeds at most one engine "
                "(one Sender per rank); give each engine its own rank"
            )

    @classmethod
    def first_of(cls, groups: Sequence[Sequence[int]]) -> EngineMap:
        """One engine per group of ranks, fed by the group's first rank (e.g. one engine per node)."""
        return cls(tuple(min(g) for g in groups if g))

    def engine_of(self, rank: int) -> int | None:
        """The engine ``rank`` feeds, or ``None`` if it sends nothing."""
        return self.senders.index(rank) if rank in self.senders else None

    def check(self, ranks: Sequence[int]) -> None:
        """Raise unless every sender is one of ``ranks`` (the global ranks of the source's group)."""
        outside = [r for r in self.senders if r not in ranks]
        if outside:
            raise ConfigError(
                f"EngineMap names rank(s) {outside} but the source's group holds ranks {list(ranks)}; "
                "pick senders among them"
            )


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if distributed() else 0


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (``None``: the default group, or this process alone)."""
    if not distributed():
        return [0]
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a flag tensor must live for a collective on ``group`` (NCCL: this rank's GPU)."""
    if distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fingerprint(specs: Sequence[object]) -> int:
    """A 63-bit digest of a plan, for checking every rank planned the same stream."""
    digest = hashlib.blake2b(repr(list(specs)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Agreement:
    """The collectives every rank of a source's group takes part in (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, what: str) -> None:
        self.group = group
        self.what = what
        self.ranks = group_ranks(group)
        self.collective = distributed() and len(self.ranks) > 1
        self.device = collective_device(group) if self.collective else torch.device("cpu")

    def _gather(self, value: int) -> list[int]:
        if not self.collective:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(everyone, mine, group=self.group)
        return [int(t.item()) for t in everyone]

    def problems(self, problems: list[str], plan: int | None = None) -> None:
        """Raise on every rank if any rank found a problem or (``plan``: a ``fingerprint``) planned differently."""
        flags = self._gather(int(bool(problems)))
        plans = self._gather(plan) if plan is not None else []
        me = global_rank()
        if problems:
            raise ConversionError(f"{self.what} failed on rank {me}: " + "; ".join(problems))
        failed = [r for r, bad in zip(self.ranks, flags, strict=True) if bad]
        if failed:
            raise PeerFailedError(
                f"{self.what} failed on rank(s) {failed} (this rank, {me}, found no problem); see their error"
            )
        if len(set(plans)) > 1:
            groups = {p: [r for r, q in zip(self.ranks, plans, strict=True) if q == p] for p in set(plans)}
            raise PeerFailedError(
                f"{self.what}: the ranks planned different streams (ranks grouped by plan: {sorted(groups.values())}); "
                "every rank must hold the same model with the same parameter names, shapes, dtypes and sharding"
            )

    def outcome(self, error: BaseException | None, detail: str) -> None:
        """After a push: raise ``error`` where it happened and ``PeerFailedError`` on every other rank."""
        flags = self._gather(int(error is not None))
        if error is not None:
            raise error
        failed = [r for r, bad in zip(self.ranks, flags, strict=True) if bad]
        if failed:
            raise PeerFailedError(
                f"{self.what}: rank(s) {failed} failed to push the update ({detail}); see their log. "
                "Each engine keeps its last committed version"
            )


__all__ = ["Agreement", "EngineMap", "Source", "Spec", "collective_device", "fingerprint", "global_rank"]
