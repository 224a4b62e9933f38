"""Colosync on Ray: an engine actor, a trainer actor, and a Link between them.

A Ray actor processes one caller's calls in order, which is all a Sender needs to pipeline
``Stage`` messages: ``RayLink.submit`` returns the call's ObjectRef at once and ``wait``
resolves it. Arguments and replies are msgpack bytes of colosync's typed structs; the tensor
bytes go through the transport (shared memory or CUDA IPC), never through Ray's object store.
The same two actors run on a laptop's local cluster or a multi-node one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import psutil
import torch

from colosync.engines.process import EngineConfig, EngineHost, codecs
from colosync.sync.link import unwrap
from colosync.wire.protocol import Codec

log = logging.getLogger(__name__)


class RayPending:
    def __init__(self, ref: Any, reply_codec: Codec) -> None:
        self._ref, self._reply_codec = ref, reply_codec

    def wait(self) -> Any:
        import ray

        return unwrap(self._reply_codec.decode(ray.get(self._ref)))


class RayLink:
    """A ``Link`` to an engine actor exposing ``handle(bytes) -> bytes``."""

    def __init__(self, actor: Any, engine_cls: type) -> None:
        self._actor = actor
        self._codec, self._reply_codec = codecs(engine_cls)

    def submit(self, request: msgspec.Struct) -> RayPending:
        return RayPending(self._actor.handle.remote(self._codec.encode(request)), self._reply_codec)

    def call(self, request: msgspec.Struct) -> Any:
        return self.submit(request).wait()

    def close(self) -> None:
        pass


def memory_sample(device: torch.device) -> dict[str, int]:
    """Resident host memory of this process and its children (e.g. vLLM's engine core), and
    peak device memory since the last sample."""
    me = psutil.Process(os.getpid())
    rss = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except psutil.Error:
            pass
    out = {"host_rss": rss, "gpu_peak": 0}
    if device.type == "cuda":
        out["gpu_peak"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    return out


class EngineActor:
    """Hosts an engine (``hf`` here; vLLM through ``colosync.engines.vllm.worker``) in a Ray actor."""

    def __init__(self, config_bytes: bytes, threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        logging.basicConfig(level=config.log_level)
        self.host = EngineHost(config)

    def handle(self, data: bytes) -> bytes:
        return self.host.handle_bytes(data)

    def memory(self) -> dict[str, int]:
        return memory_sample(self.host.engine.device)

    def pid(self) -> int:
        return os.getpid()


class TrainerActor:
    """Holds the PEFT policy and its optimizer; pushes the LoRA to the engine after each step."""

    def __init__(
        self, model_dir: str, engine: Any, engine_cls: type, transport: str, rank: int, alpha: float,
        lr: float, seed: int, device: str, threads: int = 0,
    ) -> None:
        from peft import LoraConfig, get_peft_model

        from colosync.demo.models import LORA_TARGETS, load_model
        from colosync.sync.sender import Sender

        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.device = torch.device(device)
        base = load_model(model_dir, self.device)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
        self.model = get_peft_model(base, config).eval()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(params, lr=lr)
        self.sender = Sender(RayLink(engine, engine_cls), transport=transport)

    def push(self) -> bytes:
        return msgspec.msgpack.encode(self.sender.push_peft(self.model))

    def train_step(self, prompts: list[list[int]], completions: list[list[int]], advantages: list[float]) -> float:
        from colosync.demo.rl import policy_gradient_step

        return policy_gradient_step(self.model, self.optimizer, prompts, completions, advantages)

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        from colosync.demo.models import score

        return score(self.model, prompts, completions)

    def memory(self) -> dict[str, int]:
        return memory_sample(self.device)

    def close(self) -> None:
        self.sender.close()
