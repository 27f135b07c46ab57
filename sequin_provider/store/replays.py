"""The replays table (store migration 15): one row per replay of retained changes into a sink
(``sequin_provider.replay``, docs/replays.md): what it asked for, where it sits in its sink's order and
how many messages it queued."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

import psycopg
from psycopg import sql

from sequin_provider.store.connection import ident


@dataclass(frozen=True)
class Replay:
    """A replay as recorded."""

    id: int
    source_sink: str
    sink: str
    tables: tuple[str, ...]
    since: str | None
    until: str | None
    row_filter: str | None
    position: int | None
    messages: int | None
    created_at: datetime
    queued_at: datetime | None


_COLUMNS = "id, source_sink, sink, tables, since, until, row_filter, position, messages, created_at, queued_at"


def _replay(row: Sequence[Any]) -> Replay:
    return Replay(*row[:3], tuple(row[3]), *row[4:])  # type: ignore[arg-type]


def create_replay(
    conn: psycopg.Connection[Any],
    schema: str,
    source_sink: str,
    sink: str,
    tables: Sequence[str],
    since: str | None,
    until: str | None,
    row_filter: str | None,
) -> Replay:
    """Record a new replay (its id marks its messages); committed by the caller."""
    row = conn.execute(
        sql.SQL(
            "INSERT INTO {}.replays (source_sink, sink, tables, since, until, row_filter)"
            " VALUES (%s, %s, %s, %s, %s, %s) RETURNING " + _COLUMNS
        ).format(ident(schema)),
        (source_sink, sink, list(tables), since, until, row_filter),
    ).fetchone()
    assert row is not None
    return _replay(row)


def record_replay_queued(
    conn: psycopg.Connection[Any], schema: str, replay_id: int, position: int, messages: int
) -> Replay:
    """The replay's messages are in its sink's buffer, at ``position`` of the sink's order; returns
    the replay as recorded now."""
    row = conn.execute(
        sql.SQL(
            "UPDATE {}.replays SET position = %s, messages = %s, queued_at = now() WHERE id = %s RETURNING " + _COLUMNS
        ).format(ident(schema)),
        (position, messages, replay_id),
    ).fetchone()
    if row is None:
        raise LookupError(f"no replay {replay_id} in {schema}.replays")
    return _replay(row)


def list_replays(conn: psycopg.Connection[Any], schema: str, limit: int = 20) -> list[Replay]:
    """The latest replays, newest first."""
    rows = conn.execute(
        sql.SQL("SELECT " + _COLUMNS + " FROM {}.replays ORDER BY id DESC LIMIT %s").format(ident(schema)), (limit,)
    ).fetchall()
    return [_replay(r) for r in rows]
