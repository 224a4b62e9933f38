"""vLLM's sleep mode as a handoff participant (``colosync.engines.vllm.memory``), on this CPU machine."""

from __future__ import annotations

import importlib.util

import pytest

from colosync.errors import SleepModeUnavailable, UnsupportedOperation


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_cpu_backend_has_no_sleep_mode():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks vLLM's CPU backend")
    from colosync.engines.vllm.memory import VllmEngineMemory, vllm_sleep_support

    ok, why = vllm_sleep_support()
    assert not ok
    assert "CPU backend has no sleep mode" in why and "engine_offload=False" in why
    with pytest.raises(SleepModeUnavailable, match="CPU backend has no sleep mode"):
        VllmEngineMemory(object())
    assert issubclass(SleepModeUnavailable, UnsupportedOperation)  # a caller may catch either


def test_the_handoff_layer_does_not_hold_vllm():
    import colosync.handoff.backends.torch_engine as torch_engine

    assert not hasattr(torch_engine, "VllmEngineMemory") and not hasattr(torch_engine, "vllm_sleep_support")
