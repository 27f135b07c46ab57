"""``make demo``: the whole pipeline on an embedded Postgres under ./var, end to end.

Starts (or reuses) a cluster in ./var/pg, creates a small shop schema, provisions capture, runs
the Spark stream app, commits a burst of inserts/updates/deletes, prints the messages that
reached the Sequin Stream sinks, drains one of them through the HTTP pull API as a consumer would,
prints a summary line, then stops everything it started.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from decimal import Decimal
from pathlib import Path

import psycopg

from devtools.demo_airflow import run_airflow_demo, sink_messages
from devtools.embedded_postgres import EmbeddedPostgres, free_port, kept_data_dir
from devtools.stream_process import ROOT, StreamAppProcess, wait_for
from sequin_provider.config import load_config
from sequin_provider.provisioning import initialize
from sequin_provider.replication import slot_info

VAR = ROOT / "var"
SCHEMA = (
    "CREATE TABLE customers (id serial PRIMARY KEY, name text NOT NULL, email text, created_at timestamptz DEFAULT now())",
    "CREATE TABLE orders (id serial PRIMARY KEY, customer_id int NOT NULL REFERENCES customers, status text NOT NULL,"
    " total numeric(12,2) NOT NULL, tags text[])",
    "ALTER TABLE orders REPLICA IDENTITY FULL",
    "CREATE TABLE order_items (order_id int REFERENCES orders ON DELETE CASCADE, line int, sku text, qty int,"
    " PRIMARY KEY (order_id, line))",
)
CONFIG = """# Written by `make demo`; see docs/configuration.md for every key.
databases:
  - name: shop
    dsn: {dsn}
    slot: {{name: sequin_demo_slot}}
    publication: {{name: sequin_demo_pub}}
    heartbeat_interval: 5s
sinks:
  - name: shop_changes
    tables: [customers, orders, order_items]
    destination: {{type: sequin_stream}}
  - name: big_orders
    tables: [{{name: orders, group_column_names: [customer_id]}}]
    filter: "cast(record.total AS decimal(12,2)) >= 100"
    actions: [insert, update]
    destination: {{type: sequin_stream}}
stream:
  checkpoint_location: {checkpoint}
"""


def burst(dsn: str) -> int:
    """Commit a mix of transactions; return how many row changes were committed."""
    statements = [
        [
            "INSERT INTO customers (name, email) VALUES ('Ada', 'ada@example.com'), ('Grace', 'grace@example.com'),"
            " ('Linus', NULL)"
        ],
        [
            "INSERT INTO orders (customer_id, status, total, tags) VALUES (1, 'open', 42.00, '{gift}'),"
            " (2, 'open', 250.00, NULL), (3, 'open', 99.99, '{}')",
            "INSERT INTO order_items VALUES (1, 1, 'book', 2), (2, 1, 'laptop', 1), (2, 2, 'mouse', 1), (3, 1, 'pen', 30)",
        ],
        ["UPDATE orders SET status = 'paid' WHERE id IN (1, 2)", "UPDATE order_items SET qty = 3 WHERE order_id = 1"],
        [
            "UPDATE orders SET total = 120.00, status = 'paid' WHERE id = 3",
            "UPDATE customers SET email = 'linus@example.com' WHERE id = 3",
        ],
        ["DELETE FROM order_items WHERE order_id = 2 AND line = 2", "DELETE FROM orders WHERE id = 1"],
    ]
    changes = 0
    with psycopg.connect(dsn) as conn:
        for txn in statements:
            for statement in txn:
                changes += conn.execute(statement).rowcount
            conn.commit()
    return changes + 1  # the order delete cascades to its one remaining item


def as_json(value: object) -> str:
    """Compact JSON for display, with numerics as the exact numbers they are on the wire."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{as_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(as_json(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def describe(message: dict[str, object]) -> str:
    """One line per message: position, action, table, key, and what changed."""
    meta = message["metadata"]  # type: ignore[index]
    position = f"{meta['commit_lsn']}:{meta['commit_idx']}"  # type: ignore[index]
    key = ",".join(meta["record_pks"])  # type: ignore[index]
    changes = message.get("changes")
    detail = as_json(message["record"])
    if changes:
        detail += f"  changes={as_json(changes)}"
    return f"  {position:>16}  {message.get('action', 'row'):<6} {meta['table_name']:<12} key={key:<6} {detail}"  # type: ignore[index]


def pull_over_http(config_path: object, dsn: str, sink: str) -> list[dict[str, object]]:
    """Serve the pull API on a free loopback port and drain ``sink`` with receive + ack, as a client would."""
    import threading

    import httpx
    import uvicorn

    from sequin_provider import stream_queue
    from sequin_provider.stream_api import create_app

    with psycopg.connect(dsn) as conn:
        token = stream_queue.create_token(conn, "sequin", f"demo-{int(time.time())}")
        conn.commit()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(load_config(config_path)), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    got: list[dict[str, object]] = []
    try:
        wait_for(lambda: server.started, 30, what="the pull API")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}) as client:
            while True:
                batch = client.post(f"/api/sequin_streams/{sink}/receive", json={"batch_size": 100}).json()["data"]
                if not batch:
                    return got
                got.extend(m["data"] for m in batch)
                client.post(f"/api/sequin_streams/{sink}/ack", json={"ack_ids": [m["ack_id"] for m in batch]})
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def stream_demo(dsn: str, config_path: Path, app: StreamAppProcess) -> bool:
    """Commit a burst while the stream app runs, show what reached the sinks and pull one over HTTP."""
    print("demo: starting the Spark stream app (log: var/stream-app.log) ...")
    app.wait_streaming(dsn)
    started = time.monotonic()
    committed = burst(dsn)
    print(f"demo: committed {committed} row changes in 5 transactions; waiting for the sink ...")

    def delivered() -> list[dict[str, object]] | None:
        app.check_alive()
        got = sink_messages(dsn, "shop_changes")
        return got if len(got) >= committed else None

    messages = wait_for(delivered, 180, what="the burst to reach the sink")
    elapsed = time.monotonic() - started
    big = sink_messages(dsn, "big_orders")
    with psycopg.connect(dsn) as conn:
        lag = slot_info(conn, "sequin_demo_slot")
    print(f"\nsink shop_changes ({len(messages)} messages, position order):")
    for message in messages:
        print(describe(message))
    print(f"\nsink big_orders (filter: total >= 100, inserts and updates; {len(big)} messages):")
    for message in big:
        print(describe(message))
    pulled = pull_over_http(config_path, dsn, "big_orders")
    summary = ", ".join(f"{m['action']} #{m['record']['id']}" for m in pulled)  # type: ignore[index]
    print(f"\ndemo: a consumer pulled {len(pulled)} big_orders messages over the HTTP API (receive + ack): {summary}")
    ok = len(messages) == committed and len(pulled) == len(big)
    print(
        f"\ndemo: {committed} changes committed -> {len(messages)} messages in shop_changes, {len(big)} in "
        f"big_orders; first burst to last message {elapsed:.2f}s; slot lag "
        f"{lag.lag_bytes if lag else '?'} bytes; {'OK' if ok else 'MISMATCH'}"
    )
    return ok


def main(with_airflow: bool = True) -> int:
    """Run the demo; exit code 0 when every committed change reached the sink (and, ``with_airflow``,
    when the same pipeline ran as Airflow DAG runs triggered over the REST API)."""
    VAR.mkdir(exist_ok=True)
    print("demo: starting embedded Postgres under ./var/pg (wal_level=logical)")
    with EmbeddedPostgres(data_dir=kept_data_dir(VAR), use_env_dsn=False) as pg:
        dsn = pg.create_database("shop")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in SCHEMA:
                conn.execute(statement)
        checkpoint = VAR / "checkpoints"
        shutil.rmtree(checkpoint, ignore_errors=True)
        config_path = VAR / "sequin.yaml"
        config_path.write_text(CONFIG.format(dsn=dsn, checkpoint=checkpoint))
        report = initialize(load_config(config_path))
        print(f"demo: sequin init created {'; '.join(report.created)}")
        app = StreamAppProcess(config_path, VAR / "stream-app.log").start()
        try:
            ok = stream_demo(dsn, config_path, app)
        finally:
            code = app.stop()
            print(f"demo: stream app stopped (exit {code})")
        if ok and with_airflow:
            ok = run_airflow_demo(
                VAR,
                dsn,
                config_path,
                database="shop",
                slot="sequin_demo_slot",
                metadata_dsn=pg.create_database("airflow_demo"),
            )
        print("demo: stopping Postgres")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(with_airflow="--no-airflow" not in sys.argv[1:]))
