"""A vLLM engine inside a Ray actor, speaking the same messages as the hf engine actor.

The demo's driver and trainer talk to either engine through one ``RayLink``: transaction
messages are forwarded to the vLLM workers' Receivers (``VllmEngine.link``), and the
serving requests every RL loop needs — sample a group of completions, score fixed
completions — map onto ``LLM.generate`` with the committed colosync adapter. Every reply
carries the update id vLLM says produced it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import msgspec

from colosync.errors import ColosyncError
from colosync.wire.protocol import Codec, Failed, TransactionRequest
from colosync.engines.hf import Generate, Generation, Score, Scores
from colosync.engines.process import EngineConfig, codecs

log = logging.getLogger(__name__)


class VllmEngineActor:
    requests: ClassVar[tuple[type, ...]] = (Generate, Score)
    replies: ClassVar[tuple[type, ...]] = (Generation, Scores)

    def __init__(self, config_bytes: bytes, threads: int = 0) -> None:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        logging.basicConfig(level=config.log_level)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if threads:
            cpus = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[:threads])))
        from vllm import LLM

        from colosync.engines.vllm.worker import WORKER_EXTENSION, VllmEngine

        self.llm = LLM(
            model=config.model_dir, skip_tokenizer_init=True, dtype="float32", enable_lora=True,
            max_lora_rank=config.max_lora_rank, max_loras=1, enforce_eager=True, max_model_len=256,
            worker_extension_cls=WORKER_EXTENSION,
        )
        self.engine = VllmEngine(self.llm)
        self._codecs: tuple[Codec, Codec] = codecs(type(self))

    def handle(self, data: bytes) -> bytes:
        request_codec, reply_codec = self._codecs
        try:
            request = request_codec.decode(data)
            if isinstance(request, TransactionRequest.__args__):
                reply: msgspec.Struct = self.engine.link.submit(request).wait()
            elif isinstance(request, Generate):
                reply = self._generate(request)
            else:
                reply = self._score(request)
        except ColosyncError as exc:
            reply = Failed.from_exception(exc)
        except Exception as exc:
            log.exception("vLLM actor: request failed")
            reply = Failed.from_exception(exc)
        return reply_codec.encode(reply)

    def _lora(self) -> Any:
        return self.engine.lora_request if self.engine.link.lora_update_id else None

    def _generate(self, request: Generate) -> Generation:
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in request.prompts]
        params = [
            SamplingParams(temperature=request.temperature, seed=request.seed + i if request.temperature else None,
                           max_tokens=request.max_new_tokens, min_tokens=request.max_new_tokens, logprobs=0,
                           detokenize=False)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora(), use_tqdm=False)
        tokens, logprobs, versions = [], [], set()
        for out in outputs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            logprobs.append([step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)])
            versions.add(self.engine.version_of(out))
        return Generation(_one_version(versions), tokens, logprobs)

    def _score(self, request: Score) -> Scores:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        result, versions = [], set()
        for prompt, completion in zip(request.prompts, request.completions):
            # One sequence per call: vLLM 0.32's CPU LoRA path fails on batched prompt logprobs.
            [out] = self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt) + list(completion)), params,
                                      lora_request=self._lora(), use_tqdm=False)
            steps = out.prompt_logprobs[len(prompt) :]
            result.append([step[t].logprob for step, t in zip(steps, completion)])
            versions.add(self.engine.version_of(out))
        return Scores(_one_version(versions), result)

    def memory(self) -> dict[str, int]:
        from colosync.engines.ray_actor import memory_sample
        import torch

        return memory_sample(torch.device("cpu"))

    def pid(self) -> int:
        return os.getpid()


def _one_version(versions: set[int]) -> int:
    if len(versions) != 1:
        raise ColosyncError(f"one request batch ran on several updates {sorted(versions)}")
    return versions.pop()
