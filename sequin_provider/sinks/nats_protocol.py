"""A blocking connection to a NATS server that speaks the client protocol itself: what the NATS
JetStream sink needs and nothing more (docs/nats_jetstream.md#the-client).

It connects over TCP or TLS with a user and password or a token, publishes a request's messages
(headers included) with a reply subject each and collects the replies (JetStream's acknowledgements,
or its API's answers), and answers the server's pings. One thread uses a connection at a time (the
sink keeps a pool of them, one per lane).

Why not nats-py: its asyncio ``publish_async`` costs about 70 µs of Python per message (a future, a
reply inbox and a parsed reply each, through an event loop in another thread), so the sink could not
publish more than ~15,000 messages/s per process; here a request's frames are built at once and its
replies scanned in one pass, about 12 µs per message (``bench/nats_jetstream_throughput.py``).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Sequence

from sequin_provider.sinks.idle_pool import readable

DEFAULT_PORT = 4222
LANG = "python-sequin"
_RECV = 1 << 16


class ExchangeFailed(ConnectionError):
    """A request's replies did not all arrive: the connection is unusable (close it). ``received``
    of ``total`` replies had arrived; ``lost`` tells a lost connection from a timeout."""

    def __init__(self, reason: str, received: int, total: int, lost: bool) -> None:
        super().__init__(reason)
        self.reason, self.received, self.total, self.lost = reason, received, total, lost


@dataclass(frozen=True)
class Status:
    """A reply that is a status without a payload (``NATS/1.0 503``: no responders)."""

    code: int
    description: str = ""


NO_RESPONDERS = 503


@dataclass(frozen=True)
class ServerAddress:
    """One server URL taken apart: where to connect, whether over TLS, and its credentials
    (``nats://user:pass@host``; a user without a password is a token, as nats-py reads it)."""

    host: str
    port: int
    tls: bool
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    @classmethod
    def parse(
        cls, url: str, user: str | None = None, password: str | None = None, token: str | None = None
    ) -> ServerAddress:
        """The address of ``url`` (``nats://`` or ``tls://``); credentials in the URL win over the
        ones given."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ValueError(f"not a nats:// or tls:// URL: {parts.scheme}://")
        if parts.username is not None:
            name = urllib.parse.unquote(parts.username)
            if parts.password is None:
                user, password, token = None, None, name
            else:
                user, password, token = name, urllib.parse.unquote(parts.password), None
        return cls(parts.hostname, parts.port or DEFAULT_PORT, parts.scheme == "tls", user, password, token)


class NatsConnection:
    """One open connection: ``exchange`` publishes messages and returns their replies in order.
    Opened by ``open``; every wait is bounded by the timeout given."""

    def __init__(self, sock: socket.socket, info: dict[str, Any]) -> None:
        self._sock = sock
        self.info = info
        self.max_payload = int(info.get("max_payload", 1 << 20))
        """The largest message (headers and payload) the server takes."""
        self._buf = bytearray()
        self._inbox = b"_INBOX." + os.urandom(8).hex().encode()
        self._requests = 0
        self.closed = False

    @classmethod
    def open(cls, address: ServerAddress, timeout: float, name: str) -> NatsConnection:
        """Connect, upgrade to TLS when asked (``tls://``) or required by the server, authenticate,
        and subscribe to the connection's reply inbox. ``ConnectionError`` says why it failed (the
        server's own words for a refused authorization)."""
        deadline = time.monotonic() + timeout
        sock = socket.create_connection((address.host, address.port), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            first = _read_line(sock, deadline)
            if not first.startswith(b"INFO "):
                raise ConnectionError(f"not a NATS server (it said {first[:80]!r})")
            info = json.loads(first[5:])
            tls = address.tls or bool(info.get("tls_required"))
            if tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=address.host)
            options: dict[str, Any] = {
                "verbose": False,
                "pedantic": False,
                "tls_required": tls,
                "name": name,
                "lang": LANG,
                "version": "1",
                "protocol": 1,
                "headers": True,
                "no_responders": True,
            }
            if address.user is not None:
                options.update(user=address.user, **{"pass": address.password or ""})
            elif address.token is not None:
                options["auth_token"] = address.token
            conn = cls(sock, info)
            conn._send(b"CONNECT " + json.dumps(options).encode() + b"\r\nPING\r\n")
            conn._await_pong(deadline)
            if not info.get("headers", False):
                raise ConnectionError("the server does not support message headers (NATS 2.2 or later needed)")
            conn._send(b"SUB " + conn._inbox + b".> 1\r\n")
            return conn
        except BaseException:
            sock.close()
            raise

    def exchange(self, messages: Sequence[tuple[bytes, bytes | None, bytes]], timeout: float) -> list[bytes | Status]:
        """Publish ``messages`` (subject, header block or None, payload) at once, each with a reply
        subject of its own, and return each one's reply (its payload, or a ``Status``) in their
        order. ``ExchangeFailed`` when they did not all arrive within ``timeout`` seconds, or the
        connection was lost or the server closed it with an error."""
        self._requests += 1
        prefix = self._inbox + b".%d." % self._requests
        frames = []
        for n, (subject, headers, payload) in enumerate(messages):
            if headers is None:
                frames.append(b"PUB %s %s%d %d\r\n%s\r\n" % (subject, prefix, n, len(payload), payload))
            else:
                size = len(headers)
                frames.append(
                    b"HPUB %s %s%d %d %d\r\n%s%s\r\n"
                    % (subject, prefix, n, size, size + len(payload), headers, payload)
                )
        replies: list[bytes | Status | None] = [None] * len(messages)
        deadline = time.monotonic() + timeout
        try:
            self._send(b"".join(frames))
            self._collect(prefix, replies, deadline)
        except ExchangeFailed:
            raise
        except (socket.timeout, TimeoutError):
            raise self._failed(f"timed out after {timeout:g}s", replies, lost=False) from None
        except (OSError, ValueError) as exc:  # ConnectionError is an OSError
            raise self._failed(describe(exc), replies, lost=True) from None
        return replies  # type: ignore[return-value]  # every one filled

    def usable(self) -> bool:
        """Whether the connection is still open, after answering the pings the server sent while it
        was idle (a connection left idle past two of the server's ping intervals is closed)."""
        if self.closed:
            return False
        try:
            while readable(self._sock):
                data = self._sock.recv(_RECV)
                if not data:
                    self.close()
                    return False
                self._buf += data
                self._drain()
        except (OSError, ValueError):  # ConnectionError is an OSError
            self.close()
            return False
        return True

    def close(self) -> None:
        """Close the socket."""
        self.closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _failed(self, reason: str, replies: Sequence[Any], lost: bool) -> ExchangeFailed:
        self.close()
        received = sum(r is not None for r in replies)
        return ExchangeFailed(reason, received, len(replies), lost)

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _await_pong(self, deadline: float) -> None:
        while True:
            line = self._line(deadline)
            if line == b"PONG":
                return
            if line.startswith(b"-ERR"):
                raise ConnectionError(_server_error(line))
            if line == b"PING":
                self._send(b"PONG\r\n")

    def _line(self, deadline: float) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 2]
                return line
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        self._sock.settimeout(remaining)
        data = self._sock.recv(_RECV)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buf += data

    def _drain(self) -> None:
        """Handle the frames already buffered: pings answered, INFO kept, replies of no request dropped."""
        self._collect(b"", [], time.monotonic())

    def _collect(self, prefix: bytes, replies: list[Any], deadline: float) -> None:
        """Read frames until every slot of ``replies`` (for reply subjects ``prefix<n>``) is filled;
        with no slots, only what is already buffered. Pings are answered; a server error raises."""
        missing = len(replies)
        buf = self._buf
        pos = 0
        skip = len(prefix)
        while True:
            end = buf.find(b"\r\n", pos)
            op = buf[pos : pos + 4] if end >= 0 else b""
            frame = op == b"MSG " or op == b"HMSG"
            if frame:
                parts = bytes(buf[pos:end]).split()
                stop = end + 2 + int(parts[-1])
            if end < 0 or (frame and len(buf) < stop + 2):  # a frame not whole yet
                if not missing:
                    break
                del buf[:pos]
                pos = 0
                self._fill(deadline)
                continue
            if frame:
                subject = parts[1]
                reply: bytes | Status
                if op == b"HMSG":
                    head = int(parts[-2])
                    reply = _status(bytes(buf[end + 2 : end + 2 + head])) or bytes(buf[end + 2 + head : stop])
                else:
                    reply = bytes(buf[end + 2 : stop])
                pos = stop + 2
                if subject.startswith(prefix):
                    try:
                        n = int(subject[skip:])
                    except ValueError:
                        continue
                    if 0 <= n < len(replies) and replies[n] is None:
                        replies[n] = reply
                        missing -= 1
                        if not missing:
                            break
                continue
            line = bytes(buf[pos:end])
            pos = end + 2
            if line == b"PING":
                self._send(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                raise ConnectionError(_server_error(line))
            elif line.startswith(b"INFO "):
                self.info.update(json.loads(line[5:]))
        del buf[:pos]


def _status(headers: bytes) -> Status | None:
    """The status of a header block that carries one (``NATS/1.0 503 ...``), else None."""
    first = headers.split(b"\r\n", 1)[0]
    words = first.split(None, 2)
    if len(words) < 2 or not words[1].isdigit():
        return None
    return Status(int(words[1]), words[2].decode(errors="replace") if len(words) > 2 else "")


def _server_error(line: bytes) -> str:
    """``-ERR 'Authorization Violation'`` -> ``the server said: Authorization Violation``."""
    text = line[4:].strip().strip(b"'").decode(errors="replace")
    return f"the server said: {text}"


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    """The first line the server sends (its INFO), read byte-exact: nothing after it is consumed
    (a TLS handshake may follow)."""
    data = bytearray()
    while not data.endswith(b"\r\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out waiting for the server's INFO")
        sock.settimeout(remaining)
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
        if len(data) > 1 << 20:
            raise ConnectionError("not a NATS server (no INFO line)")
    return bytes(data[:-2])


def describe(exc: BaseException) -> str:
    """An exception as a short text: a plain ``ConnectionError``'s (this module's) own words, a
    timeout as ``timed out``, else its type and text (``ConnectionRefusedError: [Errno 111] ...``)."""
    text = str(exc).strip()
    if isinstance(exc, (socket.timeout, TimeoutError)) and not text:
        return "timed out"
    if type(exc) in (ConnectionError, ExchangeFailed) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
