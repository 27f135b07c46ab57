"""The store: Sequin's internal Postgres schema (migrations) and the queries on it (DESIGN §8).

Migrations are versioned and idempotent; ``migrate`` applies the missing ones under an advisory
lock, so ``sequin init`` and every app start may call it concurrently. All SQL that touches the
store lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, Union

import psycopg
from psycopg import sql

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "stream messages and stream status", """
CREATE TABLE IF NOT EXISTS {schema}.stream_messages (
    sink              text        NOT NULL,
    commit_lsn        bigint      NOT NULL,
    commit_idx        integer     NOT NULL,
    group_id          text        NOT NULL,
    idempotency_key   text        NOT NULL,
    ack_id            uuid,                    -- assigned when the message is delivered
    state             text        NOT NULL DEFAULT 'available',
    deliver_count     integer     NOT NULL DEFAULT 0,
    not_visible_until timestamptz,
    last_delivered_at timestamptz,
    inserted_at       timestamptz NOT NULL DEFAULT now(),
    data              json        NOT NULL,
    -- A message's position is unique per sink and identical when a batch is replayed, so it is
    -- the idempotency constraint (for changes the idempotency key is the position itself).
    PRIMARY KEY (sink, commit_lsn, commit_idx)
);
CREATE INDEX IF NOT EXISTS stream_messages_group ON {schema}.stream_messages (sink, group_id, commit_lsn, commit_idx);
CREATE UNIQUE INDEX IF NOT EXISTS stream_messages_ack_id ON {schema}.stream_messages (ack_id);
CREATE TABLE IF NOT EXISTS {schema}.stream_status (
    database          text PRIMARY KEY,
    slot              text,
    app_started_at    timestamptz,
    heartbeat_at      timestamptz,
    last_batch_id     bigint,
    last_batch_at     timestamptz,
    last_commit_lsn   bigint,
    batch_rows        integer,
    batch_latency_ms  double precision,
    rows_per_sec      double precision,
    total_rows        bigint NOT NULL DEFAULT 0,
    last_error        text
);
"""),
)

SCHEMA_VERSION = MIGRATIONS[-1][0]


def _ident(schema: str) -> sql.Identifier:
    return sql.Identifier(schema)


def migrate(conn: psycopg.Connection[Any], schema: str = "sequin") -> list[int]:
    """Create the schema and apply missing migrations; return the versions applied now."""
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('sequin-migrate:' || %s))", (schema,))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_ident(schema)))
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())").format(_ident(schema)))
        done = {v for (v,) in conn.execute(sql.SQL("SELECT version FROM {}.schema_migrations").format(_ident(schema)))}
        for version, name, body in MIGRATIONS:
            if version in done:
                continue
            conn.execute(sql.SQL(body).format(schema=_ident(schema)))  # type: ignore[arg-type]
            conn.execute(sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)").format(
                _ident(schema)), (version, name))
            applied.append(version)
    return applied


def schema_version(conn: psycopg.Connection[Any], schema: str = "sequin") -> int:
    """The highest applied migration, 0 when the store is not initialised."""
    exists = conn.execute("SELECT to_regclass(%s)", (f"{schema}.schema_migrations",)).fetchone()
    if not exists or exists[0] is None:
        return 0
    row = conn.execute(sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(_ident(schema))).fetchone()
    return int(row[0]) if row else 0


StreamRow = tuple[str, int, int, str, str, str]
"""(sink, commit_lsn, commit_idx, group_id, idempotency_key, data JSON)."""

STREAM_COLUMNS = ("sink", "commit_lsn", "commit_idx", "group_id", "idempotency_key", "data")
COPY_TEXT_ESCAPES: tuple[tuple[str, str], ...] = (("\\", "\\\\"), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"))
"""Replacements that make a value safe as a field of COPY's text format (backslash first)."""


def copy_text(value: object) -> str:
    """One field in COPY text format."""
    text = str(value)
    for raw, escaped in COPY_TEXT_ESCAPES:
        text = text.replace(raw, escaped)
    return text


def copy_line(row: StreamRow) -> str:
    """A stream row as one line of COPY text (``STREAM_COLUMNS`` order, no trailing newline)."""
    return "\t".join(copy_text(v) for v in row)


def insert_stream_messages(conn: psycopg.Connection[Any], schema: str, rows: Sequence[StreamRow]) -> int:
    """Durably add messages to the stream; a replayed batch adds nothing. Returns the new count."""
    return insert_stream_copy(conn, schema, ["".join(copy_line(r) + "\n" for r in rows)])


CopyChunk = Union[str, bytes, memoryview]


def insert_stream_copy(conn: psycopg.Connection[Any], schema: str, chunks: Iterable[CopyChunk],
                       consumed: list[CopyChunk] | None = None) -> int:
    """Like ``insert_stream_messages`` for rows already in COPY text, streamed chunk by chunk.

    Chunks are whole lines (``copy_line`` + newline) and are sent as they come, so the server
    works while the producer renders the next chunk. Fast path: COPY straight into the table.
    When a row is already there (the batch is a replay after a crash), the COPY fails on the
    primary key (the position) and the rows go through a temporary table with
    ``ON CONFLICT DO NOTHING`` instead. Every chunk taken is appended to ``consumed`` (so a
    caller can retry after a connection failure). Returns the number of new rows; commits.
    """
    seen: list[CopyChunk] = consumed if consumed is not None else []
    pending = iter(chunks)  # one pass: after a failure, only what was not taken remains
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in STREAM_COLUMNS)
    target = sql.SQL("{}.stream_messages").format(_ident(schema))
    try:
        with conn.transaction(), conn.cursor() as cur:
            with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(target, columns)) as copy:
                for chunk in pending:
                    seen.append(chunk)
                    copy.write(chunk)
            return max(cur.rowcount, 0)
    except psycopg.errors.UniqueViolation:
        seen.extend(pending)  # whatever the failed COPY did not take yet
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE IF NOT EXISTS sequin_incoming (sink text, commit_lsn bigint, commit_idx integer,"
                    " group_id text, idempotency_key text, data text) ON COMMIT DELETE ROWS")
        with cur.copy(sql.SQL("COPY sequin_incoming ({}) FROM STDIN").format(columns)) as copy:
            for chunk in seen:
                copy.write(chunk)
        cur.execute(sql.SQL(
            "INSERT INTO {} ({}) SELECT sink, commit_lsn, commit_idx, group_id, idempotency_key, data::json"
            " FROM sequin_incoming ORDER BY commit_lsn, commit_idx ON CONFLICT DO NOTHING").format(target, columns))
        return cur.rowcount


@dataclass(frozen=True)
class StoredMessage:
    """A message as it sits in the stream table."""

    sink: str
    commit_lsn: int
    commit_idx: int
    group_id: str
    idempotency_key: str
    data: str


def stream_messages(conn: psycopg.Connection[Any], schema: str, sink: str | None = None) -> list[StoredMessage]:
    """All messages of a sink (or all sinks), in position order."""
    query = sql.SQL("SELECT sink, commit_lsn, commit_idx, group_id, idempotency_key, data::text FROM {}.stream_messages"
                    " {} ORDER BY sink, commit_lsn, commit_idx").format(
        _ident(schema), sql.SQL("WHERE sink = %s") if sink else sql.SQL(""))
    return [StoredMessage(*r) for r in conn.execute(query, (sink,) if sink else ()).fetchall()]


def count_stream_messages(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """Messages per sink."""
    rows = conn.execute(sql.SQL("SELECT sink, count(*) FROM {}.stream_messages GROUP BY sink").format(_ident(schema)))
    return {sink: int(n) for sink, n in rows.fetchall()}


STATUS_FIELDS = ("slot", "app_started_at", "heartbeat_at", "last_batch_id", "last_batch_at", "last_commit_lsn",
                 "batch_rows", "batch_latency_ms", "rows_per_sec", "last_error")


def update_status(conn: psycopg.Connection[Any], schema: str, database: str, add_rows: int = 0,
                  **fields: Any) -> None:
    """Upsert the stream status row of ``database`` (only the given fields change)."""
    unknown = set(fields) - set(STATUS_FIELDS)
    if unknown:
        raise ValueError(f"unknown status fields: {sorted(unknown)}")
    names = list(fields)
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in ["database", *names])
    vals = sql.SQL(", ").join(sql.Placeholder() for _ in range(len(names) + 1))
    sets = [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names]
    sets.append(sql.SQL("total_rows = {}.stream_status.total_rows + %s").format(_ident(schema)))
    conn.execute(sql.SQL("INSERT INTO {}.stream_status ({}, total_rows) VALUES ({}, %s) ON CONFLICT (database) DO UPDATE SET {}").format(
        _ident(schema), cols, vals, sql.SQL(", ").join(sets)),
        (database, *fields.values(), add_rows, add_rows))
    conn.commit()


def read_status(conn: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    """Every stream status row as a dict."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(sql.SQL("SELECT * FROM {}.stream_status ORDER BY database").format(_ident(schema)))
        return list(cur.fetchall())
