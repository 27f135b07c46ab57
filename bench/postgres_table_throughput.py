"""postgres_table benchmark: changes/s into a mirror table through the stream app, beside a bulk COPY of
the same rows into a table of the same database (the target's own limit), in the same run.

    .venv/bin/python bench/postgres_table_throughput.py [--changes 200000]

One fresh embedded cluster: ``events`` (bench/stream_throughput.py's table and workload: inserts, then
updates of the same ids, in transactions of 500) mirrored by a ``postgres_table`` sink into a second
database. Prints a Markdown table. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stream_throughput import ROW, TABLE, write_workload  # noqa: E402

from bench.destination_results import record  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402

SUMMARY = "SELECT count(*), sum(amount), max(updated_at) FROM {}"


def mirrored(dsn: str, target: str) -> bool:
    """Whether the mirror holds the source's rows (count, sum of the updated column, last update)."""
    with psycopg.connect(dsn) as a, psycopg.connect(target) as b:
        return a.execute(SUMMARY.format("events")).fetchone() == b.execute(SUMMARY.format("mirror.events")).fetchone()


def copy_limit(dsn: str, target: str, rows: int) -> float:
    """Rows/s of one ``COPY FROM STDIN`` of ``rows`` rows (the workload's values) into a keyed table."""
    with psycopg.connect(dsn) as conn:
        data = io.BytesIO()
        with conn.cursor().copy(f"COPY (SELECT {ROW}, now() FROM generate_series(1, {rows}) g) TO STDOUT") as copy:
            for chunk in copy:
                data.write(chunk)
    with psycopg.connect(target) as conn:
        conn.execute(TABLE.replace("events", "copied"))
        started = time.perf_counter()
        with conn.cursor().copy("COPY copied FROM STDIN") as copy:
            copy.write(data.getvalue())
        conn.commit()
        return rows / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000, help="changes (half inserts, half updates)")
    parser.add_argument("--batch-size", type=int, default=500, help="the sink's batch_size")
    parser.add_argument("--warmup", type=int, default=20_000, help="changes streamed before measuring")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-"))
    with EmbeddedPostgres(use_env_dsn=False) as pg:
        dsn, target = pg.create_database("bench"), pg.create_database("bench_mirror")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(TABLE)
        config_path = work / "sequin.yaml"
        config_path.write_text(f"""
databases:
  - name: bench
    dsn: {dsn}
    slot: {{name: bench_slot}}
    publication: {{name: bench_pub}}
sinks:
  - name: mirror
    tables: [events]
    destination: {{type: postgres_table, dsn: "{target}", table: "mirror.{{table_name}}", create_table: true,
                   batch_size: {args.batch_size}}}
stream: {{checkpoint_location: {work / "ckpt"}}}
""")
        initialize(load_config(config_path))
        app = StreamAppProcess(config_path, work / "app.log").start()
        try:
            app.wait_streaming(dsn)
            if args.warmup:  # the stream app's first batches (Python workers starting) are not measured
                write_workload(dsn, args.warmup, 50_000_001)
                wait_for(lambda: mirrored(dsn, target), 600, interval=0.25, what="the warm-up")
            started, written = write_workload(dsn, args.changes, 1)
            wait_for(lambda: mirrored(dsn, target), 1800, interval=0.25, what="the mirror to equal the source")
            e2e = args.changes / (time.time() - started)
        finally:
            app.stop()
        copy = copy_limit(dsn, target, args.changes)
    record("postgres_table", e2e, copy, "bulk COPY of as many rows into a keyed table")
    print(f"| measurement ({args.changes:,} changes) | per second |")
    print("| --- | ---: |")
    print(f"| postgres_table sink end to end (stream app -> mirror, batch {args.batch_size}) | {e2e:,.0f} changes |")
    print(
        f"| source workload written (inserts then updates, 500 per transaction) | {args.changes / (written - started):,.0f} changes |"
    )
    print(f"| bulk COPY of the same number of rows into a keyed table (the target's limit) | {copy:,.0f} rows |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
