"""Raw channel clients for the fault suite: just enough of the protocol to misbehave at one step."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from colosync.control.channel import EngineAddress

HEADER = struct.Struct("!I")


def raw_client(address: EngineAddress, authenticate: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(address.path)
    challenge = sock.recv(32)
    if authenticate:
        sock.sendall(hmac.new(address.authkey, challenge, hashlib.sha256).digest())
        assert sock.recv(11) == b"colosync-ok"
    return sock


def send_raw(sock: socket.socket, data: bytes) -> None:
    sock.sendall(HEADER.pack(len(data)) + data)


def send(sock: socket.socket, message: msgspec.Struct) -> None:
    send_raw(sock, msgspec.msgpack.encode(message))


def read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("closed")
            out += chunk
        return out

    (size,) = HEADER.unpack(exactly(HEADER.size))
    return exactly(size)


def closed_by_engine(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True
