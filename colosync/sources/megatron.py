"""Megatron-core trainer source: gather TP shards and PP stages to one rank, convert, stream.

Why it looks like this:

* **One sender per model-parallel group.** In the seed's path every trainer rank ended up
  holding the same full payload and every engine worker received all of them (N² copies of
  one adapter). Here exactly one rank -- TP rank 0 of ``sender_stage`` (stage 0 by default)
  -- ever holds converted tensors and talks to the engine. Every other rank only
  contributes its own shard: its TP peers on the sender's stage through a ``gather`` into
  the sender, ranks of other pipeline stages by point-to-point ``send`` straight to the
  sender. No intermediate rank assembles a full tensor, and nothing is all-gathered. (The
  fused 3-D expert tensor of an MoE layer is the one HF tensor the sender must hold whole.)
* **Plan first, tensors later.** The ``Sender`` plans its manifest from ``(name, shape,
  dtype)``. Every rank derives the same ordered plan from the same
  :class:`~colosync.sources.megatron_layout.ConversionContext`, so :meth:`MegatronSource.specs`
  is known before anything moves, and the collectives run in lockstep without exchanging
  metadata.
* **Memory bounded by a bucket, not the model.** Tensors are gathered one Megatron
  parameter at a time, lazily, as the ``Sender`` pulls them to fill its next bucket. The
  sender holds at most one gathered Megatron tensor plus the bucket being packed; other
  ranks hold nothing beyond a dtype-cast copy of one local shard.
* **The context is explicit everywhere.** The context object is the only carrier of rank,
  alpha, targets, geometry and dtype policy; the manifest's ``LoraSpec`` is the context's
  own object, in every bucket of every update. There is no ``**kwargs`` on this path.
* **Collectives stay balanced on failure.** If the engine rejects an update midway, the
  sender keeps draining the stream (participating in the remaining gathers without
  converting), then every rank learns the outcome from one broadcast; no rank hangs and
  every rank raises.
* **Experts come from their owners, once.** For an MoE architecture the routed experts of
  a layer live on the expert-parallel (EP) ranks, split over the expert-TP group; those
  ranks may sit in other data-parallel replicas of the dense model. Each expert shard is
  sent point-to-point by the one rank that owns it (the lowest rank holding that EP /
  expert-TP position) straight to the sender, which assembles the fused HF tensor; the
  dense tensors still come only from the sender's own model-parallel group.

Not handled (each rejected with a message saying so): virtual pipeline chunks, linear
biases, MLA, LoRA on experts (routed or shared). Full-weight updates send base
weights; an adapter is not merged into them.

This module is the collective schedule; the checks each rank runs before it agrees to
start are in ``megatron_checks``, the process groups in ``megatron_groups``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colosync.errors import ConversionError
from colosync.sources.architectures.base import Split
from colosync.sources.architectures.context import ConversionContext
from colosync.sources.architectures.layout import ConversionItem, convert, hf_specs, plan
from colosync.sources.architectures.naming import ParamKey, index_params
from colosync.sources.megatron_checks import check_layer_numbers, check_layout, check_params
from colosync.sources.megatron_groups import ParallelGroups, sync_group

if TYPE_CHECKING:
    from colosync.sync.sender import Sender, SyncReport
    from colosync.wire.manifest import AdapterPolicy

log = logging.getLogger(__name__)


@dataclass
class SourceStats:
    """What this rank did in its last sync (for logs and for the no-fan-out tests)."""

    items: int = 0  # Megatron tensors this rank stepped through (the whole plan)
    tensors_yielded: int = 0  # HF/PEFT tensors handed to the consumer (the sender rank only)
    bytes_contributed: int = 0  # bytes of this rank's shards that went to the sender
    bytes_received: int = 0  # bytes the sender received from other ranks
    largest_held: int = 0  # largest tensor this rank materialized for the sync, in bytes
    seconds: float = 0.0


class MegatronSource:
    """Stream a Megatron-core model's weights or LoRA, converted to HF/PEFT, to one sender rank.

    Every rank of the model-parallel group -- and, for an MoE architecture, every rank of the
    expert group that holds its experts (``sync_ranks``) -- constructs it (a collective: it
    validates the local parameters against the context on every rank and agrees on who
    sends) and calls :meth:`push` or iterates :meth:`tensors` (collectives: every rank must
    take part).

    >>> ctx = ConversionContext.from_megatron(config, vocab, padded_vocab, "lora", lora_spec, False, arch="qwen3")
    >>> source = MegatronSource(model, ctx, ParallelGroups.from_megatron())
    >>> sender = Sender(engine_link) if source.is_sender else None
    >>> source.push(sender)   # on every rank; only the sender rank talks to the engine
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        ctx: ConversionContext,
        groups: ParallelGroups,
        sender_stage: int = 0,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            chunks = list(model)
            if len(chunks) != 1:
                raise ConversionError(
                    f"got {len(chunks)} model chunks: virtual pipeline parallelism is not supported; "
                    "pass the single model chunk of this rank (virtual_pipeline_model_parallel_size=None)"
                )
            model = chunks[0]
        if not 0 <= sender_stage < ctx.pp_size:
            raise ConversionError(f"sender_stage={sender_stage} is not a stage of pp_size={ctx.pp_size}")
        self.ctx = ctx
        self.groups = groups
        self.sender_stage = sender_stage
        self.stats = SourceStats()
        self.tp_rank, self.stage = groups.tp_rank, groups.pp_rank
        self._moe = ctx.num_experts > 0
        self.ep_rank, self.etp_rank = (groups.ep_rank, groups.etp_rank) if self._moe else (0, 0)
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._collective = ctx.tp_size * ctx.pp_size > 1 or (self._moe and ctx.ep_size * ctx.expert_tp_size > 1)
        self._plan = plan(ctx)
        problems = check_layout(ctx, groups, collective=self._collective, moe=self._moe)
        self._group = sync_group(groups, experts=self._moe and self._collective)
        self.sync_ranks: tuple[int, ...] = (
            tuple(dist.get_process_group_ranks(self._group)) if self._collective and self._group is not None else (0,)
        )  # the global ranks that take part in this source's syncs (one model replica)
        self._local: dict[ParamKey, tuple[str, torch.Tensor]] = {}
        if not problems:
            try:
                self._local = index_params(model.named_parameters(), ctx.naming)
            except ConversionError as exc:
                problems.append(str(exc))
            problems += check_layer_numbers(model, ctx, self.stage)
            problems += check_params(
                ctx, self._plan, self._local, stage=self.stage, tp_rank=self.tp_rank, etp_rank=self.etp_rank
            )
        self._agree(problems, "validation")
        # (stage, tp) -> rank of the sender's model-parallel group; (stage, ep, etp) -> the rank that sends experts
        self._ranks: dict[tuple[int, int], int] = {}
        self._owners: dict[tuple[int, int, int], int] = {}
        self.sender_rank, self._me = 0, 0
        self._dense, self.is_sender = True, (self.stage, self.tp_rank) == (sender_stage, 0)
        if self._collective:
            self._rank_tables()
        log.debug(
            "megatron source: stage %d tp %d ep %d, sender is global rank %d, %d items",
            self.stage,
            self.tp_rank,
            self.ep_rank,
            self.sender_rank,
            len(self._plan),
        )

    # -- public -----------------------------------------------------------------------------
    def specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Every HF/PEFT tensor of the update, in stream order (the same on every rank)."""
        return hf_specs(self.ctx)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective generator: converted tensors on the sender rank, nothing elsewhere.

        Every rank must iterate it to the end, in step; the sender rank gets each tensor
        as soon as its Megatron parameter has been gathered (views into that gathered
        tensor, valid until the consumer drops them).
        """
        self.stats = SourceStats()
        start = time.perf_counter()
        for item in self._plan:
            full = self._bring(item)
            self.stats.items += 1
            if full is None:
                continue
            for name, tensor in convert(item, full, self.ctx):
                self.stats.tensors_yielded += 1
                yield name, tensor
        self.stats.seconds = time.perf_counter() - start

    def push(
        self, sender: Sender | None, update_id: int | None = None, adapters: AdapterPolicy = "drop"
    ) -> SyncReport | None:
        """Collective: send one update through ``sender`` on the sender rank.

        The sender rank must pass its ``Sender``; other ranks pass ``None`` (a ``Sender``
        given elsewhere is not used: the payload reaches each engine once). Returns the
        ``SyncReport`` on the sender rank and ``None`` elsewhere; raises on every rank if the
        push failed.
        """
        stream = self.tensors()
        error: BaseException | None = None
        report = None
        if self.is_sender:
            try:
                if sender is None:
                    raise ConversionError(
                        f"rank {self.sender_rank} (stage {self.stage}, TP rank 0) sends this model-parallel "
                        "group's update but got sender=None; create the Sender on the rank where "
                        "source.is_sender is True"
                    )
                lora = self.ctx.lora if self.ctx.kind == "lora" else None
                report = sender.push_stream(self.specs(), stream, lora=lora, update_id=update_id, adapters=adapters)
            except BaseException as exc:  # re-raised below, after the other ranks are released
                error = exc
        elif sender is not None:
            log.warning(
                "megatron source: ignoring the Sender passed on non-sending rank (stage %d, tp %d); "
                "only rank %d talks to the engine",
                self.stage,
                self.tp_rank,
                self.sender_rank,
            )
        for _ in stream:  # non-senders: contribute shards; sender after a failure: keep collectives balanced
            pass
        ok = self._outcome(error is None)
        if error is not None:
            raise error
        if not ok:
            raise ConversionError(
                f"the sending rank {self.sender_rank} failed to push the update (see its log); the engine "
                "kept its last committed version"
            )
        if report is not None:
            log.info(
                "megatron source: pushed %s update %d from stage %d (%d Megatron tensors -> %d HF tensors, "
                "%d bytes from other ranks) in %.1f ms",
                self.ctx.kind,
                report.update_id,
                self.stage,
                self.stats.items,
                self.stats.tensors_yielded,
                self.stats.bytes_received,
                self.stats.seconds * 1e3,
            )
        return report

    # -- moving tensors ---------------------------------------------------------------------
    def _local_shard(self, item: ConversionItem, expert: int | None = None) -> torch.Tensor:
        _, param = self._local[item.key if expert is None else item.expert_key(expert)]
        shard = param.detach().to(item.dtype).contiguous()
        self.stats.largest_held = max(self.stats.largest_held, shard.numel() * shard.element_size())
        return shard

    def _empty(self, shape: Sequence[int], item: ConversionItem) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=item.dtype, device=self.device)
        self.stats.largest_held = max(self.stats.largest_held, t.numel() * t.element_size())
        return t

    def _chunks(self, full: torch.Tensor, item: ConversionItem) -> list[torch.Tensor]:
        """Receive buffers for the TP shards: views of ``full`` for row splits (no copy)."""
        tp = self.ctx.tp_size
        if item.split is Split.ROWS:
            return list(full.chunk(tp, dim=0))
        return [self._empty(item.local_shape(tp), item) for _ in range(tp)]

    def _bring(self, item: ConversionItem) -> torch.Tensor | None:
        """The full Megatron tensor of ``item`` on the sender rank; ``None`` on every other rank."""
        if item.experts:
            return self._bring_experts(item)
        if not self._dense:  # another replica of the dense model (an EP peer): its copy is not needed
            return None
        split = item.split is not Split.NONE and self.ctx.tp_size > 1
        if self.stage == item.stage:
            mine = self._local_shard(item) if split or self.tp_rank == 0 else None
            if item.stage == self.sender_stage:
                if not split:
                    return mine if self.is_sender else None
                if mine is None:  # split: every rank of the stage holds a shard
                    raise ConversionError(
                        f"a TP rank of the sending stage holds no shard of {item}; "
                        "every rank of that stage must hold one"
                    )
                if not self.is_sender:
                    dist.gather(mine, None, dst=self.sender_rank, group=self.groups.tp)
                    self.stats.bytes_contributed += mine.numel() * mine.element_size()
                    return None
                full = self._empty(item.shape, item)
                chunks = self._chunks(full, item)
                dist.gather(mine, chunks, dst=self.sender_rank, group=self.groups.tp)
                self.stats.bytes_received += item.nbytes - mine.numel() * mine.element_size()
                return self._join(full, chunks, item)
            if mine is not None:  # another stage: straight to the sender, no intermediate hop
                dist.send(mine, dst=self.sender_rank)
                self.stats.bytes_contributed += mine.numel() * mine.element_size()
            return None
        if not self.is_sender:
            return None
        full = self._empty(item.shape, item)
        if not split:
            dist.recv(full, src=self._ranks[(item.stage, 0)])
            self.stats.bytes_received += item.nbytes
            return full
        chunks = self._chunks(full, item)
        works = [dist.irecv(chunk, src=self._ranks[(item.stage, r)]) for r, chunk in enumerate(chunks)]
        for work in works:
            if work is None:  # irecv returns None only to ranks outside the group
                raise ConversionError("the sending rank is outside the pipeline group; check ParallelGroups")
            work.wait()
        self.stats.bytes_received += item.nbytes
        return self._join(full, chunks, item)

    def _bring_experts(self, item: ConversionItem) -> torch.Tensor | None:
        """Every expert's matrix of one layer, stacked, on the sender: each shard from its one owner.

        The owner of (stage, EP rank, expert-TP rank) sends its local experts in order,
        tagged with the local expert index; the sender posts every receive of the item
        before waiting, and copies its own shards locally.
        """
        ctx = self.ctx
        per, etp = ctx.local_experts, ctx.expert_tp_size
        split = item.split is not Split.NONE and etp > 1
        if not self.is_sender:
            if self.stage == item.stage and self._owners.get((self.stage, self.ep_rank, self.etp_rank)) == self._me:
                for i in range(per):
                    mine = self._local_shard(item, i)
                    dist.send(mine, dst=self.sender_rank, tag=i)
                    self.stats.bytes_contributed += mine.numel() * mine.element_size()
            return None
        full = self._empty(item.shape, item)
        works, pending = [], []
        for e in range(ctx.num_experts):
            ep, i = divmod(e, per)
            for t in range(etp):
                dst = full[e].chunk(etp, dim=item.split.value)[t] if split else full[e]
                owner = self._owners[(item.stage, ep, t)] if self._collective else self._me
                if owner == self._me:
                    dst.copy_(self._local_shard(item, i))
                    continue
                buf = dst if dst.is_contiguous() else self._empty(dst.shape, item)
                work = dist.irecv(buf, src=owner, tag=i)
                if work is None:
                    raise ConversionError("the sending rank is outside the expert group; check ParallelGroups")
                works.append(work)
                pending.append((dst, buf))
        for work in works:
            work.wait()
        for dst, buf in pending:
            if buf is not dst:
                dst.copy_(buf)
            self.stats.bytes_received += buf.numel() * buf.element_size()
        return full

    @staticmethod
    def _join(full: torch.Tensor, chunks: list[torch.Tensor], item: ConversionItem) -> torch.Tensor:
        if item.split is Split.COLS:
            torch.cat(chunks, dim=1, out=full)
        return full

    def _rank_tables(self) -> None:
        """Agree, over the sync group, on the sender, its dense group and each expert shard's owner."""
        me = dist.get_rank()
        leader = min(dist.get_process_group_ranks(self.groups.mp)) if self.groups.mp is not None else me
        row = [me, self.stage, self.tp_rank, self.ep_rank, self.etp_rank, leader]
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(everyone, mine, group=self._group)
        rows = sorted(tuple(int(v) for v in r.tolist()) for r in everyone)
        candidates = sorted(
            (ep, etp, rank, lead) for rank, stage, tp, ep, etp, lead in rows if stage == self.sender_stage and tp == 0
        )
        _, _, sender, sender_leader = candidates[0]
        self._me, self.sender_rank = me, sender
        self._dense, self.is_sender = leader == sender_leader, me == sender
        for rank, stage, tp, ep, etp, lead in rows:  # sorted by rank: the lowest rank owns a position
            if lead == sender_leader:
                self._ranks.setdefault((stage, tp), rank)
            self._owners.setdefault((stage, ep, etp), rank)

    def _agree(self, problems: list[str], what: str) -> None:
        """Raise on every rank if any rank found a problem (so none is left in a collective)."""
        bad = bool(problems)
        if self._collective:
            flag = torch.tensor([int(bad)], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            anyone = bool(flag.item())
        else:
            anyone = bad
        if bad:
            raise ConversionError(
                f"Megatron source {what} failed on stage {self.stage}, TP rank {self.tp_rank}: " + "; ".join(problems)
            )
        if anyone:
            raise ConversionError(
                f"Megatron source {what} failed on another rank of this model-parallel group (this rank, stage "
                f"{self.stage} TP rank {self.tp_rank}, found no problem); see that rank's error"
            )

    def _outcome(self, ok: bool) -> bool:
        if not self._collective:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, src=self.sender_rank, group=self._group)
        return bool(flag.item())


__all__ = [
    "ConversionContext",
    "ConversionError",
    "MegatronSource",
    "ParallelGroups",
    "SourceStats",
]
