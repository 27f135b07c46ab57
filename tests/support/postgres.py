"""Postgres helpers of the tests: run statements, write WAL past a slot, read and write a sink's stream messages."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from sequin_provider import store
from sequin_provider.messages import parse_message


def execute(dsn: str, *statements: str, params: Any = None) -> None:
    """Run statements in one autocommit session."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement, params)


def write_wal(dsn: str, rows: int = 2000) -> None:
    """Commit ``rows`` rows of 200 bytes so the server's WAL position moves past a slot's.

    The commit is synchronous: the harness's cluster runs ``synchronous_commit=off``, and there the WAL
    writer may not have written the rows yet when the commit returns, so ``pg_current_wal_lsn()`` (the
    written position slot lag is measured from) could still stand short of them (CI once saw 138 kB of
    0.5 MB)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        conn.execute("CREATE TABLE IF NOT EXISTS filler (id serial PRIMARY KEY, body text)")
        conn.execute("INSERT INTO filler (body) SELECT repeat('x', 200) FROM generate_series(1, %s)", (rows,))


def sink_messages(dsn: str, sink: str, schema: str = "sequin") -> list[dict[str, Any]]:
    """A sink's stream messages that a consumer may be served (visible), parsed, in position order."""
    with psycopg.connect(dsn) as conn:
        if not store.schema_version(conn, schema):
            return []
        return [parse_message(m.data) for m in store.stream_messages(conn, schema, sink, visible_only=True)]


def put_stream_messages(dsn: str, sink: str, messages: list[tuple[int, int, str]], visible: bool = True) -> None:
    """Write (commit_lsn, commit_idx, group) messages as the stream app does, then make them visible."""
    rows = [
        (
            sink,
            lsn,
            idx,
            group,
            f"{lsn}:{idx}",
            json.dumps(
                {
                    "record": {"lsn": lsn, "idx": idx, "g": group},
                    "action": "insert",
                    "changes": None,
                    "metadata": {"commit_lsn": lsn, "commit_idx": idx},
                }
            ),
        )
        for lsn, idx, group in messages
    ]
    with psycopg.connect(dsn) as conn:
        store.insert_stream_messages(conn, "sequin", rows)
        if visible:
            store.advance_visible_lsn(conn, "sequin", [sink], max(m[0] for m in messages))
