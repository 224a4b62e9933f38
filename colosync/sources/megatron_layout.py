"""The Megatron -> HF/PEFT conversion, under its original import path.

The conversion moved to ``colosync.sources.architectures`` when it learned more than one
architecture (``base``: slots, splits and ``Architecture``; ``naming``: the naming table;
``context``: ``ConversionContext``; ``layout``: the plan and the conversions; one file per
architecture declares the rest). This module re-exports them so that code written against
``colosync.sources.megatron_layout`` keeps working unchanged.

``megatron_tensor_bytes`` is defined here: it sizes a sender's memory from the plan alone,
before any rank or process group exists, so it belongs with the plan rather than with the
collective schedule of ``colosync.sources.megatron``.
"""

from __future__ import annotations

import math

from colosync.errors import ConversionError
from colosync.sources.architectures import get as get_architecture
from colosync.sources.architectures.base import (
    HF_PARTS,
    LORA_SLOTS,
    PEFT_PREFIX,
    SPLITS,
    Architecture,
    Kind,
    Role,
    Slot,
    Split,
    hf_module,
)
from colosync.sources.architectures.context import ConversionContext, DtypePolicy
from colosync.sources.architectures.layout import (
    ConversionItem,
    HFTensor,
    convert,
    experts_from_hf,
    experts_to_hf,
    hf_specs,
    local_params,
    merge_fc1,
    merge_qkv,
    plan,
    shard,
    split_fc1,
    split_qkv,
    to_megatron,
)
from colosync.sources.architectures.naming import (
    ADAPTER_SUFFIXES,
    BASE_SUFFIXES,
    DEFAULT_NAMING,
    NamingRule,
    ParamKey,
    classify,
    index_params,
)


def megatron_tensor_bytes(ctx: ConversionContext) -> int:
    """Largest single gathered Megatron tensor of an update: the sender's memory beyond a bucket."""
    return max((math.prod(i.shape) * i.dtype.itemsize for i in plan(ctx)), default=0)


__all__ = [
    "ADAPTER_SUFFIXES",
    "BASE_SUFFIXES",
    "DEFAULT_NAMING",
    "HF_PARTS",
    "LORA_SLOTS",
    "PEFT_PREFIX",
    "SPLITS",
    "Architecture",
    "ConversionContext",
    "ConversionError",
    "ConversionItem",
    "DtypePolicy",
    "HFTensor",
    "Kind",
    "NamingRule",
    "ParamKey",
    "Role",
    "Slot",
    "Split",
    "classify",
    "convert",
    "experts_from_hf",
    "experts_to_hf",
    "get_architecture",
    "hf_module",
    "hf_specs",
    "index_params",
    "local_params",
    "megatron_tensor_bytes",
    "merge_fc1",
    "merge_qkv",
    "plan",
    "shard",
    "split_fc1",
    "split_qkv",
    "to_megatron",
]
