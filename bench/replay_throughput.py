"""Replay benchmark: changes/s of ``sequin replay`` from a Postgres changelog into a webhook, beside the
endpoint's own limit for requests of one message (the way the buffer's retry sends them).

    .venv/bin/python bench/replay_throughput.py [--changes 20000]

One fresh embedded cluster: a changelog table (``postgres_table`` in ``mode: changelog``) filled with
``--changes`` change rows of 4,000 rows (inserts, then updates), replayed whole into a ``webhook`` sink
whose endpoint is a minimal local HTTP server (``bench/delivery_throughput.py``'s). Measures the queueing
(reading, rendering, parking in the buffer) and the delivery (one retry run, 8 groups at a time), and
the endpoint alone taking one message per request from 8 threads. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.delivery_throughput import answers, free_port, serve_counter, server_limit  # noqa: E402
from bench.stream_throughput import TABLE  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.stream_process import wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.replay import ReplayRequest, queue_replay  # noqa: E402
from sequin_provider.sinks.postgres_changelog import create_changelog  # noqa: E402
from sequin_provider.sinks.retry import retry_sinks  # noqa: E402

ROWS = 4_000
FILL = """
INSERT INTO cdc.changes SELECT 1000 + g / 500, g % 500, CASE WHEN g < {rows} THEN 'insert' ELSE 'update' END,
  (1000 + g / 500) || ':' || (g % 500), 'public', 'events', now() - interval '1 hour', ARRAY[(g % {rows})::text],
  json_build_object('id', g % {rows}, 'account', g % 1000, 'amount', (g % 10000) / 100.0, 'kind', 'kind-' || (g % 7),
                    'payload', json_build_object('n', g, 'tag', md5(g::text)), 'updated_at', now()),
  CASE WHEN g < {rows} THEN NULL ELSE json_build_object('amount', 0) END
FROM generate_series(0, {last}) g
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=5.0, help="the endpoint's own limit: seconds of posting")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-replay-"))
    port = free_port()
    server = mp.get_context("spawn").Process(target=serve_counter, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/hook"
    try:
        wait_for(lambda: answers(url), 30, what="the endpoint")
        with EmbeddedPostgres(use_env_dsn=False) as pg:
            dsn, log_dsn = pg.create_database("bench"), pg.create_database("bench_log")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(TABLE)
            with psycopg.connect(log_dsn, autocommit=True) as conn:
                create_changelog(conn, "cdc.changes")
                conn.execute(FILL.format(rows=ROWS, last=args.changes - 1))
            config_path = work / "sequin.yaml"
            sinks = sink("log", f'{{type: postgres_table, mode: changelog, dsn: "{log_dsn}", table: cdc.changes}}')
            sinks += sink("hook", f'{{type: webhook, url: "{url}", batch: false}}')
            config_path.write_text(app_config(dsn, sinks, work / "ckpt"))
            config = load_config(config_path)
            before = int(httpx.get(url, timeout=10).text)
            started = time.monotonic()
            result = queue_replay(config, ReplayRequest("log", "hook"))
            queued = time.monotonic()
            (report,) = retry_sinks(config, "hook")
            done = time.monotonic()
            received = int(httpx.get(url, timeout=10).text) - before
            if result.queued != args.changes or report.delivered != args.changes or received != args.changes:
                raise SystemExit(f"queued {result.queued}, delivered {report.delivered}, received {received}")
        limit = server_limit(url, 1, args.seconds)
    finally:
        server.terminate()
    queue_rate, deliver_rate = args.changes / (queued - started), args.changes / (done - queued)
    print()
    print(f"| replay of {args.changes:,} changes ({ROWS:,} rows) into a webhook | changes/s |")
    print("|---|---:|")
    print(f"| queueing: changelog read, rendered, parked in the buffer | {queue_rate:,.0f} |")
    print(f"| delivery: one retry run, one message per request, 8 groups at a time | {deliver_rate:,.0f} |")
    print(f"| the whole replay | {args.changes / (done - started):,.0f} |")
    print(f"| the endpoint alone, one message per request from 8 threads | {limit:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
