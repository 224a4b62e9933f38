"""What ``colosync bench`` and ``bench-separated`` share at the end: run under a progress bar, then a table or JSON.

A bench is a function ``run(args, progress)`` returning a msgspec struct whose ``results`` each
carry ``verified``; ``--json`` prints the struct, ``--out`` also writes it, and the exit status
is 1 when any path's bytes did not check out, 2 when colosync refused the run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from colosync.errors import ColosyncError


def add_output_arguments(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int]) -> None:
    """``--json`` and ``--out``, which ``run_and_report`` reads, and ``run`` as the subcommand."""
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    parser.set_defaults(func=run, argv=None)


def run_and_report(
    command: str,
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace, Any], Any],
    print_table: Callable[[Any], None],
) -> int:
    """Run ``run`` (with a progress bar on stderr unless ``--json``), then print and write its result."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    try:
        if args.json:
            result = run(args, None)
        else:
            columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
            with Progress(*columns, console=err, transient=True) as progress:
                result = run(args, progress)
    except ColosyncError as exc:
        print(f"colosync {command}: {exc}", file=sys.stderr)
        return 2
    encoded = msgspec.json.format(msgspec.json.encode(result).decode(), indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(encoded)
    if args.json:
        sys.stdout.write(encoded)
    else:
        print_table(result)
        if args.out:
            err.print(f"wrote {args.out}")
    return 0 if all(r.verified is not False for r in result.results) else 1


__all__ = ["add_output_arguments", "run_and_report"]
