"""The benchmarks' webhook endpoint: answers every POST with 200, counts its messages, and logs each
message's commit-to-receipt latency. It stands in for the user's server, which would run on another
machine.

Here it shares the 2 cores with the pipeline it measures, so it is kept as cheap as it can be:
- one thread per connection, and a request is read with a minimal HTTP/1.1 parser (the request line
  and headers up to the blank line, then ``Content-Length`` bytes);
- a body's commit timestamps are found with one regular expression (no JSON);
- the log has one line per distinct commit time of a body: ``commit_ms,received_ms,count``.

``http.server`` spent 380–400 µs of CPU per 100-message request (docs/performance.md, "The webhook's
requests"), about four times what the sink spends to send it.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

COMMIT_TIMESTAMP = re.compile(rb'"commit_timestamp":"([^"]+)"')
"""Each message's ``metadata.commit_timestamp``; the benchmark's table has no column of that name, so
there is exactly one per message."""
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class LatencyEndpoint:
    """The endpoint's state: messages received, and the latency log (appended per request)."""

    def __init__(self, log_path: str) -> None:
        self.log = open(log_path, "a", encoding="ascii")  # open for the process's life
        self.count = 0
        self.lock = threading.Lock()
        self.committed: dict[bytes, float] = {}  # commit timestamp text -> epoch ms, parsed once

    def received(self, body: bytes, at_ms: float) -> None:
        """Count a POST's messages and log their latencies (logged first: ``logged`` never lags the count)."""
        lines = []
        count = 0
        for stamp, n in Counter(COMMIT_TIMESTAMP.findall(body)).items():
            committed = self.committed.get(stamp)
            if committed is None:
                if len(self.committed) > 100_000:
                    self.committed.clear()
                committed = self.committed[stamp] = (
                    datetime.fromisoformat(stamp.decode().replace("Z", "+00:00")).timestamp() * 1000
                )
            lines.append(f"{committed:.1f},{at_ms:.1f},{n}\n")
            count += n
        with self.lock:
            self.log.write("".join(lines))
            self.log.flush()
            self.count += count

    def serve(self, conn: socket.socket) -> None:
        """Answer one connection's requests until it closes."""
        buffer = b""
        with conn:
            while True:
                while (end := buffer.find(b"\r\n\r\n")) < 0:
                    data = conn.recv(262144)
                    if not data:
                        return
                    buffer += data
                head, buffer = buffer[: end + 2], buffer[end + 4 :]
                match = _CONTENT_LENGTH.search(head)
                length = int(match.group(1)) if match else 0
                while len(buffer) < length:
                    data = conn.recv(262144)
                    if not data:
                        return
                    buffer += data
                body, buffer = buffer[:length], buffer[length:]
                if head.startswith(b"GET "):
                    text = str(self.count).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
                    continue
                self.received(body, time.time() * 1000)
                conn.sendall(OK)


def serve_latency(port: int, log_path: str) -> None:
    """Run the endpoint on 127.0.0.1:``port`` until the process ends."""
    endpoint = LatencyEndpoint(log_path)
    listener = socket.create_server(("127.0.0.1", port), backlog=256)  # every lane of every partition
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=endpoint.serve, args=(conn,), daemon=True).start()


def _lines(path: Path) -> list[list[str]]:
    """The log's whole lines, split (a last line still being written is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [line.split(",") for line in text[: text.rfind("\n") + 1].splitlines() if line]


def latencies(path: Path, skip: int) -> list[float]:
    """The latencies (ms) logged in ``path`` after its first ``skip`` messages, in the order logged.
    A line is ``commit_ms,received_ms[,count]`` (without a count: one message, as Debezium's sink logs)."""
    out: list[float] = []
    for committed, received, *count in _lines(path):
        out.extend([float(received) - float(committed)] * (int(count[0]) if count else 1))
    return out[skip:]


def logged(path: Path) -> int:
    """How many messages ``path`` logged so far."""
    return sum(int(fields[2]) if len(fields) > 2 else 1 for fields in _lines(path))


class ReceivedCount:
    """The endpoint's message count, asked over one kept-alive connection (callable; ``close`` when done).

    The benchmarks poll it every 0.1 s while the pipeline they measure runs on the same 2 cores: an
    ``httpx.get`` per poll (a new client and its TLS context each time) cost 31 ms of CPU, about 30 %
    of a core at that rate, taken from the webhook contender alone; a request on a kept connection
    costs about 0.1 ms."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._conn: http.client.HTTPConnection | None = None

    def __call__(self) -> int:
        for attempt in range(2):  # a connection the endpoint dropped is opened again once
            try:
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
                self._conn.request("GET", "/")
                return int(self._conn.getresponse().read())
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the kept connection (the next call opens one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
