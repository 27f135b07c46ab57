"""The NATS JetStream sink's own client (``sinks.nats_protocol``) against real ``nats-server``
processes started for these tests (the machine's binary, each on a free port with JetStream in a
temporary directory): user/password and token authorization, TLS with a certificate of a CA made
here, a server that pings fast and closes idle connections that do not answer, a small
``max_payload``, a server frozen (SIGSTOP) mid-request, and JetStream refusing messages.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from devtools.embedded_postgres import free_port
from sequin_provider.config import parse_config
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.sinks.nats_protocol import NatsConnection, ServerAddress

NATS_SERVER = shutil.which("nats-server")
pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="needs the nats-server binary")


class NatsServer:
    """A private ``nats-server`` with JetStream and ``settings`` (its config file's lines)."""

    def __init__(self, work: Path, settings: str = "") -> None:
        self.port = free_port()
        work.mkdir(parents=True, exist_ok=True)
        conf = work / "nats.conf"
        conf.write_text(f'listen: "127.0.0.1:{self.port}"\njetstream {{ store_dir: "{work / "js"}" }}\n{settings}\n')
        self.process = subprocess.Popen(
            [NATS_SERVER, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start: {self.process.stderr.read()!r}") from None
                time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP the server and wait until every one of its threads is stopped: the kernel stops a
        multi-threaded process thread by thread, and on a loaded machine a thread that is running
        answered a request after ``kill`` had returned (CI)."""
        self.process.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        deadline = time.monotonic() + 10
        while not all(_state(task) in ("T", "t") for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not stop within 10 s of SIGSTOP")
            time.sleep(0.01)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        self.process.wait(10)


def _state(task: Path) -> str:
    """A thread's state letter in ``/proc/<pid>/task/<tid>/stat`` (after the parenthesized name)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread ended
        return "T"


@pytest.fixture()
def start(tmp_path: Path) -> Iterator[Any]:
    servers: list[NatsServer] = []

    def started(settings: str = "") -> NatsServer:
        servers.append(NatsServer(tmp_path / f"nats{len(servers)}", settings))
        return servers[-1]

    yield started
    for server in servers:
        server.stop()


def _sink(server: str, stream: str = "CDC", **destination: Any) -> Any:
    return parse_config(
        {
            "databases": [{"name": "app", "dsn": "postgresql:///x"}],
            "sinks": [
                {
                    "name": "jets",
                    "tables": ["kv"],
                    "destination": {
                        "type": "nats_jetstream",
                        "servers": server,
                        "subject": "cdc.{record.id}",
                        "stream": stream,
                        "create_stream": True,
                        "timeout": "2s",
                        **destination,
                    },
                }
            ],
        },
        "sequin.yaml",
    ).sinks[0]


def _messages(first: int, count: int) -> tuple[list[str], list[str]]:
    messages = [json.dumps({"record": {"id": n % 3}, "n": n}) for n in range(first, first + count)]
    return messages, [f"{n}:0" for n in range(first, first + count)]


def _stored(port: int, stream: str, scheme: str = "nats") -> list[tuple[str, dict[str, Any]]]:
    """(subject, JSON) of every message of ``stream``, in order, read with the JetStream API."""
    conn = NatsConnection.open(ServerAddress.parse(f"{scheme}://u:p@127.0.0.1:{port}"), 5, "test-reader")
    try:
        out = []
        (info,) = conn.exchange([(f"$JS.API.STREAM.INFO.{stream}".encode(), None, b"")], 5)
        last = json.loads(info)["state"]["last_seq"]
        for seq in range(1, last + 1):
            body = json.dumps({"seq": seq}).encode()
            (reply,) = conn.exchange([(f"$JS.API.STREAM.MSG.GET.{stream}".encode(), None, body)], 5)
            message = json.loads(reply)["message"]
            out.append((message["subject"], json.loads(base64.b64decode(message["data"]))))
        return out
    finally:
        conn.close()


AUTH = 'authorization { user: "u", password: "p" }'


def test_user_and_password_publish_and_a_wrong_password_is_refused_in_the_servers_words(start: Any) -> None:
    server = start(AUTH)
    bad = _sink(f"nats://u:nope@127.0.0.1:{server.port}")
    with pytest.raises(DestinationError, match="Authorization Violation") as err:
        bad.destination.kind.prepare(bad)
    assert "nope" not in str(err.value)
    sink = _sink(f"nats://127.0.0.1:{server.port}", user="u", password="p")
    assert sink.destination.kind.prepare(sink) == ["JetStream stream 'CDC' (subjects cdc.*) for sink 'jets'"]
    pusher = sink.destination.kind.pusher(sink)
    try:
        pusher.send(*_messages(1, 30))
        pusher.send(*_messages(1, 30))  # a replay: dropped by the duplicate window
        assert pusher.duplicates == 30
    finally:
        pusher.close()
    assert [(s, m["n"]) for s, m in _stored(server.port, "CDC")] == [(f"cdc.{n % 3}", n) for n in range(1, 31)]


def test_a_token_authorizes(start: Any) -> None:
    server = start('authorization { token: "s3cret" }')
    sink = _sink(f"nats://s3cret@127.0.0.1:{server.port}")
    assert sink.destination.kind.health(
        sink
    ) == "JetStream stream 'CDC' does not exist on nats://***@127.0.0.1:{}".format(server.port)
    assert sink.destination.kind.prepare(sink)
    assert sink.destination.kind.health(sink) == "ok"
    wrong = _sink(f"nats://127.0.0.1:{server.port}", token="other")
    assert "Authorization Violation" in wrong.destination.kind.health(wrong)


def test_tls_with_a_certificate_of_a_trusted_ca(start: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tls://`` and a server that requires TLS: the certificate is verified against the trusted
    CAs (here a CA made for the test, trusted through ``SSL_CERT_FILE``); an untrusted one is refused."""
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    subprocess.run(
        [*openssl, "-keyout", tmp_path / "ca.key", "-out", ca, "-subj", "/CN=test-ca"], check=True, capture_output=True
    )
    subprocess.run(
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            tmp_path / "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    subprocess.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            tmp_path / "server.csr",
            "-CA",
            ca,
            "-CAkey",
            tmp_path / "ca.key",
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "2",
            "-extfile",
            tmp_path / "san.ext",
        ],
        check=True,
        capture_output=True,
    )
    server = start(f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n{AUTH}')
    sink = _sink(f"tls://u:p@127.0.0.1:{server.port}")
    untrusted = sink.destination.kind.health(sink)
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted, untrusted
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    assert sink.destination.kind.prepare(sink)
    plain = _sink(f"nats://u:p@127.0.0.1:{server.port}")  # the server requires TLS: upgraded all the same
    duplicates = []
    for each in (sink, plain):
        pusher = each.destination.kind.pusher(each)
        try:
            pusher.send(*_messages(1, 10))
            duplicates.append(pusher.duplicates)
        finally:
            pusher.close()
    assert duplicates == [0, 10]  # the second connection's publishes reached the same stream
    assert [m["n"] for _, m in _stored(server.port, "CDC", "tls")] == list(range(1, 11))


def test_a_connection_idle_past_the_servers_pings_is_replaced_without_failing_a_request(start: Any) -> None:
    """The server pings every 200 ms and closes a connection that left two pings unanswered; the
    pusher's idle connection is checked (pings answered, a closed one replaced) when taken."""
    server = start(f'ping_interval: "200ms"\nping_max: 2\n{AUTH}')
    sink = _sink(f"nats://u:p@127.0.0.1:{server.port}", concurrency=1)
    sink.destination.kind.prepare(sink)
    pusher = sink.destination.kind.pusher(sink)
    try:
        pusher.send(*_messages(1, 5))
        time.sleep(2)  # about ten pings: the server has closed it (Stale Connection)
        pusher.send(*_messages(6, 5))
        first = pusher._idle.take()  # noqa: SLF001  # the pool's one connection
        assert first is not None
        pusher._idle.give(first)  # noqa: SLF001
        for _ in range(5):  # taken while the server pings: answered, kept
            time.sleep(0.15)
            pusher.send(*_messages(100 + _, 1))
        assert pusher._idle.take() is first  # noqa: SLF001
    finally:
        pusher.close()
    assert len(_stored(server.port, "CDC")) == 15


def test_a_message_over_max_payload_fails_its_request_before_anything_is_sent(start: Any) -> None:
    server = start(f"max_payload: 2048\n{AUTH}")
    sink = _sink(f"nats://u:p@127.0.0.1:{server.port}")
    sink.destination.kind.prepare(sink)
    pusher = sink.destination.kind.pusher(sink)
    try:
        messages, keys = _messages(1, 3)
        messages[1] = json.dumps({"record": {"id": 1}, "pad": "x" * 3000})
        with pytest.raises(
            DeliveryError, match=r"message 2 of 3 is 3,\d{3} bytes, over the server's max_payload \(2,048\)"
        ):
            pusher.send(messages, keys)
        pusher.send(*_messages(10, 2))  # the connection is fine
    finally:
        pusher.close()
    assert [m["n"] for _, m in _stored(server.port, "CDC")] == [10, 11]


def test_a_frozen_server_times_the_request_out_and_the_next_one_reconnects(start: Any) -> None:
    server = start(AUTH)
    sink = _sink(f"nats://u:p@127.0.0.1:{server.port}", timeout="1s")
    sink.destination.kind.prepare(sink)
    pusher = sink.destination.kind.pusher(sink)
    try:
        pusher.send(*_messages(1, 3))
        server.freeze()
        try:
            with pytest.raises(DeliveryError, match=r"no acknowledgement within 1s \(0 of 4 acknowledged\)"):
                pusher.send(*_messages(4, 4))
        finally:
            server.process.send_signal(signal.SIGCONT)
        pusher.send(*_messages(4, 4))  # a new connection: the timed-out one was dropped
    finally:
        pusher.close()
    stored = [m["n"] for _, m in _stored(server.port, "CDC")]
    assert stored[:3] == [1, 2, 3] and sorted(set(stored[3:])) == [4, 5, 6, 7]  # 4-7 stored (once or twice)


def test_jetstream_refusals_name_the_message_and_the_reason(start: Any) -> None:
    server = start(AUTH)
    url = f"nats://u:p@127.0.0.1:{server.port}"
    sink = _sink(url)
    sink.destination.kind.prepare(sink)
    other = _sink(url, stream="OTHER", subject="other.x", stream_subjects=["other.>"])
    other.destination.kind.prepare(other)
    pusher = sink.destination.kind.pusher(sink)
    try:
        with pytest.raises(
            DeliveryError, match=r"message 1 of 1 \(nowhere\.x\): no JetStream stream captures subject 'nowhere\.x'"
        ):
            pusher.route = _sink(url, subject="nowhere.x").destination.options.subject
            pusher.send(*_messages(1, 1))
        pusher.route = _sink(url, subject="other.x").destination.options.subject
        with pytest.raises(
            DeliveryError, match=r"message 1 of 2 \(other\.x\): expected stream does not match \(400, 10060\)"
        ):
            pusher.send(*_messages(1, 2))  # captured by OTHER, expected CDC: refused, not stored elsewhere
    finally:
        pusher.close()
    assert _stored(server.port, "OTHER") == []


def test_a_server_that_is_not_nats_is_named(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def speak() -> None:
        peer, _ = listener.accept()
        peer.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        time.sleep(1)
        peer.close()

    threading.Thread(target=speak, daemon=True).start()
    try:
        sink = _sink(f"nats://127.0.0.1:{port}", stream=f"S{uuid.uuid4().hex[:6]}")
        assert "not a NATS server" in sink.destination.kind.health(sink)
    finally:
        listener.close()
