"""The repository speaks of the project only: never of how, when or in which sitting it was made.

A reader cannot tell a current figure from a superseded one when records are named after the
sitting that made them, and a tree or a table named by its day or its tracker number means
nothing outside it.
Public sources are cited by name (alibaba/ROLL #484, radixark/miles #2781). ``session`` alone
stays allowed: it is also a client of an engine (``colosync.sync.transaction.Session``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HISTORY = re.compile(
    r"\bsessions? ?#?\d+"  # a sitting's number
    r"|\b(?:this|last|next|previous) session\b"
    r"|\bh200-s(?:ession)?\d+"  # folders named after a sitting
    r"|\bissues? ?#?\d+"  # a tracker number (public reports are cited as owner/repo #N)
    r"|(?<!\.)\btoday(?:'s)?\b(?!\()"  # not date.today()
    r"|\bthe seed[s]\b|\bseed[s]'",
    re.IGNORECASE,
)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    found = []
    for name in names.stdout.splitlines():
        path = ROOT / name
        if path.is_file() and path.suffix not in {".png", ".whl", ".pt", ".safetensors"}:
            found.append(path)
    return found


def history_words(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in HISTORY.finditer(line):
                found.append(f"{path.relative_to(root)}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_no_word_of_how_the_project_was_made():
    found = history_words([p for p in tracked_text_files() if p != Path(__file__)])
    assert not found, "say what the project does, not when it was done:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    # Built from parts, so that this file does not say what it forbids.
    ["see benchmarks/h200-" + "s9/", "measured in " + "sess" + "ion 4", "to" + "day's tree", "iss" + "ue 16's targets"]
    + ["the " + "see" + "ds' paths"],
)
def test_the_word_rule_catches_history(tmp_path, line):
    planted = tmp_path / "planted.md"
    planted.write_text(f"A line.\n{line}\n")
    [found] = history_words([planted], tmp_path)
    assert found.startswith("planted.md:2:")


def test_a_client_session_or_the_date_is_no_history():
    assert not HISTORY.search("a session that ends takes only its own in-flight update with it")
    assert not HISTORY.search("stamp = datetime.date.today().isoformat()")
