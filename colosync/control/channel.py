"""The engine process's control channel: framed, authenticated messages over a Unix socket.

An engine must outlive every client, and no client may stall another. So every connection
has its own thread: a client that sends half a message, never authenticates, stops reading
its replies or dies only ever blocks its own thread, and each of those has a deadline
(authentication, the rest of a message once its first byte arrived). Engine work takes one
turn at a time, first come first served (``_Turns``), on the thread of the connection that
asked for it, and that thread writes the reply. So a request reaches the engine on the
thread that was blocked in ``recv`` for it: no event-loop pass and no hand-off to a worker
thread, which cost ~110 µs and ~75 µs on the H200 host's VM (``benchmarks/channel``).
When a connection ends for any reason the host is told at once (``EngineHost.close_session``),
which aborts that client's in-flight update: a trainer killed mid-push costs its own update
within milliseconds, not a 60 s timeout.

Why plain Unix-socket streams rather than pyzmq (which vLLM and SGLang use for their engine
IPC): ZeroMQ's ROUTER socket hides the connection a message came from, so a peer that dies is
invisible to the application; the end of a Unix-socket stream is exactly the signal the
engine needs, and the kernel's socket buffers give back-pressure for free. An asyncio server
was the first version; it cost a loop wake-up and a thread switch per message. The framing is
a 4-byte big-endian length before each msgpack message.

Authentication keeps what ``multiprocessing.connection`` did: the socket lives in a private
0700 directory, and a client proves it holds the engine's 32-byte key by answering a random
challenge with an HMAC-SHA256 before any message is read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from colosync.errors import AuthenticationError, EngineError, ManifestError
from colosync.sync.link import Pending, batch_parts, unwrap
from colosync.wire.protocol import MAX_MESSAGE_BYTES, Batch, Codec, Commit, Failed, Hello, Prepare, Stage

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_CHALLENGE_BYTES = 32
_WELCOME = b"colosync-ok"
_READ_BYTES = 1 << 16


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


class EngineAddress(msgspec.Struct, frozen=True):
    """Where a running engine listens; hand it to another process to connect there."""

    path: str
    authkey: bytes


class Deadlines(msgspec.Struct, frozen=True):
    """How long a client may take, per step, before the engine drops it."""

    authenticate_s: float = 2.0  # from connect to a correct challenge answer
    message_s: float = 10.0  # from a message's first byte to its last
    shutdown_s: float = 2.0  # at shutdown, for the clients' last replies to be taken (then they are cut off)


# =========================================================================================
# Server side (inside the engine process).
# =========================================================================================


class ChannelServer:
    """Serve ``handle(session, data) -> bytes`` to every authenticated connection on ``address``.

    Each connection has its own thread, which reads the client's messages and writes its
    replies; ``open_session()``, ``handle(session, data)``, ``close_session(session, reason)``
    and ``tick()`` take the engine's turn (``_Turns``), so engine work runs one request at a
    time, in the order requests asked for it. Nothing a client does can raise out of it.
    """

    def __init__(
        self,
        address: EngineAddress,
        open_session: Callable[[int | None], Any],
        handle: Callable[[Any, bytes], bytes],
        close_session: Callable[[Any, str], None],
        deadlines: Deadlines | None = None,
        tick: Callable[[], None] | None = None,
        tick_s: float = 0.5,
    ) -> None:
        self.address = address
        self.deadlines = deadlines or Deadlines()
        self._open, self._handle, self._close, self._tick = open_session, handle, close_session, tick
        self._tick_s = tick_s
        self._turn = _Turns()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()  # stop() wakes the accepting thread
        self._signalled = False  # set by stop_from_signal (no lock may be taken in a signal handler)
        self._lock = threading.Lock()  # guards _clients
        self._clients: dict[socket.socket, threading.Thread] = {}

    @property
    def connections(self) -> int:
        """Connections open now (authenticated or not)."""
        with self._lock:
            return len(self._clients)

    def stop(self) -> None:
        """Ask the server to stop (thread-safe, also from inside ``handle``); ``serve`` returns once
        every connection has ended. A request being handled still gets its reply."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop_from_signal(self) -> None:
        """``stop`` for a signal handler, which runs between two bytecodes of the serving thread and
        so must take no lock that thread may hold (``Event.set`` does): a flag and a wake-up."""
        self._signalled = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Accept connections until ``stop``; ``ready`` is called once the socket listens."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address.path)
        os.chmod(self.address.path, 0o600)
        listener.listen(64)
        ticker = None
        if self._tick is not None:
            ticker = threading.Thread(target=self._ticks, args=(self._tick,), name="colosync-tick", daemon=True)
            ticker.start()
        if ready is not None:
            ready()
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(listener, selectors.EVENT_READ)
                selector.register(self._wake_r, selectors.EVENT_READ)
                while not (self._stopping.is_set() or self._signalled):
                    if any(key.fileobj is listener for key, _ in selector.select()):
                        self._accept(listener)
        finally:
            self._stopping.set()  # also for a stop_from_signal: the tick thread and waits end
            listener.close()
            self._end_clients()
            if ticker is not None:
                ticker.join()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self, listener: socket.socket) -> None:
        """Take one connection onto a thread of its own; out of descriptors or threads, wait a second."""
        try:
            sock = listener.accept()[0]
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.warning("engine channel: cannot accept a connection (%s); retrying in 1 s", exc)
                self._stopping.wait(1.0)  # the listener stays readable: do not spin on it
            return
        thread = threading.Thread(target=self._client, args=(sock,), name="colosync-client", daemon=True)
        with self._lock:
            self._clients[sock] = thread
        try:
            thread.start()
        except RuntimeError as exc:  # no more threads: refuse this client, keep serving the others
            log.warning("engine channel: refused a connection: %s", exc)
            with self._lock:
                del self._clients[sock]
                sock.close()
            self._stopping.wait(1.0)

    def _end_clients(self) -> None:
        """Stop reading every client; a request in hand is answered, then each session closes. Clients
        still blocked after ``shutdown_s`` (on a full socket, say) are cut off, all at once."""
        with self._lock:
            clients = dict(self._clients)
            for sock in clients:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + self.deadlines.shutdown_s
        for thread in clients.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for sock, thread in clients.items():
                if thread.is_alive() and sock.fileno() >= 0:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
        for thread in clients.values():
            thread.join()

    def _ticks(self, tick: Callable[[], None]) -> None:
        while not self._stopping.wait(self._tick_s):
            with self._turn:
                _safe(tick)

    def _client(self, sock: socket.socket) -> None:
        """One connection, on its own thread, from the challenge to the closed session."""
        frames = _Frames(sock, self.deadlines.message_s)
        try:
            try:
                self._authenticate(sock, frames)
            except (TimeoutError, AuthenticationError, OSError, EOFError) as exc:
                log.warning("engine channel: dropped a client that did not authenticate (%s)", type(exc).__name__)
                return
            with self._turn:
                try:
                    session = self._open(_peer_pid(sock))
                except Exception:
                    log.exception("engine channel: opening a session failed; dropping the client")
                    return
            why = "the engine channel failed"
            try:
                why = self._serve_client(sock, frames, session)
            finally:  # whatever ended the connection, its session ends: that aborts its update
                if self._stopping.is_set():
                    why = "the engine is shutting down"
                with self._turn:
                    _safe(self._close, session, why)
                log.info("engine channel: client left: %s", why)
        except Exception:  # logged here rather than lost with the thread
            log.exception("engine channel: a connection's thread failed")
        finally:
            with self._lock:
                self._clients.pop(sock, None)
                sock.close()

    def _authenticate(self, sock: socket.socket, frames: _Frames) -> None:
        deadline = time.monotonic() + self.deadlines.authenticate_s
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        sock.settimeout(self.deadlines.authenticate_s)
        sock.sendall(challenge)
        if not hmac.compare_digest(frames.exactly(32, deadline), _digest(self.address.authkey, challenge)):
            raise AuthenticationError("wrong key")
        sock.sendall(_WELCOME)

    def _serve_client(self, sock: socket.socket, frames: _Frames, session: Any) -> str:
        """Read, handle and answer requests until the client goes; return why it went."""
        try:
            while True:
                data = frames.next()
                if data is None:
                    return "the client closed the connection"
                if self._stopping.is_set():  # read before the engine stopped, but not handled by it
                    return "the engine is shutting down"
                with self._turn:
                    try:
                        reply = self._handle(session, data)
                    except Exception:  # the host never raises; if it did, the reply stream would be out of step
                        log.exception("engine channel: a request failed without a reply; dropping the client")
                        return "a request failed without a reply"
                sock.settimeout(None)  # a client that stops reading its replies blocks only this thread
                sock.sendall(frame(reply))
        except _Oversize as exc:
            return f"it announced a {exc.size}-byte message (limit {MAX_MESSAGE_BYTES})"
        except TimeoutError:
            return f"it stopped mid-message for {self.deadlines.message_s}s"
        except (OSError, EOFError) as exc:
            return f"the connection ended ({type(exc).__name__})"
        except MemoryError:
            return "its message did not fit in memory"


class _Turns:
    """The engine's turn: one holder at a time, granted first come, first served.

    A plain lock lets the thread that just released it take it again before a waiter wakes,
    so a client that keeps sending could starve the others; tickets cannot.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class _Oversize(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


class _Frames:
    """Length-prefixed messages from one socket, each under a deadline once its first byte is in."""

    def __init__(self, sock: socket.socket, message_s: float) -> None:
        self._sock, self._message_s = sock, message_s
        self._buffer = bytearray()

    def next(self) -> bytes | None:
        """The next message, or None if the client closed the connection between messages."""
        if not self._buffer and not self._fill(None):  # idle between messages is fine
            return None
        deadline = time.monotonic() + self._message_s
        (size,) = _HEADER.unpack(self.exactly(_HEADER.size, deadline))
        if size > MAX_MESSAGE_BYTES:
            raise _Oversize(size)
        return self.exactly(size, deadline)

    def exactly(self, n: int, deadline: float) -> bytes:
        while len(self._buffer) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not self._fill(left):
                raise EOFError("the connection ended mid-message")
        with memoryview(self._buffer) as view:
            data = bytes(view[:n])
        del self._buffer[:n]
        return data

    def _fill(self, timeout: float | None) -> bool:
        self._sock.settimeout(timeout)
        chunk = self._sock.recv(_READ_BYTES)
        self._buffer += chunk
        return bool(chunk)


def _safe(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # the engine's own bug: log it, keep serving
        log.exception("engine channel: %s failed", getattr(fn, "__name__", fn))
        return None


# =========================================================================================
# Client side (a trainer, a driver, a replacement sender): blocking, pipelined.
# =========================================================================================


class SocketLink:
    """A ``Link`` to an engine process: ordered request/reply over one authenticated connection.

    ``submit`` writes the request and returns at once; replies are read in order, on ``wait``.
    The first message on every connection is a ``Hello`` with this process's pid, which the
    engine uses to tell when the client has died.
    """

    def __init__(
        self,
        address: EngineAddress,
        codec: Codec,
        reply_codec: Codec,
        name: str = "",
        timeout_s: float | None = None,
        adapter: str = "",
    ) -> None:
        self._codec, self._reply_codec = codec, reply_codec
        self._waiting: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(30.0)
            self._sock.connect(address.path)
            challenge = self._read_exactly(_CHALLENGE_BYTES)
            self._sock.sendall(_digest(address.authkey, challenge))
            if self._read_exactly(len(_WELCOME)) != _WELCOME:
                raise AuthenticationError("the engine refused this connection's key; connect with engine.address")
            self._sock.settimeout(timeout_s)
        except (OSError, EOFError) as exc:
            raise EngineError(f"cannot reach the engine at {address.path}: {exc}; is it running?") from exc
        self.call(Hello(pid=os.getpid(), host=socket.gethostname(), name=name, adapter=adapter))

    def submit(self, request: msgspec.Struct) -> _Pending:
        data = frame(self._codec.encode(request))
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise EngineError(f"the engine process is gone ({exc}); restart it") from exc
            pending = _Pending(self)
            self._waiting.append(pending)
        return pending

    def submit_batch(self, requests: list[Stage | Prepare | Commit]) -> list[Pending]:
        """Send ``requests`` as one ``Batch`` (one hop to the engine thread); one pending reply each."""
        return batch_parts(self.submit(Batch(requests)), len(requests))

    def call(self, request: msgspec.Struct) -> Any:
        return self.submit(request).wait()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _read_exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self._sock.recv(left)
            if not chunk:
                raise EOFError("the engine closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _receive_until(self, target: _Pending) -> None:
        with self._lock:
            while not target.done:
                try:
                    (size,) = _HEADER.unpack(self._read_exactly(_HEADER.size))
                    data = self._read_exactly(size)
                except TimeoutError:  # a reply may be half read: this connection is done (the engine sees it end)
                    with contextlib.suppress(OSError):
                        self._sock.close()
                    raise EngineError(
                        f"the engine did not answer within {self.timeout_s}s, so it is stalled or overloaded; this "
                        "connection is closed (the engine aborts its update when it sees that): connect again"
                    ) from None
                except (OSError, EOFError) as exc:
                    raise EngineError(f"the engine process is gone ({exc}); restart it") from exc
                head = self._waiting.popleft()
                try:
                    head.reply = self._reply_codec.decode(data)
                except ManifestError as exc:
                    head.reply = Failed.from_exception(EngineError(f"the engine sent an unreadable reply: {exc}"))
                head.done = True


class _Pending:
    def __init__(self, link: SocketLink) -> None:
        self._link = link
        self.reply: msgspec.Struct | None = None
        self.done = False

    def wait(self) -> Any:
        if not self.done:
            self._link._receive_until(self)
        return unwrap(self.reply)


__all__ = ["ChannelServer", "Deadlines", "EngineAddress", "SocketLink", "frame"]


def _peer_pid(sock: socket.socket) -> int | None:
    """The connecting process's pid as the kernel sees it (SO_PEERCRED), or None where unavailable."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (AttributeError, OSError):
        return None
    return pid if pid > 0 else None
