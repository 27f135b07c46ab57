"""The Postgres changelog: a ``postgres_table`` sink with ``mode: changelog`` appends every message as a
row of one table (``sinks.changelog``: change retention, docs/replays.md).

The table is keyed by the message's position, so a replayed request adds nothing (``ON CONFLICT DO
NOTHING``), and indexed by ``commit_timestamp`` for the retention's prune and a replay's time range.
``record`` and ``changes`` are ``json``: the message's own text, every digit of a numeric kept, and
queryable (``record->>'status' = 'paid'``). A request is one ``INSERT … SELECT`` over the messages
sent as one JSON array: the server takes the fields apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from sequin_provider.exceptions import ReplayError
from sequin_provider.sinks.changelog import CHANGELOG_COLUMNS, ChangelogSelection, read_changes
from sequin_provider.sinks.postgres_table_schema import split_name

if TYPE_CHECKING:
    from sequin_provider.config import SinkConfig


def create_changelog(conn: psycopg.Connection[Any], name: str) -> bool:
    """Create the changelog table ``name`` (and its schema) if missing; returns whether it did."""
    schema, table = split_name(name)
    if conn.execute("SELECT to_regclass(%s)", (sql.Identifier(schema, table).as_string(conn),)).fetchone()[0]:
        return False
    with conn.transaction():
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (commit_lsn bigint NOT NULL, commit_idx integer NOT NULL,"
                " action text NOT NULL, idempotency_key text NOT NULL, table_schema text NOT NULL,"
                " table_name text NOT NULL, commit_timestamp timestamptz, record_pks text[], record json,"
                " changes json, PRIMARY KEY (commit_lsn, commit_idx))"
            ).format(sql.Identifier(schema, table))
        )
        conn.execute(
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (commit_timestamp)").format(
                sql.Identifier(f"{table}_commit_timestamp"), sql.Identifier(schema, table)
            )
        )
    return True


def is_changelog(conn: psycopg.Connection[Any], name: str) -> bool | None:
    """Whether table ``name`` has the changelog's columns; None when it does not exist."""
    schema, table = split_name(name)
    rows = conn.execute(
        "SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped",
        (schema, table),
    ).fetchall()
    if not rows:
        return None
    return set(CHANGELOG_COLUMNS) <= {r[0] for r in rows}


def append_messages(conn: psycopg.Connection[Any], name: str, messages: list[str]) -> int:
    """Add ``messages`` (Sequin change messages, JSON text) as rows; those already there (by position)
    are skipped. Returns how many were new. A message without ``action`` or ``metadata`` fails it
    (``psycopg.errors.NotNullViolation``: the caller parks the request)."""
    with conn.cursor() as cur:
        cur.execute(
            sql.SQL(
                "INSERT INTO {} (commit_lsn, commit_idx, action, idempotency_key, table_schema, table_name,"
                " commit_timestamp, record_pks, record, changes)"
                " SELECT (m->'metadata'->>'commit_lsn')::bigint, (m->'metadata'->>'commit_idx')::int, m->>'action',"
                " m->'metadata'->>'idempotency_key', m->'metadata'->>'table_schema', m->'metadata'->>'table_name',"
                " (m->'metadata'->>'commit_timestamp')::timestamptz,"
                " ARRAY(SELECT json_array_elements_text(m->'metadata'->'record_pks')),"
                " m->'record', CASE WHEN json_typeof(m->'changes') = 'null' THEN NULL ELSE m->'changes' END"
                " FROM json_array_elements(%s::json) m ON CONFLICT DO NOTHING"
            ).format(sql.Identifier(*split_name(name))),
            ("[" + ",".join(messages) + "]",),
        )
        return cur.rowcount


def prune(conn: psycopg.Connection[Any], name: str, seconds: float) -> int:
    """Delete the rows whose commit is more than ``seconds`` old (the retention period, when its
    ``Retention`` says a prune is due); returns how many went."""
    with conn.cursor() as cur:
        cur.execute(
            sql.SQL("DELETE FROM {} WHERE commit_timestamp < now() - make_interval(secs => %s)").format(
                sql.Identifier(*split_name(name))
            ),
            (seconds,),
        )
        return cur.rowcount


def changelog_rows(sink: SinkConfig, selection: ChangelogSelection) -> list[tuple[Any, ...]]:
    """The selection's rows of the changelog tables ``sink``'s route names, in position order."""
    from sequin_provider.sinks.postgres_table import connect
    from sequin_provider.sinks.postgres_table_schema import fixed_targets

    options = sink.destination.options
    names = sorted(set(fixed_targets(sink, options).values()))
    if not names:
        raise ReplayError(f"sink {sink.name!r}: its table route names no fixed changelog table to read")
    rows: list[tuple[Any, ...]] = []
    try:
        with connect(options, sink.name, autocommit=True, timeout=max(options.timeout, 60)) as conn:
            for name in names:
                rows += read_changes(conn, sql.Identifier(*split_name(name)), selection)
    except psycopg.Error as exc:
        raise ReplayError(f"sink {sink.name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - DeliveryError of connect: the changelog's database is unreachable
        if isinstance(exc, ReplayError):
            raise
        raise ReplayError(str(exc)) from None
    rows.sort(key=lambda r: (r[0], r[1]))
    return rows
