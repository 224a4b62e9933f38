"""Transport registry: name -> the module that implements it, imported only when used.

Adding a transport is one new file (a ``SenderTransport`` and a ``ReceiverTransport``) plus
one line in ``_REGISTRY`` (the contract suite, ``tests/transports/test_contract.py``, then
covers it). ``candidates("auto", device)`` lists them in preference order with why each can or
cannot run here; ``attach_first`` creates and attaches the first that works end to end (the
engine really opening its handle is the test, done by a callback, so this layer knows nothing
of links or Senders) and logs why it passed over the others.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from colosync.errors import TransportError, TransportUnavailable
from colosync.transports.base import Peers, ReceiverTransport, SenderTransport

log = logging.getLogger(__name__)

# name -> "module:SenderClass:ReceiverClass"; listed fastest first (the order "auto" tries).
_REGISTRY: dict[str, str] = {
    "cuda_ipc": "colosync.transports.cuda_ipc:CudaIpcSender:CudaIpcReceiver",
    "shm": "colosync.transports.shm:ShmSender:ShmReceiver",
    # Separated mode (engines on other hosts): over a torch.distributed group. p2p before broadcast: on gloo it
    # measured faster (benchmarks/separated), and a dead engine fails only its own sends.
    "p2p": "colosync.transports.broadcast:P2pSender:BroadcastReceiver",
    "broadcast": "colosync.transports.broadcast:BroadcastSender:BroadcastReceiver",
}


def names() -> list[str]:
    return list(_REGISTRY)


def _load(name: str, index: int) -> type:
    try:
        spec = _REGISTRY[name]
    except KeyError:
        raise TransportUnavailable(f"unknown transport {name!r}; choose one of {names()} or 'auto'") from None
    module, *classes = spec.split(":")
    cls: type = getattr(importlib.import_module(module), classes[index])  # a class named in _REGISTRY
    return cls


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


@dataclass(frozen=True)
class Attached:
    """What ``attach_first`` settled on: the attached transport, the engine's reply and why."""

    transport: SenderTransport
    reply: Any  # what the ``attach`` callback returned (the Sender's: the engine's ``Ack``)
    log: list[str]  # "picked 'x': why", then "passed over 'y': why" for each transport passed over


def attach_first(
    name: str,
    device: torch.device,
    bucket_bytes: int,
    slots: int,
    attach: Callable[[str, bytes], Any],
    peers: Peers | None = None,
) -> Attached:
    """Create and attach the first transport that works end to end: ``name``, or each in order for ``"auto"``.

    Each candidate is created for buckets of ``bucket_bytes`` with ``slots`` in flight (its
    ``geometry``), then ``attach(transport_name, handle_bytes)`` hands its handle to the engine
    and returns the engine's reply; a ``TransportError`` from it means the engine could not open
    the handle. With ``"auto"`` a transport that cannot run here (INFO), cannot be created or
    cannot be opened (WARNING) is closed, logged and passed over; a named transport raises instead.
    ``peers``: the receivers of a set of engines (``EngineSet``), for a transport that forms a group.
    """
    explicit = name != "auto"
    passed: list[str] = []
    for candidate, cls, why in candidates(name, device):
        if cls is None:
            if explicit:
                raise TransportUnavailable(
                    f"transport {candidate!r} cannot run here: {why}; use transport='auto' or another of {names()}"
                )
            _pass_over(passed, candidate, logging.INFO, "", why)
            continue
        try:
            geometry = cls.geometry(bucket_bytes, slots, device)
            # peers only for a set of engines: a transport written before sets keeps working for one engine
            transport = cls.create(*geometry, device) if peers is None else cls.create(*geometry, device, peers)
        except Exception as exc:
            if explicit:
                raise
            _pass_over(passed, candidate, logging.WARNING, "it could not be created: ", exc)
            continue
        try:
            reply = attach(cls.name, transport.handle())
        except TransportError as exc:
            transport.close()
            if explicit:
                raise
            _pass_over(passed, candidate, logging.WARNING, "the engine could not open it: ", exc)
            continue
        except BaseException:
            transport.close()
            raise
        transport.attached()
        if not explicit:
            log.info("transport auto: picked %r (%s)", candidate, why)
        return Attached(transport, reply, [f"picked {candidate!r}: {why}"] + [f"passed over {p}" for p in passed])
    raise TransportUnavailable(
        "no transport works here: " + "; ".join(passed) + "; run `colosync probe` to see what this machine allows"
    )


def _pass_over(passed: list[str], name: str, level: int, what: str, why: object) -> None:
    log.log(level, "transport auto: passed over %r: %s%s", name, what, why)
    passed.append(f"{name!r}: {why}")


__all__ = [
    "Attached",
    "Peers",
    "SenderTransport",
    "ReceiverTransport",
    "attach_first",
    "names",
    "candidates",
    "sender_class",
    "receiver_class",
]
