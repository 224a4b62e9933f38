"""benchmarks/README.md is what benchmarks/index.py writes from the records, and every subject has a record."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def index():
    spec = importlib.util.spec_from_file_location("benchmarks_index", BENCHMARKS / "index.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_the_committed_index_is_what_the_records_give(index, tmp_path):
    assert index.main(["--out", str(tmp_path), "--no-plots"]) == 0
    written = (tmp_path / "README.md").read_text()
    assert written == (BENCHMARKS / "README.md").read_text(), "stale: run `python benchmarks/index.py`"
    assert index.readme() == written  # the same records give the same page


def test_every_subject_folder_has_a_record_saying_how_it_was_made(index):
    folders = {p.name for p in BENCHMARKS.iterdir() if p.is_dir() and p.name not in {"gpu", "__pycache__"}}
    assert folders == set(index.SUBJECTS), "a folder the index does not list, or a listed folder that is gone"
    for row in index.ROWS:
        m = index.meta(index.load(row.folder, row.record))
        for key in ("command", "date", "commit", "machine"):
            assert m[key], f"{row.folder}/{row.record} has no {key}"
        assert (BENCHMARKS / row.folder / "README.md").is_file(), f"{row.folder}/ has no README"
