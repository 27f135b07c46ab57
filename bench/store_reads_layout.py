"""What a backfill's reads cost the store, laid out as a row each (today) or as blocks of many reads.

    .venv/bin/python bench/store_reads_layout.py [--rows 1000000] [--block-reads 100 1000] [--runs 3]

A design measurement, not a feature's benchmark: the store's write of a backfill's reads is the
largest part of a served backfill's CPU (docs/performance.md, "Backfills"), and this measures how
much of it is the row per read. On a fresh embedded cluster, ``--rows`` rows of the ``events``
table are read in pages of 50,000 and rendered as a range task renders them for a plain Sequin
Stream sink (``reader.rendered_reads``: compact reads, COPY binary), then written into the store
by two connections at once (two range tasks), each page in its own transaction, in these layouts:
  - ``rows``: every read a row of ``stream_messages``, as the task writes them today (the reference);
  - ``rows without their record``: the same rows with an empty record: what the row alone costs;
  - ``blocks of N``: N reads per row of a scratch table (their group ids, keys and records as three
    arrays, the records compressed as the store compresses its data), built from the rows above;
  - ``rows from blocks of N``: the blocks expanded into rows of ``stream_messages`` later, one
    statement per block (what a receive reaching a block would have to run if consumers were
    still served a row per message).
Each layout runs ``--runs`` times, interleaved, into an emptied table after a checkpoint. Reported
per layout: reads/s (wall), the store backends' CPU per read, the relation's bytes per read (heap,
TOAST and index) and the WAL written per read. Prints a Markdown table and writes
bench/results/store_reads_layout.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.backfill_throughput import seed_events  # noqa: E402 - the same table as the others
from bench.stream_throughput import add_pg_setting_argument  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from sequin_provider.backfill.reader import PageQuery, rendered_reads, table_relation, table_shape  # noqa: E402
from sequin_provider.messages import metadata_tail, read_message_template  # noqa: E402
from sequin_provider.pgoutput import PgOutputDecoder, TypeRegistry  # noqa: E402
from sequin_provider.pq_copy import copy_out_text  # noqa: E402
from sequin_provider.replication import Catalog  # noqa: E402
from sequin_provider.store import READ_MESSAGE_COLUMNS, StoreReads  # noqa: E402
from sequin_provider.store.migrations import migrate  # noqa: E402

PAGE_ROWS = 50_000
"""Reads per page: the backfill's default page ceiling (``reader.DEFAULT_MAX_PAGE_ROWS``)."""
WRITERS = 2
"""Connections writing at once: the two range tasks of a served backfill on 2 cores."""
SCHEMA = "sequin"
BLOCKS_TABLE = f"{SCHEMA}.bench_read_blocks"
BLOCK_COLUMNS = "sink, commit_lsn, first_idx, n, backfill_page, group_ids, keys, records"

Pages = list[bytes]
"""One COPY binary payload (header to trailer) per page."""


def rendered_pages(dsn: str, rows: int) -> Pages:
    """The ``events`` table's reads as a range task renders them, one COPY binary payload per page
    (positions: one commit LSN per page, as each page's read position)."""
    pages: Pages = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        shape = table_shape(conn, "public", "events")
        catalog = Catalog(dsn)
        try:
            decoder = PgOutputDecoder(TypeRegistry(catalog.type_info))
            rel = table_relation(decoder, shape)
            tail = metadata_tail("00000000-0000-0000-0000-000000000000", "events", "bench")
            template = read_message_template("change", "public", "events", "2026-01-01T00:00:00Z", 1, tail)
            cursor: list[str] | None = None
            for page in range(0, rows, PAGE_ROWS):
                n = min(PAGE_ROWS, rows - page)
                data = copy_out_text(conn, PageQuery(shape, shape.primary_key, None, None).sql(cursor, n))
                cursor = [str(page + n)]  # ids are 1..rows
                reads = StoreReads("events", 1, template, "public.events:", 1_000_000 + page, 0)
                pages.append(
                    b"".join(
                        bytes(c) for c in rendered_reads(decoder, rel, data, reads, 1 + page // PAGE_ROWS, n).chunks
                    )
                )
        finally:
            catalog.close()
    return pages


def copied_pages(conn: psycopg.Connection[Any], select: str, pages: int) -> Pages:
    """``select`` (with a ``{page}`` placeholder: the page's id) as one COPY binary payload per page."""
    return [
        bytes(copy_out_text(conn, sql.SQL(f"COPY ({select.format(page=page)}) TO STDOUT (FORMAT binary)")))
        for page in range(1, pages + 1)
    ]


def backend_cpu(pid: int) -> float:
    """A store backend's CPU seconds so far (user + system)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def write(dsn: str, table: str, columns: str, pages: Pages, cpu: list[float]) -> None:
    """COPY ``pages`` into ``table``, each in its own transaction; appends the backend's CPU seconds."""
    with psycopg.connect(dsn) as conn:
        pid = conn.info.backend_pid
        started = backend_cpu(pid)
        for payload in pages:
            with conn.cursor() as cur, cur.copy(f"COPY {table} ({columns}) FROM STDIN (FORMAT binary)") as copy:
                copy.write(payload)
            conn.commit()
        cpu.append(backend_cpu(pid) - started)


def emptied(conn: psycopg.Connection[Any], table: str) -> int:
    """Empty ``table`` and checkpoint; returns the WAL position after."""
    conn.execute(f"TRUNCATE {table}")
    conn.execute("CHECKPOINT")
    return wal_position(conn)


def wal_position(conn: psycopg.Connection[Any]) -> int:
    """The server's current WAL position, in bytes."""
    return int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()[0])


def measured(
    conn: psycopg.Connection[Any], table: str, reads: int, seconds: float, cpu: float, wal_from: int
) -> dict[str, float]:
    """A layout's figures per read: the rate, the backends' ``cpu`` seconds, the relation's size and
    the WAL written since ``wal_from``."""
    wal = wal_position(conn) - wal_from
    size = int(conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()[0])
    return {
        "reads_per_s": reads / seconds,
        "cpu_us_per_read": cpu / reads * 1e6,
        "bytes_per_read": size / reads,
        "wal_bytes_per_read": wal / reads,
    }


def write_layout(store: str, table: str, columns: str, pages: Pages, reads: int) -> dict[str, float]:
    """One run of a layout: ``pages`` written by ``WRITERS`` connections at once into the emptied ``table``."""
    with psycopg.connect(store, autocommit=True) as conn:
        wal_from = emptied(conn, table)
        cpu: list[float] = []
        writers = [
            threading.Thread(target=write, args=(store, table, columns, pages[i::WRITERS], cpu)) for i in range(WRITERS)
        ]
        started = time.monotonic()
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        if len(cpu) != WRITERS:
            raise SystemExit(f"a writer into {table} failed")
        return measured(conn, table, reads, time.monotonic() - started, sum(cpu), wal_from)


def expand_blocks(store: str, blocks: Pages, reads: int) -> dict[str, float]:
    """One run of ``rows from blocks``: the blocks written (not measured), then each expanded into
    rows of ``stream_messages`` and deleted, one statement per block, on one connection."""
    write_layout(store, BLOCKS_TABLE, BLOCK_COLUMNS, blocks, reads)
    with psycopg.connect(store, autocommit=True) as conn:
        wal_from = emptied(conn, f"{SCHEMA}.stream_messages")
        keys = conn.execute(f"SELECT commit_lsn, first_idx FROM {BLOCKS_TABLE} ORDER BY 1, 2").fetchall()
        pid = conn.info.backend_pid
        cpu, started = backend_cpu(pid), time.monotonic()
        for lsn, first in keys:
            conn.execute(
                f"WITH b AS (DELETE FROM {BLOCKS_TABLE} WHERE sink = 'events' AND commit_lsn = %s AND first_idx = %s"
                f" RETURNING *) INSERT INTO {SCHEMA}.stream_messages ({', '.join(READ_MESSAGE_COLUMNS)})"
                " SELECT b.sink, b.commit_lsn, b.first_idx + u.o::integer - 1, u.g, u.k, u.r, b.backfill_page"
                " FROM b, unnest(b.group_ids, b.keys, b.records) WITH ORDINALITY AS u(g, k, r, o)",
                (lsn, first),
            )
        seconds, cpu = time.monotonic() - started, backend_cpu(pid) - cpu
        result = measured(conn, f"{SCHEMA}.stream_messages", reads, seconds, cpu, wal_from)
        stored = conn.execute(f"SELECT count(*) FROM {SCHEMA}.stream_messages").fetchone()[0]
    if stored != reads:
        raise SystemExit(f"expanding the blocks made {stored} rows of {reads} reads")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of events, one read each")
    parser.add_argument("--block-reads", type=int, nargs="+", default=[100, 1000], metavar="N")
    parser.add_argument("--runs", type=int, default=3)
    add_pg_setting_argument(parser)
    args = parser.parse_args()
    rows, pages = args.rows, -(-args.rows // PAGE_ROWS)
    message_columns = ", ".join(READ_MESSAGE_COLUMNS)
    layouts: dict[str, Any] = {}
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        source, store = pg.create_database("bench"), pg.create_database("bench_store")
        seed_events(source, rows)
        print(f"bench: rendering {rows:,} reads in {pages} pages", flush=True)
        as_rows = rendered_pages(source, rows)
        with psycopg.connect(store, autocommit=True) as conn:
            migrate(conn, SCHEMA)
            conn.execute(
                f"CREATE TABLE {BLOCKS_TABLE} (sink text NOT NULL, commit_lsn bigint NOT NULL, first_idx integer NOT NULL,"
                " n integer NOT NULL, backfill_page bigint NOT NULL, group_ids text[] NOT NULL, keys text[] NOT NULL,"
                " records text[] NOT NULL, PRIMARY KEY (sink, commit_lsn, first_idx))"
            )
            compression = conn.execute(
                "SELECT attcompression FROM pg_attribute WHERE attrelid = %s::regclass AND attname = 'data'",
                (f"{SCHEMA}.stream_messages",),
            ).fetchone()
            if compression and compression[0] == "l":  # as the store's data column (migration 19)
                conn.execute(f"ALTER TABLE {BLOCKS_TABLE} ALTER COLUMN records SET COMPRESSION lz4")
            write_layout(store, f"{SCHEMA}.stream_messages", message_columns, as_rows, rows)
            layout_pages: dict[str, tuple[str, str, Pages]] = {
                "rows": (f"{SCHEMA}.stream_messages", message_columns, as_rows),
                "rows without their record": (
                    f"{SCHEMA}.stream_messages",
                    message_columns,
                    copied_pages(
                        conn,
                        "SELECT "
                        + ", ".join("''" if c == "data" else c for c in READ_MESSAGE_COLUMNS)
                        + f" FROM {SCHEMA}.stream_messages"
                        " WHERE backfill_page = {page} ORDER BY commit_idx",
                        pages,
                    ),
                ),
            }
            for n in args.block_reads:
                layout_pages[f"blocks of {n}"] = (
                    BLOCKS_TABLE,
                    BLOCK_COLUMNS,
                    copied_pages(
                        conn,
                        "SELECT sink, commit_lsn, min(commit_idx), count(*)::integer, backfill_page,"
                        " array_agg(group_id ORDER BY commit_idx), array_agg(idempotency_key ORDER BY commit_idx),"
                        f" array_agg(data ORDER BY commit_idx) FROM {SCHEMA}.stream_messages WHERE backfill_page = {{page}}"
                        f" GROUP BY sink, commit_lsn, backfill_page, (commit_idx - 1) / {n} ORDER BY 3",
                        pages,
                    ),
                )
        for run in range(args.runs):
            for name, (table, columns, payloads) in layout_pages.items():
                result = write_layout(store, table, columns, payloads, rows)
                layouts.setdefault(name, []).append(result)
                print(
                    f"bench: run {run + 1}, {name}: {result['reads_per_s']:,.0f} reads/s, {result['cpu_us_per_read']:.2f} µs",
                    flush=True,
                )
                if name.startswith("blocks of "):
                    result = expand_blocks(store, payloads, rows)
                    layouts.setdefault(f"rows from {name}", []).append(result)
                    print(f"bench: run {run + 1}, rows from {name}: {result['cpu_us_per_read']:.2f} µs", flush=True)
    print(
        f"\n{rows:,} reads of `events` into the store, {WRITERS} writers (rows from blocks: one), median of {args.runs} (min–max):\n"
    )
    print("| layout | reads/s | store backends, µs of CPU per read | bytes per read (relation) | WAL bytes per read |")
    print("|---|---:|---:|---:|---:|")
    summary: dict[str, dict[str, float]] = {}
    for name, results in layouts.items():
        cells = []
        for key in ("reads_per_s", "cpu_us_per_read", "bytes_per_read", "wal_bytes_per_read"):
            values = [r[key] for r in results]
            summary.setdefault(name, {})[key] = statistics.median(values)
            fmt = "{:,.0f}" if key != "cpu_us_per_read" else "{:.2f}"
            cells.append(
                f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    out = ROOT / "bench" / "results" / "store_reads_layout.json"
    out.write_text(
        json.dumps(
            {
                "rows": rows,
                "runs": args.runs,
                "writers": WRITERS,
                "pg_settings": dict(args.pg_setting),
                "run_at": time.strftime("%Y-%m-%d %H:%M"),
                "median": summary,
                "runs_by_layout": layouts,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
