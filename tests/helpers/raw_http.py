"""HTTP/1.1 over a bare socket, for requests no HTTP client library would send (hostile heads, trickled
bytes, smuggling attempts): write exactly these bytes, read one response, tell whether the server closed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import select
import socket
import time
from typing import Any


@dataclasses.dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send ``data``; False when the server has already closed (reset or broken pipe)."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def read_response(sock: socket.socket, timeout: float = 10.0) -> RawResponse | None:
    """One response, or None when the connection ended before a whole one arrived."""
    return ResponseReader(sock, timeout).next()


class ResponseReader:
    """Responses read one after another from one connection, bytes past a response kept for the next (a
    pipelined answer may arrive in the same read as the end of the one before)."""

    def __init__(self, sock: socket.socket, timeout: float = 10.0) -> None:
        self.sock, self.timeout = sock, timeout
        self.buffer = b""

    def _more(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def next(self) -> RawResponse | None:
        """The next response, or None when the connection ended before a whole one arrived."""
        self.sock.settimeout(self.timeout)
        try:
            while b"\r\n\r\n" not in self.buffer:
                if not self._more():
                    return None
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            status_line, *lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            while len(rest) < length:
                if not self._more():
                    return None
                rest = self.buffer.partition(b"\r\n\r\n")[2]
        except (ConnectionResetError, TimeoutError):
            return None
        self.buffer = rest[length:]
        return RawResponse(int(status_line.split(" ", 2)[1]), headers, rest[:length])


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closes the connection within ``seconds`` (whatever else it still sends is read and dropped)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def trickle(sock: socket.socket, data: bytes, every_s: float, until: float) -> bool:
    """Send ``data`` one byte per ``every_s`` until the monotonic time ``until``, stopping as soon as the server
    answers or closes (the answer is left to read). Returns whether the server spoke before ``until``."""
    for byte in data:
        if time.monotonic() >= until:
            return False
        if select.select([sock], [], [], 0)[0] or not send_quietly(sock, bytes([byte])):
            return True
        time.sleep(every_s)
    return bool(select.select([sock], [], [], max(0.0, until - time.monotonic()))[0])


@contextlib.contextmanager
def connection(host: str, port: int, timeout: float = 10.0) -> Any:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield sock
    finally:
        sock.close()
