"""mkdocs hook: the pages generated from the code, so they cannot drift from it.

A page holds a marker comment where generated Markdown goes:

- ``<!-- generated: cli -->`` (``cli.md``): the ``--help`` of ``colosync`` and of every subcommand,
  from the parser ``colosync.tools.cli.build_parser`` builds;
- ``<!-- generated: exports -->`` (``api.md``): a table of every name ``colosync.__all__`` exports, the
  module that defines it and a link to its reference (an exception's to ``troubleshooting.md``);
  an export without a reference on ``api.md`` is a broken cross-reference, which fails the build;
- ``<!-- generated: errors -->`` (``troubleshooting.md``): every exception class of
  ``colosync.errors`` in source order, its cause (the docstring) and its fix (the docstring's
  ``Fix:`` paragraph). A class without a ``Fix:`` paragraph fails the build.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import inspect
import os
import re
from collections.abc import Iterator
from pathlib import Path

MARKER = re.compile(r"<!-- generated: (\w+) -->")


@contextlib.contextmanager
def _plain_help() -> Iterator[None]:
    """argparse wraps ``--help`` to the terminal's width and, from Python 3.14, may colour it: fix the
    width and turn colour off, so the page depends on neither."""
    settings = {"COLUMNS": "100", "PYTHON_COLORS": "0"}
    old = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _fence(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def cli_markdown() -> str:
    """``colosync --help``, then one section per subcommand with its summary and its ``--help``."""
    from colosync.tools.cli import build_parser

    with _plain_help():
        parser = build_parser()
        parts = ["## colosync\n", _fence(parser.format_help())]
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        summaries = {choice.dest: choice.help for choice in sub._choices_actions}
        for name, subparser in sub.choices.items():
            parts.append(f"## colosync {name}\n")
            if summaries.get(name):
                parts.append(f"{summaries[name].rstrip('.')}.\n")
            parts.append(_fence(subparser.format_help()))
    return "\n".join(parts)


def _reference(text: str) -> str:
    """reST literals (````x````) as Markdown code (```x```)."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def error_types() -> list[type[BaseException]]:
    """Every exception class defined in ``colosync.errors``, in the order of its source."""
    from colosync import errors

    return [
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


def cause_and_fix(cls: type[BaseException]) -> tuple[str, str]:
    doc = inspect.getdoc(cls) or ""
    cause, sep, fix = doc.partition("\nFix:")
    if not cause.strip() or not sep or not fix.strip():
        raise ValueError(
            f"colosync.errors.{cls.__name__} needs a docstring with its cause and a 'Fix:' paragraph "
            "(troubleshooting.md is generated from them)"
        )
    return " ".join(cause.split()), " ".join(fix.split())


def errors_markdown() -> str:
    """One section per exception class: where it sits in the hierarchy, its cause, its fix."""
    import colosync

    exported = set(getattr(colosync, "__all__", ()))
    parts = []
    for cls in error_types():
        cause, fix = cause_and_fix(cls)
        bases = [b.__name__ for b in cls.__mro__[1:] if b.__module__ == cls.__module__]
        where = f"`colosync.{cls.__name__}`" if cls.__name__ in exported else f"`colosync.errors.{cls.__name__}`"
        family = f"; a subclass of {', '.join(f'[`{b}`](#{b.lower()})' for b in bases)}" if bases else ""
        builtin = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins" and b is not Exception]
        also = f", and of the built-in `{'`, `'.join(builtin)}`" if builtin else ""
        parts.append(
            f"## {cls.__name__}\n\n{where}{family}{also}.\n\n"
            f"**Cause.** {_reference(cause)}\n\n**Fix.** {_reference(fix)}\n"
        )
    return "\n".join(parts)


def exports() -> list[tuple[str, str]]:
    """``(name, defining module)`` for every name in ``colosync.__all__``, read from its source."""
    spec = importlib.util.find_spec("colosync")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    imported = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    [names] = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
    ]
    missing = [name for name in names if name not in imported]
    if missing:
        raise ValueError(f"colosync.__all__ names {missing}, which colosync/__init__.py does not import")
    return [(name, imported[name]) for name in names]


def exports_markdown() -> str:
    rows = ["| name | defined in | what it is |", "|---|---|---|"]
    for name, module in sorted(exports(), key=lambda item: (item[1], item[0])):
        if module == "colosync.errors":
            link = f"[`{name}`](troubleshooting.md#{name.lower()})"
            what = "an exception type: cause and fix on troubleshooting"
        else:
            link = f"[`{name}`][{module}.{name}]"
            what = "reference below"
        rows.append(f"| {link} | `{module}` | {what} |")
    return "\n".join(rows) + "\n"


def benchmarks_markdown() -> str:
    """The table of ``benchmarks/README.md``, as ``benchmarks/index.py`` writes it from the records, with
    each subject's folder named as a repository path (the site does not hold ``benchmarks/``)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path.cwd() / "benchmarks" / "index.py"  # mkdocs runs from the repository root (snippets need it too)
    spec = importlib.util.spec_from_file_location("benchmarks_index", path)
    assert spec is not None and spec.loader is not None
    index = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = index  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(index)
        table = [line for line in index.readme().splitlines() if line.startswith("|")]
    finally:
        sys.modules.pop(spec.name, None)
    return "\n".join(re.sub(r"\[`([\w-]+)/`\]\(\1/\)", r"`benchmarks/\1/`", line) for line in table) + "\n"


GENERATORS = {
    "cli": cli_markdown,
    "errors": errors_markdown,
    "exports": exports_markdown,
    "benchmarks": benchmarks_markdown,
}


def on_page_markdown(markdown: str, page: object, config: object, files: object) -> str:
    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r} (known: {sorted(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(generated, markdown)
