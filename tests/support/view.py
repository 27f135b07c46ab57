"""The store the Sequin view's tests show: a ``kv`` table captured by a Sequin Stream sink and a
webhook sink, and a backfill caught running (``tests/integration/airflow/test_plugins.py`` and
``test_view_browser.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from sequin_provider import store
from tests.support.config import write_config
from tests.support.postgres import execute


def view_config(dsn: str, dbname: str, tmp_path: Path, hook_url: str) -> Path:
    """A config of database ``app`` with sinks ``kv_stream`` (Sequin Stream) and ``kv_hook`` (one
    message per request to ``hook_url``), its slot made and the store migrated."""
    execute(
        dsn,
        "CREATE TABLE kv (k int PRIMARY KEY, v int)",
        f"SELECT pg_create_logical_replication_slot('slot_{dbname}', 'pgoutput')",
    )
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}}}]
        sinks:
          - {{name: kv_stream, tables: [kv], destination: {{type: sequin_stream}}}}
          - {{name: kv_hook, tables: [kv], destination: {{type: webhook, url: "{hook_url}", batch: false, timeout: 5s}}}}
        """,
    )
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    return config


def running_backfill(conn: psycopg.Connection[Any], sink: str, table: str) -> int:
    """A backfill of ``public.<table>`` for ``sink``, running: 400 of about 1,000 rows done in 40 s
    (10 rows/s, 60 s to go); its id."""
    backfill = store.create_backfill(conn, "sequin", sink, "public", table, rows_initial=1000)
    store.transition_backfill(conn, "sequin", backfill.id, "running")
    store.record_backfill_progress(conn, "sequin", backfill.id, {"k": 400}, 400, 400)
    conn.execute(
        "UPDATE sequin.backfills SET started_at = updated_at - interval '40 seconds' WHERE id = %s", (backfill.id,)
    )
    conn.commit()
    return backfill.id
