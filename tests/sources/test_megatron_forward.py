"""Numerical ground truth: a real megatron-core forward vs the HF model built from the stream.

The Megatron model keeps its own initialization and its LoRA is drawn directly in
Megatron's layout and sharded as Megatron shards it, so these tests do not rely on the
converter's inverse: if the conversion of qkv interleaving, GQA, [gate; up] per shard,
row/column splits, vocab padding or the LoRA halves were wrong, the logits would disagree.

CPU runs on the shared gloo world (Megatron's few hard-coded CUDA device calls redirected,
see ``megatron_cpu_shims``); the ``gpu`` tests run the unshimmed forward on CUDA with NCCL,
TP=1 on one GPU and TP=2 on two.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_helpers import run_world
from megatron_workers import forward_worker

# relative L2 error of the logits: fp32 agrees to rounding; bf16 to bf16 rounding of a
# 2-layer model. A layout error gives errors of order 1 (the LoRA alone moves them ~10%+).
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def _check(result: dict, dtype: str) -> None:
    assert result["lora_effect"] > max(0.1, 10 * TOLERANCE[dtype]), f"the LoRA must visibly change the logits: {result}"
    assert result["base_err"] < TOLERANCE[dtype], result
    assert result["lora_err"] < TOLERANCE[dtype], result
    if dtype == "float32":
        assert result["argmax_agree"] == 1.0, result


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cpu_megatron_logits_match_converted_hf(cpu_world, tp):
    result = cpu_world.run(forward_worker, tp, "float32")[0]
    _check(result, "float32")


def test_cpu_megatron_logits_match_converted_hf_bf16(cpu_world):
    result = cpu_world.run(forward_worker, 2, "bfloat16")[0]
    _check(result, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_megatron_logits_match_converted_hf(tp, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs, found {torch.cuda.device_count()}")
    result = run_world(forward_worker, tp, (tp, dtype), backend="nccl", timeout_s=300)[0]
    print(f"TP={tp} {dtype}: {result}")
    _check(result, dtype)
