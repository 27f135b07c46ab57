"""WebhookClient against real HTTP servers on loopback: kept-alive connections (and ones the server
closed while idle), errors as DeliveryError, a proxy named by the environment, TLS."""

from __future__ import annotations

import base64
import datetime
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from sequin_provider.buffer import DeliveryError
from sequin_provider.config import DestinationConfig, SinkConfig
from sequin_provider.sinks.webhook import SIGNATURE_HEADER, WebhookClient, WebhookOptions, signature


class Recorder:
    """An HTTP/1.1 endpoint that records each request (its connection, line, headers, body).

    ``drop_every``: after every n-th answer it closes the connection without announcing it (as a
    server does with an idle kept-alive connection); ``status``/``stall`` shape the answers."""

    def __init__(self, drop_every: int = 0, status: int = 200, stall: float = 0.0, tls: ssl.SSLContext | None = None):
        self.requests: list[dict[str, Any]] = []
        self.connections: set[tuple[str, int]] = set()
        self.drop_every, self.status, self.stall = drop_every, status, stall
        self.answer_bytes = 1000
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                recorder.requests.append(
                    {"peer": self.client_address, "path": self.path, "body": body, "headers": dict(self.headers)}
                )
                recorder.connections.add(self.client_address)
                time.sleep(recorder.stall)
                answer = b"nope: " + b"x" * recorder.answer_bytes if recorder.status >= 300 else b""
                try:
                    self.send_response(recorder.status)
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except (BrokenPipeError, ConnectionResetError):
                    return
                if recorder.drop_every and len(recorder.requests) % recorder.drop_every == 0:
                    self.close_connection = True  # silently: no "Connection: close"

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.stop()


def client(url: str, **options: Any) -> WebhookClient:
    return WebhookClient(
        SinkConfig(
            name="hooks",
            database="app",
            tables=(),
            destination=DestinationConfig(
                type="webhook",
                options=WebhookOptions(
                    **{
                        "url": url,
                        "batch": True,
                        "batch_size": 10,
                        "timeout": 5.0,
                        "secret": None,
                        "headers": {},
                        **options,
                    }
                ),
            ),
        )
    )


def test_batches_go_out_in_order_over_kept_alive_connections_with_signature_and_headers(recorder: Recorder) -> None:
    hooks = client(f"http://127.0.0.1:{recorder.port}/in/hook?team=data", secret="s3cret", headers={"X-Team": "data"})
    for n in range(20):
        hooks.send([f'{{"n":{n}}}', f'{{"n":{n}.5}}'])
    hooks.close()
    assert [r["body"] for r in recorder.requests] == [
        f'{{"data":[{{"n":{n}}},{{"n":{n}.5}}]}}'.encode() for n in range(20)
    ]
    assert {r["path"] for r in recorder.requests} == {"/in/hook?team=data"}
    assert all(r["headers"][SIGNATURE_HEADER] == signature("s3cret", r["body"]) for r in recorder.requests)
    assert all(
        r["headers"]["X-Team"] == "data" and r["headers"]["Content-Type"] == "application/json"
        for r in recorder.requests
    )
    assert len(recorder.connections) == 1  # one connection, kept alive


def test_configured_headers_replace_the_clients_own_whatever_their_case(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks = client(
        f"http://u:p@127.0.0.1:{recorder.port}/hook",
        secret="s3cret",
        headers={
            "content-type": "application/cloudevents+json",
            "AUTHORIZATION": "Bearer t",
            "x-sequin-signature": "x",
        },
    )
    hooks.send(["1"])
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{recorder.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    client("http://hooks.invalid:8080/hook", headers={"host": "virtual.example"}).send(["2"])
    first, proxied = recorder.requests
    sent = {(name.lower(), value) for name, value in first["headers"].items()}
    assert {
        (name, value) for name, value in sent if name in ("content-type", "authorization", "x-sequin-signature")
    } == {
        ("authorization", "Bearer t"),
        ("content-type", "application/cloudevents+json"),
        ("x-sequin-signature", signature("s3cret", first["body"])),  # the client's own
    }
    assert len(first["headers"]) == len({name.lower() for name in first["headers"]})  # none sent twice
    proxied_headers = {name.lower(): value for name, value in proxied["headers"].items()}
    # through a proxy the request still names the URL's host; the Host header is the configured one
    assert proxied["path"] == "http://hooks.invalid:8080/hook"
    assert proxied_headers["host"] == "virtual.example"


def test_a_connection_the_server_closed_while_idle_is_replaced_and_nothing_is_lost_or_doubled() -> None:
    server = Recorder(drop_every=3)
    try:
        hooks = client(f"http://127.0.0.1:{server.port}/hook")
        for n in range(12):
            time.sleep(0.01)  # let the server's close land before the next request
            hooks.send([str(n)])
        assert [r["body"] for r in server.requests] == [f'{{"data":[{n}]}}'.encode() for n in range(12)]
        assert len(server.connections) == 4  # a new connection after each silent close, and only then
    finally:
        server.stop()


def test_concurrent_senders_share_the_pool_without_mixing_answers(recorder: Recorder) -> None:
    hooks = client(f"http://127.0.0.1:{recorder.port}/hook")
    threads = [
        threading.Thread(target=lambda t=t: [hooks.send([f"{t * 100 + n}"]) for n in range(25)]) for t in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bodies = sorted(int(r["body"][9:-2]) for r in recorder.requests)
    assert bodies == sorted(t * 100 + n for t in range(8) for n in range(25))
    assert len(recorder.connections) <= 8


def test_refusals_timeouts_and_unreachable_endpoints_are_delivery_errors() -> None:
    refusing, slow = Recorder(status=503), Recorder(stall=2.0)
    try:
        with pytest.raises(DeliveryError, match=r"webhook hooks: HTTP 503: nope: x+$") as refused:
            client(f"http://127.0.0.1:{refusing.port}/hook").send(["1"])
        assert len(str(refused.value)) < 400  # the answer's body is cut short
        refusing.answer_bytes = 10_000_000  # a huge answer is not read whole: its connection is dropped
        hooks = client(f"http://127.0.0.1:{refusing.port}/hook")
        for _ in range(2):
            with pytest.raises(DeliveryError, match=r"HTTP 503: nope: x+$"):
                hooks.send(["1"])
        assert len(refusing.connections) == 3  # the first client's, then one per huge answer
        started = time.monotonic()
        with pytest.raises(DeliveryError, match=r"webhook hooks: timed out after 0.5s"):
            client(f"http://127.0.0.1:{slow.port}/hook", timeout=0.5).send(["1"])
        assert time.monotonic() - started < 2.0
        with pytest.raises(DeliveryError, match="ConnectionRefusedError"):
            client(f"http://127.0.0.1:{refusing.port + 1 if refusing.port < 65535 else 1}/hook").send(["1"])
    finally:
        refusing.stop()
        slow.stop()


def test_a_proxy_named_by_the_environment_gets_the_whole_url_and_its_credentials(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://bob:s%40cret@127.0.0.1:{recorder.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    client("http://al%20ice:pw@hooks.invalid:8080/hook?x=1").send(["7"])
    [request] = recorder.requests
    assert request["path"] == "http://hooks.invalid:8080/hook?x=1" and request["body"] == b'{"data":[7]}'
    assert request["headers"]["Host"] == "hooks.invalid:8080"
    assert request["headers"]["Authorization"] == "Basic " + base64.b64encode(b"al ice:pw").decode()
    assert request["headers"]["Proxy-Authorization"] == "Basic Ym9iOnNAY3JldA=="  # bob:s@cret
    monkeypatch.setenv("NO_PROXY", "hooks.invalid")  # bypassed: straight to a host that does not resolve
    with pytest.raises(DeliveryError, match="gaierror|Name or service"):
        client("http://hooks.invalid:8080/hook").send(["8"])
    monkeypatch.setenv("HTTP_PROXY", "socks5://127.0.0.1:1080")
    monkeypatch.delenv("NO_PROXY")
    with pytest.raises(DeliveryError, match=r"unsupported http proxy 'socks5://127.0.0.1:1080'"):
        client("http://hooks.invalid/hook").send(["9"])
    assert len(recorder.requests) == 1


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def test_https_verifies_the_certificate_against_ssl_cert_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server = Recorder(tls=context)
    try:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with pytest.raises(DeliveryError, match="certificate verify failed"):  # not in certifi's bundle
            client(f"https://127.0.0.1:{server.port}/hook").send(["1"])
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
        client(f"https://127.0.0.1:{server.port}/hook").send(["2"])
        assert [r["body"] for r in server.requests] == [b'{"data":[2]}']
    finally:
        server.stop()
