"""A backfill page's read, CPU per row: psycopg's ``Copy.read()`` beside ``pq_copy.copy_out_text``.

    .venv/bin/python bench/page_read.py [--rows 50000] [--runs 6]

On a fresh embedded cluster, the ``events`` table of the stream and backfill benchmarks; one page of
``--rows`` rows (a range task's ``PageQuery.sql``, what ``RangeReader`` reads for a plain Sequin
Stream sink) read ``--runs`` times each way, interleaved, and this process's CPU time per row taken
around each read (``resource.getrusage``: the reading process's own work, not the server's):
  - psycopg's ``Copy.read()``, one row per call (the reference, and the way pages were read before);
  - ``copy_out_text`` with its reference loop of ``get_copy_data`` (``compiled=False``);
  - ``copy_out_text`` through the compiled ``copy_out_into`` (the default);
  - and, beside them, rendering the page's reads (``reader.rendered_reads``, compiled), the task's
    other work on the same page.
Every way must return the same bytes (checked). Prints a Markdown table and writes
bench/results/page_read.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stream_throughput import ROW, TABLE, add_pg_setting_argument  # noqa: E402 - the same table as the others
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from sequin_provider.backfill.reader import (  # noqa: E402
    PageQuery,
    page_end,
    rendered_reads,
    table_relation,
    table_shape,
)
from sequin_provider.messages import metadata_tail, read_message_template  # noqa: E402
from sequin_provider.pgoutput import PgOutputDecoder, TypeRegistry  # noqa: E402
from sequin_provider.pq_copy import copy_out_text, psycopg_copy_out  # noqa: E402
from sequin_provider.replication import Catalog  # noqa: E402
from sequin_provider.store import StoreReads  # noqa: E402


def cpu_seconds() -> float:
    """This process's CPU time (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000, help="rows in the page (the default page ceiling)")
    parser.add_argument("--runs", type=int, default=6)
    add_pg_setting_argument(parser)
    args = parser.parse_args()
    per_row: dict[str, list[float]] = {}
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        dsn = pg.create_database("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(TABLE)
            conn.execute(
                f"INSERT INTO events (id, account, amount, kind, payload) SELECT {ROW} FROM generate_series(1, {args.rows}) g"
            )
            conn.execute("VACUUM ANALYZE events")
            shape = table_shape(conn, "public", "events")
            catalog = Catalog(dsn)
            try:
                decoder = PgOutputDecoder(TypeRegistry(catalog.type_info))
                rel = table_relation(decoder, shape)
                query = PageQuery(shape, shape.primary_key, None, None).sql(None, args.rows)
                tail = metadata_tail("00000000-0000-0000-0000-000000000000", "events", "bench")
                template = read_message_template("change", "public", "events", "2026-01-01T00:00:00Z", 1, tail)
                reads = StoreReads("events", 1, template, "public.events:", 1_000_000, 0)
                expected = bytes(psycopg_copy_out(conn, query))
                ways: dict[str, Callable[[], Any]] = {
                    "psycopg's Copy.read(), one row per call": lambda: psycopg_copy_out(conn, query),
                    "copy_out_text, reference loop of get_copy_data": lambda: copy_out_text(conn, query, False),
                    "copy_out_text, compiled copy_out_into": lambda: copy_out_text(conn, query, True),
                }
                for _ in range(args.runs):
                    for name, read in ways.items():
                        started = cpu_seconds()
                        data = read()
                        per_row.setdefault(name, []).append((cpu_seconds() - started) / args.rows * 1e6)
                        if bytes(data) != expected:
                            raise SystemExit(f"{name} read other bytes than psycopg's COPY")
                    rows, _ = page_end(expected, [0])
                    started = cpu_seconds()
                    for _chunk in rendered_reads(decoder, rel, expected, reads, 1, rows).chunks:
                        pass
                    per_row.setdefault("(rendering the page's reads, for comparison)", []).append(
                        (cpu_seconds() - started) / args.rows * 1e6
                    )
            finally:
                catalog.close()
    print(f"\nA page of {args.rows:,} rows of `events`, {args.runs} runs each, interleaved; this process's CPU:\n")
    print("| way | µs of CPU per row: median (min–max) |\n|---|---:|")
    for name, values in per_row.items():
        print(f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) |")
    out = ROOT / "bench" / "results" / "page_read.json"
    out.write_text(
        json.dumps(
            {"rows": args.rows, "runs": args.runs, "pg_settings": dict(args.pg_setting), "cpu_us_per_row": per_row},
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
