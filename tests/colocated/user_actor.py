"""A trainer actor class outside colosync, as a user's own module holds one: ``ActorProcess``
and ``Cluster`` take any importable ``module:Class`` (``tests/colocated/test_launch.py``)."""

from __future__ import annotations

import os
from typing import Any

import colosync.errors


class EchoActor:
    """Answers, and raises what it is told to: a ``colosync.errors`` class by name or a builtin."""

    def __init__(self, greeting: str) -> None:
        self.greeting = greeting

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value: Any) -> list[Any]:
        return [self.greeting, value]

    def fail(self, name: str, message: str) -> None:
        cls = getattr(colosync.errors, name, None) or {"ValueError": ValueError, "KeyError": KeyError}[name]
        raise cls(message)
