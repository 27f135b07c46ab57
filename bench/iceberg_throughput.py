"""Iceberg sink benchmark: changes/s through the stream app into Iceberg (changelog, then mirror),
beside a plain pyiceberg append of the same number of rows.

    .venv/bin/python bench/iceberg_throughput.py [--changes 50000]

One run on a fresh embedded cluster: the ``events`` workload of bench/stream_throughput.py (inserts
then updates in 500-row transactions), (a) into a ``changelog`` sink and (b) into a ``mirror`` sink, each
timed from the first commit to the table's recorded position reaching the workload's last message;
(c) pyiceberg alone: ``append`` of the same number of changelog-shaped rows in chunks of
``stream.max_batch_rows`` (one commit each), the native limit. Catalog in the cluster, warehouse in a
temporary folder. Prints a Markdown table. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.destination_results import record  # noqa: E402
from bench.stream_throughput import ROW, TABLE, write_workload  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.sqlalchemy_url import sqlalchemy_url  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.sinks.iceberg_rows import changelog_schema  # noqa: E402
from sequin_provider.sinks.iceberg_tables import open_catalog  # noqa: E402


def stream_run(pg: EmbeddedPostgres, work: Path, mode: str, changes: int, warmup: int = 0) -> tuple[float, int]:
    """Changes/s of the stream app into an Iceberg sink of ``mode`` (after ``warmup`` changes not
    measured), and the table's snapshots."""
    dsn = pg.create_database(f"bench_{mode}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)
    config_path = work / f"{mode}.yaml"
    catalog = sqlalchemy_url(dsn)
    destination = f'{{type: iceberg, catalog: {{uri: "{catalog}", warehouse: "file://{work}/{mode}"}}, mode: {mode}}}'
    config_path.write_text(
        app_config(
            dsn, sink("lake", destination), work / f"ckpt_{mode}", slot=f"bench_{mode}", publication=f"bench_{mode}"
        )
    )
    config = load_config(config_path)
    initialize(config)
    options = config.sink("lake").destination.options
    app = StreamAppProcess(config_path, work / f"{mode}.log").start()
    try:
        app.wait_streaming(dsn)
        cat = open_catalog(options)

        def run(count: int, first_id: int, marker: int, rows_before: int) -> float:
            """Changes/s of ``count`` changes, to a last row (``marker``) in the table."""
            started, _ = write_workload(dsn, count, first_id)
            with psycopg.connect(dsn, autocommit=True) as conn:  # a last row: batches are applied in order
                conn.execute(
                    f"INSERT INTO events (id, account, amount, kind, payload) SELECT {ROW} FROM (SELECT {marker} g) s"
                )

            def done() -> bool:
                try:
                    table = cat.load_table(options.identifier("public", "events"))
                except Exception:  # noqa: BLE001 - not created yet
                    return False
                if mode == "mirror":
                    return table.scan(row_filter=f"id = {marker}").count() == 1
                return table.scan().count() >= rows_before + count + 1

            wait_for(done, 1800, interval=0.2, what=f"the {mode} table to catch up")
            return count / (time.time() - started)

        if warmup:  # the stream app's first batches (Python workers starting) are not measured
            run(warmup, 50_000_001, -2, 0)
        rate = run(changes, 1, -1, warmup + 1 if warmup else 0)
        snapshots = len(cat.load_table(options.identifier("public", "events")).snapshots())
        return rate, snapshots
    finally:
        app.stop()


def plain_append(pg: EmbeddedPostgres, work: Path, rows: int, chunk: int) -> float:
    """Rows/s of pyiceberg appending changelog rows in ``chunk``-row commits."""
    import pyarrow as pa
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    from sequin_provider.sinks.iceberg import IcebergOptions
    from sequin_provider.sinks.routing import Route

    dsn = pg.create_database("bench_plain")
    options = IcebergOptions(
        catalog_uri=sqlalchemy_url(dsn),
        warehouse=f"file://{work}/plain",
        table=Route("plain"),
    )
    catalog = open_catalog(options)
    catalog.create_namespace_if_not_exists("sequin")
    table = catalog.create_table(("sequin", "plain"), changelog_schema())
    arrow_schema = schema_to_pyarrow(table.schema(), include_field_ids=False)
    now = datetime.now(timezone.utc)
    started = time.time()
    for lo in range(0, rows, chunk):
        n = min(chunk, rows - lo)
        record = '{"id": 1, "account": 1, "amount": 1.00, "kind": "kind-1", "payload": {"n": 1}}'
        batch = pa.Table.from_pydict(
            {
                "commit_lsn": list(range(lo, lo + n)),
                "commit_idx": [0] * n,
                "action": ["update"] * n,
                "idempotency_key": [f"{i}:0" for i in range(lo, lo + n)],
                "table_schema": ["public"] * n,
                "table_name": ["events"] * n,
                "commit_timestamp": [now] * n,
                "record_pks": [["1"]] * n,
                "record": [record] * n,
                "changes": [None] * n,
            },
            schema=arrow_schema,
        )
        table.append(batch)
    return rows / (time.time() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--warmup", type=int, default=20_000, help="changes streamed before measuring")
    parser.add_argument("--chunk", type=int, default=10_000, help="rows per plain append (about one micro-batch)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sequin-iceberg-bench-"))
    with EmbeddedPostgres(use_env_dsn=False) as pg:
        plain = plain_append(pg, work, args.changes, args.chunk)
        print(f"bench: plain pyiceberg append {plain:,.0f} rows/s", flush=True)
        changelog, changelog_snaps = stream_run(pg, work, "changelog", args.changes, args.warmup)
        print(f"bench: changelog {changelog:,.0f} changes/s", flush=True)
        mirror, mirror_snaps = stream_run(pg, work, "mirror", args.changes, args.warmup)
        print(f"bench: mirror {mirror:,.0f} changes/s", flush=True)
    record("iceberg", changelog, plain, f"pyiceberg append alone, {args.chunk:,} rows per commit", mirror=mirror)
    print()
    print(f"| path ({args.changes:,} changes) | changes/s | snapshots |")
    print("|---|---|---|")
    print(
        f"| pyiceberg append alone, {args.chunk:,} rows per commit | {plain:,.0f} | {-(-args.changes // args.chunk)} |"
    )
    print(f"| stream app -> iceberg changelog | {changelog:,.0f} | {changelog_snaps} |")
    print(f"| stream app -> iceberg mirror | {mirror:,.0f} | {mirror_snaps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
