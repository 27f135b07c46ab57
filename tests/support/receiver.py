"""A webhook endpoint on loopback for the tests: records what it accepts, misbehaves on demand.

Its ``policy`` decides each request's answer (status, seconds to stall first), so a test can
refuse a row, answer 500 at random, stall past the client's timeout or go down (``stop``).
"""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from devtools.embedded_postgres import free_port
from sequin_provider.sinks.webhook import SIGNATURE_HEADER, signature

Policy = Callable[[list[dict[str, Any]]], tuple[int, float]]
"""Given a request's messages: (status to answer, seconds to stall first)."""


class Receiver:
    """A webhook endpoint on loopback that records the messages of every request it answers 2xx."""

    def __init__(self, secret: str | None = None, exact: bool = False) -> None:
        """``exact``: parse the bodies with decimals as ``Decimal`` (every digit as sent), not floats."""
        self.port = free_port()
        self.secret = secret
        self.exact = exact
        self.policy: Policy = lambda messages: (200, 0.0)
        self.accepted: list[dict[str, Any]] = []
        self.stalled: list[dict[str, Any]] = []  # answered after the client's timeout: delivery was ambiguous
        self.refused = 0
        self.bad_signatures = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        """The most requests it was answering at once."""
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if receiver.secret and self.headers.get(SIGNATURE_HEADER) != signature(receiver.secret, body):
                    with receiver.lock:
                        receiver.bad_signatures += 1
                payload = json.loads(body, parse_float=Decimal if receiver.exact else float)
                messages = payload["data"] if isinstance(payload, dict) and "data" in payload else [payload]
                status, stall = receiver.policy(messages)
                with receiver.lock:
                    receiver.in_flight += 1
                    receiver.peak_in_flight = max(receiver.peak_in_flight, receiver.in_flight)
                if stall:
                    time.sleep(stall)
                with receiver.lock:
                    receiver.in_flight -= 1
                    if 200 <= status < 300:
                        receiver.accepted.extend(messages)
                        if stall:
                            receiver.stalled.extend(messages)
                    else:
                        receiver.refused += 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a stall past its timeout): it counts the delivery as failed

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.server.allow_reuse_address = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def messages(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.accepted)
