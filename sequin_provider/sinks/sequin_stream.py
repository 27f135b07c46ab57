"""Sequin Stream sink: messages become durable rows of the store's stream table (DESIGN §9).

Writes are idempotent on (sink, position), so a micro-batch replayed after a crash adds nothing,
not even the messages its consumers acked meanwhile (the acked ledger). Its connection's commits
are durable when they return (``store.connect_durable``), because the slot is acknowledged once a
batch's writes have committed. A store that cannot be reached is retried with backoff for
``retry_timeout`` seconds; until then the batch is not complete and the slot does not advance
(DESIGN §2.1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import psycopg

from sequin_provider import buffer, store
from sequin_provider.buffer import Render, RetryReport
from sequin_provider.config import SequinConfig, SinkConfig
from sequin_provider.exceptions import StoreUnavailableError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.registry import register
from sequin_provider.store import CopyChunk, Parked, Span

if TYPE_CHECKING:
    from sequin_provider.sinks.stored import StoredSinkWriter, StreamTableWriter

log = logging.getLogger(__name__)
T = TypeVar("T")


# ``StoreUnavailableError`` (``exceptions``): the store stayed unreachable for longer than the retry budget.


class SequinStreamSink:
    """Writes stream messages of any number of sinks to the store, one transaction per call."""

    def __init__(self, dsn: str, schema: str, retry_timeout: float = 300.0) -> None:
        self.dsn = dsn
        self.schema = schema
        self.retry_timeout = retry_timeout
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = store.connect_durable(self.dsn, connect_timeout=5)
        return self._conn

    def write(self, chunks: Iterable[CopyChunk], binary: bool = False, span: Span | None = None) -> int:
        """Durably write stream rows given as COPY chunks (``store.copy_line`` lines, or with
        ``binary`` a whole COPY binary stream), streamed as they come; return how many were new
        (not stored yet, nor acked: ``span`` bounds their positions, ``store.insert_stream_copy``).
        Retries while the store is down."""
        consumed: list[CopyChunk] = []
        source: Iterator[CopyChunk] = iter(chunks)

        def attempt(conn: psycopg.Connection[Any]) -> int:
            nonlocal source, consumed
            try:
                return store.insert_stream_copy(conn, self.schema, source, consumed, binary, span)
            except psycopg.OperationalError:
                consumed.extend(source)  # take the rest: the retry sends the whole batch again
                source, consumed = iter(list(consumed)), []
                raise

        return self.retrying(attempt)

    def make_visible(self, sinks: Sequence[str], lsn: int) -> None:
        """Mark the sinks' messages up to ``lsn`` complete (``store.advance_visible_lsn``), with retries."""
        self.retrying(lambda conn: store.advance_visible_lsn(conn, self.schema, sinks, lsn))

    def retrying(self, operation: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``operation`` on the store connection, reconnecting with backoff while the store is down."""
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.2
        while True:
            try:
                return operation(self._connection())
            except psycopg.OperationalError as exc:
                self.close()
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailableError(f"store unreachable for {self.retry_timeout:.0f}s: {exc}") from exc
                log.warning("store unreachable (%s); retrying in %.1fs", str(exc).strip(), delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def close(self) -> None:
        """Close the store connection."""
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
            self._conn = None


@dataclass(frozen=True)
class SequinStreamOptions:
    """A Sequin Stream's consumer settings (docs/stream-api.md)."""

    visibility_timeout: float = 30.0
    max_ack_pending: int = 10_000
    max_waiting: int = 20


class SequinStreamKind(DestinationKind):
    """``type: sequin_stream``: stored; messages are rows of the store's stream table, written by
    the executors' COPY (``writer``, ``SequinStreamSink``) and pulled through the stream API."""

    name = "sequin_stream"
    stored = True

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> SequinStreamOptions:
        """``visibility_timeout``, ``max_ack_pending``, ``max_waiting``."""
        item = self.option_keys(reader, value, path, {"visibility_timeout", "max_ack_pending", "max_waiting"})
        return SequinStreamOptions(
            visibility_timeout=reader.duration(item.get("visibility_timeout", 30), f"{path}.visibility_timeout"),
            max_ack_pending=reader.integer(item.get("max_ack_pending", 10_000), f"{path}.max_ack_pending", 1),
            max_waiting=reader.integer(item.get("max_waiting", 20), f"{path}.max_waiting", 1),
        )

    def writer(self, sink: SinkConfig, table: StreamTableWriter) -> StoredSinkWriter:
        """The sink's share of each partition's COPY (transform, parked groups held: ``sinks.stored``)."""
        from sequin_provider.sinks.stored import StoredSinkWriter  # executors only: it loads pyarrow

        return StoredSinkWriter(sink, table)

    def retry(self, config: SequinConfig, sink: SinkConfig, render: Render, workers: int) -> RetryReport:
        """A stream parks messages whose transform or filter failed, and those behind them: retried
        into the stream, one at a time in position order (one connection)."""
        with psycopg.connect(config.store_dsn(sink.database), connect_timeout=10) as conn:

            def into_stream(m: Parked, data: str) -> None:
                store.insert_stream_messages(
                    conn,
                    config.store.schema,
                    [(m.sink, m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key, data, m.barrier)],
                )

            return buffer.retry_sink(config, sink, into_stream, render, workers=1)

    def counts(self, conn: psycopg.Connection[Any], schema: str, sink: str) -> dict[str, int]:
        """The stream's messages: total, visible, outstanding (``store.stream_counts``)."""
        return store.stream_counts(conn, schema, sink)


KIND = register(SequinStreamKind())
