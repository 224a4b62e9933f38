"""Megatron-core trainer source: gather TP shards and PP stages to one rank, convert, stream.

Why it looks like this:

* **One sender per model-parallel group.** In the seed's path every trainer rank ended up
  holding the same full payload and every engine worker received all of them (N² copies of
  one adapter). Here exactly one rank -- TP rank 0 of ``sender_stage`` (stage 0 by default)
  -- ever holds converted tensors and talks to the engine. Every other rank only
  contributes its own shard: its TP peers on the sender's stage through a ``gather`` into
  the sender, ranks of other pipeline stages by point-to-point ``send`` straight to the
  sender. No intermediate rank assembles a full tensor, and nothing is all-gathered.
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

Not handled (each rejected with a message saying so): virtual pipeline chunks, MoE, biases,
qk-norm, MLA. Full-weight updates send base weights; an adapter is not merged into them.

One module (~430 lines): the collective schedule (who gathers, who sends, who raises when
the engine refuses) must be read as one piece for every rank to be seen to agree.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colosync.sources.megatron_layout import (
    ConversionContext,
    ConversionError,
    ConversionItem,
    ParamKey,
    Role,
    Split,
    convert,
    hf_specs,
    index_params,
    plan,
)

if TYPE_CHECKING:
    from colosync.sync.sender import Sender, SyncReport

log = logging.getLogger(__name__)

_LAYER_MODULE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)$")


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of this rank's model-parallel group (``None``: a group of one)."""

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None  # tp x pp: the ranks that hold one model replica

    @classmethod
    def from_megatron(cls) -> ParallelGroups:
        """The groups ``megatron.core.parallel_state.initialize_model_parallel`` created."""
        from megatron.core import parallel_state

        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            pp=parallel_state.get_pipeline_model_parallel_group(),
            mp=parallel_state.get_model_parallel_group(),
        )

    @staticmethod
    def _rank(group: dist.ProcessGroup | None) -> int:
        return dist.get_rank(group) if group is not None else 0

    @staticmethod
    def _size(group: dist.ProcessGroup | None) -> int:
        return dist.get_world_size(group) if group is not None else 1

    @property
    def tp_rank(self) -> int:
        return self._rank(self.tp)

    @property
    def tp_size(self) -> int:
        return self._size(self.tp)

    @property
    def pp_rank(self) -> int:
        return self._rank(self.pp)

    @property
    def pp_size(self) -> int:
        return self._size(self.pp)


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

    Every rank of the model-parallel group constructs it (a collective: it validates the
    local parameters against the context on every rank and agrees on who sends) and calls
    :meth:`push` or iterates :meth:`tensors` (collectives: every rank must take part).

    >>> ctx = ConversionContext.from_megatron(config, vocab, padded_vocab, "lora", lora_spec, False)
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
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._collective = ctx.tp_size * ctx.pp_size > 1
        self._plan = plan(ctx)
        problems = self._check_layout(groups)
        self._local: dict[ParamKey, tuple[str, torch.Tensor]] = {}
        if not problems:
            try:
                self._local = index_params(model.named_parameters(), ctx.naming)
            except ConversionError as exc:
                problems.append(str(exc))
            problems += self._check_layer_numbers(model)
            problems += self._check_params()
        self._agree(problems, "validation")
        self._ranks = self._rank_table() if self._collective else {}
        self.sender_rank = self._ranks.get((sender_stage, 0), 0)
        self.is_sender = (self.stage, self.tp_rank) == (sender_stage, 0)
        log.debug(
            "megatron source: stage %d tp %d, sender is global rank %d, %d items",
            self.stage,
            self.tp_rank,
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

    def push(self, sender: Sender | None, update_id: int | None = None) -> SyncReport | None:
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
                report = sender.push_stream(self.specs(), stream, lora=lora, update_id=update_id)
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
    def _local_shard(self, item: ConversionItem) -> torch.Tensor:
        _, param = self._local[item.key]
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

    @staticmethod
    def _join(full: torch.Tensor, chunks: list[torch.Tensor], item: ConversionItem) -> torch.Tensor:
        if item.split is Split.COLS:
            torch.cat(chunks, dim=1, out=full)
        return full

    # -- agreement --------------------------------------------------------------------------
    def _rank_table(self) -> dict[tuple[int, int], int]:
        """(stage, tp rank) -> global rank, for every rank of this model-parallel group."""
        mine = torch.tensor([dist.get_rank(), self.stage, self.tp_rank], dtype=torch.int64, device=self.device)
        size = dist.get_world_size(self.groups.mp)
        everyone = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(everyone, mine, group=self.groups.mp)
        table = {}
        for row in everyone:
            rank, stage, tp = (int(v) for v in row.tolist())
            table[(stage, tp)] = rank
        return table

    def _agree(self, problems: list[str], what: str) -> None:
        """Raise on every rank if any rank found a problem (so none is left in a collective)."""
        bad = bool(problems)
        if self._collective:
            flag = torch.tensor([int(bad)], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.mp)
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
        dist.broadcast(flag, src=self.sender_rank, group=self.groups.mp)
        return bool(flag.item())

    # -- validation -------------------------------------------------------------------------
    def _check_layout(self, groups: ParallelGroups) -> list[str]:
        ctx = self.ctx
        problems = []
        if (groups.tp_size, groups.pp_size) != (ctx.tp_size, ctx.pp_size):
            problems.append(
                f"the process groups are TP={groups.tp_size} x PP={groups.pp_size} but the context says "
                f"TP={ctx.tp_size} x PP={ctx.pp_size}; build the context from the model's TransformerConfig"
            )
        if self._collective and (groups.mp is None or not dist.is_initialized()):
            # without a group there is no way to agree on failure: fail here, on every rank alike
            raise ConversionError(
                "TP x PP > 1 needs torch.distributed initialized and ParallelGroups with tp, pp and mp "
                "(use ParallelGroups.from_megatron())"
            )
        if self._collective and dist.get_world_size(groups.mp) != ctx.tp_size * ctx.pp_size:
            problems.append(
                f"ParallelGroups.mp has {dist.get_world_size(groups.mp)} ranks, expected TP x PP = "
                f"{ctx.tp_size * ctx.pp_size}"
            )
        return problems

    def _check_layer_numbers(self, model: torch.nn.Module) -> list[str]:
        """Megatron's TransformerLayer knows its global ``layer_number``: it must match the context."""
        offset = self.ctx.stage_offsets[self.stage]
        problems, count = [], 0
        for name, module in model.named_modules():
            match = _LAYER_MODULE.match(name)
            if not match:
                continue
            count += 1
            local = int(match[1])
            number = getattr(module, "layer_number", None)
            if number is not None and number - 1 != offset + local:
                problems.append(
                    f"{name} is global layer {number - 1} but the context places stage {self.stage}'s local "
                    f"layer {local} at {offset + local}; pass stage_layers as Megatron placed the layers"
                )
        if count and count != self.ctx.stage_layers[self.stage]:
            problems.append(
                f"stage {self.stage} holds {count} layers but the context's stage_layers says "
                f"{self.ctx.stage_layers[self.stage]}; pass stage_layers as Megatron placed the layers"
            )
        return problems

    def _check_params(self) -> list[str]:
        ctx, tp = self.ctx, self.ctx.tp_size
        problems = []
        mine = [item for item in self._plan if item.stage == self.stage]
        for item in mine:
            found = self._local.get(item.key)
            if found is None:
                hint = (
                    "; the adapter is missing on this module: attach it, or drop "
                    f"{[o.name.split('.')[-3] for o in item.outputs]} from LoraSpec.target_modules"
                    if item.role is not Role.WEIGHT
                    else ""
                )
                problems.append(f"no local parameter for {item.describe()}{hint}")
                continue
            name, param = found
            want = item.local_shape(tp)
            if tuple(param.shape) != want:
                why = (
                    f" (lora rank {ctx.lora.rank} from the LoraSpec)"
                    if item.role is not Role.WEIGHT and ctx.lora
                    else ""
                )
                problems.append(
                    f"{name} has shape {list(param.shape)}, expected {list(want)}{why} for TP rank "
                    f"{self.tp_rank} of {tp}; check the context against the model's config"
                )
            if getattr(param, "tensor_model_parallel", False):
                dim = getattr(param, "partition_dim", None)
                if item.split is Split.NONE or dim != item.split.value:
                    problems.append(
                        f"{name} is split on dim {dim} by Megatron but the converter expects "
                        f"{item.split.name}; the naming table maps it to the wrong slot"
                    )
        if ctx.kind == "lora":
            wanted = set(ctx.lora_slots)
            for key, (name, _) in self._local.items():
                if key.role is not Role.WEIGHT and key.slot not in wanted:
                    problems.append(
                        f"{name} is an adapter weight but {key.slot.value} is not among the LoraSpec's "
                        f"target_modules {list(ctx.lora.target_modules) if ctx.lora else []}; add its HF names"
                    )
        return problems


def megatron_tensor_bytes(ctx: ConversionContext) -> int:
    """Largest single gathered Megatron tensor of an update: the sender's memory beyond a bucket."""
    return max((math.prod(i.shape) * i.dtype.itemsize for i in plan(ctx)), default=0)


__all__ = [
    "ConversionContext",
    "ConversionError",
    "MegatronSource",
    "ParallelGroups",
    "SourceStats",
    "megatron_tensor_bytes",
]
