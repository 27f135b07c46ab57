"""The Airflow part of ``make demo``: the same pipeline, run by Airflow and driven over its REST API.

Starts ``airflow standalone`` (fresh home under ./var/airflow-demo, a free port), unpauses
``sequin_replication`` (``@continuous``: the scheduler starts its run) so the supervisor starts the stream app, shows a new change arriving through
it, triggers a ``sequin_backfill`` run with a conf (as the UI form or a script would) and waits for it
to succeed, then pauses ``sequin_replication`` and marks its run done, which stops the stream app.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import psycopg

from devtools.airflow_standalone import AirflowStandalone, airflow_env
from devtools.embedded_postgres import free_port
from devtools.stream_process import streaming_status, wait_for
from sequin_provider import store
from sequin_provider.backfill import MIN_SERVER_VERSION
from sequin_provider.messages import parse_message
from sequin_provider.replication import slot_info

REPLICATION, BACKFILL = "sequin_replication", "sequin_backfill"


def slot_active(dsn: str, slot: str) -> bool:
    """Whether a stream app is reading ``slot`` right now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        info = slot_info(conn, slot)
    return bool(info and info.active)


def sink_messages(dsn: str, sink: str) -> list[dict[str, Any]]:
    """What a consumer of ``sink`` may be served, in position order."""
    with psycopg.connect(dsn) as conn:
        return [parse_message(m.data) for m in store.stream_messages(conn, "sequin", sink, visible_only=True)]


def run_airflow_demo(var: Path, dsn: str, config_path: Path, database: str, slot: str, metadata_dsn: str) -> bool:
    """Run the pipeline through Airflow (its metadata in the database ``metadata_dsn``); True when both
    DAG runs did what they should."""
    home = var / "airflow-demo"
    shutil.rmtree(home, ignore_errors=True)  # a fresh Airflow: every DAG starts paused, no runs left over
    port = free_port()
    env = airflow_env(home, dsn, config_path, port=port, database=database, slot=slot, metadata_dsn=metadata_dsn)
    log = var / "airflow-demo.log"
    log.unlink(missing_ok=True)
    started = time.monotonic()
    print(
        f"\ndemo (Airflow): starting airflow standalone on http://localhost:{port} (home var/airflow-demo,"
        f" log var/airflow-demo.log) ...",
        flush=True,
    )
    with AirflowStandalone(home, env, port=port, log_path=log) as airflow:
        airflow.wait_ready()
        print(f"demo (Airflow): healthy after {time.monotonic() - started:.0f}s; logged in to the REST API as admin")
        with psycopg.connect(dsn) as conn:
            before = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]

        replication = airflow.start_continuous(REPLICATION)
        print(
            f"demo (Airflow): PATCH /api/v2/dags/{REPLICATION} is_paused=false -> the scheduler started"
            f" {replication}; waiting for the supervised stream app ...",
            flush=True,
        )
        airflow.wait_task(REPLICATION, replication, "supervise_stream", frozenset({"running"}))
        status = wait_for(
            lambda: airflow.check_alive() or streaming_status(dsn, database=database, after=before),
            600,
            interval=1,
            what="the stream app started by sequin_replication to stream",
        )
        with psycopg.connect(dsn) as conn:
            customer = conn.execute(
                "INSERT INTO customers (name, email) VALUES ('Airflow', 'af@example.com') RETURNING id"
            ).fetchone()[0]  # type: ignore[index]
        arrived = wait_for(
            lambda: [
                m
                for m in sink_messages(dsn, "shop_changes")
                if m["metadata"]["table_name"] == "customers"  # type: ignore[index]
                and m["record"]["id"] == customer
            ],
            180,
            interval=0.5,
            what="the new customer to reach shop_changes",
        )
        print(
            f"demo (Airflow): {REPLICATION} is running; its stream app (started {status['app_started_at']:%H:%M:%S})"
            f" delivered the new customer #{customer} as {arrived[0]['action']}"
        )

        with psycopg.connect(dsn) as conn:
            source_version = conn.info.server_version
        backfills_run = source_version >= MIN_SERVER_VERSION
        if not backfills_run:  # PostgreSQL 12/13: no logical messages in pgoutput, so no watermarks
            print(
                f"demo (Airflow): skipping {BACKFILL}: backfills need PostgreSQL 14 or later; this source is"
                f" {source_version // 10000} (docs/postgres-versions.md)"
            )
        else:
            conf = {"sink": "shop_changes", "table": "orders"}
            backfill = airflow.trigger(BACKFILL, conf)
            print(
                f"demo (Airflow): POST /api/v2/dags/{BACKFILL}/dagRuns conf={conf} -> {backfill}; waiting ...",
                flush=True,
            )
            run = airflow.wait_run(BACKFILL, backfill)
            with psycopg.connect(dsn) as conn:
                record = store.list_backfills(conn, "sequin", "shop_changes")[0]
                order_count = conn.execute("SELECT count(*) FROM orders").fetchone()[0]  # type: ignore[index]
            reads = [
                m
                for m in sink_messages(dsn, "shop_changes")
                if m["action"] == "read" and m["metadata"]["idempotency_key"].startswith(f"backfill:{record.id}:")
            ]  # type: ignore[index]
            print(
                f"demo (Airflow): {BACKFILL} run {run['state']}; backfill #{record.id} {record.state},"
                f" {record.rows_processed} rows read, {len(reads)} read messages for {order_count} orders"
            )
            if run["state"] != "success":
                print(airflow.task_logs(BACKFILL, backfill), flush=True)

        airflow.set_paused(REPLICATION, True)  # no new continuous run after this one
        airflow.set_run_state(REPLICATION, replication, "success")
        wait_for(lambda: not slot_active(dsn, slot), 180, interval=1, what="the supervised stream app to stop")
        print(f"demo (Airflow): marked {replication} done: the supervisor stopped the stream app; stopping Airflow")
    ok = not backfills_run or (run["state"] == "success" and record.state == "completed" and len(reads) == order_count)
    print(f"demo (Airflow): {'OK' if ok else 'FAILED'} in {time.monotonic() - started:.0f}s")
    return ok
