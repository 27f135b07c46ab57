"""One huge transaction through the stream app: peak memory and throughput beside pg_recvlogical.

    .venv/bin/python bench/large_transaction.py [--rows 200000 2000000 10000000] [--batch-rows 200000]

For each size, on a fresh embedded cluster: load the rows (not measured), then ``UPDATE`` every one
of them in one transaction, and measure
  (a) pg_recvlogical streaming that transaction from its own pgoutput slot: the decode limit;
  (b) the stream app (Sequin Stream sink) from the UPDATE's commit to its last row durable in the
      store, and the peak resident memory of all the app's processes (driver, JVM, Python
      workers) while it streamed.
Before the reader cut open transactions into chunks it held every row of one until its commit
(~1.6 KB of RAM per row); now the peak is set by ``stream.max_batch_rows``, not by the transaction.
Prints a Markdown table and writes bench/results/large_transaction.json. Not a test: no thresholds.
``make soak`` runs it at 200,000, 2,000,000 and 10,000,000 rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stream_throughput import current_lsn, run_pg_recvlogical, sink_count  # noqa: E402

from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.process_memory import PeakRss, tree_rss  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.replication import create_slot  # noqa: E402


def run_one(rows: int, batch_rows: int, work: Path) -> dict[str, float]:
    """One size on a fresh cluster: the figures of (a) and (b)."""
    with EmbeddedPostgres() as pg:
        dsn = pg.create_database("source")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, sku text NOT NULL)")
            conn.execute("CREATE PUBLICATION bench_pub FOR TABLE items")
        config = work / f"sequin-{rows}.yaml"
        config.write_text(f"""
databases:
  - name: shop
    dsn: {dsn}
    slot: {{name: stream_slot}}
    publication: {{name: bench_pub}}
    heartbeat_interval: 1s
sinks:
  - name: items
    tables: [items]
    destination: {{type: sequin_stream}}
stream:
  checkpoint_location: {work / f"ckpt-{rows}"}
  max_batch_rows: {batch_rows}
""")
        initialize(load_config(config))
        app = StreamAppProcess(config, work / f"app-{rows}.log").start()
        try:
            app.wait_streaming(dsn)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"INSERT INTO items SELECT g, 0, 'sku-' || g FROM generate_series(1, {rows}) g")
            wait_for(lambda: sink_count(dsn) >= rows, 3600, 1.0, "the load in the sink")
            with psycopg.connect(dsn, autocommit=True) as conn:
                create_slot(conn, "recv_slot")
            idle_rss = sum(tree_rss(app.proc.pid).values())  # type: ignore[union-attr]
            with PeakRss(app.proc.pid) as sampler:  # type: ignore[union-attr]
                started = time.monotonic()
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("UPDATE items SET qty = qty + 1")
                committed = time.monotonic()
                end_lsn = current_lsn(dsn)

                def done() -> bool:
                    app.check_alive()
                    return sink_count(dsn) >= 2 * rows

                wait_for(done, 7200, 0.2, "the transaction in the sink")
            finished = time.monotonic()
        finally:
            app.stop()
        recv_seconds = run_pg_recvlogical(dsn, "recv_slot", end_lsn)
    return {
        "rows": rows,
        "update_seconds": committed - started,
        "stream_seconds": finished - committed,
        "stream_rows_per_s": rows / (finished - committed),
        "pg_recvlogical_seconds": recv_seconds,
        "pg_recvlogical_rows_per_s": rows / recv_seconds,
        "idle_rss_mib": idle_rss / 2**20,
        "peak_rss_mib": max(sampler.peak, idle_rss) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[200_000, 2_000_000])
    parser.add_argument("--batch-rows", type=int, default=200_000, help="stream.max_batch_rows (the default)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="sequin-large-txn-") as tmp:
        for rows in args.rows:
            results.append(run_one(rows, args.batch_rows, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    lines = [
        "| rows in one transaction | stream app rows/s (commit -> all durable) | pg_recvlogical rows/s | "
        "ratio | app RSS idle | app RSS peak |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']:,} | {r['stream_rows_per_s']:,.0f} | {r['pg_recvlogical_rows_per_s']:,.0f} | "
            f"{r['stream_rows_per_s'] / r['pg_recvlogical_rows_per_s']:.2f} | {r['idle_rss_mib']:,.0f} MiB | "
            f"{r['peak_rss_mib']:,.0f} MiB |"
        )
    print("\n".join(lines))
    out = ROOT / "bench" / "results" / "large_transaction.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch_rows": args.batch_rows, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
