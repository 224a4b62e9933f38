"""What crosses the boundary into an engine, typed: how to build it and what to ask it.

An engine is built in another process (a spawned child, a Ray actor), so its configuration
is a msgpack struct rather than keyword arguments; the serving requests every RL loop needs
(sample completions, score given completions) are structs too, so the hf engine, the vLLM
engine and any future one answer the same messages and a driver can swap them.
"""

from __future__ import annotations

import msgspec

from colosync.errors import ManifestError
from colosync.sync.staleness import Staleness
from colosync.sync.target import ReceiverPolicy


class EngineConfig(msgspec.Struct, frozen=True):
    """How to build an engine (typed: it crosses a process boundary)."""

    engine: str  # registry name, see colosync.control.registry.names()
    model_dir: str = ""
    device: str = "cpu"
    max_lora_rank: int = 64
    max_loras: int = 1  # adapters served at once: the default one and named ones (``Hello.adapter``)
    reject_nonfinite: bool = True
    verify_fingerprints: bool = True
    timeout_s: float = 60.0
    log_level: str = "WARNING"
    threads: int = 0  # CPU threads for the engine's compute; 0 leaves the library default
    auth_timeout_s: float = 2.0  # engine process: a client must authenticate within this
    message_timeout_s: float = 10.0  # engine process: a message's bytes must all arrive within this
    max_lag: int | None = None  # refuse a Generate on a version more than this many updates behind its trainer

    def __post_init__(self) -> None:
        Staleness(self.max_lag)  # refused here, in the trainer, rather than in the engine process

    def policy(self) -> ReceiverPolicy:
        return ReceiverPolicy(self.reject_nonfinite, self.verify_fingerprints, self.timeout_s)


class Generate(msgspec.Struct, tag="generate", frozen=True):
    """Continue each prompt: greedy at temperature 0, else sampled from ``seed``; with ``adapter``'s
    committed version ("": the default)."""

    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    adapter: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0 or not all(self.prompts):
            raise ManifestError("Generate needs non-empty prompts and max_new_tokens >= 0")


class Generation(msgspec.Struct, tag="generation", frozen=True):
    update_id: int  # the committed version (of the adapter asked for) that produced these tokens
    tokens: list[list[int]]
    logprobs: list[list[float]]


class Score(msgspec.Struct, tag="score", frozen=True):
    """Logprobs of given completions (the parity probe of an RL step)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    adapter: str = ""


class Scores(msgspec.Struct, tag="scores", frozen=True):
    update_id: int
    logprobs: list[list[float]]


__all__ = ["EngineConfig", "Generate", "Generation", "Score", "Scores"]
