"""The engine process's control channel: framed, authenticated messages over a Unix socket.

An engine must outlive every client, and no client may stall another. So the server side is
an asyncio loop with one task per connection: a client that sends half a message, never
authenticates, stops reading its replies or dies only ever blocks its own task, and each of
those has a deadline (authentication, the rest of a message once its header arrived). Engine
work runs on one worker thread in arrival order, so the loop keeps accepting and reading
while the engine computes; that thread writes each reply straight into its socket when the
socket takes it at once (``_ReplyWriter``), so a request costs one thread switch, not two. When
a connection ends for any reason the host is told at once (``EngineHost.close_session``),
which aborts that client's in-flight update: a trainer killed mid-push costs its own update
within milliseconds, not a 60 s timeout.

Why asyncio streams rather than pyzmq (which vLLM and SGLang use for their engine IPC):
ZeroMQ's ROUTER socket hides the connection a message came from, so a peer that dies is
invisible to the application; the end of a Unix-socket stream is exactly the signal the
engine needs, and the standard library already gives per-connection streams, deadlines and
back-pressure. The framing is a 4-byte big-endian length before each msgpack message.

Authentication keeps what ``multiprocessing.connection`` did: the socket lives in a private
0700 directory, and a client proves it holds the engine's 32-byte key by answering a random
challenge with an HMAC-SHA256 before any message is read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from colosync.engines.config import EngineAddress
from colosync.errors import AuthenticationError, EngineError, ManifestError
from colosync.sync.link import Pending, batch_parts, unwrap
from colosync.wire.protocol import MAX_MESSAGE_BYTES, Batch, Codec, Commit, Failed, Hello, Prepare, Stage

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_CHALLENGE_BYTES = 32
_WELCOME = b"colosync-ok"


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


class Deadlines(msgspec.Struct, frozen=True):
    """How long a client may take, per step, before the engine drops it."""

    authenticate_s: float = 2.0  # from connect to a correct challenge answer
    message_s: float = 10.0  # from a message's header to its last byte
    pending_replies: int = 4096  # requests a client may have in flight before its reads are paused


# =========================================================================================
# Server side (inside the engine process).
# =========================================================================================


class ChannelServer:
    """Serve ``handle(session, data) -> bytes`` to every authenticated connection on ``address``.

    ``open_session()``, ``handle(session, data)`` and ``close_session(session, reason)`` run on
    one worker thread, in the order the messages arrived; nothing a client does can raise out
    of the loop.
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
        self._engine = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colosync-engine")
        self._stopping: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # one per connection, ended at shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connections = 0

    def stop(self) -> None:
        """Ask the server to stop (thread-safe); ``serve`` returns once connections are closed."""
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Run until ``stop``; ``ready`` is called once the socket listens."""
        asyncio.run(self._serve(ready))
        self._engine.shutdown(wait=True)

    async def _serve(self, ready: Callable[[], None] | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_unix_server(
            self._connection, path=self.address.path, limit=MAX_MESSAGE_BYTES + _HEADER.size
        )
        os.chmod(self.address.path, 0o600)
        ticker = asyncio.create_task(self._ticks(self._tick)) if self._tick is not None else None
        if ready is not None:
            ready()
        async with server:
            await self._stopping.wait()
            for task in list(self._tasks):  # end every connection (Python >= 3.12 waits for them to close)
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if ticker is not None:
            ticker.cancel()

    async def _ticks(self, tick: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._tick_s)
            await loop.run_in_executor(self._engine, self._safe, tick)

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # the engine's own bug: log it, keep serving
            log.exception("engine channel: %s failed", getattr(fn, "__name__", fn))
            return None

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        writer.write(challenge)
        await writer.drain()
        answer = await reader.readexactly(32)
        if not hmac.compare_digest(answer, _digest(self.address.authkey, challenge)):
            raise AuthenticationError("wrong key")
        writer.write(_WELCOME)
        await writer.drain()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._authenticate(reader, writer), self.deadlines.authenticate_s)
        except (TimeoutError, AuthenticationError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.warning("engine channel: dropped a client that did not authenticate (%s)", type(exc).__name__)
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.connections += 1
        session = await loop.run_in_executor(self._engine, self._open, _peer_pid(writer))
        replies = _ReplyWriter(loop, writer, self.deadlines.pending_replies)
        submitted: deque[concurrent.futures.Future[None]] = deque()  # handed to the engine thread
        why = "the client closed the connection"
        try:
            while True:
                header = await reader.readexactly(_HEADER.size)  # idle between messages is fine
                (size,) = _HEADER.unpack(header)
                if size > MAX_MESSAGE_BYTES:
                    why = f"it announced a {size}-byte message (limit {MAX_MESSAGE_BYTES})"
                    break
                async with asyncio.timeout(self.deadlines.message_s):
                    data = await reader.readexactly(size)
                await replies.admit()  # a client that reads no replies has its reads paused
                submitted.append(self._engine.submit(self._serve_one, session, data, replies))
                while submitted and submitted[0].done():
                    submitted.popleft()
        except TimeoutError:
            why = f"it stopped mid-message for {self.deadlines.message_s}s"
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            why = f"the connection ended ({type(exc).__name__})"
        except asyncio.CancelledError:
            why = "the engine is shutting down"
        finally:
            # The client is gone or dropped. What it sent and the engine has not started is cancelled:
            # one engine thread runs requests in order, so what ran is a prefix of what was sent. Then
            # its session ends, which aborts its update.
            for future in submitted:
                future.cancel()
            await asyncio.gather(*map(asyncio.wrap_future, submitted), return_exceptions=True)
            replies.close()  # no reply is written after this, so the socket can be closed
            await loop.run_in_executor(self._engine, self._safe, self._close, session, why)
            writer.close()
            self.connections -= 1
            if task is not None:
                self._tasks.discard(task)
            log.info("engine channel: client left: %s", why)

    def _serve_one(self, session: Any, data: bytes, replies: _ReplyWriter) -> None:
        """On the engine thread: one request, and its reply written from here (see ``_ReplyWriter``)."""
        try:
            reply = self._handle(session, data)
        except Exception:  # the host never raises; if it did, the reply stream would be out of step
            log.exception("engine channel: a request failed without a reply; dropping the client")
            replies.abort()
            return
        replies.send(reply)


class _ReplyWriter:
    """One connection's replies, written by the engine thread straight into the socket.

    Handing each reply back to the event loop would cost a thread switch and a loop wake-up
    per message, about half of a round trip. So the engine thread writes a reply itself
    while the socket takes it whole at once (a client that reads its replies). The first
    reply the socket does not take whole, and every reply after it, goes through the loop's
    transport, which buffers it, so the engine thread never blocks on a client that stopped
    reading. Only one side writes at a time and the switch happens once, so replies stay in
    order. The loop pauses a client's reads while ``limit`` of its requests are unanswered or
    its transport holds a backlog (``admit``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter, limit: int) -> None:
        self._loop, self._writer, self._limit = loop, writer, max(1, limit)
        self._fd = writer.get_extra_info("socket").fileno()
        self._lock = threading.Lock()
        self._via_loop = False  # the socket once refused a whole reply: every later one goes through the loop
        self._closed = False
        self._in_flight = 0  # requests handed to the engine thread whose reply is not written or buffered yet
        self._room: asyncio.Event | None = None  # set, on the loop, once the waiting reader may go on

    async def admit(self) -> None:
        """Wait (on the loop) until this client may have one more request in flight."""
        if self._via_loop:
            await self._writer.drain()  # the transport's backlog is under its high-water mark
        while True:
            with self._lock:
                if self._in_flight < self._limit:
                    self._in_flight += 1
                    self._room = None
                    return
                room = self._room = asyncio.Event()
            await room.wait()

    def send(self, data: bytes) -> None:
        """On the engine thread: write one reply, at once if the socket takes it, else through the loop."""
        payload = frame(data)
        with self._lock:
            self._in_flight -= 1
            if self._room is not None and self._in_flight < self._limit:
                self._loop.call_soon_threadsafe(self._room.set)
            if self._closed:
                return
            if not self._via_loop:
                try:
                    written = os.write(self._fd, payload)
                except BlockingIOError:
                    written = 0
                except OSError:  # the client is gone; its reader sees the end and closes
                    self._closed = True
                    return
                payload = payload[written:]
                self._via_loop = bool(payload)
            if payload:
                self._loop.call_soon_threadsafe(self._write, payload)

    def _write(self, payload: bytes) -> None:
        if not self._closed:
            self._writer.write(payload)

    def abort(self) -> None:
        """Drop the client (from any thread): its reply stream can no longer be trusted to be in order."""
        with self._lock:
            self._closed = True
        self._loop.call_soon_threadsafe(self._writer.transport.abort)

    def close(self) -> None:
        with self._lock:
            self._closed = True


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
        self, address: EngineAddress, codec: Codec, reply_codec: Codec, name: str = "", timeout_s: float | None = None
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
        self.call(Hello(pid=os.getpid(), host=socket.gethostname(), name=name))

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
                except TimeoutError:
                    raise EngineError(f"the engine did not answer within {self.timeout_s}s") from None
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


__all__ = ["ChannelServer", "Deadlines", "SocketLink", "frame"]


def _peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The connecting process's pid as the kernel sees it (SO_PEERCRED), or None where unavailable."""
    sock = writer.get_extra_info("socket")
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (AttributeError, OSError):
        return None
    return pid if pid > 0 else None
