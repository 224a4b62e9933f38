"""The examples run as written: each ``examples/*.py`` runs to completion in a fresh process, and every
Python block of the README is one of them, character for character (the docs include them from their
files: ``tests/test_docs.py``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(example):
    run = subprocess.run(
        [sys.executable, str(example)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"{example.name} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


def test_every_python_block_of_the_readme_is_a_tested_example():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    examples = {p.read_text(): p.name for p in EXAMPLES}
    assert blocks, "the README shows the quickstart"
    for block in blocks:
        assert block in examples, f"a README block is no examples/*.py file as it is:\n{block[:300]}"
