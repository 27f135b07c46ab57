"""Backfills: a table's existing rows sent to a sink as reads (DESIGN §7, reference/000 and 004).

- ``control``: what needs neither Spark nor Airflow to request and run one: ``plan_backfill`` /
  ``create_backfill`` (validate and record), ``PageSizeOptimizer`` (keyset page sizes from a query
  budget), the run and server locks, placement and ``follow_backfill``, ``progress_line`` (with
  ``backfill_rate`` and ``backfill_eta_seconds``, the numbers of the Airflow view). Its public
  names are re-exported here (``from sequin_provider.backfill import create_backfill``).
- ``reader``: reading a backfill's rows: key ranges, keyset pages, the page protocol (``RangeReader``).
- ``row_filter``: a backfill's optional SQL condition (``--where``): checked lexically and by the
  source before it is recorded, AND-ed in parentheses into every page.
- ``source_sql``: a page rendered by the source's own SQL, byte for byte the decoder's record JSON.
- ``watermarks``: the watermark window protocol between pages and the change stream.

The store's side (the backfills table, ranges and pages) is ``store.backfills`` and
``store.backfill_pages``; the Spark app is ``spark.backfill_app``. ``reader``, ``source_sql`` and
``watermarks`` are imported from their modules, so importing this package (as the Airflow operators,
hooks and triggers do) does not load the readers' dependencies.
"""

from __future__ import annotations

from sequin_provider.backfill.control import (
    DEFAULT_MAX_PAGE_ROWS,
    DEFAULT_MAX_QUERY_MS,
    DEFAULT_PAGES_IN_FLIGHT,
    DEFAULT_WINDOW_TIMEOUT,
    FOLLOW_POLL_INTERVAL,
    FOLLOW_PROGRESS_INTERVAL,
    MIN_SERVER_VERSION,
    RUN_LOCK_WAIT,
    SERVE_POLL_INTERVAL,
    SERVER_CHECK_INTERVAL,
    BackfillBusy,
    BackfillPlan,
    PageObservation,
    PageSizeOptimizer,
    Placement,
    backfill_eta_seconds,
    backfill_rate,
    check_backfill_source,
    create_backfill,
    create_initial_backfills,
    follow_backfill,
    place_backfill,
    plan_backfill,
    progress_line,
    run_lock,
    run_lock_holder,
    server_lock,
)

__all__ = [
    "DEFAULT_MAX_PAGE_ROWS",
    "DEFAULT_MAX_QUERY_MS",
    "DEFAULT_PAGES_IN_FLIGHT",
    "DEFAULT_WINDOW_TIMEOUT",
    "FOLLOW_POLL_INTERVAL",
    "FOLLOW_PROGRESS_INTERVAL",
    "MIN_SERVER_VERSION",
    "RUN_LOCK_WAIT",
    "SERVER_CHECK_INTERVAL",
    "SERVE_POLL_INTERVAL",
    "BackfillBusy",
    "BackfillPlan",
    "PageObservation",
    "PageSizeOptimizer",
    "Placement",
    "backfill_eta_seconds",
    "backfill_rate",
    "check_backfill_source",
    "create_backfill",
    "create_initial_backfills",
    "follow_backfill",
    "place_backfill",
    "plan_backfill",
    "progress_line",
    "run_lock",
    "run_lock_holder",
    "server_lock",
]
