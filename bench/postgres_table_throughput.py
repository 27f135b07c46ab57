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
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stream_throughput import (  # noqa: E402
    ROW,
    TABLE,
    backend_database,
    cpu_by_class,
    cpu_delta,
    print_cpu_by_class,
    process_class,
    write_workload,
)

from bench.app_config import app_config, sink  # noqa: E402
from bench.destination_results import record  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402

SUMMARY = "SELECT count(*), sum(amount), max(updated_at) FROM {}"
LAST_ROW = "SELECT id, amount, updated_at FROM {0} WHERE id = (SELECT max(id) FROM {0})"


MIRROR_BACKENDS = "postgres: mirror backends (the sink's upserts)"


def classify(proc: Any) -> str | None:
    """``stream_throughput.process_class``, the mirror database's backends on their own."""
    klass = process_class(proc)
    if klass is not None and klass.startswith("postgres"):
        try:
            if backend_database(" ".join(proc.cmdline())) == "bench_mirror":
                return MIRROR_BACKENDS
        except Exception:  # noqa: BLE001  # the process ended: classed as it was
            return klass
    return klass


class Mirrored:
    """Whether the mirror holds the source's rows (count, sum of the updated column, last update),
    on two kept connections, the full comparison only once the row of the highest id matches: a
    poll that scanned both tables on new connections every 250 ms took about a tenth of the CPU
    the pipeline had (13-18 us per change)."""

    def __init__(self, dsn: str, target: str) -> None:
        self.source = psycopg.connect(dsn, autocommit=True)
        self.mirror = psycopg.connect(target, autocommit=True)

    def __call__(self) -> bool:
        if (
            self.source.execute(LAST_ROW.format("events")).fetchone()
            != self.mirror.execute(LAST_ROW.format("mirror.events")).fetchone()
        ):
            return False
        return (
            self.source.execute(SUMMARY.format("events")).fetchone()
            == self.mirror.execute(SUMMARY.format("mirror.events")).fetchone()
        )

    def close(self) -> None:
        self.source.close()
        self.mirror.close()


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
        destination = (
            f'{{type: postgres_table, dsn: "{target}", table: "mirror.{{table_name}}", create_table: true,'
            f" batch_size: {args.batch_size}}}"
        )
        config_path.write_text(app_config(dsn, sink("mirror", destination), work / "ckpt"))
        initialize(load_config(config_path))
        app = StreamAppProcess(config_path, work / "app.log").start()
        mirrored = Mirrored(dsn, target)
        try:
            app.wait_streaming(dsn)
            if args.warmup:  # the stream app's first batches (Python workers starting) are not measured
                write_workload(dsn, args.warmup, 50_000_001)
                wait_for(mirrored, 600, interval=0.25, what="the warm-up")
            before = cpu_by_class(classify)
            started, written = write_workload(dsn, args.changes, 1)
            wait_for(mirrored, 1800, interval=0.25, what="the mirror to equal the source")
            e2e = args.changes / (time.time() - started)
            cpu = cpu_delta(before, cpu_by_class(classify))
        finally:
            mirrored.close()
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
    print("\nCPU per change, by process, end to end:")
    print_cpu_by_class(cpu, args.changes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
