"""A vLLM ``LLM`` as a served engine: the same requests and the same host as the hf engine.

An RL loop needs two things from its engine besides updates: sample a group of completions
and score fixed completions (the parity probe). Serving them here, behind ``EngineHost``,
lets one driver talk to vLLM or the hf engine through one link, in an ``EngineProcess`` or a
Ray actor alike. Transaction messages go on to the Receivers in vLLM's workers through
``VllmEngine.link``; every reply carries the update id vLLM says produced it.

One transaction. The host serves the link's own ``EngineTransaction``: the one an in-process
``VllmEngine`` pushes through, so ownership, the commit choreography (pause, commit, relabel,
resume) and the verification of a probe are the same here and there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from colosync.engines.config import EngineConfig, Generate, Generation, Score, Scores
from colosync.engines.vllm.lanes import VllmLane
from colosync.errors import ConfigError, EngineError, ManifestError
from colosync.sync.target import ReceiverPolicy
from colosync.sync.transaction import EngineTransaction

if TYPE_CHECKING:  # pragma: no cover - typing only
    from colosync.engines.vllm.client import VllmEngine

log = logging.getLogger(__name__)


class VllmServing:
    """``ServedEngine`` over a ``vllm.LLM`` built with colosync's worker extension and LoRA on."""

    requests: ClassVar[tuple[type, ...]] = (Generate, Score)
    replies: ClassVar[tuple[type, ...]] = (Generation, Scores)

    def __init__(self, llm: Any, engine: VllmEngine | None = None) -> None:
        """``engine``: the ``VllmEngine`` already in front of ``llm`` in this process, whose transaction (one
        owner) this host then shares; without, one is made."""
        from colosync.engines.vllm.client import VllmEngine

        self.llm = llm
        self.engine = engine or VllmEngine(llm)

    @classmethod
    def from_config(cls, config: EngineConfig) -> VllmServing:
        """A small fp32 engine for local models (the demo's, the tests', ``bench-async``'s), ``max_loras`` slots."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else vLLM's CPU backend reserves most of RAM
        if config.threads:
            cpus = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[: config.threads])))
        from vllm import LLM

        from colosync.engines.vllm.worker import WORKER_EXTENSION

        llm = LLM(
            model=config.model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            enable_lora=True,
            max_lora_rank=config.max_lora_rank,
            max_loras=config.max_loras,
            enforce_eager=True,
            max_model_len=256,
            worker_extension_cls=WORKER_EXTENSION,
        )
        return cls(llm)

    def transaction(self, policy: ReceiverPolicy | None) -> EngineTransaction:
        # The workers' Receivers run with their own default policy; vLLM's collective RPC
        # reaches them only through the worker extension.
        return self.engine.link.transaction

    def lane(self, name: str) -> _Lane:
        """Named adapter ``name`` for ``EngineHost`` (a connection's ``Hello.adapter``): its own transaction."""
        return _Lane(self.engine.link.lane(name))

    def close(self) -> None:
        """Shut the engine core down (its processes end with it); the host is closing."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # the process is ending anyway; say why it may linger
            log.exception("vllm engine: shutting the engine core down failed")

    def handle(self, request: Generate | Score) -> Generation | Scores:
        if isinstance(request, Generate):
            return self._generate(request)
        if isinstance(request, Score):
            return self._score(request)
        raise ManifestError(f"the vLLM engine serves Generate and Score, not {type(request).__name__}")

    @contextlib.contextmanager
    def _lora(self, adapter: str) -> Iterator[Any]:
        """The served adapter (``adapter``'s, if named) for one batch, else None; raises ``FailedClosedError``
        while the engine refuses to serve. Committing beside running requests, the batch holds its version."""
        link = self.engine.link
        if adapter:
            lane = link.lanes.get(adapter)
            if lane is None:
                raise ConfigError(f"this engine has no adapter {adapter!r}; it has {sorted(link.lanes)}: push it first")
            with lane.lease(bounded=False) as lease:  # the host refused a Generate that lags: it never waits
                yield lease.lora_request
            return
        if link.versions is None:
            yield link.default_lora()
            return
        with link.lease(bounded=False) as lease:
            yield lease.lora_request

    def _generate(self, request: Generate) -> Generation:
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in request.prompts]
        params = [
            SamplingParams(
                temperature=request.temperature,
                seed=request.seed + i if request.temperature else None,
                max_tokens=request.max_new_tokens,
                min_tokens=request.max_new_tokens,
                logprobs=0,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        with self._lora(request.adapter) as lora:
            outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        tokens, logprobs, versions = [], [], set()
        for out in outputs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            logprobs.append(
                [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]
            )
            versions.add(self.engine.version_of(out))
        return Generation(_one_version(versions), tokens, logprobs)

    def _score(self, request: Score) -> Scores:
        # The same scoring the link verifies a probe with (one sequence per generate call).
        with self._lora(request.adapter) as lora:
            result, versions = self.engine.link.score(request.prompts, request.completions, lora)
        return Scores(_one_version(versions), result)


class _Lane:
    """What ``EngineHost`` makes a named adapter's transaction from."""

    def __init__(self, lane: VllmLane) -> None:
        self._lane = lane

    def transaction(self, policy: ReceiverPolicy | None) -> EngineTransaction:
        return self._lane.transaction


def _one_version(versions: set[int]) -> int:
    if len(versions) != 1:
        raise EngineError(f"one request batch ran on several updates {sorted(versions)}")
    return versions.pop()
