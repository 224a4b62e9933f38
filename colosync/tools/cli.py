"""``colosync`` command line: one subcommand per module, each with ``--json``.

Subcommands live next to the code they drive (``colosync.tools.handoff``, ``colosync.tools.bench.sync``,
...) and register themselves through ``COMMANDS``: each entry is a module exposing
``register(subparsers)`` which adds its parser and sets ``func`` to a ``(args) -> int``.
Heavy imports (torch, transformers, ray) happen inside the commands, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: tuple[str, ...] = (
    "colosync.demo.cli",
    "colosync.tools.bench.step",
    "colosync.tools.probe",
    "colosync.tools.bench.sync",
    "colosync.tools.bench.separated",
    "colosync.tools.bench.asynchronous",
    "colosync.tools.bench.source",
    "colosync.tools.handoff",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colosync",
        description="Transactional weight sync and memory handoff for colocated RL trainers and engines.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real missing dependency inside the module
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
