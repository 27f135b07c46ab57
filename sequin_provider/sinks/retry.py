"""Retry of parked messages for every kind of sink (the entry point of ``sequin buffer retry`` and
of the Airflow retry operator)."""

from __future__ import annotations

from typing import Any

import psycopg

from sequin_provider import store
from sequin_provider.buffer import DeliveryError, Render, RetryReport, parked_change
from sequin_provider.config import ConfigError, SequinConfig, SinkConfig
from sequin_provider.delivery import apply_transform, load_transform
from sequin_provider.store import Parked


class _Filters:
    """The retry run's ``spark.poison.FilterCheck``, made when a parked filter failure is first met
    (Spark is imported, and for a filter a local session started, only then)."""

    def __init__(self) -> None:
        self.check: Any = None

    def get(self) -> Any:
        if self.check is None:
            from sequin_provider.spark.poison import FilterCheck

            self.check = FilterCheck()
        return self.check

    def close(self) -> None:
        if self.check is not None:
            self.check.close()


def _renderer(sink: SinkConfig, filters: _Filters) -> Render:
    """Renders a parked message that has no rendered form: re-applies the sink's transform to a
    message whose transform failed, or runs a change the sink's filter failed on through the
    sink's current selection (``buffer.Filtered`` when it no longer takes it), then renders and
    transforms it as the stream would."""
    transform = load_transform(sink.transform)

    def render(message: Parked) -> str:
        change = parked_change(message.source)
        if change is None:
            if transform is None:
                raise DeliveryError("the message has no rendered form")
            return apply_transform(sink, transform, message.source or "null")
        import pyarrow as pa

        from sequin_provider import message_render

        check = filters.get()
        rendering = message_render.SinkRendering.of(sink, sink.database)
        check.passes(sink, rendering, change)
        rendered = message_render.render(check.change_batch(change), rendering, pa.array([message.group_id]))
        data: str = rendered.data[0].as_py()
        return data if transform is None else apply_transform(sink, transform, data)

    return render


def retry_sinks(config: SequinConfig, sink_name: str | None = None, workers: int = 8) -> list[RetryReport]:
    """Retry the due parked messages of one sink, or of every sink; one report per sink."""
    if sink_name is None:
        sinks = list(config.sinks)
    elif config.has_sink(sink_name):
        sinks = [config.sink(sink_name)]
    else:
        raise ConfigError(config.source, "sinks", f"no sink named {sink_name!r}")
    reports = []
    filters = _Filters()
    try:
        for sink in sinks:
            reports.append(_retry_one(config, sink, filters, workers))
    finally:
        filters.close()
    return reports


def _retry_one(config: SequinConfig, sink: SinkConfig, filters: _Filters, workers: int) -> RetryReport:
    """One sink's retry run."""
    with psycopg.connect(config.store_dsn(sink.database), connect_timeout=10) as conn:
        store.migrate(conn, config.store.schema)
        conn.commit()
    return sink.destination.kind.retry(config, sink, _renderer(sink, filters), workers)
