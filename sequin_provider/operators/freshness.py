"""``SequinFreshnessOperator``: emit, per sink table, the commit time through which the sink is complete.

For each database it takes a mark on the source (``freshness``: a time of the source's clock and a
WAL position every transaction committed by then precedes), waits up to ``wait_timeout`` seconds for
the pipeline's confirmed position (the slot's) to pass it, and then emits an event of the asset of
every table of every sink with no message parked before the mark (``operators.assets``), with the
extra ``complete_through``: every change of the table committed at or before it has reached the sink.
Never ahead of what is delivered. A sink with parked messages before the mark, or a database whose
stream has not passed the mark in time, gets no event this run (the log and the return value say so).

Why a scheduled task and not the supervisor: a task's asset events are recorded when it finishes,
so the long-running ``SequinReplicationOperator`` cannot emit any while it runs. A short scheduled
task (``sequin_freshness``) is Airflow's way; it also measures what is *delivered*, from outside the
stream app, rather than what the app believes.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from airflow.sdk import BaseOperator

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.operators.assets import emit_sink_table_event, sink_table_asset, sink_tables_alias
from sequin_provider.operators.common import load_sequin_config, optional_text
from sequin_provider.pgoutput import int_to_lsn

if TYPE_CHECKING:
    from airflow.sdk import Context


class SequinFreshnessOperator(BaseOperator):
    """Emit a freshness event (``complete_through``) for every sink table that is complete through now.

    :param database: only this database of the config (default: every one).
    :param sequin_conn_id: the ``sequin`` connection (store schema, config path).
    :param config_path: the ``sequin.yaml`` (default: the connection's, else ``SEQUIN_CONFIG``).
    :param wait_timeout: seconds to wait for the stream to pass the mark (a few heartbeat intervals).
    """

    template_fields: Sequence[str] = ("database", "sequin_conn_id", "config_path")
    ui_color = "#fdebd0"

    def __init__(
        self,
        *,
        database: str | None = None,
        sequin_conn_id: str = SequinHook.default_conn_name,
        config_path: str | None = None,
        wait_timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("outlets", [sink_tables_alias()])
        super().__init__(**kwargs)
        self.database = database
        self.sequin_conn_id = sequin_conn_id
        self.config_path = config_path
        self.wait_timeout = wait_timeout

    @cached_property
    def hook(self) -> SequinHook:
        """The ``sequin`` hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    def execute(self, context: Context) -> dict[str, Any]:
        """Measure each database and emit the events; returns ``{database: {complete_through, sinks, behind}}``."""
        config, _ = load_sequin_config(self.hook, self.config_path)
        with airflow_errors():
            name = optional_text(self.database)
            databases = [config.database(name)] if name else list(config.databases)
        summary: dict[str, Any] = {}
        for db in databases:
            sinks = [s for s in config.sinks if s.database == db.name]
            if not sinks:
                continue
            with airflow_errors():
                measured = self.hook.measure_freshness(
                    db.dsn, config.store_dsn(db.name), db.slot.name, [s.name for s in sinks], float(self.wait_timeout)
                )
            at = measured.mark.at.isoformat()
            if measured.confirmed_lsn is None:
                self.log.warning(
                    "database %r: the stream has not passed %s (%s) within %.0fs: no freshness event",
                    db.name,
                    int_to_lsn(measured.mark.lsn),
                    at,
                    float(self.wait_timeout),
                )
            elif measured.behind:
                self.log.warning("database %r: sinks with messages parked before %s: %s", db.name, at, measured.behind)
            for sink in sinks:
                if sink.name not in measured.complete:
                    continue
                for table in sink.tables:
                    extra = {
                        "event": "freshness",
                        "database": db.name,
                        "sink": sink.name,
                        "table": table.qualified,
                        "complete_through": at,
                        "position": measured.mark.lsn,
                        "position_lsn": int_to_lsn(measured.mark.lsn),
                        "confirmed_position": measured.confirmed_lsn,
                    }
                    emit_sink_table_event(context, sink_table_asset(db.name, table.qualified, sink.name), extra)
            summary[db.name] = {
                "complete_through": at if measured.confirmed_lsn is not None else None,
                "sinks": list(measured.complete),
                "behind": list(measured.behind),
            }
        return summary
