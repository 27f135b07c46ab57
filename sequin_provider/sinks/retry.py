"""Retry of parked messages for every kind of sink (the entry point of ``sequin buffer retry`` and
of the Airflow retry operator)."""

from __future__ import annotations

from typing import Any, Callable

import psycopg

from sequin_provider import buffer, store
from sequin_provider.buffer import Parked, RetryReport
from sequin_provider.config import ConfigError, SequinConfig, SinkConfig
from sequin_provider.delivery import apply_transform, load_transform
from sequin_provider.sinks.webhook import WebhookClient


def _renderer(sink: SinkConfig) -> Callable[[Parked], str] | None:
    """Re-applies the sink's transform to a message whose transform failed when it was parked."""
    transform = load_transform(sink.transform)
    if transform is None:
        return None
    return lambda message: apply_transform(sink, transform, message.source or "null")


def retry_sinks(config: SequinConfig, sink_name: str | None = None, workers: int = 8) -> list[RetryReport]:
    """Retry the due parked messages of one sink, or of every sink; one report per sink."""
    sinks = [s for s in config.sinks if sink_name in (None, s.name)]
    if sink_name is not None and not sinks:
        raise ConfigError(config.source, "sinks", f"no sink named {sink_name!r}")
    reports = []
    for sink in sinks:
        with psycopg.connect(config.store_dsn(sink.database), connect_timeout=10) as conn:
            store.migrate(conn, config.store.schema)
            conn.commit()
        if sink.destination.type == "webhook":
            client = WebhookClient(sink)
            try:
                reports.append(buffer.retry_sink(config, sink, lambda m, data, c=client: c.send([data]), _renderer(sink),
                                                 workers))
            finally:
                client.close()
        else:  # a Sequin Stream sink parks only messages whose transform failed: retried into the stream
            with psycopg.connect(config.store_dsn(sink.database), connect_timeout=10) as conn:
                def into_stream(m: Parked, data: str, conn: Any = conn) -> None:
                    store.insert_stream_messages(conn, config.store.schema,
                                                 [(m.sink, m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key,
                                                   data, m.barrier)])
                reports.append(buffer.retry_sink(config, sink, into_stream, _renderer(sink), workers=1))
    return reports
