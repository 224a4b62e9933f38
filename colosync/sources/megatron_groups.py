"""Which ranks hold one Megatron model, as process groups: ``ParallelGroups`` and a sync's group.

Why this is not part of ``megatron``: the groups describe how Megatron placed the model --
the tensor-, pipeline- and expert-parallel groups and which of them spans one sync -- and
are fixed before any source exists; the checks and the collective schedule both read them.
Apart, both can import them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from colosync.errors import ConversionError


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of this rank's model-parallel group (``None``: a group of one).

    ``ep`` / ``etp`` / ``expert_mp`` are Megatron's expert-parallel, expert-tensor-parallel
    and expert-TP x EP x PP groups; only MoE architectures use them.
    """

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None  # tp x pp: the ranks that hold one model replica
    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    expert_mp: dist.ProcessGroup | None = None  # etp x ep x pp: the ranks that hold every expert once

    @classmethod
    def from_megatron(cls) -> ParallelGroups:
        """The groups ``megatron.core.parallel_state.initialize_model_parallel`` created."""
        from megatron.core import parallel_state

        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            pp=parallel_state.get_pipeline_model_parallel_group(),
            mp=parallel_state.get_model_parallel_group(),
            ep=parallel_state.get_expert_model_parallel_group(),
            etp=parallel_state.get_expert_tensor_parallel_group(),
            expert_mp=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
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

    @property
    def ep_rank(self) -> int:
        return self._rank(self.ep)

    @property
    def ep_size(self) -> int:
        return self._size(self.ep)

    @property
    def etp_rank(self) -> int:
        return self._rank(self.etp)

    @property
    def etp_size(self) -> int:
        return self._size(self.etp)


def sync_group(groups: ParallelGroups, *, experts: bool) -> dist.ProcessGroup | None:
    """The group every rank of one sync belongs to: ``mp``, or the expert group that contains it.

    With expert parallelism the experts of one model may sit in other data-parallel
    replicas of the dense model (EP over DP) or inside this one (EP over TP); one of the
    two groups then contains the other, and the larger is the sync's group. ``experts``: the
    architecture has routed experts and the sync spans more than one rank.
    """
    if not experts or groups.expert_mp is None:
        return groups.mp
    mine = {dist.get_rank()}
    dense = set(dist.get_process_group_ranks(groups.mp)) if groups.mp is not None else mine
    expert = set(dist.get_process_group_ranks(groups.expert_mp))
    if dense <= expert:
        return groups.expert_mp
    if expert <= dense:
        return groups.mp
    raise ConversionError(
        f"the model-parallel group {sorted(dense)} and the expert group {sorted(expert)} overlap without one "
        "containing the other; this EP / expert-TP layout is not supported"
    )
