"""NATS JetStream sink: each message published to its subject and stored by a JetStream stream
(docs/nats_jetstream.md).

A message goes to the subject its route names (``sinks.routing``), with the header ``Nats-Msg-Id``
set to its idempotency key, so the stream's duplicate window drops a replay (a retry after a lost
acknowledgement, a batch sent again after the stream app was killed), and ``Nats-Expected-Stream``
set to the configured stream, so a subject another stream captures is refused rather than stored
elsewhere. A request (up to ``batch_size`` messages) is published at once on the pusher's
connection and succeeds when JetStream acknowledged every message: the server stores them in the
order they were published on one connection, and a group's next request is published only after
this one's acknowledgements.

The sink speaks the NATS client protocol itself (``sinks.nats_protocol``: nats-py's asyncio publish
cost five times the CPU per message): a pool of blocking connections, one per lane at most, each
used by one thread at a time, every wait bounded by ``timeout``. A connection does not reconnect by
itself: one that was lost fails its request at once (parked, retried) and the next request opens a
new one, so nothing buffered while disconnected is published behind the caller's back. The start
checks use the same connection for JetStream's API (``$JS.API.STREAM.INFO``/``CREATE``).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Mapping

from sequin_provider.config import SinkConfig
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.idle_pool import IdlePool
from sequin_provider.sinks.nats_protocol import (
    NO_RESPONDERS,
    ExchangeFailed,
    NatsConnection,
    ServerAddress,
    Status,
    describe,
)
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register
from sequin_provider.sinks.routing import Route, parse_route

DEFAULT_SERVER = "nats://127.0.0.1:4222"
MSG_ID_HEADER = b"Nats-Msg-Id"
EXPECTED_STREAM_HEADER = b"Nats-Expected-Stream"
JS_API = "$JS.API"
SCHEMES = ("nats", "tls")
STREAM_NAME = re.compile(r"^[^\s.*>/\\\x00-\x1f\x7f]+$")
"""A JetStream stream name: no whitespace, dots, wildcards or path separators."""
_TOKEN = re.compile(r"^[^\s.\x00-\x1f\x7f]+$")
_ACK_ERROR = re.compile(rb'"error"\s*:')
"""An acknowledgement that refuses its message (a JSON key: a stream's name is quoted with its own quotes escaped)."""
_ACK_DUPLICATE = re.compile(rb'"duplicate"\s*:\s*true')
"""An acknowledgement of a message the stream already had (``{"stream":"S", "seq":1,"duplicate": true}``)."""
HEALTH_TIMEOUT = 2.0
"""Seconds ``health`` waits at most (``sequin status`` and the Airflow view)."""


def valid_subject(subject: str, wildcards: bool = False) -> bool:
    """Whether ``subject`` is a NATS subject one can publish to (dot-separated non-empty tokens,
    no whitespace or control characters, no ``*``/``>`` token), or with ``wildcards`` a subject
    filter (``*`` tokens, ``>`` as the last)."""
    tokens = subject.split(".")
    for n, token in enumerate(tokens):
        if not _TOKEN.match(token):
            return False
        if token in ("*", ">") and not (wildcards and (token == "*" or n == len(tokens) - 1)):
            return False
    return True


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether the subject filter ``pattern`` (``*`` one token, ``>`` the rest) captures ``subject``."""
    want, have = pattern.split("."), subject.split(".")
    for n, token in enumerate(want):
        if token == ">":
            return len(have) > n
        if n >= len(have) or (token != "*" and token != have[n]):
            return False
    return len(want) == len(have)


def derived_subjects(route: Route) -> tuple[str, ...] | None:
    """The subject filter capturing what a template route publishes to: each token holding a
    placeholder becomes ``*`` (``cdc.{table_schema}.{table_name}`` -> ``cdc.*.*``); None for a
    function route, whose subjects cannot be known beforehand."""
    if route.function is not None:
        return None
    marker = "\x00"
    text = "".join(literal + (marker if name is not None else "") for literal, name in route.parts)
    return (".".join("*" if marker in token else token for token in text.split(".")),)


def _redacted(server: str) -> str:
    """A server URL without its credentials (for messages and logs)."""
    parts = urllib.parse.urlsplit(server)
    if parts.username is None and parts.password is None:
        return server
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


@dataclass(frozen=True)
class NatsJetStreamOptions:
    """A NATS JetStream destination's settings (docs/nats_jetstream.md)."""

    subject: Route
    stream: str
    servers: tuple[str, ...] = (DEFAULT_SERVER,)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    create_stream: bool = False
    stream_subjects: tuple[str, ...] = ()
    duplicate_window: float = 120.0
    batch_size: int = 100
    timeout: float = 10.0
    concurrency: int = 4

    @property
    def capture(self) -> tuple[str, ...]:
        """The subjects a stream created for this sink captures: ``stream_subjects``, else the
        route's derived filter."""
        return self.stream_subjects or derived_subjects(self.subject) or ()

    @property
    def where(self) -> str:
        """The servers, without credentials, for messages."""
        return ", ".join(_redacted(s) for s in self.servers)


class NatsJetStreamKind(DestinationKind):
    """``type: nats_jetstream``: pushed, each request a batch of JetStream publishes awaited for
    their acknowledgements (``JetStreamPublisher``)."""

    name = "nats_jetstream"
    stored = False

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> NatsJetStreamOptions:
        """``subject`` (a route), ``stream``, ``servers``, ``user``/``password``/``token``,
        ``create_stream``, ``stream_subjects``, ``duplicate_window``, ``batch_size``, ``timeout``,
        ``concurrency``."""
        keys = {
            "servers",
            "user",
            "password",
            "token",
            "subject",
            "stream",
            "create_stream",
            "stream_subjects",
            "duplicate_window",
            "batch_size",
            "timeout",
            "concurrency",
        }
        item = self.option_keys(reader, value, path, keys, {"subject", "stream"})
        route = parse_route(reader, item["subject"], f"{path}.subject")
        literal = "".join(text + ("x" if name is not None else "") for text, name in route.parts)
        if route.function is None and not valid_subject(literal):
            raise reader.fail(
                f"{path}.subject", f"not a NATS subject: {route.spec!r} (dot-separated tokens, no spaces or wildcards)"
            )
        stream = reader.string(item["stream"], f"{path}.stream")
        if not STREAM_NAME.match(stream):
            raise reader.fail(f"{path}.stream", f"not a JetStream stream name: {stream!r} (no spaces, dots, * or >)")
        servers = _servers(reader, item.get("servers", DEFAULT_SERVER), f"{path}.servers")
        subjects_value = item.get("stream_subjects")
        stream_subjects: tuple[str, ...] = ()
        if subjects_value is not None:
            items = subjects_value if isinstance(subjects_value, list) else [subjects_value]
            stream_subjects = tuple(reader.string(s, f"{path}.stream_subjects") for s in items)
            bad = [s for s in stream_subjects if not valid_subject(s, wildcards=True)]
            if bad or not stream_subjects:
                raise reader.fail(f"{path}.stream_subjects", f"not NATS subject filters: {bad or subjects_value!r}")
        create = reader.boolean(item.get("create_stream", False), f"{path}.create_stream")
        if create and not stream_subjects and route.function is not None:
            raise reader.fail(
                f"{path}.stream_subjects", "required with create_stream when the subject is a function route"
            )
        optional = {
            k: None if item.get(k) is None else reader.string(item[k], f"{path}.{k}") for k in ("user", "token")
        }
        password = item.get("password")
        return NatsJetStreamOptions(
            subject=route,
            stream=stream,
            servers=servers,
            user=optional["user"],
            password=None if password is None else reader.string(password, f"{path}.password"),
            token=optional["token"],
            create_stream=create,
            stream_subjects=stream_subjects,
            duplicate_window=reader.duration(item.get("duplicate_window", "2m"), f"{path}.duplicate_window"),
            batch_size=reader.integer(item.get("batch_size", 100), f"{path}.batch_size", 1, 1000),
            timeout=reader.duration(item.get("timeout", 10), f"{path}.timeout"),
            concurrency=reader.integer(item.get("concurrency", 4), f"{path}.concurrency", 1, 64),
        )

    def pusher(self, sink: SinkConfig) -> JetStreamPublisher:
        """A publisher on its own connection to the sink's servers."""
        return JetStreamPublisher(sink)

    def prepare(self, sink: SinkConfig) -> list[str]:
        """Connect, find the stream (create it with ``create_stream``) and check it captures the
        sink's subjects where they are known beforehand; ``DestinationError`` names the sink."""
        return _checked(sink, sink.destination.options.timeout, create=True)

    def health(self, sink: SinkConfig) -> str:
        """``ok`` when the servers answer and the stream is there and captures the sink's known
        subjects; else what is wrong."""
        try:
            _checked(sink, HEALTH_TIMEOUT, create=False)
        except DestinationError as exc:
            return exc.reason
        return "ok"


def _servers(reader: OptionReader, value: Any, path: str) -> tuple[str, ...]:
    """``servers``: a URL or a list of them (``nats://``, ``tls://``: the sink speaks NATS over TCP)."""
    items = value if isinstance(value, list) else [value]
    servers = tuple(reader.string(s, path) for s in items)
    if not servers:
        raise reader.fail(path, "expected a server URL or a list of them")
    for server in servers:
        try:
            parts = urllib.parse.urlsplit(server)
            ok = parts.scheme in SCHEMES and bool(parts.hostname) and (parts.port is None or parts.port > 0)
        except ValueError:
            ok = False
        if not ok or re.search(r"[\s\x00-\x1f\x7f]", server):
            raise reader.fail(
                path,
                f"expected a nats://host:port URL (or tls://; websockets are not supported), got {_redacted(server)!r}",
            )
    return servers


def known_subjects(sink: SinkConfig) -> list[str]:
    """The subjects the sink will publish to that can be named before any message: its fixed
    subject, or a template over ``{table_schema}``/``{table_name}`` alone for each of its tables
    (without a transform, which may drop the fields the template reads)."""
    route: Route = sink.destination.options.subject
    fixed = route.fixed
    if fixed is not None:
        return [fixed]
    names = {name for _, name in route.parts}
    if route.function is not None or sink.transform is not None or not names <= {None, "table_schema", "table_name"}:
        return []
    values = ({"table_schema": t.schema, "table_name": t.name} for t in sink.tables)
    return list(dict.fromkeys("".join(text + (v[n] if n else "") for text, n in route.parts) for v in values))


def connect(options: NatsJetStreamOptions, name: str, timeout: float | None = None) -> NatsConnection:
    """A connection to the first of the servers (in order) that takes one, each tried once within
    ``timeout`` (the sink's by default); ``ConnectionError`` naming every server and why it failed."""
    seconds = options.timeout if timeout is None else timeout
    failures: list[str] = []
    for server in options.servers:
        try:
            address = ServerAddress.parse(server, options.user, options.password, options.token)
            return NatsConnection.open(address, seconds, name)
        except (OSError, ValueError) as exc:  # ConnectionError is an OSError; a bad INFO a ValueError
            failures.append(f"{_redacted(server)}: {describe(exc)}")
    raise ConnectionError("cannot connect (" + "; ".join(failures) + ")")


def api_request(conn: NatsConnection, what: str, body: Mapping[str, Any] | None, timeout: float) -> dict[str, Any]:
    """A JetStream API request (``$JS.API.<what>``) and its JSON answer; ``DestinationError``-free:
    ``JetStreamUnavailable`` when no server answers the API (JetStream not enabled)."""
    payload = b"" if body is None else json.dumps(body).encode()
    (reply,) = conn.exchange([(f"{JS_API}.{what}".encode(), None, payload)], timeout)
    if isinstance(reply, Status):
        raise JetStreamUnavailable(f"JetStream did not answer ({reply.code} {reply.description})".rstrip())
    answer: dict[str, Any] = json.loads(reply)
    return answer


class JetStreamUnavailable(ConnectionError):
    """No JetStream answered the API on the server (not enabled there)."""


def _checked(sink: SinkConfig, timeout: float, create: bool) -> list[str]:
    """``prepare``/``health``: the stream there (or created, with ``create`` and ``create_stream``)
    and capturing the sink's known subjects; returns what was created."""
    options: NatsJetStreamOptions = sink.destination.options
    try:
        conn = connect(options, f"sequin-{sink.name}-check", timeout)
    except ConnectionError as exc:
        raise DestinationError(sink.name, f"NATS at {options.where}: {describe(exc)}") from None
    created: list[str] = []
    try:
        info = api_request(conn, f"STREAM.INFO.{options.stream}", None, timeout)
        error = info.get("error")
        if error and error.get("code") == 404:
            if not (create and options.create_stream):
                why = "" if options.create_stream else " (create_stream is false)"
                raise DestinationError(
                    sink.name, f"JetStream stream {options.stream!r} does not exist on {options.where}{why}"
                )
            config = {
                "name": options.stream,
                "subjects": list(options.capture),
                "duplicate_window": int(options.duplicate_window * 1e9),
                "retention": "limits",
                "storage": "file",
                "num_replicas": 1,
            }
            info = api_request(conn, f"STREAM.CREATE.{options.stream}", config, timeout)
            error = info.get("error")
            if not error:
                created.append(
                    f"JetStream stream {options.stream!r} (subjects {', '.join(options.capture)}) for sink {sink.name!r}"
                )
        if error:
            raise DestinationError(
                sink.name, f"JetStream stream {options.stream!r} on {options.where}: {_api_error(error)}"
            )
        captured = list(info.get("config", {}).get("subjects") or [])
        for subject in known_subjects(sink):
            if not any(subject_matches(pattern, subject) for pattern in captured):
                raise DestinationError(
                    sink.name,
                    f"JetStream stream {options.stream!r} (subjects {', '.join(captured) or 'none'})"
                    f" does not capture subject {subject!r}",
                )
        return created
    except JetStreamUnavailable:
        raise DestinationError(sink.name, f"JetStream is not enabled on {options.where}") from None
    except (OSError, ValueError) as exc:
        raise DestinationError(sink.name, f"NATS at {options.where}: {describe(exc)}") from None
    finally:
        conn.close()


def _api_error(error: Mapping[str, Any]) -> str:
    """A JetStream API error as text: ``stream not found (404, 10059)``."""
    codes = ", ".join(str(error[k]) for k in ("code", "err_code") if error.get(k) is not None)
    return f"{error.get('description') or 'error'}" + (f" ({codes})" if codes else "")


class JetStreamPublisher(PushSink):
    """Publishes one sink's messages to JetStream over a pool of connections (one per lane, opened
    on first use, again after one was lost): each request's publishes go out together on one
    connection and their acknowledgements are awaited within ``timeout``."""

    def __init__(self, sink: SinkConfig) -> None:
        options: NatsJetStreamOptions = sink.destination.options
        self.sink = sink.name
        self.options = options
        self.route = options.subject
        self.batch_size = options.batch_size
        self.lanes = options.concurrency
        self.timeout = float(options.timeout)
        self.duplicates = 0
        """Messages the stream already had (dropped by its duplicate window): replays."""
        self._counting = threading.Lock()
        self._stream = options.stream.encode()
        self._idle: IdlePool[NatsConnection] = IdlePool(NatsConnection.usable)

    def send(self, messages: list[str], keys: list[str]) -> None:
        """Publish ``messages`` (in order) to their subjects with ``Nats-Msg-Id`` = their key and
        wait for every acknowledgement; ``DeliveryError`` unless JetStream stored (or already had)
        all of them."""
        subjects = [self.route.target(m) for m in messages]  # DeliveryError: no route
        for subject in subjects:
            if not valid_subject(subject):
                raise DeliveryError(f"nats_jetstream {self.sink}: not a NATS subject: {subject!r}")
        conn = self._take()
        frames = []
        for n, (subject, message, key) in enumerate(zip(subjects, messages, keys)):
            if "\r" in key or "\n" in key:
                self._idle.give(conn)
                raise DeliveryError(f"nats_jetstream {self.sink}: message {n + 1}: a line break in its key {key!r}")
            headers = b"NATS/1.0\r\n%s: %s\r\n%s: %s\r\n\r\n" % (
                MSG_ID_HEADER,
                key.encode(),
                EXPECTED_STREAM_HEADER,
                self._stream,
            )
            payload = message.encode()
            if len(headers) + len(payload) > conn.max_payload:
                self._idle.give(conn)
                raise DeliveryError(
                    f"nats_jetstream {self.sink}: message {n + 1} of {len(messages)} is"
                    f" {len(headers) + len(payload):,} bytes, over the server's max_payload ({conn.max_payload:,})"
                )
            frames.append((subject.encode(), headers, payload))
        try:
            replies = conn.exchange(frames, self.timeout)
        except ExchangeFailed as exc:  # the connection is closed: the next request opens another
            if exc.lost:
                what = f"the connection was lost before the acknowledgements ({exc.reason})"
            else:
                what = f"no acknowledgement within {self.timeout:g}s"
            raise DeliveryError(
                f"nats_jetstream {self.sink}: {what} ({exc.received} of {exc.total} acknowledged)"
            ) from None
        self._idle.give(conn)
        duplicates = 0
        for n, reply in enumerate(replies):
            if isinstance(reply, Status):
                reason = (
                    f"no JetStream stream captures subject {subjects[n]!r}"
                    if reply.code == NO_RESPONDERS
                    else f"{reply.code} {reply.description}".rstrip()
                )
            elif _ACK_ERROR.search(reply):
                reason = _ack_error(reply)
            else:
                duplicates += _ACK_DUPLICATE.search(reply) is not None
                continue
            raise DeliveryError(
                f"nats_jetstream {self.sink}: message {n + 1} of {len(replies)} ({subjects[n]}): {reason}"
            )
        if duplicates:
            with self._counting:
                self.duplicates += duplicates

    def _take(self) -> NatsConnection:
        """An idle connection still open, else a new one; ``DeliveryError`` when none can be had."""
        conn = self._idle.take()
        if conn is not None:
            return conn
        try:
            return connect(self.options, f"sequin-{self.sink}")
        except ConnectionError as exc:
            raise DeliveryError(f"nats_jetstream {self.sink}: {describe(exc)}") from None

    def close(self) -> None:
        """Close the idle connections."""
        self._idle.close()


def _ack_error(reply: bytes) -> str:
    """The reason of a JetStream acknowledgement that refused its message."""
    try:
        error = json.loads(reply).get("error") or {}
    except ValueError:
        return f"an unreadable acknowledgement: {reply[:200]!r}"
    return _api_error(error)


KIND = register(NatsJetStreamKind())
