"""The README's examples run as written: each ``examples/*.py`` runs to completion in a fresh process,
and the README shows each one as a block, character for character."""

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


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_readme_shows_the_example_as_it_is(example):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert example.read_text() in blocks, f"the README's block for {example.name} differs from the file"
