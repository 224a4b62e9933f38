"""Transport registry: name -> the module that implements it, imported only when used.

Adding a transport is one new file (a ``SenderTransport`` and a ``ReceiverTransport``) plus
one line in ``_REGISTRY``. ``candidates("auto", device)`` lists them in preference order with
why each can or cannot run here; the Sender attaches the first that works end to end (the
engine really opening its handle is the test) and logs why it passed over the others.
"""

from __future__ import annotations

import importlib
import logging

import torch

from colosync.errors import TransportUnavailable
from colosync.transports.base import ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)

# name -> "module:SenderClass:ReceiverClass"; listed fastest first (the order "auto" tries).
_REGISTRY: dict[str, str] = {
    "cuda_ipc": "colosync.transports.cuda_ipc:CudaIpcSender:CudaIpcReceiver",
    "shm": "colosync.transports.shm:ShmSender:ShmReceiver",
}


def names() -> list[str]:
    return list(_REGISTRY)


def _load(name: str, index: int) -> type:
    try:
        spec = _REGISTRY[name]
    except KeyError:
        raise TransportUnavailable(
            f"unknown transport {name!r}; choose one of {names()} or 'auto'"
        ) from None
    module, *classes = spec.split(":")
    return getattr(importlib.import_module(module), classes[index])


def sender_class(name: str) -> type[SenderTransport]:
    return _load(name, 0)


def receiver_class(name: str) -> type[ReceiverTransport]:
    return _load(name, 1)


def candidates(name: str, device: torch.device) -> list[tuple[str, type[SenderTransport] | None, str]]:
    """``(name, class or None, why)`` for ``name``, or for every transport in order if ``"auto"``.

    The class is ``None`` where the transport cannot run here; ``why`` says why (not).
    """
    out: list[tuple[str, type[SenderTransport] | None, str]] = []
    for candidate in names() if name == "auto" else [name]:
        cls = sender_class(candidate)
        try:
            ok, why = cls.available(device)
        except Exception as exc:  # a probe must never take the sender down
            ok, why = False, f"{type(exc).__name__}: {exc}"
        out.append((candidate, cls if ok else None, why))
    return out


def resolve(name: str, device: torch.device) -> type[SenderTransport]:
    """The sender transport class for ``name``; ``"auto"`` picks the first that works."""
    if name != "auto":
        cls = sender_class(name)
        ok, why = cls.available(device)
        if not ok:
            raise TransportUnavailable(f"transport {name!r} cannot run here: {why}")
        return cls
    reasons = []
    for candidate in names():
        cls = sender_class(candidate)
        ok, why = cls.available(device)
        if ok:
            for skipped in reasons:
                log.info("transport auto: passed over %s", skipped)
            log.info("transport auto: picked %r (%s)", candidate, why)
            return cls
        reasons.append(f"{candidate!r}: {why}")
    raise TransportUnavailable("no transport works here: " + "; ".join(reasons))


__all__ = [
    "SenderTransport", "ReceiverTransport", "names", "candidates", "resolve", "sender_class", "receiver_class",
]
