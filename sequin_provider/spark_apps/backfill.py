"""spark-submit entry point of the backfill batch app (DESIGN §7).

    spark-submit <APPS_DIR>/backfill.py --config sequin.yaml --backfill-id 7
    spark-submit <APPS_DIR>/backfill.py --config sequin.yaml --serve [--database NAME]

``<APPS_DIR>`` is ``sequin_provider/spark_apps`` in the installed package
(``python -c 'import sequin_provider.spark_apps as a; print(a.APPS_DIR)'``); in a source checkout,
``spark_apps/backfill.py`` is a shim calling ``main``.

Runs (or resumes) a recorded backfill to its end; with ``--serve``, stays up and runs each backfill
as it is recorded (``sequin backfill serve``). Only parses arguments and calls into the package.
Exit code 0: completed (``--serve``: stopped); 1: not completed (failed, cancelled, or stopped because
its supervisor, ``$SEQUIN_SUPERVISOR_PID``, is gone); 2: bad input; 3: another app is running this
backfill (left as it is), or (``--serve``) another server serves the database.
"""

from __future__ import annotations

import argparse
import sys

from sequin_provider.backfill import SERVE_POLL_INTERVAL
from sequin_provider.backfill.control import DEFAULT_MAX_PAGE_ROWS, DEFAULT_WINDOW_TIMEOUT
from sequin_provider.spark.backfill_app import run_backfill_app, run_backfill_server_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sequin backfill app")
    parser.add_argument("--config", default=None, help="sequin.yaml (default: $SEQUIN_CONFIG or ./sequin.yaml)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--backfill-id", type=int, help="the backfill to run (sequin backfill start --no-run)")
    target.add_argument("--serve", action="store_true", help="stay up and run each backfill as it is recorded")
    parser.add_argument("--database", default=None, help="--serve: only this database's backfills")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=SERVE_POLL_INTERVAL,
        help="--serve: seconds between looks for new backfills",
    )
    parser.add_argument("--master", default=None, help="Spark master when not given by spark-submit")
    parser.add_argument("--ranges", type=int, default=None, help="key ranges read in parallel (default: parallelism)")
    parser.add_argument("--max-page-rows", type=int, default=DEFAULT_MAX_PAGE_ROWS)
    parser.add_argument("--window-timeout", type=float, default=DEFAULT_WINDOW_TIMEOUT)
    args = parser.parse_args(argv)
    if args.serve:
        return run_backfill_server_app(
            args.config,
            args.database,
            args.master,
            args.poll_interval,
            args.ranges,
            args.max_page_rows,
            args.window_timeout,
        )
    return run_backfill_app(
        args.config, args.backfill_id, args.master, args.ranges, args.max_page_rows, args.window_timeout
    )


if __name__ == "__main__":
    sys.exit(main())
