"""The stream status table: one row per source database (slot, heartbeat, the last batch)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.store.connection import ident

STATUS_FIELDS = (
    "slot",
    "app_started_at",
    "heartbeat_at",
    "last_batch_id",
    "last_batch_at",
    "last_commit_lsn",
    "batch_rows",
    "batch_latency_ms",
    "rows_per_sec",
    "last_error",
)


def update_status(conn: psycopg.Connection[Any], schema: str, database: str, add_rows: int = 0, **fields: Any) -> None:
    """Upsert the stream status row of ``database`` (only the given fields change)."""
    unknown = set(fields) - set(STATUS_FIELDS)
    if unknown:
        raise ValueError(f"unknown status fields: {sorted(unknown)}")
    names = list(fields)
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in ["database", *names])
    vals = sql.SQL(", ").join(sql.Placeholder() for _ in range(len(names) + 1))
    sets = [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names]
    sets.append(sql.SQL("total_rows = {}.stream_status.total_rows + %s").format(ident(schema)))
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.stream_status ({}, total_rows) VALUES ({}, %s) ON CONFLICT (database) DO UPDATE SET {}"
        ).format(ident(schema), cols, vals, sql.SQL(", ").join(sets)),
        (database, *fields.values(), add_rows, add_rows),
    )
    conn.commit()


def read_status(conn: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    """Every stream status row as a dict."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(sql.SQL("SELECT * FROM {}.stream_status ORDER BY database").format(ident(schema)))
        return list(cur.fetchall())


def status_ages(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, float | None, float | None]]:
    """Per database: (database, seconds since its heartbeat, seconds since its last micro-batch), on
    the store's clock (``metrics.stream``)."""
    return [
        (database, None if beat is None else float(beat), None if batch is None else float(batch))
        for database, beat, batch in conn.execute(
            sql.SQL(
                "SELECT database, extract(epoch FROM now() - heartbeat_at), extract(epoch FROM now() - last_batch_at)"
                " FROM {}.stream_status ORDER BY database"
            ).format(ident(schema))
        ).fetchall()
    ]
