"""A real TRL GRPO run on the CPU: a tiny local Llama, a locally built tokenizer, nothing downloaded.

Every run builds TRL's own colocated vLLM engine (``external_launcher``: in this process) and
shuts it down before the next one starts, so one vLLM engine exists at a time. The model is
``make_tiny_llama`` (hidden 128, head size 32: vLLM's CPU minimum) from a fixed seed; the
tokenizer is a WordLevel vocabulary ``w4 ... w511`` plus four special tokens, saved next to the
weights because TRL's engine loads its tokenizer from the model's directory.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

VOCAB = 512
TARGET = 64  # the reward: the share of completion tokens below this id
STEPS = 3
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tokenizer(vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: the tiny model's pad, bos and eos ids
    vocab = {token: i for i, token in enumerate(special)} | {f"w{i}": i for i in range(len(special), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def trl_model_dir(tmp_path_factory) -> Path:
    from colosync.testing import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("trl-models") / "tiny-llama", seed=0)
    make_tokenizer().save_pretrained(path)
    return path


def reward_low_ids(completion_ids, **_: Any) -> list[float]:
    """The share of completion tokens drawn from the target vocabulary (ids below ``TARGET``)."""
    return [sum(t < TARGET for t in ids) / max(len(ids), 1) for ids in completion_ids]


def prompts_dataset(n: int = 64):
    from datasets import Dataset

    rng = random.Random(0)
    return Dataset.from_dict({"prompt": [" ".join(f"w{rng.randrange(4, VOCAB)}" for _ in range(6)) for _ in range(n)]})


def grpo_config(out: Path, **overrides: Any):
    from trl import GRPOConfig

    options: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        vllm_gpu_memory_utilization=0.3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    return GRPOConfig(**(options | overrides))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS)


@contextlib.contextmanager
def cpu_engine_env():
    """vLLM's CPU backend reserves most of the RAM for KV cache unless told; TRL reads no such option."""
    added = {k: v for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@dataclass
class Run:
    """What one training run left behind."""

    logs: list[dict[str, float]]
    load_weights_calls: int
    syncs: int
    reports: list[Any] = field(default_factory=list)

    def steps(self) -> list[dict[str, float]]:
        return [entry for entry in self.logs if "loss" in entry]


def shutdown(trainer) -> None:
    """Stop TRL's in-process engine so the next run can build its own (one engine at a time)."""
    llm = trainer.vllm_generation.llm
    llm = getattr(llm, "llm", llm)  # colosync's ColosyncLLM wraps the real one
    llm.llm_engine.engine_core.shutdown()
    del trainer.vllm_generation.llm
    gc.collect()


def count_load_weights(trainer) -> list[int]:
    """Wrap the real vLLM model's ``load_weights`` (what TRL's stock sync calls once per tensor) with a counter."""
    llm = trainer.vllm_generation.llm
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    calls = [0]
    original = model.load_weights

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    model.load_weights = counted
    return calls


def count_syncs(trainer) -> list[int]:
    """Count ``sync_weights`` calls on the trainer's generation object (wrapping the real method)."""
    generation = trainer.vllm_generation
    calls = [0]
    original = generation.sync_weights

    def counted():
        calls[0] += 1
        return original()

    generation.sync_weights = counted
    return calls


@pytest.fixture(scope="package", autouse=True)
def environment_restored():
    """TRL's colocated engine and accelerate set MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, ... in
    this process (and keep the port bound); a subprocess started after these tests (an example)
    would inherit them and try to join that world. The environment is put back as it was once the
    package's tests are done."""
    saved = dict(os.environ)
    yield
    for k in set(os.environ) - set(saved):
        del os.environ[k]
    os.environ.update(saved)
