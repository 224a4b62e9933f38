"""The demo's trainer as a Ray actor: a PEFT policy, its optimizer, and a Sender to the engine.

It holds the model the engine must match, so it also scores the parity probe with the same
decoding code the hf engine uses.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from colosync.engines.ray_actor import RayLink, memory_sample


class TrainerActor:
    """Holds the PEFT policy and its optimizer; pushes the LoRA to the engine after each step."""

    def __init__(
        self,
        model_dir: str,
        engine: Any,
        engine_name: str,
        transport: str,
        rank: int,
        alpha: float,
        lr: float,
        seed: int,
        device: str,
        threads: int = 0,
        entropy_coef: float = 0.0,
    ) -> None:
        from peft import LoraConfig, get_peft_model

        from colosync.demo.models import LORA_TARGETS, load_model
        from colosync.sync.sender import Sender

        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.entropy_coef = entropy_coef
        base = load_model(model_dir, self.device)
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; a float alpha works (scale alpha/r)
            target_modules=list(LORA_TARGETS),
            lora_dropout=0.0,
        )
        self.model = get_peft_model(base, config).eval()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(params, lr=lr)
        self.sender = Sender(RayLink(engine, engine_name), transport=transport)

    def push(self) -> bytes:
        return msgspec.msgpack.encode(self.sender.push_peft(self.model))

    def train_step(
        self, prompts: list[list[int]], completions: list[list[int]], advantages: list[list[float]]
    ) -> float:
        """One policy-gradient step; ``advantages`` has one value per completion token."""
        from colosync.demo.rl import policy_gradient_step

        return policy_gradient_step(
            self.model, self.optimizer, prompts, completions, advantages, entropy_coef=self.entropy_coef
        )

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        from colosync.demo.models import score

        return score(self.model, prompts, completions)

    def memory(self) -> dict[str, int]:
        return memory_sample(self.device)

    def close(self) -> None:
        self.sender.close()
