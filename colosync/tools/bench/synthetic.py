"""Synthetic engine and trainer states of a chosen size, for tests, benchmarks and dry runs.

Rehearsing a handoff on the real machine before a long job needs participants with the job's
byte counts but none of its model code: an "engine" of bf16 weight matrices plus a KV-cache
tensor, and a "trainer" of fp32 parameters with gradients and AdamW state (4 bytes of
parameters become 16 bytes of resident state).
"""

from __future__ import annotations

import math

import torch

MiB = 1 << 20


def _sizes(total_bytes: int, tensor_bytes: int) -> list[int]:
    count = max(1, math.ceil(total_bytes / tensor_bytes))
    per = total_bytes // count
    return [per] * count


def engine_state(
    weight_bytes: int,
    kv_bytes: int,
    *,
    device: torch.device | str,
    tensor_bytes: int = 256 * MiB,
    kv_tensor_bytes: int = 4 << 30,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A module of ``weight_bytes`` of weights and KV-cache tensors of ``kv_bytes`` in total."""
    device = torch.device(device)
    model = torch.nn.Module()
    params = []
    for n in _sizes(weight_bytes, tensor_bytes):
        t = torch.empty(n // dtype.itemsize, dtype=dtype, device=device)
        t.uniform_(-1, 1)
        params.append(torch.nn.Parameter(t, requires_grad=False))
    model.weights = torch.nn.ParameterList(params)
    kv = [torch.zeros(n // dtype.itemsize, dtype=dtype, device=device) for n in _sizes(kv_bytes, kv_tensor_bytes)]
    return model, kv


def trainer_state(
    param_bytes: int,
    *,
    device: torch.device | str,
    tensor_bytes: int = 128 * MiB,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 parameters of ``param_bytes`` with gradients and AdamW state (4x in total), after one step."""
    device = torch.device(device)
    model = torch.nn.Module()
    params = []
    for n in _sizes(param_bytes, tensor_bytes):
        t = torch.empty(n // 4, dtype=torch.float32, device=device)
        t.normal_()
        params.append(torch.nn.Parameter(t))
    model.weights = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    return model, opt
