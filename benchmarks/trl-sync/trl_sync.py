"""Sync seconds per GRPO step: stock TRL (merge, one load_weights per tensor, unmerge) vs colosync (adapter only).

Both runs are real TRL ``GRPOTrainer`` runs with a colocated vLLM (CPU backend) on one synthetic
Llama (random weights, HF's init, saved locally in bf16; nothing downloaded), one after the
other in this process, one engine at a time. Each step's sync is timed around the trainer's
own ``vllm_generation.sync_weights`` call. colosync's steps are verified pushes (a probe
scored by trainer and engine); after its run, ``--extra-pushes`` unverified pushes of the
same adapter are timed too. The stock run makes vLLM's CPU backend keep its linear weights
(``torch.nn.functional.linear`` instead of oneDNN/AMX prepacking, which drops the parameter
TRL's ``load_weights`` writes into); colosync's run uses the backend as shipped.

Run: nice -n 10 .venv/bin/python benchmarks/trl-sync/trl_sync.py --out benchmarks/trl-sync/record.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(path: Path, layers: int, hidden: int, intermediate: int, vocab: int) -> int:
    """A Llama with HF's default init, saved in bf16; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 64
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    del model
    gc.collect()
    return count


def save_tokenizer(path: Path, vocab: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    words = {t: i for i, t in enumerate(special)} | {f"w{i}": i for i in range(len(special), vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.save_pretrained(path)
    return wrapped


def reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of even token ids: about half of a random model's tokens, so advantages (and the adapter) move."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def timed_syncs(trainer: Any) -> list[float]:
    seconds: list[float] = []
    generation = trainer.vllm_generation
    original = generation.sync_weights

    def timed() -> None:
        start = time.perf_counter()
        original()
        seconds.append(time.perf_counter() - start)

    generation.sync_weights = timed
    return seconds


def shutdown(trainer: Any) -> None:
    llm = trainer.vllm_generation.llm
    getattr(llm, "llm", llm).llm_engine.engine_core.shutdown()
    del trainer.vllm_generation.llm
    gc.collect()


def run(kind: str, model_dir: Path, tokenizer: Any, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(4, args.vocab)}" for _ in range(6)) for _ in range(64)]
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    common: dict[str, Any] = dict(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=LORA_TARGETS),
    )
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if kind == "stock":
            import pytest

            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr("vllm._custom_ops._supports_onednn", False)
            mp.setattr("vllm.model_executor.layers.utils.check_cpu_sgl_kernel", lambda n, k, dtype: False)
            trainer = GRPOTrainer(**common)
        else:
            from colosync.integrations.trl import ColosyncGRPOTrainer, ColosyncOptions

            trainer = ColosyncGRPOTrainer(**common, colosync=ColosyncOptions(engine_kwargs={"enforce_eager": True}))
        built = time.perf_counter() - started
        syncs = timed_syncs(trainer)
        try:
            trainer.train()
            result: dict[str, Any] = {
                "build_seconds": built,
                "sync_seconds": syncs,
                "median_sync_seconds": statistics.median(syncs),
                "median_sync_seconds_after_first": statistics.median(syncs[1:]) if len(syncs) > 1 else None,
                "logprob_gap_mean": [
                    e.get("sampling/sampling_logp_difference/mean") for e in trainer.state.log_history if "loss" in e
                ],
            }
            if kind == "colosync":
                reports = list(trainer.colosync_reports)
                result["reports"] = [
                    {
                        "update_id": r.update_id,
                        "bytes": r.bytes,
                        "tensors": r.tensors,
                        "seconds": r.seconds,
                        "deviation": r.delivery.max_deviation if r.delivery else None,
                    }
                    for r in reports
                ]
                sender, model = trainer.vllm_generation.colosync_sender, trainer.model
                plain = [sender.push_peft(model).seconds["total"] for _ in range(args.extra_pushes)]
                result["unverified_push_seconds"] = plain
                result["median_unverified_push_seconds"] = statistics.median(plain) if plain else None
                result["adapter_bytes"] = reports[-1].bytes
        finally:
            shutdown(trainer)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--extra-pushes", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/trl-sync/record.json"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import trl
    import vllm

    from colosync.tools.bench.machine import machine_info

    work = Path(tempfile.mkdtemp(prefix="trl-sync-"))
    model_dir = work / "model"
    params = build_model(model_dir, args.layers, args.hidden, args.intermediate, args.vocab)
    tokenizer = save_tokenizer(model_dir, args.vocab)
    print(f"synthetic Llama: {params / 1e6:.0f}M parameters", flush=True)
    results = {}
    for kind in ("stock", "colosync"):
        results[kind] = run(kind, model_dir, tokenizer, args, work / kind)
        print(kind, json.dumps({k: v for k, v in results[kind].items() if k != "reports"}), flush=True)
    report = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "vllm": vllm.__version__},
        "model": {
            "parameters": params,
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "checkpoint_dtype": "bfloat16",
            "trainer_dtype": "float32",
            "engine_dtype": "auto (bfloat16 on the CPU backend)",
        },
        "lora": {"rank": args.rank, "alpha": 2 * args.rank, "targets": LORA_TARGETS},
        "steps": args.steps,
        "notes": (
            "sync_seconds: wall time of the trainer's vllm_generation.sync_weights per step (stock: merge, one "
            "load_weights per base tensor, unmerge, reset_prefix_cache; colosync: one verified adapter-only push + "
            "reset_prefix_cache). Stock vLLM runs with its CPU GEMM fallback (weights kept; see the docstring). "
            "unverified_push_seconds: colosync pushes of the final adapter without a probe, after training."
        ),
        "results": results,
        "speedup_median": results["stock"]["median_sync_seconds"] / results["colosync"]["median_sync_seconds"],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"stock median {results['stock']['median_sync_seconds']:.3f} s, colosync median "
        f"{results['colosync']['median_sync_seconds']:.3f} s -> {args.out}"
    )


if __name__ == "__main__":
    main()
