"""The backfills table (a backfill's lifecycle, its progress) and the sink setups that decide a
sink's initial backfills."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from sequin_provider.exceptions import BackfillError
from sequin_provider.store.backfill_pages import stale_backfill_pages
from sequin_provider.store.connection import durable_commit, ident

BACKFILL_TRANSITIONS: dict[str, tuple[str, ...]] = {
    "running": ("pending",),
    "completed": ("running",),
    "failed": ("pending", "running"),
    "cancelled": ("pending", "running"),
}
"""Target state -> the states it may be reached from; completed, failed and cancelled are final."""
ACTIVE_BACKFILL_STATES = ("pending", "running")


# ``BackfillError`` (``exceptions``): the backfill functions below commit what they change, so they
# compose with a caller's connection whatever its transaction state.


@dataclass(frozen=True)
class Backfill:
    """A row of the backfills table."""

    id: int
    sink: str
    table_schema: str
    table_name: str
    kind: str
    sort_column: str | None
    start_position: str | None
    max_query_ms: int
    state: str
    cursor: Any
    rows_initial: int | None
    rows_processed: int
    rows_emitted: int
    error: str | None
    created_at: Any
    started_at: Any
    finished_at: Any
    updated_at: Any
    requested_by: str | None = None
    where: str | None = None  # the SQL condition its rows match (None: every row)


class BackfillConflict(BackfillError):
    """The sink already has an active backfill of the table (``active``, when it could be read)."""

    def __init__(self, message: str, active: Backfill | None) -> None:
        super().__init__(message)
        self.active = active


MAX_QUERY_MS_LIMIT = 600_000


def check_max_query_ms(value: object) -> int:
    """A backfill's per-page query budget: an integer from 1 to 600000 ms."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUERY_MS_LIMIT:
        raise BackfillError(f"max_query_ms must be an integer between 1 and {MAX_QUERY_MS_LIMIT}, got {value!r}")
    return value


def _backfill_query(schema: str, where: str) -> sql.Composed:
    return sql.SQL(
        "SELECT id, sink, table_schema, table_name, kind, sort_column, start_position, max_query_ms, state,"
        " cursor, rows_initial, rows_processed, rows_emitted, error, created_at, started_at, finished_at,"
        " updated_at, requested_by, row_filter FROM {}.backfills " + where
    ).format(ident(schema))


BACKFILL_CHANNEL = "sequin_backfill"
"""The store's ``NOTIFY`` channel of new backfills (the payload: the store schema), which a backfill
server (``spark.backfill_app.serve_backfills``) listens on rather than waiting out its poll interval."""


def create_backfill(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    table_schema: str,
    table_name: str,
    kind: str = "full",
    sort_column: str | None = None,
    start_position: str | None = None,
    max_query_ms: int = 5000,
    rows_initial: int | None = None,
    requested_by: str | None = None,
    where: str | None = None,
) -> Backfill:
    """Record a pending backfill; at most one is active per (sink, table): ``BackfillConflict``.
    ``where``: the SQL condition its rows match (validated by ``backfill.plan_backfill``)."""
    if kind not in ("full", "partial"):
        raise BackfillError(f"kind must be 'full' or 'partial', got {kind!r}")
    if (kind == "partial") != (sort_column is not None):
        raise BackfillError("a partial backfill needs a sort column; a full one takes none")
    check_max_query_ms(max_query_ms)
    try:
        with conn.transaction():
            durable_commit(conn)
            row = conn.execute(
                sql.SQL(
                    "INSERT INTO {}.backfills (sink, table_schema, table_name, kind, sort_column, start_position,"
                    " max_query_ms, rows_initial, requested_by, row_filter) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                    " RETURNING id"
                ).format(ident(schema)),
                (
                    sink,
                    table_schema,
                    table_name,
                    kind,
                    sort_column,
                    start_position,
                    max_query_ms,
                    rows_initial,
                    requested_by,
                    where,
                ),
            ).fetchone()
            conn.execute("SELECT pg_notify(%s, %s)", (BACKFILL_CHANNEL, schema))  # a backfill server wakes on commit
        conn.commit()  # a caller's open transaction made the block above a savepoint
    except psycopg.errors.UniqueViolation:
        active = conn.execute(
            _backfill_query(
                schema, "WHERE sink = %s AND table_schema = %s AND table_name = %s AND state IN ('pending', 'running')"
            ),
            (sink, table_schema, table_name),
        ).fetchone()
        conn.commit()
        found = Backfill(*active) if active else None
        which = (
            f"backfill {found.id} ({found.state}{', requested by ' + found.requested_by if found.requested_by else ''})"
            if found
            else "another backfill"
        )
        raise BackfillConflict(
            f"sink {sink!r} already has an active backfill of {table_schema}.{table_name}: {which};"
            " cancel it or wait for it to finish",
            found,
        ) from None
    return get_backfill(conn, schema, int(row[0]))  # type: ignore[index]


def get_backfill(conn: psycopg.Connection[Any], schema: str, backfill_id: int) -> Backfill:
    """One backfill by id."""
    row = conn.execute(_backfill_query(schema, "WHERE id = %s"), (backfill_id,)).fetchone()
    if row is None:
        raise BackfillError(f"no backfill with id {backfill_id}")
    return Backfill(*row)


def list_backfills(conn: psycopg.Connection[Any], schema: str, sink: str | None = None) -> list[Backfill]:
    """Backfills, newest first (optionally of one sink)."""
    where = "WHERE sink = %s ORDER BY id DESC" if sink else "ORDER BY id DESC"
    return [Backfill(*r) for r in conn.execute(_backfill_query(schema, where), (sink,) if sink else ()).fetchall()]


def transition_backfill(
    conn: psycopg.Connection[Any], schema: str, backfill_id: int, state: str, error: str | None = None
) -> Backfill:
    """Move a backfill to ``state`` if its current state allows it (``BACKFILL_TRANSITIONS``)."""
    allowed = BACKFILL_TRANSITIONS.get(state)
    if allowed is None:
        raise BackfillError(f"unknown target state {state!r} (running | completed | failed | cancelled)")
    stamps = {
        "running": "started_at = now(), ",
        "completed": "finished_at = now(), ",
        "failed": "finished_at = now(), ",
        "cancelled": "finished_at = now(), ",
    }[state]
    with conn.transaction():
        durable_commit(conn)
        row = conn.execute(
            sql.SQL(
                "UPDATE {}.backfills SET state = %s, " + stamps + "error = coalesce(%s, error), updated_at = now()"
                " WHERE id = %s AND state = ANY(%s) RETURNING id"
            ).format(ident(schema)),
            (state, error, backfill_id, list(allowed)),
        ).fetchone()
        if row is not None and state in ("failed", "cancelled"):
            # its pages in flight will not be emitted: hidden reads must not hold back their groups
            stale_backfill_pages(conn, ident(schema), backfill_id)
    conn.commit()
    if row is None:
        current = get_backfill(conn, schema, backfill_id)
        raise BackfillError(f"backfill {backfill_id} is {current.state}: it cannot become {state}")
    return get_backfill(conn, schema, backfill_id)


def record_backfill_progress(
    conn: psycopg.Connection[Any], schema: str, backfill_id: int, cursor: Any, processed: int, emitted: int
) -> None:
    """Advance a running backfill's cursor and add to its row counts."""
    with conn.transaction():
        done = conn.execute(
            sql.SQL(
                "UPDATE {}.backfills SET cursor = %s, rows_processed = rows_processed + %s, rows_emitted = rows_emitted + %s,"
                " updated_at = now() WHERE id = %s AND state = 'running' RETURNING id"
            ).format(ident(schema)),
            (Jsonb(cursor), processed, emitted, backfill_id),
        ).fetchone()
    conn.commit()
    if done is None:
        raise BackfillError(f"backfill {backfill_id} is not running: progress not recorded")


def new_sinks(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str]) -> list[str]:
    """Which of ``sinks`` were never set up before (without recording them: ``record_sink_setup``)."""
    known = {
        r[0]
        for r in conn.execute(
            sql.SQL("SELECT sink FROM {}.sink_setups WHERE sink = ANY(%s)").format(ident(schema)), (list(sinks),)
        ).fetchall()
    }
    conn.commit()
    return [s for s in sinks if s not in known]


def record_sink_setup(conn: psycopg.Connection[Any], schema: str, sink: str) -> None:
    """Remember that a sink has been set up (its initial backfills are created once)."""
    conn.execute(
        sql.SQL("INSERT INTO {}.sink_setups (sink) VALUES (%s) ON CONFLICT DO NOTHING").format(ident(schema)), (sink,)
    )
    conn.commit()


def backfill_totals(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, str, str, str, int, int]]:
    """Per sink, table and state: (sink, table_schema, table_name, state, backfills, rows processed),
    one aggregate over the backfills table (``metrics.backfill``)."""
    return [
        (sink, table_schema, table_name, state, int(n), int(rows))
        for sink, table_schema, table_name, state, n, rows in conn.execute(
            sql.SQL(
                "SELECT sink, table_schema, table_name, state, count(*), coalesce(sum(rows_processed), 0)"
                " FROM {}.backfills GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"
            ).format(ident(schema))
        ).fetchall()
    ]
