"""One HTTP/1.1 request and its answer on a kept-alive connection: the webhook sink's hot path.

The stream tasks send every change of a webhook sink through here. ``http.client`` spent about three
times this module's CPU per request: 113–138 µs against 40–44 µs for a POST of 100 messages on
loopback (docs/performance.md, "The webhook's requests"). Most of its cost was parsing the answer's
headers with the ``email`` package and a file object per answer. ``http.client`` still opens the
connections (TLS, proxy tunnels: ``webhook.WebhookClient``). This module writes each request in one
send and reads the answer with a small parser. That parser knows what an endpoint may answer:
interim 1xx answers, a ``Content-Length`` or chunked body, a body read to the end of the
connection, ``Connection: close`` and HTTP/1.0.
"""

from __future__ import annotations

import http.client
import re
import socket
from dataclasses import dataclass

MAX_HEAD = 64 * 1024
"""Bytes of an answer's status line and headers at most (``http.client`` allows 100 lines of 64 KiB)."""

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
_RECV = 65536


class ProtocolError(http.client.HTTPException):
    """The server's answer is not HTTP/1.x, or it ended in the middle."""


@dataclass(frozen=True)
class Answer:
    """What the server answered: its status, the start of its body, and whether the connection may
    carry another request (the answer was read whole and the server keeps the connection open)."""

    status: int
    body: bytes
    reusable: bool


@dataclass
class _Head:
    status: int
    length: int | None
    chunked: bool
    closes: bool


class HttpChannel:
    """A connected socket (plain or TLS) that carries one request at a time.

    Not thread-safe: ``webhook.WebhookClient`` hands each channel to one sender at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def exchange(self, request: bytes, limit: int) -> Answer:
        """Send ``request`` (a whole HTTP/1.1 request) and read its answer, keeping at most ``limit``
        bytes of its body. An answer longer than ``limit`` is not read to its end: its connection is
        not reusable. Raises ``http.client.RemoteDisconnected`` when the connection ends before the
        answer's first byte (a kept-alive connection the server closed while idle), and
        ``ProtocolError`` when it ends inside the answer or the answer is not HTTP/1.x."""
        self.sock.sendall(request)
        head = self._read_head(first=True)
        while 100 <= head.status < 200 and head.status != 101:  # interim answers (100 Continue...)
            head = self._read_head(first=False)
        if head.status in (101, 204, 304):  # no body (101: the server switched protocols, never reused)
            body, whole = b"", head.status != 101
        elif head.chunked:
            body, whole = self._read_chunked(limit)
        elif head.length is not None:
            body, whole = self._read_exactly(min(head.length, limit)), head.length <= limit
        else:  # no length: the body ends with the connection
            return Answer(head.status, self._read_to_end(limit), False)
        # bytes beyond the answer mean the server and we disagree on where it ends: not reused
        return Answer(head.status, body, whole and not head.closes and not self._buffer)

    def _fill(self) -> bool:
        """Receive more bytes into the buffer; False at the end of the connection."""
        data = self.sock.recv(_RECV)
        self._buffer += data
        return bool(data)

    def _read_head(self, first: bool) -> _Head:
        while (end := _HEAD_END.search(self._buffer)) is None:
            if len(self._buffer) > MAX_HEAD:
                raise ProtocolError(f"the answer's headers are longer than {MAX_HEAD} bytes")
            if not self._fill():
                if first and not self._buffer:
                    raise http.client.RemoteDisconnected("Remote end closed connection without response")
                raise ProtocolError("the connection ended inside the answer's headers")
        lines = bytes(self._buffer[: end.start()]).split(b"\n")
        del self._buffer[: end.end()]
        status_line = lines[0].rstrip(b"\r")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not re.fullmatch(rb"[1-9]\d\d", parts[1]):
            raise ProtocolError(f"not an HTTP/1.x answer: {status_line[:100]!r}")
        lengths: set[bytes] = set()
        chunked = False
        connection: set[bytes] = set()
        for line in lines[1:]:
            name, _, value = line.rstrip(b"\r").partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":  # a list of equal values is one (RFC 9112 6.3)
                lengths.update(v.strip() for v in value.split(b","))
            elif name == b"transfer-encoding":
                chunked = value.lower().split(b",")[-1].strip() == b"chunked"
            elif name in (b"connection", b"proxy-connection"):
                connection.update(token.strip() for token in value.lower().split(b","))
            elif name == b"keep-alive":  # an HTTP/1.0 server's way to keep the connection (as http.client)
                connection.add(b"keep-alive")
        if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
            raise ProtocolError(f"an invalid Content-Length: {b', '.join(sorted(lengths))[:40]!r}")
        closes = (
            b"close" in connection
            or (parts[0] == b"HTTP/1.0" and b"keep-alive" not in connection)
            or (chunked and bool(lengths))  # both: where the answer ends is in doubt, the connection is not reused
        )
        return _Head(int(parts[1]), int(next(iter(lengths))) if lengths else None, chunked, closes)

    def _read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            if not self._fill():
                raise ProtocolError("the connection ended inside the answer's body")
        body = bytes(self._buffer[:count])
        del self._buffer[:count]
        return body

    def _read_line(self) -> bytes:
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_HEAD:
                raise ProtocolError("a line of the answer's chunked body is too long")
            if not self._fill():
                raise ProtocolError("the connection ended inside the answer's body")
        line = bytes(self._buffer[:end]).rstrip(b"\r")
        del self._buffer[: end + 1]
        return line

    def _read_chunked(self, limit: int) -> tuple[bytes, bool]:
        """A chunked body's first ``limit`` bytes, and whether it was read to its end (trailers included)."""
        body = bytearray()
        while True:
            size_text = self._read_line().split(b";")[0].strip()
            if not _CHUNK_SIZE.fullmatch(size_text):  # int(..., 16) would take "-2", "0x2", "1_0"
                raise ProtocolError(f"an invalid chunk size: {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                while self._read_line():  # trailers, up to the empty line
                    pass
                return bytes(body), True
            if len(body) + size > limit:
                body += self._read_exactly(min(size, limit - len(body)))
                return bytes(body), False
            body += self._read_exactly(size)
            if self._read_line():
                raise ProtocolError("a chunk of the answer's body is longer than its size")

    def _read_to_end(self, limit: int) -> bytes:
        while len(self._buffer) < limit and self._fill():
            pass
        body = bytes(self._buffer[:limit])
        self._buffer.clear()
        return body
