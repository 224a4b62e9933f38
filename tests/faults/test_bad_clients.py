"""Clients that never authenticate, stall mid-message, hang up before their reply or lie about sizes.

Each is a raw Unix-socket client speaking just enough of the channel to misbehave at one
step. While it misbehaves, a well-behaved client must be served at once (nobody blocks
anybody), and afterwards the engine is healthy. A misbehaving client that owned an update
loses that update, and nothing else.
"""

from __future__ import annotations

import socket
import time

import msgspec

from colosync.errors import EngineBusyError
from colosync.wire.protocol import Status
from tests.faults.clients import HEADER, closed_by_engine, raw_client, send


def answered_promptly(fault_engine, within_s: float = 1.0) -> None:
    """A fresh, well-behaved client connects and gets a Status reply within ``within_s``."""
    started = time.monotonic()
    link = fault_engine.engine.connect("bystander")
    link._sock.settimeout(within_s)  # a blocked engine fails the test here instead of hanging it
    link.timeout_s = within_s
    try:
        link.call(Status())
    finally:
        link.close()
    assert time.monotonic() - started < within_s, "a misbehaving client blocked another"


def test_a_client_that_never_authenticates_blocks_nobody_and_is_dropped(fault_engine):
    before = fault_engine.healthy({"base", "new"})
    silent = raw_client(fault_engine.engine.address, authenticate=False)
    answered_promptly(fault_engine)
    assert closed_by_engine(silent, within_s=3.0), "the engine kept an unauthenticated client"
    fault_engine.healthy({before})


def test_a_wrong_key_is_refused(fault_engine):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(fault_engine.engine.address.path)
    sock.recv(32)
    sock.sendall(b"\0" * 32)
    assert closed_by_engine(sock, within_s=3.0)
    answered_promptly(fault_engine)


def test_a_client_stalling_mid_message_blocks_nobody_and_loses_its_update(fault_engine):
    """An owner begins an update, then stalls halfway through its next message."""
    from colosync.sync.sender import Sender
    from colosync.wire.bucket import plan_buckets
    from colosync.wire.manifest import UpdateManifest
    from colosync.wire.protocol import Begin

    before = fault_engine.healthy({"base", "new"})
    target = "new" if before == "base" else "base"
    link = fault_engine.engine.connect("stalling owner")
    sender = Sender(link, transport="shm", bucket_bytes=64 << 10)
    sender.push(fault_engine.updates[target])  # attached and owning; the engine now serves target
    named = fault_engine.updates[before]
    layout = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in named], 64 << 10)
    uid = link.call(Status()).next_update_id()
    link.submit(Begin(UpdateManifest(uid, "full", layout))).wait()
    assert fault_engine.status().in_flight_update_id == uid
    link._sock.sendall(HEADER.pack(1000) + b"\x81" * 10)  # announces 1000 bytes, sends 10, then nothing
    answered_promptly(fault_engine)
    assert closed_by_engine(link._sock, within_s=3.0), "the engine waited forever for the rest of a message"
    fault_engine.healthy({target})  # its update was aborted, the one before it still serves
    sender.close()


def test_hanging_up_before_the_reply_costs_nothing(fault_engine):
    before = fault_engine.healthy({"base", "new"})
    for _ in range(5):
        sock = raw_client(fault_engine.engine.address)
        for _ in range(20):
            send(sock, Status())
        sock.close()  # gone before a single reply was read
    answered_promptly(fault_engine)
    fault_engine.healthy({before})


def test_an_oversize_announcement_is_dropped(fault_engine):
    before = fault_engine.healthy({"base", "new"})
    sock = raw_client(fault_engine.engine.address)
    sock.sendall(HEADER.pack(0xFFFFFFFF))
    assert closed_by_engine(sock, within_s=3.0)
    answered_promptly(fault_engine)
    fault_engine.healthy({before})


def test_an_owner_that_dies_mid_update_releases_the_engine_to_the_next_sender(fault_engine):
    """A raw owner begins an update and vanishes; the next Sender attaches and commits."""
    from colosync.sync.sender import Sender

    before = fault_engine.healthy({"base", "new"})
    target = "new" if before == "base" else "base"
    first = fault_engine.engine.connect("first owner")
    sender = Sender(first, transport="shm", bucket_bytes=64 << 10)
    sender.push(fault_engine.updates[target])
    second = fault_engine.engine.connect("second")
    try:
        Sender(second, transport="shm").push(fault_engine.updates[before])
        raise AssertionError("a second sender attached while the first owned the engine")
    except EngineBusyError as exc:
        assert "owned by another sender" in str(exc) and "takeover=True" in str(exc)
    first.close()  # the owner's connection ends without a Detach: ownership is released at once
    time.sleep(0.2)
    with Sender(second, transport="shm") as replacement:
        replacement.push(fault_engine.updates[before])
    second.close()
    fault_engine.healthy({before})


def test_a_client_that_never_reads_its_replies_blocks_nobody(fault_engine):
    """Thousands of requests and not one reply read. The client's own thread writes its replies;
    once the socket is full it blocks there, outside the engine's turn (blocked inside it, the
    bystander would never be answered), and stops reading the client's requests. The bystander
    waits at most for the one request in hand."""
    before = fault_engine.healthy({"base", "new"})
    sock = raw_client(fault_engine.engine.address)
    sock.settimeout(1.0)
    batch = b"".join(HEADER.pack(len(m)) + m for m in [msgspec.msgpack.encode(Status())] * 1000)
    sent = 0
    try:
        for _ in range(8):  # ~360 KB of replies unread: more than a Unix socket holds
            sock.sendall(batch)
            sent += 1000
    except TimeoutError:
        pass  # the engine stopped reading this client: what the test wants, too
    answered_promptly(fault_engine, within_s=5.0)
    assert sent >= 5000, f"the engine stopped reading after {sent} requests, before the socket could fill"
    sock.close()
    fault_engine.healthy({before})
