"""A trainer of a given size, to rehearse a colocated step: bf16 weights, fp32 Adam, full pushes.

The memory of a colocated step is set by sizes: the trainer's weights (which it pushes whole
into the engine, the same ``SyntheticModel`` the synthetic engine serves), its gradient
buffer, and its fp32 Adam moments, 2 + 2 + 8 bytes per parameter (the moments of 1/N of
them with ``optimizer_shards=N``: one rank's share of a distributed optimizer). Its step is a real Adam
update with the moments in fp32 (the bf16 weights updated from fp32 arithmetic, one tensor
at a time) on gradients drawn from a seeded generator, so every push changes every byte the
engine serves and the parity check (``digest`` here against the engine's ``Digest``) means
something. It runs in a plain process or a Ray actor like any ``ServedTrainer``, with its
memory served to the controller's executor through ``handoff``; ``colosync bench-step`` runs
it against the synthetic engine at a job's sizes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import torch

from colosync.colocated.trainer import ServedTrainer, TrainerPlan, as_probe, engine_link
from colosync.engines.synthetic import SyntheticModel, digest
from colosync.errors import ConfigError
from colosync.sync.sender import DEFAULT_BUCKET_BYTES, Sender

BACKENDS = ("torch", "tms")  # TorchTrainerMemory (the arena), TmsTrainerMemory (torch_memory_saver)


class SyntheticTrainer(ServedTrainer):
    """``SyntheticModel``'s weights as trainable bf16 parameters with fp32 Adam moments."""

    def __init__(
        self,
        model_dir: str,
        engine: Any,
        engine_name: str = "synthetic",
        transport: str = "auto",
        device: str = "cpu",
        lr: float = 1e-3,
        seed: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        optimizer_shards: int = 1,
        backend: str = "torch",
    ) -> None:
        self.spec = SyntheticModel.load(model_dir)
        if optimizer_shards < 1:
            raise ConfigError(f"optimizer_shards must be >= 1, got {optimizer_shards}")
        if backend not in BACKENDS:
            raise ConfigError(f"unknown trainer backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        self.backend = backend
        layout = self.spec.layout()
        # This rank's share of a distributed optimizer over ``optimizer_shards`` ranks: the fp32
        # moments of the first 1/N of the weights; the rest change by the gradient alone (what
        # the other ranks' updates, all-gathered, would bring).
        self.shard = [i < -(-len(layout) // optimizer_shards) for i in range(len(layout))]
        self.device = torch.device(device)
        self.lr, self.seed, self.steps = lr, seed, 0
        self.model: torch.nn.Module | None = None
        self.moments: list[torch.Tensor] = []
        self.sender = Sender(engine_link(engine, engine_name), transport=transport, bucket_bytes=bucket_bytes)
        self._warm_up()

    def _warm_up(self) -> None:
        """What the first step would pay once, before the controller's baseline: the CUDA
        context, the step's kernels, and one sync (of the engine's own first weight, drawn from
        the same seed, so it changes nothing) for the transport's set-up and the sync's kernels."""
        x = torch.ones(1024, device=self.device, dtype=self.spec.torch_dtype)
        _adam(x, x.clone(), torch.zeros(1024, device=self.device), torch.zeros(1024, device=self.device), 1, 1e-3)
        # The first update sizes the transport (no more slots than it has buckets), so it
        # spans a bucket per slot: the engine's own first tensors, drawn in build order from
        # the same seed.
        generator = torch.Generator(device=self.device).manual_seed(self.spec.seed)
        first: list[tuple[str, torch.Tensor]] = []
        total, slots = 0, self.sender.slots
        for name, shape in self.spec.layout():
            if len(first) >= slots and total >= slots * self.sender.bucket_bytes:
                break
            total += _nbytes(shape, self.spec.torch_dtype)
            t = torch.empty(shape, dtype=self.spec.torch_dtype, device=self.device)
            first.append((name, t.normal_(0.0, 0.02, generator=generator)))
        self.sender.push(first)
        del x, first
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- the model --------------------------------------------------------------------------
    def _load(self) -> tuple[torch.nn.Module, None]:
        """The engine's starting weights (same seed), a zeroed gradient buffer, zero moments."""
        self._load_state()
        self._load_grads()
        assert self.model is not None
        return self.model, None

    def _load_state(self) -> None:
        model = self.spec.build(self.device)
        self.moments = [
            torch.zeros(p.shape, dtype=torch.float32, device=self.device)
            for p, mine in zip(model.parameters(), self.shard, strict=True)
            if mine
            for _ in range(2)
        ]
        self.model = model

    def _load_grads(self) -> None:
        assert self.model is not None
        for p in self.model.parameters():
            p.requires_grad_(True)
            p.grad = torch.zeros_like(p)

    def _load_into(self, memory: Any) -> None:
        """The same, allocated inside torch_memory_saver's regions (state backed up, grads not)."""
        with memory.state_region():
            self._load_state()
        with memory.grad_region():
            self._load_grads()

    def trainer_memory(self, pool: Any) -> Any:
        cache = self.planned_sizes().cache
        if self.backend == "tms":  # side by side: torch_memory_saver's own pinned backup, not the arena
            from colosync.handoff.backends.tms_trainer import TmsTrainerMemory

            return TmsTrainerMemory(device=self.device, loader=self._load_into, cache_bytes=cache)
        from colosync.handoff.backends.torch_trainer import TorchTrainerMemory

        return TorchTrainerMemory(
            loader=self._load, pool=pool, device=self.device, extra_state=lambda: self.moments, cache_bytes=cache
        )

    def planned_sizes(self) -> TrainerPlan:
        weights = sum(_nbytes(shape, self.spec.torch_dtype) for _, shape in self.spec.layout())
        moments = sum(
            2 * _nbytes(shape, torch.float32)
            for (_, shape), mine in zip(self.spec.layout(), self.shard, strict=True)
            if mine
        )
        backup = weights + moments
        # the step's fp32 temporaries of one tensor, kept by the allocator until clear_memory
        largest = max(_nbytes(shape, self.spec.torch_dtype) for _, shape in self.spec.layout())
        return TrainerPlan(
            backup=backup,
            resident=backup + weights + 8 * largest,
            grad_buffer=weights,
            sync_kind="full",
            sync_bytes=weights,
        )

    # -- the step -----------------------------------------------------------------------------
    def train_step(self) -> float:
        """One Adam step on seeded gradients; its seconds (device work included)."""
        assert self.model is not None, "the trainer is not loaded (the plan's init phase loads it)"
        started = time.perf_counter()
        self.steps += 1
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.steps)
        with torch.no_grad():
            moments = iter(self.moments)
            for p, mine in zip(self.model.parameters(), self.shard, strict=True):
                assert p.grad is not None
                p.grad.normal_(0.0, 1.0, generator=generator)
                if mine:
                    _adam(p, p.grad, next(moments), next(moments), self.steps, self.lr)
                else:
                    p.add_(p.grad, alpha=-self.lr)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def push(self, probe: Any = None) -> bytes:
        assert self.model is not None, "the trainer is not loaded"
        named = [(f"{name}", p.detach()) for name, p in self.model.named_parameters()]
        return msgspec.msgpack.encode(self.sender.push(named, verify=as_probe(probe)))

    def digest(self) -> list[int]:
        assert self.model is not None, "the trainer is not loaded"
        return digest(list(self.model.parameters()))


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _adam(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float, b1: float = 0.9
) -> None:
    """Adam (b2 0.999, eps 1e-8) with fp32 moments on a bf16 weight, in place."""
    b2 = 0.999
    gf = g.float()
    m.mul_(b1).add_(gf, alpha=1 - b1)
    v.mul_(b2).addcmul_(gf, gf, value=1 - b2)
    update = (m / (1 - b1**step)).div_((v / (1 - b2**step)).sqrt_().add_(1e-8))
    p.add_(update.to(p.dtype), alpha=-lr)


__all__ = ["SyntheticTrainer"]
