"""``SequinReplayOperator``: replay retained changes from a changelog sink into a sink (the ``sequin
replay`` of Airflow; docs/replays.md).

It calls ``sequin_provider.replay.replay_changes``, the function behind the CLI: the changes in range
that match the condition are queued in the sink's buffer at the replay's position and delivered by one
retry pass; what the sink refuses stays parked for the ``sequin_retry`` DAG.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.operators.common import load_sequin_config, optional_text

if TYPE_CHECKING:
    from airflow.sdk import Context


class SequinReplayOperator(BaseOperator):
    """Replay the changes ``source`` (a changelog sink) kept into ``sink``; returns ``{"replay_id",
    "queued", "delivered", "still_parked"}``.

    :param source: the changelog sink (``postgres_table`` or ``iceberg`` with ``mode: changelog``).
    :param sink: the sink to deliver them to.
    :param tables: ``schema.table`` names (default: every table both sinks have).
    :param since: commit time (ISO 8601) or position the range starts at (included); templated, e.g.
        ``{{ data_interval_start }}``.
    :param until: where the range ends (excluded).
    :param where: an SQL condition over the changelog's columns.
    :param fail_on_parked: fail the task when messages stay parked after the delivery pass.
    """

    template_fields: Sequence[str] = ("source", "sink", "tables", "since", "until", "where", "config_path")
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        source: str,
        sink: str,
        tables: Sequence[str] | str = (),
        since: str | None = None,
        until: str | None = None,
        where: str | None = None,
        sequin_conn_id: str = SequinHook.default_conn_name,
        config_path: str | None = None,
        workers: int = 8,
        fail_on_parked: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.source, self.sink, self.tables = source, sink, tables
        self.since, self.until, self.where = since, until, where
        self.sequin_conn_id = sequin_conn_id
        self.config_path = config_path
        self.workers = workers
        self.fail_on_parked = fail_on_parked

    @cached_property
    def hook(self) -> SequinHook:
        """The ``sequin`` hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    def execute(self, context: Context) -> dict[str, Any]:
        """Queue and deliver the replay; log its line."""
        from sequin_provider.replay import ReplayRequest

        config, _ = load_sequin_config(self.hook, self.config_path)
        tables = [t.strip() for t in self.tables.split(",")] if isinstance(self.tables, str) else list(self.tables)
        request = ReplayRequest(
            self.source,
            self.sink,
            tuple(t for t in tables if t),
            optional_text(self.since),
            optional_text(self.until),
            optional_text(self.where),
        )
        with airflow_errors():
            result = self.hook.replay_changes(config, request, self.workers)
        self.log.info("%s", result.line())
        delivery = result.delivery
        for error in delivery.errors if delivery else []:
            self.log.warning("  %s", error)
        still = delivery.still_parked if delivery else 0
        if self.fail_on_parked and still:
            raise AirflowException(f"{still} messages are still parked after the replay's delivery")
        return {
            "replay_id": result.replay.id,
            "queued": result.queued,
            "delivered": delivery.delivered if delivery else 0,
            "still_parked": still,
        }
