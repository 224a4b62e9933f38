"""A PEFT adapter's LoraSpec names its targets by leaf, however PEFT was told them.

PEFT keeps ``target_modules="all-linear"``, a regex string, or a list of full module paths as
given; the manifest (and every engine) matches modules by leaf name (``q_proj``) and layer. A
second adapter, named, travels with its own spec and tensors, not the default's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model

from colosync.sync.sender import peft_lora_spec, peft_lora_tensors
from colosync.testing import load_model, make_tiny_llama

ALL = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", seed=0, num_hidden_layers=2)


def spec_of(model_dir, targets):
    return peft_lora_spec(get_peft_model(load_model(model_dir), LoraConfig(r=4, target_modules=targets)))


def test_all_linear_becomes_every_projection_on_every_layer(model_dir):
    spec = spec_of(model_dir, "all-linear")
    assert spec.target_modules == ALL and spec.layers is None


def test_full_paths_become_leaves_and_the_layers_they_sit_in(model_dir):
    spec = spec_of(model_dir, ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"])
    assert spec.target_modules == ("down_proj", "q_proj") and spec.layers == (1,)


def test_a_regex_becomes_the_leaves_it_matched(model_dir):
    spec = spec_of(model_dir, r".*\.(q|v)_proj")
    assert spec.target_modules == ("q_proj", "v_proj") and spec.layers is None


def test_leaf_names_pass_through(model_dir):
    spec = spec_of(model_dir, ["v_proj", "q_proj"])
    assert spec.target_modules == ("q_proj", "v_proj") and spec.layers is None


def test_push_peft_on_a_model_without_an_adapter_names_the_fix(model_dir):
    from colosync.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"push_peft needs a PEFT model.*get_peft_model.*push\(model\.named_parameters"
    ):
        peft_lora_spec(load_model(model_dir))
    peft_model = get_peft_model(load_model(model_dir), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"no adapter 'policy'; it has \['default'\]: pass adapter="):
        peft_lora_spec(peft_model, adapter="policy")


def test_a_peft_adapter_on_full_module_paths_keeps_the_layers_it_was_configured_for(tiny_model_dir):
    """Targets given as full module paths are reported by leaf; ``layers_to_transform`` travels as configured."""
    torch.manual_seed(0)
    base = load_model(tiny_model_dir)
    layers = base.config.num_hidden_layers
    paths = [f"model.layers.{i}.self_attn.q_proj" for i in range(layers)]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=paths, layers_to_transform=list(range(layers)))
    spec = peft_lora_spec(get_peft_model(base, cfg))
    assert spec.target_modules == ("q_proj",) and spec.layers == tuple(range(layers))


def test_a_second_peft_adapter_travels_with_its_own_spec_and_weights(tiny_model_dir):
    """``push_peft(model, adapter)``: the named adapter's rank, rslora, layers and weights, not the default's."""
    torch.manual_seed(0)
    model = get_peft_model(load_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    second = LoraConfig(
        r=2, lora_alpha=6, target_modules=["v_proj", "k_proj"], use_rslora=True, layers_to_transform=[1, 0]
    )
    model.add_adapter("second", second)
    spec = peft_lora_spec(model, "second")
    assert (spec.rank, spec.alpha, spec.target_modules) == (2, 6.0, ("k_proj", "v_proj"))
    assert spec.use_rslora and spec.layers == (0, 1)
    default = peft_lora_spec(model)
    assert (default.rank, default.use_rslora, default.layers) == (4, False, None)
    names = [n for n, _ in peft_lora_tensors(model, "second")]
    assert names and all(("k_proj" in n or "v_proj" in n) and "q_proj" not in n for n in names)
    assert {t.shape[0] for n, t in peft_lora_tensors(model, "second") if "lora_A" in n} == {2}
