"""The channel server on its own: a real Unix socket, real threads, a handler that answers.

What the engine relies on here: requests from many connections are handled one at a time, in
the order they asked for the engine, and each connection's replies come back in order; ``stop``
answers the request that asked for it, handles nothing after it, and ends every connection
within one deadline, also those whose threads are blocked on clients that stopped reading; a
failing handler or session costs only its own client; running out of descriptors or threads
makes the server wait, not spin or die. (The engine-level faults, through a real engine process,
are in ``tests/faults``.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from colosync.control import channel
from colosync.control.channel import ChannelServer, Deadlines, EngineAddress
from tests.faults.clients import HEADER, raw_client


@contextlib.contextmanager
def serving(
    handle: Callable[[object, bytes], bytes],
    closed: list[str],
    deadlines: Deadlines | None = None,
    open_session: Callable[[int | None], object] = lambda pid: pid,
) -> Iterator[tuple[ChannelServer, EngineAddress]]:
    folder = tempfile.mkdtemp(prefix="colosync-test-channel-")
    address = EngineAddress(os.path.join(folder, "socket"), secrets.token_bytes(32))
    server = ChannelServer(address, open_session, handle, lambda _session, why: closed.append(why), deadlines)
    ready = threading.Event()
    thread = threading.Thread(target=server.serve, kwargs={"ready": ready.set}, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield server, address
    finally:
        server.stop()
        thread.join(30)
        assert not thread.is_alive(), "serve() did not return after stop()"
        os.unlink(address.path)
        os.rmdir(folder)


def read_reply(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the server closed the connection"
            data += chunk
        return data

    (size,) = HEADER.unpack(exactly(HEADER.size))
    return exactly(size)


def test_requests_from_many_connections_are_handled_one_at_a_time_and_answered_in_order():
    inside, most = [0], [0]
    lock = threading.Lock()

    def handle(_session: object, data: bytes) -> bytes:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.0005)  # long enough for another connection's thread to come in, if it could
        with lock:
            inside[0] -= 1
        return data[::-1]

    closed: list[str] = []
    with serving(handle, closed) as (_, address):

        def client(k: int, out: list[bool]) -> None:
            sock = raw_client(address)
            messages = [f"client {k} request {i}".encode() for i in range(40)]
            sock.sendall(b"".join(HEADER.pack(len(m)) + m for m in messages))  # pipelined
            out.append(all(read_reply(sock) == m[::-1] for m in messages))
            sock.close()

        results: list[bool] = []
        threads = [threading.Thread(target=client, args=(k, results)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert results == [True] * 4, "a connection's replies came back wrong or out of order"
    assert most[0] == 1, f"{most[0]} requests were handled at once; the engine takes one turn at a time"


def test_turns_are_granted_first_come_first_served():
    """A plain lock wakes waiters in no promised order, so a client that keeps asking could starve
    another; the engine's turn goes to waiters in the order they asked."""
    turns = channel._Turns()
    order: list[int] = []

    def wait_for_turn(k: int) -> None:
        with turns:
            order.append(k)

    with turns:  # held while eight threads line up, one after the other
        threads = []
        for k in range(8):
            thread = threading.Thread(target=wait_for_turn, args=(k,))
            thread.start()
            threads.append(thread)
            while turns._issued < k + 2:  # this one has its ticket before the next one starts
                time.sleep(0.001)
    for thread in threads:
        thread.join(10)
    assert order == list(range(8))


def test_stop_cuts_off_every_client_blocked_on_a_full_socket_within_one_deadline():
    handled = [0]

    def handle(_session: object, data: bytes) -> bytes:
        handled[0] += 1
        return b"r" * 4096

    closed: list[str] = []
    floods = []
    with serving(handle, closed, Deadlines(shutdown_s=1.0)) as (server, address):
        idle = raw_client(address)  # connected, sends nothing: its thread sleeps in recv
        for _ in range(3):
            flood = raw_client(address)
            flood.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                for _ in range(2000):  # ~8 MB of replies, never read: its thread blocks writing them
                    flood.sendall((HEADER.pack(1) + b"x") * 50)
            floods.append(flood)
        seen = -1
        while seen != handled[0]:  # until the server stopped taking these clients' requests
            seen = handled[0]
            time.sleep(0.2)
        assert server.connections == 4
        started = time.monotonic()
    # leaving ``serving`` stopped the server: one deadline for all the blocked clients, not one each
    assert time.monotonic() - started < 2.5
    assert closed == ["the engine is shutting down"] * 4
    for sock in [idle, *floods]:
        sock.close()


def test_a_request_that_stops_the_server_is_answered_and_the_ones_after_it_are_not_handled():
    handled: list[bytes] = []
    server_box: list[ChannelServer] = []

    def handle(_session: object, data: bytes) -> bytes:
        handled.append(data)
        if data == b"stop":
            server_box[0].stop()
            return b"bye"
        return b"ok"

    closed: list[str] = []
    with serving(handle, closed) as (server, address):
        server_box.append(server)
        sock = raw_client(address)
        sock.sendall(b"".join(HEADER.pack(len(m)) + m for m in [b"one", b"stop", *[b"late"] * 500]))
        assert read_reply(sock) == b"ok"
        assert read_reply(sock) == b"bye"
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.01)
    assert handled == [b"one", b"stop"], "requests read after stop() reached the engine"
    assert closed == ["the engine is shutting down"]
    sock.close()


def echo(_session: object, data: bytes) -> bytes:
    return data


def test_a_handler_that_raises_drops_its_client_closes_its_session_and_serves_the_others():
    def handle(_session: object, data: bytes) -> bytes:
        if data == b"boom":
            raise RuntimeError("an engine bug")
        return data

    closed: list[str] = []
    with serving(handle, closed) as (_, address):
        victim, bystander = raw_client(address), raw_client(address)
        victim.sendall(HEADER.pack(4) + b"boom")
        assert victim.recv(16) == b"", "the client whose request failed was not dropped"
        bystander.sendall(HEADER.pack(2) + b"hi")
        assert read_reply(bystander) == b"hi"
        assert closed == ["a request failed without a reply"]
        victim.close()
        bystander.close()


def test_a_session_that_cannot_open_drops_only_that_client():
    opened: list[int | None] = []

    def open_session(pid: int | None) -> object:
        opened.append(pid)
        if len(opened) == 1:
            raise RuntimeError("no session for you")
        return pid

    closed: list[str] = []
    with serving(echo, closed, open_session=open_session) as (server, address):
        first = raw_client(address)
        assert first.recv(16) == b"", "a client without a session was kept"
        second = raw_client(address)
        second.sendall(HEADER.pack(2) + b"hi")
        assert read_reply(second) == b"hi"
        assert server.connections == 1
    assert closed == ["the engine is shutting down"]  # the second's; the first never had a session
    first.close()
    second.close()


class _ListenerOutOfDescriptors:
    """A fake listener: running this test process out of descriptors for real would break the rest
    of the run, and accept() failing with EMFILE is all the server can see of it."""

    def __init__(self) -> None:
        self.calls = 0

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_accept_out_of_descriptors_waits_a_second_instead_of_spinning():
    closed: list[str] = []
    with serving(echo, closed) as (server, _):
        listener = _ListenerOutOfDescriptors()
        started = time.monotonic()
        server._accept(listener)  # type: ignore[arg-type]
        assert time.monotonic() - started >= 0.9, "the accepting thread would spin on a readable listener"
        threading.Timer(0.1, server.stop).start()
        started = time.monotonic()
        server._accept(listener)  # type: ignore[arg-type]
        assert time.monotonic() - started < 0.9, "the wait did not end when the server stopped"


def test_a_connection_whose_thread_cannot_start_is_refused_and_the_server_goes_on(monkeypatch):
    closed: list[str] = []
    with serving(echo, closed) as (server, address):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address.path + "-spare")
        listener.listen(1)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(address.path + "-spare")
        with monkeypatch.context() as patch:  # the thread limit, which the test cannot reach for real
            patch.setattr(threading.Thread, "start", lambda self: (_ for _ in ()).throw(RuntimeError("no threads")))
            server._accept(listener)
        client.settimeout(5)
        assert client.recv(16) == b"", "the refused connection was left open"
        assert server.connections == 0
        client.close()
        listener.close()
        os.unlink(address.path + "-spare")
