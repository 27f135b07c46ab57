"""``SequinBackfillServerOperator``: run the backfill server of a database and keep it alive (DESIGN §7, §10).

The backfill server (``spark_apps/backfill.py --serve``, what ``sequin backfill serve`` runs) keeps
one Spark app up and runs each recorded backfill of its database as a job of it, so a backfill pays
no Spark start. While it is up it holds its lock in the store (``backfill.server_lock``), and
``SequinBackfillOperator`` and ``sequin backfill start`` then hand it their backfills instead of
submitting an app of their own.

Supervised as ``SequinReplicationOperator`` supervises the stream app (``SupervisedAppOperator``):
one supervisor per database (its own advisory lock), restarts on exit or stall with an exponential
backoff, bounded, ``on_kill`` stops it cleanly (a backfill in progress stays ``running`` with its
cursors and the next server resumes it). The server records no heartbeat: its sign of life is its
lock seen held, so a server that never takes it (stuck starting) or loses it (its store connection
gone: backfills would no longer go to it) counts as stalled and is restarted. An exit with code 2
(bad input) or 3 (another server serves the database) is not restarted: the task fails with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sequin_provider.operators.supervised import SupervisedAppOperator
from sequin_provider.supervision import AppRun, BackfillServerSupervisorLock

if TYPE_CHECKING:
    from pathlib import Path

    from sequin_provider.operators.spark_submit import SparkTarget

FATAL_EXITS = {
    2: "bad input (the config or an argument; see the app's log)",
    3: "another backfill server serves the database",
}
"""Exit codes of ``backfill.py --serve`` that a restart cannot fix."""


class SequinBackfillServerOperator(SupervisedAppOperator):
    """Run and supervise the backfill server of one database until the task is stopped.

    The parameters are ``SupervisedAppOperator``'s (database, connections, timeouts, restart budget,
    ``run_for``, Spark settings), and:

    :param serve_poll_interval: seconds between the server's looks for new backfills when no
        ``NOTIFY`` wakes it (the app's ``--poll-interval``; default: the app's, 1 s).
    :param ranges: key ranges a backfill reads in parallel (default: Spark's parallelism).
    :param max_page_rows: page size ceiling.
    :param window_timeout: seconds a backfill waits for the stream app to take a page.

    ``stall_timeout`` counts seconds without the server's lock seen held.
    """

    app_title = "backfill server"
    app_file = "backfill.py"
    submit_name = "sequin-backfill-server"
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        serve_poll_interval: float | None = None,
        ranges: int | None = None,
        max_page_rows: int | None = None,
        window_timeout: float | None = None,
        driver_memory: str | None = "4g",
        **kwargs: Any,
    ) -> None:
        super().__init__(driver_memory=driver_memory, **kwargs)
        self.serve_poll_interval = serve_poll_interval
        self.ranges = ranges
        self.max_page_rows = max_page_rows
        self.window_timeout = window_timeout

    def supervisor_lock(self, database: str, application_name: str) -> BackfillServerSupervisorLock:
        """The lock "one supervised backfill server of ``database``"; its sign of life is the server's lock."""
        return self.hook.backfill_server_supervisor_lock(database, application_name)

    def app_arguments(self, config_path: Path, database: str, target: SparkTarget) -> list[str]:
        """``--config``, ``--serve``, ``--database``, ``--master`` and the optional settings."""
        args = ["--config", str(config_path), "--serve", "--database", database, "--master", target.master]
        for flag, value in (
            ("--poll-interval", self.serve_poll_interval),
            ("--ranges", self.ranges),
            ("--max-page-rows", self.max_page_rows),
            ("--window-timeout", self.window_timeout),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args

    def fatal(self, run: AppRun) -> str | None:
        """Exit codes 2 and 3 (``FATAL_EXITS``) are not restarted."""
        return FATAL_EXITS.get(run.returncode) if run.returncode is not None else None
