"""A PEFT adapter's LoraSpec names its targets by leaf, however PEFT was told them.

PEFT keeps ``target_modules="all-linear"``, a regex string, or a list of full module paths as
given; the manifest (and every engine) matches modules by leaf name (``q_proj``) and layer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model

from colosync.sync.sender import peft_lora_spec
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
