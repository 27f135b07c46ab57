"""``SequinBufferRetryOperator``: redeliver due parked messages (the ``sequin buffer retry`` of Airflow).

It calls ``sequin_provider.sinks.retry.retry_sinks``, the function behind the CLI: group by group,
in position order, with the per-sink advisory lock that keeps two retries of a sink from
overlapping (a run that finds the lock held reports the sink as skipped).
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

    from sequin_provider.buffer import RetryReport


def totals(reports: Sequence[RetryReport]) -> dict[str, int]:
    """``{delivered, still_parked, discarded}`` summed over the sinks' reports."""
    return {
        "delivered": sum(r.delivered for r in reports),
        "still_parked": sum(r.still_parked for r in reports),
        "discarded": sum(r.discarded for r in reports),
    }


class SequinBufferRetryOperator(BaseOperator):
    """Retry the due parked messages of ``sink``, or of every sink; returns
    ``{"delivered": n, "still_parked": n, "discarded": n}``.

    :param sink: one sink, or None for all.
    :param sequin_conn_id: the ``sequin`` connection (its ``config_path``).
    :param config_path: the ``sequin.yaml`` (default: the connection's, else ``SEQUIN_CONFIG``).
    :param workers: groups retried in parallel per webhook sink.
    :param fail_on_parked: fail the task while messages stay parked (default: succeed; alert on
        parked messages with ``ParkedMessagesSensor`` instead, so a sink that is down does not turn
        every run red).
    """

    template_fields: Sequence[str] = ("sink", "sequin_conn_id", "config_path")
    ui_color = "#fdebd0"

    def __init__(
        self,
        *,
        sink: str | None = None,
        sequin_conn_id: str = SequinHook.default_conn_name,
        config_path: str | None = None,
        workers: int = 8,
        fail_on_parked: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sink = sink
        self.sequin_conn_id = sequin_conn_id
        self.config_path = config_path
        self.workers = workers
        self.fail_on_parked = fail_on_parked

    @cached_property
    def hook(self) -> SequinHook:
        """The ``sequin`` hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    def execute(self, context: Context) -> dict[str, int]:
        """Run one retry pass and log a line per sink."""
        config, _ = load_sequin_config(self.hook, self.config_path)
        with airflow_errors():
            reports = self.hook.retry_buffer(config, optional_text(self.sink), self.workers)
        for report in reports:
            self.log.info("%s", report.line())
            for error in report.errors:
                self.log.warning("  %s", error)
        result = totals(reports)
        if self.fail_on_parked and result["still_parked"]:
            raise AirflowException(f"{result['still_parked']} messages are still parked after the retry")
        return result
