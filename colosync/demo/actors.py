"""The demo's trainer: a PEFT policy, its optimizer, a Sender to the engine, and its memory.

One class for both launchers: a Ray actor (``ray.remote(TrainerActor)``) or a plain process
(``colosync.colocated.launch.ActorProcess``), so the same code trains, scores and pushes either way.
It holds the model the engine must match, so it also scores the parity probe with the same
decoding code the hf engine uses. With ``handoff=True`` the model is not built here but by the
plan's ``trainer.load`` (a ``TorchTrainerMemory`` served through ``handoff``), so the
controller's executor sees the load, the sleeps and the wake-ups as they happen.
"""

from __future__ import annotations

import gc
from typing import Any

import msgspec
import torch

from colosync.colocated.trainer import ServedTrainer, TrainerPlan, as_probe, engine_link


class TrainerActor(ServedTrainer):
    """Holds the PEFT policy and its optimizer; pushes the LoRA to the engine after each step.

    ``engine``: a Ray actor handle of the engine, or the msgpack bytes of an ``EngineAddress``
    (an ``EngineProcess``'s socket).
    """

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
        handoff: bool = False,
    ) -> None:
        from colosync.sync.sender import Sender

        if threads:
            torch.set_num_threads(threads)
        self.model_dir, self.rank, self.alpha, self.lr, self.seed = model_dir, rank, alpha, lr, seed
        self.device = torch.device(device)
        self.entropy_coef = entropy_coef
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sender = Sender(engine_link(engine, engine_name), transport=transport)
        if handoff:
            self._warm_up()  # CUDA context, kernels, lazy imports: before the executor's baseline
        else:
            self._load()

    # -- the model --------------------------------------------------------------------------
    def _build(self) -> tuple[Any, torch.optim.Optimizer]:
        from peft import LoraConfig, get_peft_model

        from colosync.testing import LORA_TARGETS, load_model

        torch.manual_seed(self.seed)
        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # PEFT annotates int; a float alpha works (scale alpha/r)
            target_modules=list(LORA_TARGETS),
            lora_dropout=0.0,
        )
        model = get_peft_model(load_model(self.model_dir, self.device), config).eval()
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.Adam(params, lr=self.lr)

    def _load(self) -> tuple[Any, torch.optim.Optimizer]:
        self.model, self.optimizer = self._build()
        return self.model, self.optimizer

    def _warm_up(self) -> None:
        """One throwaway step on a throwaway copy, so what the first real step allocates once
        (CUDA context and libraries, autograd, optimizer imports) is there before the plan runs."""
        from colosync.demo.rl import policy_gradient_step
        from colosync.handoff.runtime.sampling import trim_host_allocator

        model, optimizer = self._build()
        # One sync too, of the fresh adapter (B = 0: the engine serves the base model): the first
        # sync's one-time costs (the fused kernel's Triton JIT here and in the engine, the engine's
        # PEFT import and first adapter, the transport's set-up) land before the baseline.
        self.sender.push_peft(model)
        policy_gradient_step(model, optimizer, [[1, 3, 4]], [[5, 6]], [[1.0, -1.0]], self.entropy_coef)
        del model, optimizer
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_host_allocator()

    def planned_sizes(self) -> TrainerPlan:
        """The backup (weights, buffers, the LoRA's two Adam moments) and one push (the LoRA),
        counted on a model built on the meta device."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        from colosync.testing import LORA_TARGETS

        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))
            config = LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(LORA_TARGETS))  # type: ignore[arg-type]
            model = get_peft_model(base, config)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        nbytes += sum(b.numel() * b.element_size() for b in model.buffers())
        lora = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        backup = nbytes + 2 * lora
        return TrainerPlan(backup=backup, resident=backup + lora, grad_buffer=lora, sync_kind="lora", sync_bytes=lora)

    # -- the step -----------------------------------------------------------------------------
    def push(self, probe: Any = None) -> bytes:
        return msgspec.msgpack.encode(self.sender.push_peft(self.model, verify=as_probe(probe)))

    def train_step(
        self, prompts: list[list[int]], completions: list[list[int]], advantages: list[list[float]]
    ) -> float:
        """One policy-gradient step; ``advantages`` has one value per completion token."""
        from colosync.demo.rl import policy_gradient_step

        assert self.optimizer is not None, "the trainer is not loaded (the plan's init phase loads it)"
        return policy_gradient_step(
            self.model, self.optimizer, prompts, completions, advantages, entropy_coef=self.entropy_coef
        )

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        from colosync.testing import score

        return score(self.model, prompts, completions)

    # -- memory -------------------------------------------------------------------------------
    def trainer_memory(self, pool: Any) -> Any:
        from colosync.handoff.backends.torch_trainer import TorchTrainerMemory

        return TorchTrainerMemory(
            loader=self._load, pool=pool, device=self.device, cache_bytes=self.planned_sizes().cache
        )


__all__ = ["TrainerActor"]
