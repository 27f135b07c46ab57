"""The machine's RabbitMQ as the tests and the benchmark see it: whether it runs, a uniquely named
exchange, and a queue bound to it that is read back with ``basic_get``."""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass
from typing import Any

HOST, PORT = "127.0.0.1", 5672
URL = f"amqp://guest:guest@{HOST}:{PORT}/%2F"


def rabbitmq_running() -> bool:
    """Whether something answers on RabbitMQ's port."""
    try:
        with socket.create_connection((HOST, PORT), timeout=1):
            return True
    except OSError:
        return False


def unique_name(prefix: str = "sequin-test") -> str:
    """An exchange or queue name no other run uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Received:
    """One message read back: its properties and its JSON body."""

    message_id: str
    content_type: str
    delivery_mode: int
    routing_key: str
    body: str

    @property
    def data(self) -> dict[str, Any]:
        """The body as JSON."""
        return json.loads(self.body)


class QueueReader:
    """A durable topic ``exchange`` (declared here, as the sink declares it) and a queue bound to it
    with ``bindings``; ``drain`` reads what arrived, in order. ``close`` deletes both."""

    def __init__(self, exchange: str, bindings: tuple[str, ...] = ("#",), exchange_type: str = "topic") -> None:
        import pika

        # no heartbeats: the reader is idle for minutes while a stream app starts, and its queue must stay
        self.connection = pika.BlockingConnection(pika.URLParameters(URL + "?heartbeat=0"))
        self.channel = self.connection.channel()
        self.exchange = exchange
        self.queue = f"{exchange}.queue"
        self.channel.exchange_declare(exchange, exchange_type, durable=True)
        self.channel.queue_declare(self.queue)
        for key in bindings:
            self.bind(key)
        self.got: list[Received] = []

    def bind(self, key: str) -> None:
        """Route messages with routing key ``key`` (a topic pattern) to the queue too."""
        self.channel.queue_bind(self.queue, self.exchange, key)

    def drain(self) -> list[Received]:
        """Everything read so far, after reading what is in the queue now."""
        while True:
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                return self.got
            self.got.append(
                Received(
                    properties.message_id,
                    properties.content_type,
                    properties.delivery_mode,
                    method.routing_key,
                    body.decode(),
                )
            )

    def close(self) -> None:
        """Delete the queue and the exchange, and disconnect."""
        try:
            self.channel.queue_delete(self.queue)
            self.channel.exchange_delete(self.exchange)
        finally:
            self.connection.close()
