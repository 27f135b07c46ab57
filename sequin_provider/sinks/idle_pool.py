"""The idle connections of one sink's lanes (webhook, NATS JetStream, RabbitMQ, Postgres table):
a request takes one, or opens one when none is idle, and gives it back when it is still fit to
reuse; the sink's ``close`` closes what is idle. One pool per sink: its lanes share it."""

from __future__ import annotations

import queue
import select
import socket
import ssl
from typing import Callable, Generic, Protocol, TypeVar


class Closable(Protocol):
    """What the pool holds: anything with ``close``."""

    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class IdlePool(Generic[C]):
    """Idle connections of one kind, shared by a sink's lanes (thread-safe, unbounded: at most one
    per lane is ever given back). ``usable`` tells a connection found idle that may still serve (a
    server may have closed it meanwhile); one that may not is closed and passed over."""

    def __init__(self, usable: Callable[[C], bool] | None = None) -> None:
        self._idle: queue.SimpleQueue[C] = queue.SimpleQueue()
        self._usable = usable

    def take(self) -> C | None:
        """An idle usable connection, or None when there is none (the caller opens one)."""
        while (conn := self._pop()) is not None:
            if self._usable is None or self._usable(conn):
                return conn
            conn.close()
        return None

    def give(self, conn: C) -> None:
        """Keep ``conn`` for the next request."""
        self._idle.put(conn)

    def close(self) -> None:
        """Close the idle connections (those in use are closed by whoever gives them back)."""
        while (conn := self._pop()) is not None:
            conn.close()

    def _pop(self) -> C | None:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return None


def readable(conn: socket.socket | int) -> bool:
    """Whether ``conn`` (a socket or a file descriptor) has something to read now, without waiting.
    On an idle connection that is what its server sent meanwhile: a ping, or its last words and the
    connection's end, so a pool's ``usable`` finds a closed connection without a round trip. An SSL
    socket's bytes already decrypted count; ``poll``, not ``select``: any descriptor number."""
    if isinstance(conn, ssl.SSLSocket) and conn.pending():
        return True
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return bool(poller.poll(0))
