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

The client, ``nats-py``, is asyncio-based while the executors call ``send`` from their threads:
each pusher runs a private event loop in a daemon thread (``_LoopThread``) and every wait on it is
bounded by ``timeout``. The connection does not reconnect by itself: a connection that was lost
fails its requests at once (parked, retried) and the next request opens a new one, so nothing
buffered while disconnected is published behind the caller's back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Mapping, TypeVar

from sequin_provider.config import SinkConfig
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register
from sequin_provider.sinks.routing import Route, parse_route

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_SERVER = "nats://127.0.0.1:4222"
MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
SCHEMES = ("nats", "tls", "ws", "wss")
STREAM_NAME = re.compile(r"^[^\s.*>/\\\x00-\x1f\x7f]+$")
"""A JetStream stream name: no whitespace, dots, wildcards or path separators."""
_TOKEN = re.compile(r"^[^\s.\x00-\x1f\x7f]+$")
HEALTH_TIMEOUT = 2.0
"""Seconds ``health`` waits at most (``sequin status`` and the Airflow view)."""


def _client() -> Any:
    """The ``nats`` package, or an error naming the extra that installs it."""
    try:
        import nats
    except ImportError:
        raise DeliveryError(
            "the nats_jetstream destination needs nats-py: pip install 'sequin-provider[nats_jetstream]'"
        ) from None
    return nats


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
    """``servers``: a URL or a list of them (``nats://``, ``tls://``, ``ws://``, ``wss://``)."""
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
                path, f"expected a nats://host:port URL (or tls://, ws://, wss://), got {_redacted(server)!r}"
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


class _LoopThread:
    """A private asyncio event loop running in a daemon thread: the synchronous callers' way into
    the asyncio client. ``run`` waits at most ``timeout`` seconds for a coroutine's result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def run(self, work: Awaitable[T], timeout: float) -> T:
        """The result of ``work`` run on the loop; ``TimeoutError`` (and ``work`` cancelled) past ``timeout``."""
        future = asyncio.run_coroutine_threadsafe(work, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"timed out after {timeout:g}s") from None

    def stop(self) -> None:
        """Stop the loop and its thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class _Connection:
    """One client connection and its JetStream context; ``lost`` is set when it closed."""

    client: Client
    js: JetStreamContext
    lost: asyncio.Event


async def _connect(options: NatsJetStreamOptions, name: str, max_pending: int = 4000) -> _Connection:
    """A connection to the first of the servers (in order) that takes one, which does not reconnect
    by itself. nats-py tries a server again at once after a failure (its pool counts attempts
    after the first): each server is tried at most twice, within ``timeout`` each."""
    nats = _client()
    lost = asyncio.Event()
    failures: list[str] = []
    last: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        last.append(exc)
        log.debug("nats %s: %s", name, _describe(exc))

    async def on_closed() -> None:
        lost.set()

    for server in options.servers:
        last.clear()
        try:
            client = await asyncio.wait_for(
                nats.connect(
                    server,
                    name=name,
                    user=options.user,
                    password=options.password,
                    token=options.token,
                    connect_timeout=options.timeout,
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,
                    error_cb=on_error,
                    disconnected_cb=on_closed,
                    closed_cb=on_closed,
                ),
                options.timeout * 2 + 1,
            )
        except Exception as exc:  # noqa: BLE001  # any failure to connect is reported with the server
            failures.append(f"{_redacted(server)}: {_describe(last[-1] if last else exc)}")
            continue
        js = client.jetstream(timeout=options.timeout, publish_async_max_pending=max_pending)
        return _Connection(client, js, lost)
    raise ConnectionError("cannot connect (" + "; ".join(failures) + ")")


def _describe(exc: BaseException) -> str:
    """An exception as a short text (nats-py's errors often have none of their own)."""
    text = str(exc).strip()
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) and not text:
        return "timed out"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _checked(sink: SinkConfig, timeout: float, create: bool) -> list[str]:
    """``prepare``/``health``: the stream there (or created, with ``create`` and ``create_stream``)
    and capturing the sink's known subjects; returns what was created."""
    options: NatsJetStreamOptions = sink.destination.options
    runner = _LoopThread(f"nats-check-{sink.name}")
    try:
        return runner.run(_check(sink, options, create), timeout * 3)
    except DestinationError:
        raise
    except Exception as exc:  # noqa: BLE001  # every failure is the destination's: named with the sink
        raise DestinationError(sink.name, f"NATS at {options.where}: {_describe(exc)}") from None
    finally:
        runner.stop()


async def _check(sink: SinkConfig, options: NatsJetStreamOptions, create: bool) -> list[str]:
    nats = _client()
    conn = await _connect(options, f"sequin-{sink.name}-check")
    created: list[str] = []
    try:
        jsm = conn.client.jsm(timeout=options.timeout)
        try:
            info = await jsm.stream_info(options.stream)
        except nats.js.errors.NotFoundError:
            if not (create and options.create_stream):
                why = "" if options.create_stream else " (create_stream is false)"
                raise DestinationError(
                    sink.name, f"JetStream stream {options.stream!r} does not exist on {options.where}{why}"
                ) from None
            info = await jsm.add_stream(
                name=options.stream, subjects=list(options.capture), duplicate_window=options.duplicate_window
            )
            created.append(
                f"JetStream stream {options.stream!r} (subjects {', '.join(options.capture)}) for sink {sink.name!r}"
            )
        except nats.js.errors.ServiceUnavailableError:
            raise DestinationError(sink.name, f"JetStream is not enabled on {options.where}") from None
        captured = list(info.config.subjects or [])
        for subject in known_subjects(sink):
            if not any(subject_matches(pattern, subject) for pattern in captured):
                raise DestinationError(
                    sink.name,
                    f"JetStream stream {options.stream!r} (subjects {', '.join(captured) or 'none'})"
                    f" does not capture subject {subject!r}",
                )
        return created
    finally:
        await asyncio.wait_for(conn.client.close(), options.timeout)


class JetStreamPublisher(PushSink):
    """Publishes one sink's messages to JetStream on one connection (opened on first use, again
    after it was lost), from any number of threads: each request's publishes go out together and
    their acknowledgements are awaited, in order, within ``timeout``."""

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
        self._loop: _LoopThread | None = None
        self._start = threading.Lock()
        self._conn: _Connection | None = None
        self._connecting: asyncio.Lock | None = None

    def _runner(self) -> _LoopThread:
        with self._start:
            if self._loop is None:
                self._loop = _LoopThread(f"nats-{self.sink}")
            return self._loop

    def send(self, messages: list[str], keys: list[str]) -> None:
        """Publish ``messages`` (in order) to their subjects with ``Nats-Msg-Id`` = their key and
        wait for every acknowledgement; ``DeliveryError`` unless JetStream stored (or already had)
        all of them."""
        subjects = [self.route.target(m) for m in messages]  # DeliveryError: no route
        for subject in subjects:
            if not valid_subject(subject):
                raise DeliveryError(f"nats_jetstream {self.sink}: not a NATS subject: {subject!r}")
        try:
            self._runner().run(self._publish(subjects, messages, keys), self.timeout * 2 + 1)
        except DeliveryError:
            raise
        except Exception as exc:  # noqa: BLE001  # the client's errors, timeouts: the request failed
            raise DeliveryError(f"nats_jetstream {self.sink}: {_describe(exc)}") from None

    async def _connection(self) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            conn = self._conn
            if conn is not None and not conn.lost.is_set() and conn.client.is_connected:
                return conn
            if conn is not None:
                await self._drop(conn)
            self._conn = await _connect(
                self.options, f"sequin-{self.sink}", max_pending=self.batch_size * self.lanes + 100
            )
            return self._conn

    async def _drop(self, conn: _Connection) -> None:
        if self._conn is conn:
            self._conn = None
        try:
            await asyncio.wait_for(conn.client.close(), self.timeout)
        except Exception as exc:  # noqa: BLE001  # it is being dropped; its error changes nothing
            log.debug("nats %s: closing a lost connection: %s", self.sink, _describe(exc))

    async def _publish(self, subjects: list[str], messages: list[str], keys: list[str]) -> None:
        conn = await self._connection()
        nats = _client()
        acks: list[asyncio.Future[Any]] = []
        try:
            for subject, message, key in zip(subjects, messages, keys):
                headers = {MSG_ID_HEADER: key, EXPECTED_STREAM_HEADER: self.options.stream}
                acks.append(
                    await conn.js.publish_async(subject, message.encode(), wait_stall=self.timeout, headers=headers)
                )
            everything = asyncio.gather(*acks, return_exceptions=True)
            lost = asyncio.ensure_future(conn.lost.wait())
            try:
                await asyncio.wait({everything, lost}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
            if not everything.done():
                acked, was_lost = sum(a.done() for a in acks), conn.lost.is_set()
                everything.cancel()
                await self._drop(conn)  # lost, or a server that stopped answering: the next request reconnects
                if was_lost:
                    raise DeliveryError(
                        f"nats_jetstream {self.sink}: the connection was lost before the acknowledgements"
                        f" ({acked} of {len(acks)} acknowledged)"
                    )
                raise DeliveryError(
                    f"nats_jetstream {self.sink}: no acknowledgement within {self.timeout:g}s"
                    f" ({acked} of {len(acks)} acknowledged)"
                )
            results = everything.result()
        except DeliveryError:
            raise
        except Exception:
            for ack in acks:
                ack.cancel()
            if conn.lost.is_set() or not conn.client.is_connected:
                await self._drop(conn)
            raise
        for n, result in enumerate(results):
            if isinstance(result, BaseException):
                if isinstance(result, nats.js.errors.NoStreamResponseError):
                    reason = f"no JetStream stream captures subject {subjects[n]!r}"
                else:
                    reason = _describe(result)
                raise DeliveryError(
                    f"nats_jetstream {self.sink}: message {n + 1} of {len(results)} ({subjects[n]}): {reason}"
                )
        self.duplicates += sum(1 for r in results if r.duplicate)

    def close(self) -> None:
        """Close the connection and stop the loop."""
        loop = self._loop
        if loop is None:
            return
        conn = self._conn
        if conn is not None:
            try:
                loop.run(self._drop(conn), self.timeout + 1)
            except Exception as exc:  # noqa: BLE001  # closing: nothing to deliver any more
                log.debug("nats %s: close: %s", self.sink, _describe(exc))
        loop.stop()
        self._loop = None


KIND = register(NatsJetStreamKind())
