"""The type checker is one of the tests: the package checks clean, and a wrong annotation fails.

``make lint`` (which ``make test`` runs first) checks the whole tree with ruff and mypy; these
tests pin down that the mypy half is real: a deliberately wrong annotation is an error under
the project's configuration, the core layers are held to ``--strict`` while the rest is
checked at mypy's default level, and ``colosync`` itself has no error.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("mypy") is None:
    pytest.skip(
        "mypy is not installed (it comes with the 'test' extra: pip install -e '.[test]')", allow_module_level=True
    )

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"
WRONG = "def f(x: int) -> str:\n    return x\n"
UNANNOTATED = "def f(x):\n    return x\n"


def mypy(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_wrong_annotation_fails_the_strict_check(tmp_path):
    (tmp_path / "wrong.py").write_text(WRONG)
    result = mypy("--strict", "--cache-dir", tmp_path / "cache", "wrong.py", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'wrong.py:2: error: Incompatible return value type (got "int", expected "str")' in result.stdout


def test_the_core_layers_are_strict_and_the_rest_is_not(tmp_path):
    """The same unannotated function: an error under ``colosync.wire``, fine under ``colosync.demo``."""
    for package in ("colosync", "colosync/wire", "colosync/demo"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "colosync/wire/probe.py").write_text(UNANNOTATED + WRONG.replace("def f", "def g"))
    (tmp_path / "colosync/demo/probe.py").write_text(UNANNOTATED + WRONG.replace("def f", "def g"))
    result = mypy("--cache-dir", tmp_path / "cache", "colosync/wire/probe.py", "colosync/demo/probe.py", cwd=tmp_path)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "colosync/wire/probe.py:1: error: Function is missing a type annotation" in out
    assert "colosync/demo/probe.py:1:" not in out  # default level: an unannotated function is not checked
    for layer in ("wire", "demo"):  # a wrong annotation is an error at every level
        assert f'colosync/{layer}/probe.py:4: error: Incompatible return value type (got "int", expected "str")' in out


def test_colosync_type_checks():
    # The project's own run (files and cache as `make lint` has them), so after `make lint` it is quick.
    result = mypy(cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found")
