"""Postgres helpers of the tests: run statements, read and write a sink's stream messages."""

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
