"""The shipped workloads, and the one place that turns a workload name or path into its JSON.

A workload is a JSON document. Two kinds ship in this folder:

* ``sync`` -- a weight-sync payload (``seed-lora``, ``llama8b-full``): a ``tensors`` list of
  name, shape and dtype, read by ``colosync bench`` (``colosync.tools.bench.sync``);
* ``handoff`` -- the memory picture of one node (``k3-gb300``, file ``k3-gb300-handoff.json``),
  read by ``colosync plan`` (``colosync.handoff.model.simulator``).

``load`` takes a preset name or the path of a JSON file and returns the parsed document; what
the document must contain is checked by the reader of each kind. This module is the bottom
layer: it imports only the standard library and ``colosync.errors``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from colosync.errors import ConfigError

WORKLOADS_DIR = Path(__file__).parent
"""The folder of the shipped workload files (found by path: importlib.resources fails under an
editable install run from outside the repository)."""

KINDS: tuple[str, ...] = ("sync", "handoff")
_HANDOFF_SUFFIX = "-handoff.json"
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _kind_of(path: Path) -> str:
    return "handoff" if path.name.endswith(_HANDOFF_SUFFIX) else "sync"


def _preset_name(path: Path) -> str:
    return path.name.removesuffix(_HANDOFF_SUFFIX) if _kind_of(path) == "handoff" else path.stem


def _check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"unknown workload kind {kind!r}; choose one of {list(KINDS)}")


def _presets(kind: str | None = None) -> dict[str, Path]:
    _check_kind(kind)
    return {_preset_name(p): p for p in sorted(WORKLOADS_DIR.glob("*.json")) if kind in (None, _kind_of(p))}


def names(kind: str | None = None) -> list[str]:
    """The shipped presets of ``kind`` (``"sync"`` or ``"handoff"``; every kind when None)."""
    return sorted(_presets(kind))


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or os.sep in text or (os.altsep is not None and os.altsep in text)


def resolve(name_or_path: str | os.PathLike[str], kind: str | None = None) -> Path:
    """The file behind a preset name or a path; ``ConfigError`` says exactly what is wrong.

    An existing file, or anything that looks like a path (ends in ``.json`` or has a
    directory), is a path; anything else is a preset name of ``kind``."""
    text = os.fspath(name_or_path)
    presets = _presets(kind)
    what = f"{kind} workload" if kind else "workload"
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"{what} {text!r} is a directory; give a JSON file in it or a preset name {sorted(presets)}")
    if _looks_like_path(text):
        raise ConfigError(f"{what} file {text!r}: no such file (presets are named without a path: {sorted(presets)})")
    if text in presets:
        return presets[text]
    for file in presets.values():  # the file's stem works too (k3-gb300-handoff)
        if file.stem == text:
            return file
    other = [k for k in KINDS if k != kind and text in _presets(k)] if kind else []
    if other:
        raise ConfigError(
            f"{text!r} is a {other[0]} workload, not a {kind} workload; {kind} presets: {sorted(presets)}"
        )
    raise ConfigError(f"no {what} preset named {text!r}; presets: {sorted(presets)} (or give the path of a JSON file)")


def load(name_or_path: str | os.PathLike[str], kind: str | None = None) -> dict[str, Any]:
    """The JSON document of a preset (``"seed-lora"``, ``"k3-gb300"``) or of a JSON file.

    ``kind`` limits the presets to that kind. Raises ``ConfigError`` for a missing file, an
    unknown preset (the message lists the presets), a file that is not valid JSON, or a
    document that is not a JSON object."""
    path = resolve(name_or_path, kind)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read workload file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"workload file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(
            f"workload file {str(path)!r} holds a JSON {_JSON_TYPES.get(type(doc), 'value')}, not an object of fields"
        )
    return doc


__all__ = ["KINDS", "WORKLOADS_DIR", "load", "names", "resolve"]
