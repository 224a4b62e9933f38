"""``colosync.workloads``: preset names and paths to JSON documents, and an error that says
exactly what is wrong for each way a workload argument can be wrong.

(It tests the bottom-layer ``colosync.workloads``; it sits with the tools that read workloads.)
"""

from __future__ import annotations

import json
import os

import pytest

from colosync import workloads
from colosync.errors import ConfigError


def test_names_by_kind():
    assert workloads.names("sync") == ["llama8b-full", "seed-lora"]
    assert workloads.names("handoff") == ["k3-gb300"]
    assert workloads.names() == ["k3-gb300", "llama8b-full", "seed-lora"]
    with pytest.raises(ConfigError, match=r"unknown workload kind 'lora'; choose one of \['sync', 'handoff'\]"):
        workloads.names("lora")


def test_shipped_folder_holds_every_preset():
    assert workloads.WORKLOADS_DIR.is_dir()
    assert (workloads.WORKLOADS_DIR / "k3-gb300-handoff.json").is_file()
    assert workloads.resolve("k3-gb300") == workloads.WORKLOADS_DIR / "k3-gb300-handoff.json"
    assert workloads.resolve("k3-gb300-handoff", kind="handoff") == workloads.resolve("k3-gb300")  # the file's stem


def test_load_a_preset_and_a_path(tmp_path, monkeypatch):
    doc = workloads.load("seed-lora", kind="sync")
    assert isinstance(doc["tensors"], list) and doc["kind"] == "lora"
    assert workloads.load("k3-gb300")["gpus_per_node"] == 4
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"gpus_per_node": 2}))
    assert workloads.load(str(path), kind="handoff") == {"gpus_per_node": 2}
    assert workloads.load(path) == {"gpus_per_node": 2}  # a Path works too
    monkeypatch.chdir(tmp_path)
    os.rename("node.json", "node")
    assert workloads.load("node") == {"gpus_per_node": 2}  # an existing file wins over the preset names


def test_missing_file_says_no_such_file(tmp_path):
    missing = tmp_path / "my-node.json"
    with pytest.raises(ConfigError) as info:
        workloads.load(str(missing), kind="handoff")
    message = str(info.value)
    assert f"handoff workload file '{missing}': no such file" in message
    assert "not a preset" not in message and "['k3-gb300']" in message
    with pytest.raises(ConfigError, match="workload file 'nodes/a': no such file"):
        workloads.load("nodes/a")  # a directory part makes it a path, not a preset name


def test_unknown_preset_lists_the_presets():
    with pytest.raises(
        ConfigError,
        match=r"no sync workload preset named 'seed-lor'; presets: "
        r"\['llama8b-full', 'seed-lora'\] \(or give the path of a JSON file\)",
    ):
        workloads.load("seed-lor", kind="sync")
    with pytest.raises(ConfigError, match=r"no workload preset named 'x'; presets: \['k3-gb300', 'llama8b-full'"):
        workloads.load("x")


def test_preset_of_the_other_kind_says_so():
    with pytest.raises(
        ConfigError,
        match=r"'seed-lora' is a sync workload, not a handoff workload; "
        r"handoff presets: \['k3-gb300'\]",
    ):
        workloads.load("seed-lora", kind="handoff")


def test_invalid_json_says_where(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus_per_node": 4,\n}')
    with pytest.raises(ConfigError, match=r"workload file '.*bad.json' is not valid JSON: .* at line 2 column 1"):
        workloads.load(str(bad))


def test_json_that_is_not_an_object(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON array, not an object of fields"):
        workloads.load(str(listed))


def test_a_directory_is_not_a_workload(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; give a JSON file in it or a preset name"):
        workloads.load(str(tmp_path))


def test_errors_are_value_errors_too():
    with pytest.raises(ValueError):  # ConfigError is a ValueError: callers that caught that still work
        workloads.load("no-such-preset")
