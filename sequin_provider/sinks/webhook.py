"""Webhook sink: POST messages to a configured URL (DESIGN §9).

The body is ``{"data": [msg, ...]}`` when batching (the default) or the message itself; only a
2xx answer is success. With a ``secret`` each request carries ``X-Sequin-Signature:
sha256=<hex HMAC-SHA256 of the body>`` so the receiver can check it came from us.

The client keeps a pool of kept-alive connections: the stream tasks send every change of a webhook
sink through it. The standard library's ``http.client`` opens them (TLS, a proxy's tunnel), and each
request and its answer go through ``http_exchange`` (``http.client`` spent three times its CPU per
request, and ``httpx`` four times ``http.client``'s: docs/architecture.md, "Measured refinements").
It honours ``HTTP(S)_PROXY``/``NO_PROXY`` and ``SSL_CERT_FILE`` as ``httpx`` did, and follows no redirects.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import os
import re
import socket
import ssl
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Mapping

from sequin_provider.buffer import DeliveryError
from sequin_provider.config import SinkConfig
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.http_exchange import HttpChannel
from sequin_provider.sinks.idle_pool import IdlePool
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register

SIGNATURE_HEADER = "X-Sequin-Signature"
ANSWER_LIMIT = 64 * 1024
"""Bytes of an answer's body read at most (its start goes into the error of a refusal); the
connection of a longer answer is closed rather than reused."""

_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
"""What a request on a kept-alive connection meets when the server closed it while idle
(``RemoteDisconnected``: ``http_exchange`` found it closed before the answer's first byte)."""


def signature(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _basic_auth(parts: urllib.parse.SplitResult) -> str:
    """The basic-auth header value of a URL's user and password."""
    credentials = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(credentials.encode()).decode()


def _tls_context() -> ssl.SSLContext:
    """Certificates verified against ``SSL_CERT_FILE`` if set, else certifi's bundle (httpx's default)."""
    cafile = os.environ.get("SSL_CERT_FILE")
    if not cafile:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:  # the system's store
            cafile = None
    return ssl.create_default_context(cafile=cafile)


@dataclass(frozen=True)
class WebhookOptions:
    """A webhook destination's settings (docs/webhook.md)."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    batch: bool = True
    batch_size: int = 10
    timeout: float = 30.0
    secret: str | None = field(default=None, repr=False)
    concurrency: int = 8


_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
"""Headers that say where a request ends or whether its connection is kept: the client's own."""
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _replaced(headers: Mapping[str, str], replacing: Mapping[str, str]) -> dict[str, str]:
    """``headers`` with ``replacing`` added, each replacing a header of the same name in any case."""
    names = {name.lower() for name in replacing}
    return {**{name: value for name, value in headers.items() if name.lower() not in names}, **replacing}


def _latin1(text: str) -> bool:
    """Whether ``text`` can be sent as a header value (ISO-8859-1)."""
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def _idna_ok(url: str) -> bool:
    """Whether the URL's host can be looked up (no empty or over-long label: ``socket`` encodes it as IDNA)."""
    try:
        (urllib.parse.urlsplit(url).hostname or "").encode("idna")
    except UnicodeError:
        return False
    return True


def _url_port_ok(url: str) -> bool:
    """Whether the URL has a host and, if it names a port, a valid one."""
    try:
        parts = urllib.parse.urlsplit(url)
        return bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:
        return False


class WebhookKind(DestinationKind):
    """``type: webhook``: pushed, each request a POST of a batch of messages (``WebhookClient``)."""

    name = "webhook"
    stored = False

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> WebhookOptions:
        """``url`` (http/https), ``headers``, ``batch``, ``batch_size``, ``timeout``, ``secret``, ``concurrency``."""
        item = self.option_keys(
            reader, value, path, {"url", "headers", "batch", "batch_size", "timeout", "secret", "concurrency"}, {"url"}
        )
        url = reader.string(item["url"], f"{path}.url")
        if not re.match(r"^https?://[^/\s]+", url) or re.search(r"[\s\x00-\x1f\x7f]", url) or not _url_port_ok(url):
            raise reader.fail(f"{path}.url", f"expected an http:// or https:// URL, got {url!r}")
        if not _idna_ok(url):
            raise reader.fail(f"{path}.url", f"the host is not a valid domain name: {url!r}")
        if not url.isascii():
            raise reader.fail(
                f"{path}.url", f"non-ASCII characters must be percent-encoded (and a host punycoded): {url!r}"
            )
        headers = item.get("headers") or {}
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, (str, int)) for k, v in headers.items()
        ):
            raise reader.fail(f"{path}.headers", "expected a mapping of header names to string values")
        for name, header in headers.items():
            if not _HEADER_NAME.fullmatch(name) or re.search(r"[\r\n\x00]", str(header)):
                raise reader.fail(f"{path}.headers", f"not a valid HTTP header: {name!r}: {str(header)!r}")
            if name.lower() in _FRAMING_HEADERS:
                raise reader.fail(f"{path}.headers", f"{name!r} is set by the client for each request")
            if not _latin1(str(header)):  # HTTP/1.1 header values are bytes: ISO-8859-1 as http.client sent them
                raise reader.fail(
                    f"{path}.headers", f"a header value must be ISO-8859-1 text: {name!r}: {str(header)!r}"
                )
        secret = item.get("secret")
        return WebhookOptions(
            url=url,
            headers={k: str(v) for k, v in headers.items()},
            batch=reader.boolean(item.get("batch", True), f"{path}.batch"),
            batch_size=reader.integer(item.get("batch_size", 10), f"{path}.batch_size", 1, 1000),
            timeout=reader.duration(item.get("timeout", 30), f"{path}.timeout"),
            secret=None if secret is None else reader.string(secret, f"{path}.secret"),
            concurrency=reader.integer(item.get("concurrency", 8), f"{path}.concurrency", 1, 64),
        )

    def pusher(self, sink: SinkConfig) -> WebhookClient:
        """A client of the sink's URL."""
        return WebhookClient(sink)


class WebhookClient(PushSink):
    """Posts rendered messages of one webhook sink; keeps its connections alive between requests.

    Thread-safe: each request takes an idle connection from the pool (or opens one) and gives it
    back when the answer was read in full."""

    def __init__(self, sink: SinkConfig) -> None:
        options: WebhookOptions = sink.destination.options
        self.sink = sink.name
        self.url: str = options.url
        self.batch: bool = options.batch
        self.batch_size = options.batch_size if self.batch else 1
        self.lanes = options.concurrency
        self.secret: str | None = options.secret
        self.timeout = float(options.timeout)
        parts = urllib.parse.urlsplit(self.url)  # checked by config: http(s), a host, a valid port
        self.tls = parts.scheme == "https"
        self.host: str = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        authority = parts.netloc.rpartition("@")[2]  # host[:port], without credentials
        defaults = {
            "Host": authority,
            "Content-Type": "application/json",
            "User-Agent": "sequin-provider",
            "Accept-Encoding": "identity",
        }
        if parts.username is not None:  # credentials in the URL: basic auth, as httpx did
            defaults["Authorization"] = _basic_auth(parts)
        self.headers = _replaced(defaults, options.headers)
        if self.secret:  # the signature is the client's own, computed per request
            self.headers = {name: v for name, v in self.headers.items() if name.lower() != SIGNATURE_HEADER.lower()}
        self.proxy, self._proxy_auth, self._proxy_error = self._proxy(parts.scheme)
        if self.proxy is not None and not self.tls:  # a plain request through the proxy names the whole URL
            self.target = urllib.parse.urlunsplit((parts.scheme, authority, parts.path or "/", parts.query, ""))
            self.headers = _replaced(self.headers, self._proxy_auth)
        self._context = _tls_context() if self.tls else None
        self._idle: IdlePool[HttpChannel] = IdlePool()
        self._head = (
            f"POST {self.target} HTTP/1.1\r\n" + "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        ).encode("latin-1")  # checked by config: an ASCII URL, ISO-8859-1 header values
        """The request's line and headers, but its length (and signature): the same for every request."""

    def _proxy(self, scheme: str) -> tuple[urllib.parse.SplitResult | None, dict[str, str], str | None]:
        """The proxy the environment names for this URL (``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``),
        its credentials as a header, and why it cannot be used (reported by ``send``, which parks)."""
        proxy = urllib.request.getproxies().get(scheme)
        if not proxy or urllib.request.proxy_bypass(self.host):
            return None, {}, None
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        if parts.scheme != "http" or not parts.hostname:
            return (
                None,
                {},
                f"webhook {self.sink}: unsupported {scheme} proxy {proxy!r} (an http:// proxy is supported)",
            )
        auth = {"Proxy-Authorization": _basic_auth(parts)} if parts.username is not None else {}
        return parts, auth, None

    def _connect(self) -> http.client.HTTPConnection:
        if self.proxy is None:
            if self.tls:
                return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._context)
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        address = (self.proxy.hostname, self.proxy.port or 80)
        if not self.tls:
            return http.client.HTTPConnection(*address, timeout=self.timeout)
        conn = http.client.HTTPSConnection(*address, timeout=self.timeout, context=self._context)
        conn.set_tunnel(self.host, self.port, headers=self._proxy_auth)  # the credentials go to the proxy only
        return conn

    def body(self, messages: list[str]) -> bytes:
        """The request body of ``messages`` (one message unless batching)."""
        if not self.batch:
            if len(messages) != 1:
                raise ValueError("one message per request when batching is off")
            return messages[0].encode()
        return ('{"data":[' + ",".join(messages) + "]}").encode()

    def send(self, messages: list[str], keys: list[str] | None = None) -> None:
        """POST ``messages`` (in order) as one request; raises DeliveryError unless answered 2xx.
        (A webhook receiver dedupes by the messages' own ``idempotency_key``: ``keys`` are unused.)"""
        if self._proxy_error:
            raise DeliveryError(self._proxy_error)
        body = self.body(messages)
        head = b"%sContent-Length: %d\r\n" % (self._head, len(body))
        if self.secret:
            head += f"{SIGNATURE_HEADER}: {signature(self.secret, body)}\r\n".encode()
        try:
            status, text = self._post(b"".join((head, b"\r\n", body)))  # one copy of the body
        except (socket.timeout, TimeoutError):
            raise DeliveryError(f"webhook {self.sink}: timed out after {self.timeout:g}s") from None
        except ssl.SSLError as exc:
            raise DeliveryError(f"webhook {self.sink}: TLS: {exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise DeliveryError(f"webhook {self.sink}: {type(exc).__name__}: {exc}") from None
        if not 200 <= status < 300:
            raise DeliveryError(f"webhook {self.sink}: HTTP {status}: {text}")

    def _open(self) -> HttpChannel:
        """A new connection to the endpoint (through the proxy, TLS verified): ``http.client`` connects."""
        conn = self._connect()
        conn.connect()
        assert conn.sock is not None
        return HttpChannel(conn.sock)

    def _post(self, request: bytes) -> tuple[int, str]:
        """One request and its answer (status, the start of its body) on a pooled connection; a
        kept-alive connection found closed by the server is replaced once."""
        for fresh in (False, True):
            channel = None
            if not fresh:
                channel = self._idle.take()
                fresh = channel is None
            if channel is None:
                channel = self._open()
            try:
                answer = channel.exchange(request, ANSWER_LIMIT)
            except _STALE:
                channel.close()
                if fresh:
                    raise
                continue  # most likely the server closed it while idle: sent again (at least once)
            except BaseException:
                channel.close()
                raise
            if answer.reusable:
                self._idle.give(channel)
            else:  # the server closes it, or an answer longer than we read
                channel.close()
            return answer.status, answer.body[:300].decode("utf-8", "replace")
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the idle connections."""
        self._idle.close()


KIND = register(WebhookKind())
