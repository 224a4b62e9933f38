"""vLLM as a colosync engine: the worker side, the trainer side, serving, sleep-mode memory.

- ``worker``: ``ColosyncWorkerExtension`` (pass ``WORKER_EXTENSION`` as ``LLM(worker_extension_cls=...)``),
  a Receiver in every vLLM worker, and ``VllmTarget``, the ``EngineTarget`` over vLLM's model.
- ``link``: the links over ``collective_rpc`` and the commit choreography (pause, commit, verify, resume).
- ``client``: ``VllmEngine`` / ``AsyncVllmEngine``; ``outputs``: ``version_of``, ``score_completions``.
- ``versions``: the LoRA versions an engine committing beside running requests holds, and their leases;
  ``rollouts``: ``Rollouts``, a synchronous ``LLM`` kept generating from one thread.
- ``serving``: ``VllmServing``, Generate/Score over ``LLM.generate`` behind the common ``EngineHost``.
- ``memory``: vLLM's sleep mode as a handoff participant.

Nothing here imports vLLM at module scope. The names below are re-exported so that
``colosync.engines.vllm.ColosyncWorkerExtension`` (the path of colosync 0.1) keeps working.
"""

from colosync.engines.vllm.client import AsyncVllmEngine, VllmEngine
from colosync.engines.vllm.link import AsyncVllmLink, CommitMode, VllmLink
from colosync.engines.vllm.worker import (
    ADAPTER_ID,
    ADAPTER_NAME,
    IN_MEMORY_PATH,
    WORKER_EXTENSION,
    ColosyncWorkerExtension,
    VllmTarget,
    WorkerInfo,
)

__all__ = [
    "ADAPTER_ID",
    "ADAPTER_NAME",
    "IN_MEMORY_PATH",
    "WORKER_EXTENSION",
    "AsyncVllmEngine",
    "AsyncVllmLink",
    "ColosyncWorkerExtension",
    "CommitMode",
    "VllmEngine",
    "VllmLink",
    "VllmTarget",
    "WorkerInfo",
]
