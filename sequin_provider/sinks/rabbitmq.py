"""RabbitMQ sink: publish each message to an exchange with publisher confirms (docs/rabbitmq.md).

Every message is one AMQP message: the rendered JSON as its body, ``content_type``
``application/json``, ``message_id`` its idempotency key, persistent (``delivery_mode`` 2) unless
``persistent: false``, published ``mandatory`` to ``exchange`` with the routing key its route names
(``sinks.routing``). A request is taken when the broker confirmed every message of it; a message it
returns (no queue bound for its routing key) or refuses (``basic.nack``) fails the request, which is
parked with its group (``sinks.push``). RabbitMQ does not deduplicate: a request is published again
after a crash or a lost confirm, so consumers dedupe by ``message_id``.

The client is ``pika``'s ``BlockingConnection``, one connection and channel per concurrent sender
(a pool, as pika's connections are not thread-safe). Its ``BlockingChannel`` waits for the confirm
of each message before publishing the next (a round trip each, 4,300 messages/s here); this module
publishes a request's messages and then waits once for their confirms, through the channel pika's
``BlockingChannel`` wraps (16,000 messages/s). Messages are published in runs of one routing key,
each confirmed before the next run, so that nothing behind a returned message is taken.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from sequin_provider.buffer import DeliveryError
from sequin_provider.config import SinkConfig
from sequin_provider.exceptions import DestinationError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.idle_pool import IdlePool
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register
from sequin_provider.sinks.routing import Route, parse_route

if TYPE_CHECKING:
    import pika

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")
"""The built-in exchange types (a plugin's type starts with ``x-``)."""
LANES = 4
"""Requests in flight per Spark task (groups concurrently), each on its own connection."""
HEALTH_TIMEOUT = 2.0
ROUTING_KEY_LIMIT = 255
"""AMQP's limit on a routing key, in bytes."""


def _pika() -> Any:
    """The ``pika`` module, or an error saying how to install it."""
    try:
        import pika
    except ImportError:
        raise ImportError("the rabbitmq destination needs pika: pip install 'sequin-provider[rabbitmq]'") from None
    return pika


@dataclass(frozen=True)
class RabbitMQOptions:
    """A RabbitMQ destination's settings (docs/rabbitmq.md)."""

    routing_key: Route
    url: str = field(default=DEFAULT_URL, repr=False)
    exchange: str = ""
    exchange_type: str = "direct"
    declare_exchange: bool = False
    batch_size: int = 100
    timeout: float = 10.0
    persistent: bool = True

    @property
    def address(self) -> str:
        """``host:port/vhost`` of the URL, without its credentials (for messages)."""
        parts = urllib.parse.urlsplit(self.url)
        port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
        vhost = urllib.parse.unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        return f"{parts.hostname}:{port} vhost {vhost!r}"

    @property
    def exchange_label(self) -> str:
        """The exchange as messages name it."""
        return f"exchange {self.exchange!r}" if self.exchange else "the default exchange"


def _valid_url(url: str) -> bool:
    """An ``amqp://`` or ``amqps://`` URL with a host and, if it names a port, a valid one."""
    try:
        parts = urllib.parse.urlsplit(url)
        return parts.scheme in ("amqp", "amqps") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:
        return False


def connection_parameters(options: RabbitMQOptions) -> pika.URLParameters:
    """pika's parameters of the URL, every wait bounded by ``timeout`` and one connection attempt."""
    pika = _pika()
    parameters = pika.URLParameters(options.url)
    parameters.connection_attempts = 1
    parameters.socket_timeout = options.timeout
    parameters.stack_timeout = options.timeout
    parameters.blocked_connection_timeout = options.timeout
    return parameters


def _connect(options: RabbitMQOptions, timeout: float | None = None) -> pika.BlockingConnection:
    """A connection to the broker; pika's errors pass through (``_refusal`` words them)."""
    pika = _pika()
    parameters = connection_parameters(options)
    if timeout is not None:
        parameters.socket_timeout = parameters.stack_timeout = parameters.blocked_connection_timeout = timeout
    return pika.BlockingConnection(parameters)


def _refusal(options: RabbitMQOptions, exc: BaseException) -> str:
    """Why the broker could not be used, from pika's error (the URL's credentials left out)."""
    pika = _pika()
    if isinstance(exc, (pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        return f"RabbitMQ at {options.address} refused the credentials: {exc}"
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        return f"RabbitMQ at {options.address} refused access (vhost or permissions): {exc}"
    if isinstance(exc, pika.exceptions.AMQPConnectionError):
        return f"cannot connect to RabbitMQ at {options.address}: {exc!r}"
    return f"RabbitMQ at {options.address}: {type(exc).__name__}: {exc}"


def _close_quietly(connection: Any) -> None:
    try:
        if connection.is_open:
            connection.close()
    except Exception:  # noqa: BLE001  # already broken: nothing to release but the socket
        pass


def _check_exchange(options: RabbitMQOptions, channel: Any) -> str | None:
    """Declare the exchange (``declare_exchange``) or check it exists; None, or what is wrong."""
    pika = _pika()
    if not options.exchange:
        return None
    try:
        if options.declare_exchange:
            channel.exchange_declare(options.exchange, options.exchange_type, durable=True)
        else:
            channel.exchange_declare(options.exchange, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return f"{options.exchange_label} does not exist at {options.address} (declare_exchange is off)"
        return f"{options.exchange_label} at {options.address}: {exc.reply_code} {exc.reply_text}"
    return None


class RabbitMQKind(DestinationKind):
    """``type: rabbitmq``: pushed, each request the messages published with confirms (``RabbitMQPublisher``)."""

    name = "rabbitmq"
    stored = False

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> RabbitMQOptions:
        """``url``, ``exchange``, ``exchange_type``, ``declare_exchange``, ``routing_key`` (a route,
        required), ``batch_size``, ``timeout``, ``persistent``."""
        allowed = {
            "url",
            "exchange",
            "exchange_type",
            "declare_exchange",
            "routing_key",
            "batch_size",
            "timeout",
            "persistent",
        }
        item = self.option_keys(reader, value, path, allowed, {"routing_key"})
        url = reader.string(item.get("url", DEFAULT_URL), f"{path}.url")
        if not _valid_url(url) or re.search(r"[\s\x00-\x1f\x7f]", url):
            raise reader.fail(f"{path}.url", "expected an amqp:// or amqps:// URL with a host")
        exchange = item.get("exchange", "")
        if exchange != "":
            exchange = reader.string(exchange, f"{path}.exchange")
            if len(exchange.encode()) > ROUTING_KEY_LIMIT or re.search(r"[\x00-\x1f\x7f]", exchange):
                raise reader.fail(f"{path}.exchange", f"not a valid exchange name: {exchange!r}")
        exchange_type = reader.string(item.get("exchange_type", "direct"), f"{path}.exchange_type")
        if exchange_type not in EXCHANGE_TYPES and not exchange_type.startswith("x-"):
            raise reader.fail(
                f"{path}.exchange_type", f"expected one of {', '.join(EXCHANGE_TYPES)} (or a plugin's x-...)"
            )
        declare = reader.boolean(item.get("declare_exchange", False), f"{path}.declare_exchange")
        if declare and not exchange:
            raise reader.fail(f"{path}.declare_exchange", 'the default exchange (exchange: "") cannot be declared')
        return RabbitMQOptions(
            routing_key=parse_route(reader, item["routing_key"], f"{path}.routing_key"),
            url=url,
            exchange=exchange,
            exchange_type=exchange_type,
            declare_exchange=declare,
            batch_size=reader.integer(item.get("batch_size", 100), f"{path}.batch_size", 1, 10000),
            timeout=reader.duration(item.get("timeout", 10), f"{path}.timeout"),
            persistent=reader.boolean(item.get("persistent", True), f"{path}.persistent"),
        )

    def pusher(self, sink: SinkConfig) -> RabbitMQPublisher:
        """A publisher to the sink's exchange."""
        return RabbitMQPublisher(sink)

    def prepare(self, sink: SinkConfig) -> list[str]:
        """Connect with the sink's credentials and check its exchange exists, or declare it
        (``declare_exchange``); ``DestinationError`` naming the sink otherwise."""
        options: RabbitMQOptions = sink.destination.options
        pika = _pika()
        try:
            connection = _connect(options)
        except (pika.exceptions.AMQPError, OSError, ValueError) as exc:
            raise DestinationError(sink.name, _refusal(options, exc)) from None
        try:
            problem = _check_exchange(options, connection.channel())
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise DestinationError(sink.name, _refusal(options, exc)) from None
        finally:
            _close_quietly(connection)
        if problem:
            raise DestinationError(sink.name, problem)
        if options.declare_exchange:
            return [f"RabbitMQ {options.exchange_type} exchange {options.exchange!r} (declared if missing)"]
        return []

    def health(self, sink: SinkConfig) -> str | None:
        """``ok``, or why the broker or the exchange cannot be used (within ~2 s)."""
        options: RabbitMQOptions = sink.destination.options
        try:
            pika = _pika()
        except ImportError as exc:
            return str(exc)
        try:
            connection = _connect(options, HEALTH_TIMEOUT)
        except (pika.exceptions.AMQPError, OSError, ValueError) as exc:
            return _refusal(options, exc)
        try:
            channel = connection.channel()
            if options.exchange:
                channel.exchange_declare(options.exchange, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return f"{options.exchange_label} does not exist"
            return f"{options.exchange_label}: {exc.reply_code} {exc.reply_text}"
        except (pika.exceptions.AMQPError, OSError) as exc:
            return _refusal(options, exc)
        finally:
            _close_quietly(connection)
        return "ok"


class ConfirmedChannel:
    """One connection and a channel in confirm mode, used by one thread at a time: publishes runs
    of messages and waits for the broker's confirms of each run."""

    def __init__(self, options: RabbitMQOptions) -> None:
        self.options = options
        self.connection = _connect(options)
        self.pending: set[int] = set()
        """Delivery tags published and not yet confirmed."""
        self.published = 0
        self.nacked = 0
        self.returned: list[str] = []
        self.closed: BaseException | None = None
        self.broken = False
        """True once a wait was cut short (confirms of this channel may still be in flight)."""
        try:
            channel = self.connection.channel()
            # pika's BlockingChannel confirms one message per round trip; its underlying channel
            # takes a callback instead, so a whole run is confirmed in one wait.
            self.channel = channel._impl
            self.channel.add_on_return_callback(self._on_return)
            self.channel.add_on_close_callback(self._on_close)
            ready: list[bool] = []
            self.channel.confirm_delivery(self._on_confirm, callback=lambda _frame: self._settle(ready))
            self._wait(lambda: bool(ready), "confirm mode")
        except BaseException:
            _close_quietly(self.connection)
            raise

    def _settle(self, flag: list[bool]) -> None:
        flag.append(True)
        self._wake()

    def _wake(self) -> None:
        """End the current ``process_data_events`` wait (it returns on a connection callback)."""
        if self.connection.is_open:
            self.connection.add_callback_threadsafe(_nothing)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if method.multiple:
            settled = {tag for tag in self.pending if tag <= method.delivery_tag}
        else:
            settled = {method.delivery_tag} & self.pending
        if method.NAME == "Basic.Nack":
            self.nacked += len(settled)
        self.pending -= settled
        if not self.pending:
            self._wake()

    def _on_return(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        self.returned.append(
            f"{method.reply_code} {method.reply_text}: no queue for routing key {method.routing_key!r}"
            f" at {self.options.exchange_label}"
        )

    def _on_close(self, _channel: Any, reason: BaseException) -> None:
        self.closed = reason
        self.broken = True
        self._wake()

    @property
    def usable(self) -> bool:
        """Whether the connection and channel are open and nothing is in flight; reads what the
        broker sent meanwhile (a closed socket is found here, not by the next publish)."""
        if self.broken or self.closed is not None or not self.connection.is_open:
            return False
        try:
            self.connection.process_data_events(0)
        except Exception:  # noqa: BLE001  # any failure here: the connection is not used again
            self.broken = True
            return False
        return self.closed is None and self.connection.is_open

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.options.timeout
        while not done():
            if self.closed is not None:
                raise DeliveryError(f"the channel was closed: {self.closed}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.broken = True
                raise DeliveryError(f"no confirm of {what} within {self.options.timeout:g}s")
            self.connection.process_data_events(remaining)

    def publish(self, routing_key: str, bodies: list[bytes], properties: list[Any]) -> None:
        """Publish a run of messages with one routing key and wait for their confirms;
        ``DeliveryError`` if any was returned (unroutable) or refused (nack)."""
        exchange = self.options.exchange
        for body, props in zip(bodies, properties):
            self.published += 1
            self.pending.add(self.published)
            self.channel.basic_publish(exchange, routing_key, body, props, mandatory=True)
        self._wait(lambda: not self.pending, f"{len(bodies)} messages")
        if self.returned:
            returned, self.returned = self.returned, []
            raise DeliveryError(f"{len(returned)} messages returned unroutable: {returned[0]}")
        if self.nacked:
            nacked, self.nacked = self.nacked, 0
            raise DeliveryError(f"the broker refused (nack) {nacked} of {len(bodies)} messages")

    def close(self) -> None:
        """Close the connection."""
        _close_quietly(self.connection)


def _nothing() -> None:
    """A callback that only wakes a waiting ``process_data_events``."""


class RabbitMQPublisher(PushSink):
    """Publishes rendered messages of one RabbitMQ sink with publisher confirms.

    Thread-safe: each request takes an idle ``ConfirmedChannel`` from the pool (or opens one) and
    gives it back when it is usable again."""

    def __init__(self, sink: SinkConfig) -> None:
        options: RabbitMQOptions = sink.destination.options
        self.sink = sink.name
        self.options = options
        self.batch_size = options.batch_size
        self.lanes = LANES
        self.route = options.routing_key
        self.delivery_mode = 2 if options.persistent else 1
        self._idle: IdlePool[ConfirmedChannel] = IdlePool(lambda channel: channel.usable)

    def properties(self, key: str) -> Any:
        """The AMQP properties of the message with idempotency key ``key``."""
        return _pika().BasicProperties(
            content_type="application/json", delivery_mode=self.delivery_mode, message_id=key
        )

    def runs(self, messages: list[str], keys: list[str]) -> list[tuple[str, list[bytes], list[Any]]]:
        """The messages as runs of consecutive messages with one routing key, each message with its
        properties; ``DeliveryError`` (before anything is published) for a message without a route."""
        runs: list[tuple[str, list[bytes], list[Any]]] = []
        for message, key in zip(messages, keys):
            target = self.route.target(message)
            if len(target.encode()) > ROUTING_KEY_LIMIT:
                raise DeliveryError(f"routing key {target[:60]!r}... is longer than {ROUTING_KEY_LIMIT} bytes")
            if not runs or runs[-1][0] != target:
                runs.append((target, [], []))
            runs[-1][1].append(message.encode())
            runs[-1][2].append(self.properties(key))
        return runs

    def send(self, messages: list[str], keys: list[str]) -> None:
        """Publish ``messages`` (in order) with ``message_id`` = their idempotency ``keys``; returns
        when the broker confirmed all of them, else ``DeliveryError``."""
        pika = _pika()
        runs = self.runs(messages, keys)
        channel = self._take()
        try:
            for routing_key, bodies, properties in runs:
                channel.publish(routing_key, bodies, properties)
        except DeliveryError as exc:
            raise DeliveryError(f"rabbitmq {self.sink}: {exc}") from None
        except (pika.exceptions.AMQPError, OSError) as exc:
            channel.broken = True
            raise DeliveryError(f"rabbitmq {self.sink}: {_refusal(self.options, exc)}") from None
        except BaseException:
            channel.broken = True
            raise
        finally:
            if channel.broken:
                channel.close()
            else:
                self._idle.give(channel)

    def _take(self) -> ConfirmedChannel:
        """An idle usable channel of the pool, or a new one (``DeliveryError`` when the broker
        cannot be reached)."""
        channel = self._idle.take()
        if channel is not None:
            return channel
        pika = _pika()
        try:
            return ConfirmedChannel(self.options)
        except DeliveryError as exc:
            raise DeliveryError(f"rabbitmq {self.sink}: {exc}") from None
        except (pika.exceptions.AMQPError, OSError, ValueError) as exc:
            raise DeliveryError(f"rabbitmq {self.sink}: {_refusal(self.options, exc)}") from None

    def close(self) -> None:
        """Close the idle connections."""
        self._idle.close()


KIND = register(RabbitMQKind())
