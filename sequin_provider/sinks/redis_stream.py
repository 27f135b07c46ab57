"""Redis Stream sink: each message an entry (``XADD``) of the stream its route names (docs/redis-stream.md).

An entry has two fields: ``data`` (the message's JSON) and ``key`` (its idempotency key). A request
(up to ``batch_size`` messages, in order) is one ``EVALSHA`` of ``ADD_SCRIPT``, which adds each
message unless its idempotency key was seen within ``dedupe_window`` (the marker key
``<stream key>:seen:<idempotency key>``), and marks it seen, atomically: a replayed request (after a
timeout, a parked retry, a killed stream app) adds nothing twice, and no message is ever marked
without being added. Entry ids are Redis's own (``*``), not derived from positions: messages of
different groups reach one stream from several lanes and tasks out of position order, and Redis
refuses an explicit id not above the stream's last one, which would refuse (not dedupe) them.

The client (``redis-py``, the ``redis_stream`` extra) is imported only by what talks to Redis, so
the config parser does not need it.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from sequin_provider.config import SinkConfig
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register
from sequin_provider.sinks.routing import Route, parse_route

if TYPE_CHECKING:
    import redis

INSTALL_HINT = "pip install 'sequin-provider[redis_stream]'"
SEEN = ":seen:"
"""Between a stream key and an idempotency key in the marker key of a message added to it."""

ADD_SCRIPT = """
-- KEYS: stream 1, marker 1, stream 2, marker 2, ...
-- ARGV: window (ms), maxlen (0: no trimming), create (1/0), data 1, key 1, data 2, key 2, ...
local window, maxlen, create = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local n = #KEYS / 2
if not create then
  for i = 1, n do
    if redis.call('EXISTS', KEYS[2 * i - 1]) == 0 then
      return redis.error_reply('ERR stream ' .. KEYS[2 * i - 1] .. ' does not exist (create: false)')
    end
  end
end
local added = 0
for i = 1, n do
  local stream, marker = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('EXISTS', marker) == 0 then
    if maxlen > 0 then
      redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'data', ARGV[2 + 2 * i], 'key', ARGV[3 + 2 * i])
    else
      redis.call('XADD', stream, '*', 'data', ARGV[2 + 2 * i], 'key', ARGV[3 + 2 * i])
    end
    redis.call('SET', marker, '1', 'PX', window)
    added = added + 1
  end
end
return added
"""
"""Adds a request's messages in order, each unless its marker exists, then sets the marker: the
``XADD`` comes first so an ``XADD`` refused (a key of another type) marks nothing; a script runs
atomically, so no other request sees a message added but not marked."""


@dataclass(frozen=True)
class RedisStreamOptions:
    """A ``redis_stream`` destination's settings (docs/redis-stream.md)."""

    url: str = field(repr=False)
    stream_key: Route
    maxlen: int | None = None
    batch_size: int = 100
    timeout: float = 10.0
    dedupe_window: float = 86400.0
    create: bool = True
    concurrency: int = 4


def _url_ok(url: str) -> bool:
    """Whether ``url`` is a ``redis://``/``rediss://`` URL with a host, a valid port and a database
    number (or none), or a ``unix://`` socket path."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "unix":
            return bool(parts.path)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            return False
        if parts.port is not None and parts.port <= 0:
            return False
        return parts.path in ("", "/") or re.fullmatch(r"/\d+", parts.path) is not None
    except ValueError:
        return False


def _redis_module(sink: str) -> Any:
    """The ``redis`` package; ``DestinationError`` saying how to install it when it is missing."""
    try:
        import redis
    except ImportError:
        raise DestinationError(sink, f"the Redis client is not installed: {INSTALL_HINT}") from None
    return redis


def connect(sink: SinkConfig, timeout: float | None = None, retries: int = 1) -> redis.Redis:
    """A client of the sink's Redis (its own connection pool): every wait bounded by ``timeout``
    (default: the sink's), a command whose connection dropped or timed out sent again ``retries``
    times on a fresh one, no other retries (the buffer retries)."""
    redis = _redis_module(sink.name)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    options: RedisStreamOptions = sink.destination.options
    wait = options.timeout if timeout is None else timeout
    return redis.Redis.from_url(
        options.url,
        socket_timeout=wait,
        socket_connect_timeout=wait,
        retry=Retry(NoBackoff(), retries),
        client_name=f"sequin:{sink.name}",
    )


def _problem(sink: SinkConfig, client: redis.Redis) -> str | None:
    """What keeps the sink from adding to its Redis (None: nothing): the server answers with these
    credentials, may run the script, and a fixed stream key is a stream, or absent and creatable."""
    options: RedisStreamOptions = sink.destination.options
    client.ping()
    client.script_load(ADD_SCRIPT)  # an ACL that forbids scripting fails here, not at the first message
    fixed = options.stream_key.fixed
    if fixed is not None:
        kind = client.type(fixed)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "none" and not options.create:
            return f"stream {fixed!r} does not exist and create is false"
        if kind not in ("none", "stream"):
            return f"key {fixed!r} holds a {kind}, not a stream"
    return None


def _where(sink: SinkConfig) -> str:
    """The sink's server without its credentials, for messages."""
    parts = urllib.parse.urlsplit(sink.destination.options.url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


class RedisStreamKind(DestinationKind):
    """``type: redis_stream``: pushed, each request one script adding its messages to their streams."""

    name = "redis_stream"
    stored = False

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> RedisStreamOptions:
        """``url``, ``stream_key`` (a route), ``maxlen``, ``batch_size``, ``timeout``,
        ``dedupe_window``, ``create``, ``concurrency``."""
        allowed = {"url", "stream_key", "maxlen", "batch_size", "timeout", "dedupe_window", "create", "concurrency"}
        item = self.option_keys(reader, value, path, allowed, {"stream_key"})
        url = reader.string(item.get("url", "redis://127.0.0.1:6379/0"), f"{path}.url")
        if not _url_ok(url):
            raise reader.fail(
                f"{path}.url", "expected redis://[user:password@]host[:port][/db], rediss://… or unix://path"
            )
        maxlen = item.get("maxlen")
        timeout = reader.duration(item.get("timeout", 10), f"{path}.timeout")
        if timeout <= 0:
            raise reader.fail(f"{path}.timeout", "must be more than 0")
        window = reader.duration(item.get("dedupe_window", "24h"), f"{path}.dedupe_window")
        if window < 1:
            raise reader.fail(f"{path}.dedupe_window", f"must be at least 1s, got {window:g}s")
        return RedisStreamOptions(
            url=url,
            stream_key=parse_route(reader, item["stream_key"], f"{path}.stream_key"),
            maxlen=None if maxlen is None else reader.integer(maxlen, f"{path}.maxlen", 1),
            batch_size=reader.integer(item.get("batch_size", 100), f"{path}.batch_size", 1, 1000),
            timeout=timeout,
            dedupe_window=window,
            create=reader.boolean(item.get("create", True), f"{path}.create"),
            concurrency=reader.integer(item.get("concurrency", 4), f"{path}.concurrency", 1, 64),
        )

    def pusher(self, sink: SinkConfig) -> RedisStreamSender:
        """A sender to the sink's Redis."""
        return RedisStreamSender(sink)

    def prepare(self, sink: SinkConfig) -> list[str]:
        """Check the server answers, the credentials work, scripts may run, and a fixed stream key
        is usable; creates nothing (a stream is created by its first entry unless ``create: false``)."""
        redis = _redis_module(sink.name)
        client = connect(sink)
        try:
            problem = _problem(sink, client)
        except redis.RedisError as exc:
            raise DestinationError(sink.name, f"Redis at {_where(sink)}: {type(exc).__name__}: {exc}") from None
        finally:
            client.close()
        if problem:
            raise DestinationError(sink.name, f"Redis at {_where(sink)}: {problem}")
        return []

    def health(self, sink: SinkConfig) -> str | None:
        """``"ok"``, or what is wrong with the sink's Redis (within ~2 s)."""
        try:
            redis = _redis_module(sink.name)
        except DestinationError as exc:
            return exc.reason
        client = connect(sink, timeout=min(2.0, sink.destination.options.timeout), retries=0)
        try:
            return _problem(sink, client) or "ok"
        except redis.RedisError as exc:
            return f"Redis at {_where(sink)}: {type(exc).__name__}: {exc}"
        finally:
            client.close()


class RedisStreamSender(PushSink):
    """Adds one redis_stream sink's messages to their streams; thread-safe (the lanes share its
    connection pool, a request takes one connection)."""

    def __init__(self, sink: SinkConfig) -> None:
        options: RedisStreamOptions = sink.destination.options
        self.sink = sink.name
        self.batch_size = options.batch_size
        self.lanes = options.concurrency
        self.route = options.stream_key
        self._redis = _redis_module(sink.name)
        self._client = connect(sink)
        self._script = self._client.register_script(ADD_SCRIPT)
        self._settings = (math.ceil(options.dedupe_window * 1000), options.maxlen or 0, int(options.create))

    def send(self, messages: list[str], keys: list[str]) -> None:
        """Add ``messages`` (in order) to their routed streams, each unless already added within the
        dedupe window; ``DeliveryError`` when a route fails or Redis refuses or cannot be reached
        (a request cut short is replayed whole: what it added is skipped then)."""
        redis_keys: list[str] = []
        args: list[Any] = list(self._settings)
        for message, key in zip(messages, keys, strict=True):
            stream = self.route.target(message)
            redis_keys += (stream, f"{stream}{SEEN}{key}")
            args += (message, key)
        try:
            self._script(keys=redis_keys, args=args)
        except self._redis.TimeoutError:
            raise DeliveryError(f"redis_stream {self.sink}: timed out") from None
        except self._redis.RedisError as exc:
            raise DeliveryError(f"redis_stream {self.sink}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """Close the connections."""
        self._client.close()


KIND = register(RedisStreamKind())
