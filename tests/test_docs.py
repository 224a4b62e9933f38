"""The documentation site builds in strict mode, and strict mode is real.

``mkdocs build --strict`` (what ``make docs`` runs) fails on a broken link, a page missing from the
navigation, a missing included example or an API reference to code that no longer exists. These
tests build the site into a temporary folder, so ``make test`` (and ``.ci/run``) fails on any of
them, and show that a planted broken link fails the build naming the page.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` from the repository root: examples are included relative to it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_docs_build_strict(tmp_path):
    from colosync import errors
    from colosync.tools.cli import build_parser

    site = tmp_path / "site"
    run = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"

    # The generated pages hold every subcommand and every exception type of the code they come from.
    cli = (site / "cli" / "index.html").read_text()
    [sub] = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name in sub.choices:
        assert f'id="colosync-{name}"' in cli, f"cli.md has no section for 'colosync {name}'"
    troubleshooting = (site / "troubleshooting" / "index.html").read_text()
    for name, obj in vars(errors).items():
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__:
            assert f'id="{name.lower()}"' in troubleshooting, f"troubleshooting.md has no section for {name}"

    # Every tested example is on a page, included from its file (never a copy).
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    included = set(re.findall(r"^--8<--\n(examples/\S+\.py)\n--8<--$", pages, flags=re.M))
    assert {f"examples/{p.name}" for p in EXAMPLES} <= included, "an example is on no page of docs/"


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs" / "broken.md").write_text("# Broken\n\nSee [the missing page](nowhere.md).\n")
    config = (ROOT / "mkdocs.yml").read_text()
    last_page = "  - Libraries: libraries.md\n"
    assert last_page in config, "mkdocs.yml's nav changed: plant the page after its last entry"
    (tmp_path / "mkdocs.yml").write_text(config.replace(last_page, last_page + "  - Broken: broken.md\n"))

    run = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = run.stdout + run.stderr
    assert run.returncode != 0, f"a broken link did not fail the strict build:\n{out[-3000:]}"
    assert re.search(r"WARNING.*broken\.md.*nowhere\.md", out), out[-3000:]
    assert "Aborted" in out and "strict mode" in out, out[-3000:]


REPO_PATH = re.compile(
    r"`((?:colosync|tests|examples|benchmarks|docs)/[\w./-]*?(?:\.(?:py|json|md|sh|png|toml)|/))[`:]"
)


def stale_paths(texts: dict[str, str]) -> list[str]:
    """Repository paths named in backticks (a file with its suffix, or a folder with its slash) that do not exist."""
    return [
        f"{where}: `{path}`"
        for where, text in texts.items()
        for path in REPO_PATH.findall(text)
        if not (ROOT / path).exists()
    ]


def test_every_path_the_docs_and_readme_name_exists():
    texts = {p.name: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    found = stale_paths(texts)
    assert not found, "these name files that moved or went:\n" + "\n".join(found)


def test_the_readmes_links_lead_somewhere():
    """GitHub shows the README, mkdocs does not build it: its links to docs pages and files are checked here."""
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to what does not exist: {missing}"


def test_the_path_rule_catches_a_moved_file():
    assert stale_paths({"page.md": "run `tests/engines/test_gone.py::test_x` and `colosync/tools/`"}) == [
        "page.md: `tests/engines/test_gone.py`"
    ]
