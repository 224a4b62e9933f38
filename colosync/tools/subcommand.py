"""The shape every ``colosync`` subcommand's parser shares (see ``colosync.tools.cli``)."""

from __future__ import annotations

import argparse


def add_subcommand(
    subparsers: argparse._SubParsersAction, name: str, *, help: str, doc: str
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` whose ``--help`` text is ``doc`` (its module's docstring) after
    the first paragraph, kept as written (reST ``literals`` shown in single quotes)."""
    description = doc.split("\n\n", 1)[1] if "\n\n" in doc else doc
    return subparsers.add_parser(
        name,
        help=help,
        description=description.replace("``", "'"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
