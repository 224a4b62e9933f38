"""colosync under a real TRL ``GRPOTrainer`` with its colocated vLLM (CPU backend), against stock TRL.

Each run trains ``STEPS`` GRPO steps of a LoRA on a tiny local Llama; one vLLM engine exists
at a time (each run shuts its engine down). The stock run is TRL's own sync (merge, one
``load_weights`` per tensor, unmerge). On vLLM's CPU backend that sync cannot run as shipped:
the backend prepacks every linear weight (oneDNN, or AMX's sgl kernel for bf16) and drops the
parameter TRL's ``load_weights`` writes into (``'Parameter' object has no attribute
'weight_loader'``). The stock run therefore makes the backend choose its plain
``torch.nn.functional.linear`` path, which keeps the weights (a setting of the real vLLM, not
a fake); colosync's runs use the backend as shipped. Both runs let vLLM pick its dtype as TRL
does (``auto``: bf16 for this float32 model on the CPU), so their logprob gaps compare.

Counts are taken by wrapping the real methods (the vLLM model's ``load_weights``, the
trainer's ``sync_weights``); nothing of vLLM or TRL is replaced by a stand-in, except in
``test_sleep_level_mapping``, which says why.
"""

from __future__ import annotations

import math
import statistics

import pytest

from colosync.errors import ConfigError, IntegrationError

from .conftest import (
    STEPS,
    Run,
    count_load_weights,
    count_syncs,
    cpu_engine_env,
    grpo_config,
    lora_config,
    prompts_dataset,
    reward_low_ids,
    shutdown,
)

pytest.importorskip("trl", reason="TRL is not installed (make test installs colosync[trl])")

GAP = "sampling/sampling_logp_difference/mean"
COLOSYNC = {"engine_kwargs": {"enforce_eager": True}}
LORA_MODULES = 2 * 7  # two layers, seven target modules each


def _model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _train(trainer) -> Run:
    load_weights = count_load_weights(trainer)
    syncs = count_syncs(trainer)
    try:
        trainer.train()
        reports = list(getattr(trainer, "colosync_reports", []))
        return Run(list(trainer.state.log_history), load_weights[0], syncs[0], reports)
    finally:
        shutdown(trainer)


@pytest.fixture(scope="module")
def stock_run(trl_model_dir, tmp_path_factory) -> Run:
    from trl import GRPOTrainer

    with cpu_engine_env(), pytest.MonkeyPatch.context() as mp:
        # vLLM's CPU backend: keep the weights TRL's stock sync writes into (see the module docstring).
        mp.setattr("vllm._custom_ops._supports_onednn", False)
        mp.setattr("vllm.model_executor.layers.utils.check_cpu_sgl_kernel", lambda n, k, dtype: False)
        trainer = GRPOTrainer(
            model=_model(trl_model_dir),
            reward_funcs=reward_low_ids,
            args=grpo_config(tmp_path_factory.mktemp("stock")),
            train_dataset=prompts_dataset(),
            processing_class=_tokenizer(trl_model_dir),
            peft_config=lora_config(),
        )
        return _train(trainer)


@pytest.fixture(scope="module")
def colosync_run(trl_model_dir, tmp_path_factory, stock_run) -> Run:  # after stock_run: one engine at a time
    from colosync.integrations.trl import ColosyncGRPOTrainer, ColosyncOptions

    with cpu_engine_env():
        trainer = ColosyncGRPOTrainer(
            model=_model(trl_model_dir),
            reward_funcs=reward_low_ids,
            args=grpo_config(tmp_path_factory.mktemp("colosync")),
            train_dataset=prompts_dataset(),
            processing_class=_tokenizer(trl_model_dir),
            peft_config=lora_config(),
            colosync=ColosyncOptions(**COLOSYNC),
        )
        return _train(trainer)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# -- the LoRA run ----------------------------------------------------------------------------


def test_stock_trl_pushes_every_merged_tensor(stock_run):
    """The baseline the counter sees: one ``load_weights`` per base tensor (21 here) at every sync."""
    assert stock_run.syncs == STEPS
    assert stock_run.load_weights_calls == 21 * stock_run.syncs


def test_colosync_pushes_adapter_only(colosync_run):
    run = colosync_run
    assert run.syncs == STEPS and len(run.reports) == STEPS
    assert run.load_weights_calls == 0  # no merged tensor ever reached vLLM
    for i, report in enumerate(run.reports, start=1):
        assert report.kind == "lora" and report.update_id == i
        assert report.tensors == 2 * LORA_MODULES  # lora_A and lora_B of every module, nothing of the base
        assert report.delivery.changed == report.delivery.expected == LORA_MODULES
        assert report.delivery.max_deviation is not None and math.isfinite(report.delivery.max_deviation)


def test_logprob_gap_within_stock_band(stock_run, colosync_run):
    """vLLM stays on-policy under colosync as under stock TRL: TRL's own vLLM-vs-trainer gap, step by step."""
    stock = [entry[GAP] for entry in stock_run.steps()]
    ours = [entry[GAP] for entry in colosync_run.steps()]
    assert len(stock) == len(ours) == STEPS
    print(f"mean |vLLM - trainer| logprob per step: stock TRL {stock}, colosync {ours}")
    band = max(stock)
    assert max(ours) <= 1.5 * band, (ours, stock)
    assert statistics.mean(ours) <= 1.25 * statistics.mean(stock) + 1e-3, (ours, stock)


def test_reward_and_colosync_metrics_logged(colosync_run):
    for entry, report in zip(colosync_run.steps(), colosync_run.reports, strict=True):
        assert 0.0 <= entry["reward"] <= 1.0
        assert entry["colosync/update_id"] == report.update_id
        assert entry["colosync/bytes"] == report.bytes
        assert entry["colosync/sync_seconds"] == pytest.approx(report.seconds["total"])
        assert entry["colosync/deviation"] == pytest.approx(report.delivery.max_deviation)
        assert entry["colosync/changed"] == LORA_MODULES


# -- full fine-tuning --------------------------------------------------------------------------


def test_full_fine_tuning_pushes_full_updates(trl_model_dir, tmp_path, colosync_run):  # after the LoRA runs
    from colosync.integrations.trl import ColosyncGRPOTrainer, ColosyncOptions

    with cpu_engine_env():
        trainer = ColosyncGRPOTrainer(
            model=_model(trl_model_dir),
            reward_funcs=reward_low_ids,
            args=grpo_config(tmp_path, learning_rate=1e-4),
            train_dataset=prompts_dataset(),
            processing_class=_tokenizer(trl_model_dir),
            colosync=ColosyncOptions(**COLOSYNC),
        )
        syncs = count_syncs(trainer)
        try:
            trainer.train()
            reports = list(trainer.colosync_reports)
            steps = [e for e in trainer.state.log_history if "loss" in e]
        finally:
            shutdown(trainer)
    assert syncs[0] == STEPS and [r.kind for r in reports] == ["full"] * STEPS
    assert all(r.tensors == 21 and r.delivery.changed == r.delivery.expected for r in reports)
    assert all(e["colosync/update_id"] == r.update_id for e, r in zip(steps, reports, strict=True))
    assert all(e[GAP] < 0.05 for e in steps), [e[GAP] for e in steps]


# -- refusals, before any engine is built ----------------------------------------------------


def _build(model_dir, tmp_path, **kwargs):
    from colosync.integrations.trl import ColosyncGRPOTrainer

    config = kwargs.pop("config", {})
    return ColosyncGRPOTrainer(
        model=_model(model_dir),
        reward_funcs=reward_low_ids,
        args=grpo_config(tmp_path, **config),
        train_dataset=prompts_dataset(8),
        processing_class=_tokenizer(model_dir),
        **kwargs,
    )


def test_trl_internals_mismatch_raises_naming_versions(trl_model_dir, tmp_path, monkeypatch):
    """A TRL whose VLLMGeneration lacks ``sync_weights`` (as a future version might) is refused up front.

    No other TRL version can be installed here, so the installed one is altered: its method
    removed and its version string changed (the fault a different version would bring).
    """
    import trl
    from trl.generation import vllm_generation

    monkeypatch.setattr(trl, "__version__", "9.0.0")
    monkeypatch.delattr(vllm_generation.VLLMGeneration, "sync_weights")
    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda *a, **k: built.append(k))
    with pytest.raises(IntegrationError, match=r"TRL 9\.0\.0 .*VLLMGeneration\.sync_weights.*>=1\.16\.0,<1\.17"):
        _build(trl_model_dir, tmp_path, peft_config=lora_config())
    assert not built  # refused before TRL built an engine


def test_trl_without_the_class_raises(monkeypatch):
    from trl.generation import vllm_generation

    from colosync.integrations.trl_check import check_trl

    monkeypatch.delattr(vllm_generation, "VLLMGeneration")
    with pytest.raises(IntegrationError, match=r"class trl\.generation\.vllm_generation\.VLLMGeneration"):
        check_trl()


def test_refusals_name_the_fix(trl_model_dir, tmp_path):
    from peft import LoraConfig

    from colosync.integrations.trl import ColosyncOptions

    with pytest.raises(ConfigError, match="vllm_mode='colocate'"):
        _build(trl_model_dir, tmp_path, config={"vllm_mode": "server"}, peft_config=lora_config())
    with pytest.raises(ConfigError, match="use_vllm=True"):
        _build(trl_model_dir, tmp_path, config={"use_vllm": False}, peft_config=lora_config())
    saving = LoraConfig(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ConfigError, match="modules_to_save"):
        _build(trl_model_dir, tmp_path, peft_config=saving)
    with pytest.raises(ConfigError, match="colosync sets them"):
        ColosyncOptions(engine_kwargs={"enable_lora": False})
    with pytest.raises(ConfigError, match="max_lora_rank"):
        ColosyncOptions(max_lora_rank=12)


# -- sleep mode ---------------------------------------------------------------------------------


def test_cpu_backend_has_no_sleep_mode(trl_model_dir, tmp_path):
    """vLLM's CPU backend refuses sleep mode outright (stock TRL and colosync alike), when the engine is configured."""
    with cpu_engine_env(), pytest.raises(ValueError, match="[Ss]leep mode"):
        _build(trl_model_dir, tmp_path, config={"vllm_enable_sleep_mode": True}, peft_config=lora_config())


def test_lora_refuses_sleep_level_2(trl_model_dir, tmp_path):
    from colosync.integrations.trl import ColosyncOptions

    with pytest.raises(ConfigError, match="sleep level 2 discards"):
        _build(
            trl_model_dir,
            tmp_path,
            config={"vllm_enable_sleep_mode": True},
            peft_config=lora_config(),
            colosync=ColosyncOptions(sleep_level=2),
        )


def test_sleep_level_mapping():
    """TRL asks for level 2 after every generate; a LoRA run gets level 1 (base weights kept), full runs 2.

    vLLM's CPU backend has no sleep mode, so the real ``LLM.sleep`` cannot run here: a recording
    stand-in takes its place, and only ``ColosyncLLM``'s choice of level is checked.
    """
    from colosync.integrations.trl import ColosyncLLM

    class Recorder:
        levels: list[int] = []

        def sleep(self, level: int = 1, **_):
            self.levels.append(level)

    for keep, expected in ((True, [1, 1, 0]), (False, [2, 1, 0])):
        llm = Recorder()
        llm.levels = []
        wrapped = ColosyncLLM(llm, engine=None, keep_weights=keep)  # type: ignore[arg-type]
        for level in (2, 1, 0):
            wrapped.sleep(level=level)
        assert llm.levels == expected


def test_trainers_sharing_vllm_generation():
    """RLOO builds the same ``VLLMGeneration``: its colosync subclass exists; a trainer without it is refused."""
    import trl

    from colosync.integrations import trl as integration

    rloo = integration.with_colosync(trl.RLOOTrainer)
    assert issubclass(rloo, trl.RLOOTrainer) and rloo is integration.ColosyncRLOOTrainer
    assert rloo.__name__ == "ColosyncRLOOTrainer"
    with pytest.raises(IntegrationError, match="SFTTrainer"):
        integration.with_colosync(trl.SFTTrainer)
