"""What every ``colosync`` subcommand's parser shares (see ``colosync.tools.cli``): its shape, and sizes."""

from __future__ import annotations

import argparse
import re


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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``140GB``, ``898GiB``, ``1.5e9`` -> bytes (decimal GB, binary GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 140GB, 898GiB or 1.5e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
