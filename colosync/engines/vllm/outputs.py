"""What vLLM's outputs say: which update produced them, and the score of given completions.

Shared by the link (which scores a verified commit's probe), ``VllmServing`` (``Score``) and the
user-facing clients (``version_of``), so every part of colosync reads an output the same way.
vLLM is imported only inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from colosync.engines.vllm.worker import ADAPTER_ID, ADAPTER_NAME, IN_MEMORY_PATH, lane_update_id, versioned_update_id
from colosync.errors import EngineError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm.lora.request import LoRARequest

GenerateOne = Callable[[list[int], Any, Any], Any]
"""``(token_ids, sampling_params, lora_request) -> RequestOutput``: one sequence through vLLM."""


def colosync_lora_request() -> LoRARequest:
    """The ``LoRARequest`` every colosync adapter version is served under."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=ADAPTER_NAME, lora_int_id=ADAPTER_ID, lora_path=IN_MEMORY_PATH)


def version_of(output: Any) -> int:
    """The ``update_id`` whose weights produced ``output`` (a RequestOutput or CompletionOutput).

    0 means the engine's initial weights. Raises ``EngineError`` if the tokens came from
    more than one version (only possible with ``commit_mode="keep"``). A request on a LoRA version
    of its own (``commit_mode="inflight"``, or a named adapter's) ran on that version alone: its adapter id
    says which; for a named adapter the number is that adapter's own update id (``adapter_of`` says which).
    """
    lora = getattr(output, "lora_request", None)
    lane = lane_update_id(lora.lora_int_id) if lora is not None else None
    if lane is not None:  # a named adapter's version: its own update ids, every token from it alone
        return lane[1]
    own = versioned_update_id(lora.lora_int_id) if lora is not None else None
    completions = getattr(output, "outputs", None) or [output]
    versions: set[int] = set()
    for completion in completions:
        spans = getattr(completion, "weight_versions", None)
        if spans is None:
            raise EngineError(
                "this output carries no weight_versions; pass the finished output that "
                "LLM.generate returned (vLLM sets them on the final output only)"
            )
        for span in spans:
            versions.add(0 if span.version == "default" else int(span.version))
    if len(versions) > 1:
        raise EngineError(f"output tokens came from several updates {sorted(versions)}")
    labelled = versions.pop() if versions else 0
    # an adapter version of its own ran on the weights of the last full update before it, or after it
    # (a full update with adapters="keep"): the later of the two is the update the request ran on
    return max(own, labelled) if own is not None else labelled


def adapter_of(output: Any) -> int:
    """The lane number of the named adapter that produced ``output`` (``VllmLane.index``); 0: the default."""
    lora = getattr(output, "lora_request", None)
    lane = lane_update_id(lora.lora_int_id) if lora is not None else None
    return lane[0] if lane is not None else 0


def score_completions(
    generate_one: GenerateOne, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], lora: Any = None
) -> tuple[list[list[float]], set[int]]:
    """vLLM's logprob of every completion token given its prompt, and the updates that computed them.

    Prompt logprobs of ``prompt + completion``, one sequence per ``generate_one`` call: vLLM
    0.32's CPU LoRA path fails on batched prompt logprobs.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    result: list[list[float]] = []
    versions: set[int] = set()
    for prompt, completion in zip(prompts, completions, strict=True):
        out = generate_one(list(prompt) + list(completion), params, lora)
        steps = out.prompt_logprobs[len(prompt) :]
        result.append([step[t].logprob for step, t in zip(steps, completion, strict=True)])
        versions.add(version_of(out))
    return result, versions


__all__ = ["GenerateOne", "adapter_of", "colosync_lora_request", "score_completions", "version_of"]
