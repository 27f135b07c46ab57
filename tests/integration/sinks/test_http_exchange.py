"""The webhook's HTTP exchange (``sinks.http_exchange``, through ``WebhookClient``) against a real
TCP server on loopback that answers with scripted bytes: every way an endpoint may frame its answer
(chunked with trailers, interim 1xx, HTTP/1.0 read to the end, ``Connection: close``, bare LF),
when a connection is kept or dropped, and answers that are not HTTP as clear delivery errors."""

from __future__ import annotations

import socket
import threading
from typing import Iterator

import pytest

from sequin_provider.buffer import DeliveryError
from sequin_provider.config import DestinationConfig, SinkConfig
from sequin_provider.sinks.webhook import WebhookClient, WebhookOptions


class ScriptedServer:
    """Answers the n-th request it reads with ``answers[n]`` (raw bytes), then closes the connection
    when the answer is followed by ``CLOSE``. Records each request's body and its connection's number."""

    CLOSE = b"<close>"

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.requests: list[tuple[int, bytes]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        try:
            with conn:
                self._answer(conn, number)
        except OSError:  # the client gave up on the connection (a long answer it stopped reading)
            pass

    def _answer(self, conn: socket.socket, number: int) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
            )
            while len(buffer) < length:
                buffer += conn.recv(65536)
            body, buffer = buffer[:length], buffer[length:]
            self.requests.append((number, body))
            answer = self.answers[len(self.requests) - 1]
            conn.sendall(answer.removesuffix(self.CLOSE))
            if answer.endswith(self.CLOSE):
                return

    def stop(self) -> None:
        self.listener.close()


@pytest.fixture()
def scripted() -> Iterator[list[ScriptedServer]]:
    servers: list[ScriptedServer] = []
    yield servers
    for server in servers:
        server.stop()


def hooks_to(servers: list[ScriptedServer], answers: list[bytes]) -> tuple[ScriptedServer, WebhookClient]:
    server = ScriptedServer(answers)
    servers.append(server)
    options = WebhookOptions(url=f"http://127.0.0.1:{server.port}/hook", batch_size=10, timeout=5.0)
    sink = SinkConfig(name="hooks", database="app", tables=(), destination=DestinationConfig("webhook", options))
    return server, WebhookClient(sink)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_chunked_answers_with_extensions_and_trailers_keep_the_connection(scripted: list[ScriptedServer]) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4;ext=1\r\nthan\r\n6\r\nks, ok\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    server, hooks = hooks_to(scripted, [chunked, chunked, OK])
    for n in range(3):
        hooks.send([str(n)])
    assert server.requests == [(1, b'{"data":[0]}'), (1, b'{"data":[1]}'), (1, b'{"data":[2]}')]


def test_interim_answers_are_skipped_and_bare_line_feeds_are_read(scripted: list[ScriptedServer]) -> None:
    server, hooks = hooks_to(
        scripted,
        [
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK,
            b"HTTP/1.1 204 No Content\n\n",
            b"HTTP/1.1 202 Accepted\nContent-Length: 0\n\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",  # a list of equal lengths is one
            b"HTTP/1.0 200 OK\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\nok",
            OK,
        ],
    )
    for n in range(6):
        hooks.send([str(n)])
    assert [number for number, _ in server.requests] == [1, 1, 1, 1, 1, 1]


def test_answers_that_end_their_connection_are_not_reused(scripted: list[ScriptedServer]) -> None:
    server, hooks = hooks_to(
        scripted,
        [
            b"HTTP/1.0 200 OK\r\n\r\nread to the end" + ScriptedServer.CLOSE,  # no length: ends with the connection
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok" + ScriptedServer.CLOSE,
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
            OK + b"HTTP/1.1 200 OK\r\n",  # more than it announced: where it ends is in doubt
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            OK,
        ],
    )
    for n in range(6):
        hooks.send([str(n)])
    assert [number for number, _ in server.requests] == [1, 2, 3, 3, 4, 5]


def test_a_long_refusal_is_cut_short_and_its_connection_dropped(scripted: list[ScriptedServer]) -> None:
    huge = b"x" * 200_000
    server, hooks = hooks_to(
        scripted,
        [
            b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(huge), huge),
            b"HTTP/1.1 503 Busy\r\nContent-Length: %d\r\n\r\n%s" % (len(huge), huge),
            OK,
        ],
    )
    with pytest.raises(DeliveryError, match=r"^webhook hooks: HTTP 500: x{300}$"):
        hooks.send(["1"])
    with pytest.raises(DeliveryError, match=r"^webhook hooks: HTTP 503: x{300}$"):
        hooks.send(["2"])
    hooks.send(["3"])
    assert [number for number, _ in server.requests] == [1, 2, 3]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", r"ProtocolError: not an HTTP/1.x answer: b'SSH-2.0-OpenSSH_9.6'"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.x answer"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort" + ScriptedServer.CLOSE,
            "ended inside the answer's body",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Le" + ScriptedServer.CLOSE, "ended inside the answer's headers"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "an invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "an invalid chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nok\r\n0\r\n\r\n", "an invalid chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok", "an invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"y" * 70_000, "longer than 65536 bytes"),
    ],
)
def test_answers_that_are_not_http_are_delivery_errors(
    scripted: list[ScriptedServer], answer: bytes, error: str
) -> None:
    server, hooks = hooks_to(scripted, [answer, OK])
    with pytest.raises(DeliveryError, match=error):
        hooks.send(["1"])
    hooks.send(["2"])  # on a new connection
    assert [number for number, _ in server.requests] == [1, 2]


def test_a_connection_closed_before_any_answer_is_sent_again_once_on_a_new_one(
    scripted: list[ScriptedServer],
) -> None:
    server, hooks = hooks_to(scripted, [OK, ScriptedServer.CLOSE, OK, ScriptedServer.CLOSE, ScriptedServer.CLOSE])
    hooks.send(["1"])
    hooks.send(["2"])  # the kept connection closes without answering: sent again on a new one
    assert server.requests == [(1, b'{"data":[1]}'), (1, b'{"data":[2]}'), (2, b'{"data":[2]}')]
    with pytest.raises(DeliveryError, match="RemoteDisconnected"):  # a new connection that does it: an error
        hooks.send(["3"])
