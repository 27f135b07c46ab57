"""Backfill ranges and pages: the watermark window protocol in the store (DESIGN §7): a page is
opened, staged (as rows, or as the sink's hidden reads), closed at its high watermark, emitted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from sequin_provider.exceptions import BackfillError
from sequin_provider.messages import ReadMessageTemplate, idempotency_key
from sequin_provider.store.connection import ident
from sequin_provider.store.stream import CopyChunk


@dataclass(frozen=True)
class BackfillRange:
    """One task's slice of a backfill's key space and how far it got."""

    backfill_id: int
    range_idx: int
    lower_key: list[str] | None
    upper_key: list[str] | None
    cursor: list[str] | None
    done: bool
    rows_processed: int
    last_page: int | None = None  # the last page the job counted (``advance_backfill_range``)


def ensure_backfill_ranges(
    conn: psycopg.Connection[Any],
    schema: str,
    backfill_id: int,
    bounds: Sequence[tuple[list[str] | None, list[str] | None]],
) -> list[BackfillRange]:
    """Record a backfill's ranges once; a resumed backfill keeps the ranges (and cursors) it has."""
    with conn.transaction():
        conn.execute(
            sql.SQL("SELECT 1 FROM {}.backfills WHERE id = %s FOR UPDATE").format(ident(schema)), (backfill_id,)
        )
        if not backfill_ranges(conn, schema, backfill_id):
            with conn.cursor() as cur:
                cur.executemany(
                    sql.SQL(
                        "INSERT INTO {}.backfill_ranges (backfill_id, range_idx, lower_key, upper_key)"
                        " VALUES (%s, %s, %s, %s)"
                    ).format(ident(schema)),
                    [
                        (backfill_id, i, Jsonb(lo) if lo is not None else None, Jsonb(hi) if hi is not None else None)
                        for i, (lo, hi) in enumerate(bounds)
                    ],
                )
    conn.commit()
    return backfill_ranges(conn, schema, backfill_id)


def backfill_ranges(conn: psycopg.Connection[Any], schema: str, backfill_id: int) -> list[BackfillRange]:
    """A backfill's ranges in key order."""
    rows = conn.execute(
        sql.SQL(
            "SELECT backfill_id, range_idx, lower_key, upper_key, cursor, done, rows_processed, last_page"
            " FROM {}.backfill_ranges WHERE backfill_id = %s ORDER BY range_idx"
        ).format(ident(schema)),
        (backfill_id,),
    ).fetchall()
    return [BackfillRange(*r) for r in rows]


def open_backfill_page(
    conn: psycopg.Connection[Any], schema: str, backfill_id: int, range_idx: int, after_page: int | None = None
) -> int:
    """A new page of a range (before its low watermark); returns the page id. ``after_page``: the
    page whose last key this page starts after (None: the range's start), which the stream app must
    have released before it releases this one (``close_backfill_window``)."""
    row = conn.execute(
        sql.SQL(
            "INSERT INTO {}.backfill_pages (backfill_id, range_idx, after_page) VALUES (%s, %s, %s) RETURNING id"
        ).format(ident(schema)),
        (backfill_id, range_idx, after_page),
    ).fetchone()
    conn.commit()
    return int(row[0])  # type: ignore[index]


def stage_backfill_page(
    conn: psycopg.Connection[Any],
    schema: str,
    page_id: int,
    rows: Sequence[tuple[list[str], str]],
    cursor_after: list[str] | None,
    reads: StoreReads | None = None,
) -> bool:
    """Stage a page's rows ``(record_pks, record JSON)`` before its high watermark is emitted; with
    ``reads``, write them as the sink's hidden reads instead (``write_page_reads``). False when the
    page is no longer open (taken back: the backfill stopped), and then nothing is written."""
    s = ident(schema)
    with conn.transaction(), conn.cursor() as cur:
        if not _lock_open_page(cur, schema, page_id):
            return False
        with cur.copy(
            sql.SQL("COPY {}.backfill_rows (page_id, ordinal, record_pks, record) FROM STDIN").format(s)
        ) as copy:
            for ordinal, (pks, record) in enumerate(rows):
                copy.write_row((page_id, ordinal, pks, record))
        if reads is not None:
            write_page_reads(conn, s, page_id, reads)
            cur.execute(sql.SQL("DELETE FROM {}.backfill_rows WHERE page_id = %s").format(s), (page_id,))
        _mark_staged(cur, s, page_id, len(rows), cursor_after, reads.commit_lsn if reads is not None else None)
    conn.commit()
    return True


def stage_backfill_copy(
    conn: psycopg.Connection[Any], schema: str, page_id: int, data: bytes, rows: int, cursor_after: list[str] | None
) -> bool:
    """``stage_backfill_page`` for a page already in COPY text form (``backfill.reader.PageQuery.staging_sql``)."""
    s = ident(schema)
    with conn.transaction(), conn.cursor() as cur:
        if not _lock_open_page(cur, schema, page_id):
            return False
        with cur.copy(
            sql.SQL("COPY {}.backfill_rows (page_id, ordinal, record_pks, record, order_key) FROM STDIN").format(s)
        ) as copy:
            copy.write(data)
        _mark_staged(cur, s, page_id, rows, cursor_after, None)
    conn.commit()
    return True


def _lock_open_page(cur: psycopg.Cursor[Any], schema: str, page_id: int) -> bool:
    row = cur.execute(
        sql.SQL("SELECT state FROM {}.backfill_pages WHERE id = %s FOR UPDATE").format(ident(schema)), (page_id,)
    ).fetchone()
    return row is not None and row[0] == "open"


def _mark_staged(
    cur: psycopg.Cursor[Any],
    s: sql.Identifier,
    page_id: int,
    rows: int,
    cursor_after: list[str] | None,
    read_lsn: int | None,
    template: ReadMessageTemplate | None = None,
) -> None:
    """A page staged: its rows, next cursor, the position of the reads the task wrote, and the
    template of those reads when they hold their records alone (``READ_DATA``)."""
    parts = (
        [template.before_record, template.before_idx, template.after_pks]
        if template is not None and not template.record_only
        else None
    )
    cur.execute(
        sql.SQL(
            "UPDATE {}.backfill_pages SET state = 'staged', rows_staged = %s, cursor_after = %s,"
            " read_lsn = %s, read_template = %s, updated_at = now() WHERE id = %s AND state = 'open'"
        ).format(s),
        (rows, Jsonb(cursor_after) if cursor_after is not None else None, read_lsn, parts, page_id),
    )


@dataclass(frozen=True)
class BackfillPage:
    """A page's state as the backfill job sees it."""

    id: int
    backfill_id: int
    range_idx: int
    state: str
    rows_staged: int
    rows_emitted: int | None


def get_backfill_page(conn: psycopg.Connection[Any], schema: str, page_id: int) -> BackfillPage:
    """One page by id."""
    row = conn.execute(
        sql.SQL(
            "SELECT id, backfill_id, range_idx, state, rows_staged, rows_emitted FROM {}.backfill_pages WHERE id = %s"
        ).format(ident(schema)),
        (page_id,),
    ).fetchone()
    conn.commit()
    if row is None:
        raise BackfillError(f"no backfill page {page_id}")
    return BackfillPage(*row)


@dataclass(frozen=True)
class ClosedWindow:
    """What the stream app emits for a page whose window it saw: the staged rows still valid, or
    (``in_store``) how many of them the store has already written as messages."""

    page_id: int
    backfill_id: int
    sink: str
    rows: list[tuple[int, list[str], str]]  # (ordinal, record_pks, record JSON)
    in_store: int = 0


@dataclass(frozen=True)
class StoreReads:
    """How a page's reads are written as a plain Sequin Stream sink's messages by the store itself:
    the sink, the message template, the group (``group_prefix`` + the key's JSON; None: the
    position) and the position (``commit_lsn``, indexes from ``commit_idx + 1``)."""

    sink: str
    backfill_id: int
    template: ReadMessageTemplate
    group_prefix: str | None
    commit_lsn: int
    commit_idx: int


def close_backfill_window(
    conn: psycopg.Connection[Any], schema: str, page_id: int, seen: bool, changed: set[tuple[str, ...]], high_lsn: int
) -> ClosedWindow | None:
    """Stream side, at a page's high watermark (DESIGN §7).

    A window this process saw becomes ``closing``: the rows whose key changed inside it are
    dropped, and ``finish_emitted_pages`` marks the page ``emitted`` once the batch is delivered.
    A page staged as rows returns the others, to be emitted at the high watermark's position. A
    page whose reads the task already wrote, hidden (``read_lsn``), has its dropped reads deleted
    and the rest released: ``in_store`` counts them. A window not seen (the app restarted in
    between), or of a backfill no longer running, makes a staged page ``stale`` (its rows and
    hidden reads go) and the job reads the page again. So does a page that follows one not released
    (``after_page``, stale: the job reads again from that page, this one included), so a range's
    released pages are always a prefix of its keys and no row is read again once its read may have
    been served. A closing page closed again (a replayed batch) gives the same answer as the first
    close; other states are left alone.
    """
    s = ident(schema)
    with conn.transaction():
        row = conn.execute(
            sql.SQL(
                "SELECT p.state, p.backfill_id, b.sink, b.state, p.rows_emitted, p.read_lsn,"
                " p.after_page IS NULL OR a.state IN ('closing', 'emitted')"
                " FROM {0}.backfill_pages p JOIN {0}.backfills b ON b.id = p.backfill_id"
                " LEFT JOIN {0}.backfill_pages a ON a.id = p.after_page"
                " WHERE p.id = %s FOR UPDATE OF p"
            ).format(s),
            (page_id,),
        ).fetchone()
        if row is None or row[0] not in ("staged", "closing"):
            result = None
        elif row[0] == "closing":
            result = ClosedWindow(
                page_id,
                int(row[1]),
                str(row[2]),
                [] if row[5] is not None else _kept_rows(conn, s, page_id),
                in_store=int(row[4] or 0) if row[5] is not None else 0,
            )
        elif not seen or row[3] != "running" or not row[6]:
            _stale_pages(conn, s, [page_id])
            result = None
        elif row[5] is not None:
            keys = [idempotency_key(0, 0, int(row[1]), k) for k in changed]
            # Never prepared: a generic plan tests each of the page's reads against the keys one
            # by one (thousands under concurrent writes: seconds per page, in the stream app's
            # reader); a custom plan sees the array and hashes it.
            dropped = (
                [
                    r[0]
                    for r in conn.execute(
                        sql.SQL(
                            "DELETE FROM {}.stream_messages WHERE sink = %s AND commit_lsn = %s AND idempotency_key = ANY(%s)"
                            " RETURNING commit_idx"
                        ).format(s),
                        (row[2], row[5], keys),
                        prepare=False,
                    ).fetchall()
                ]
                if keys
                else []
            )
            kept = _close_page(conn, s, page_id, high_lsn, sorted(dropped), None)
            result = ClosedWindow(page_id, int(row[1]), str(row[2]), [], in_store=kept)
        else:
            staged = conn.execute(
                sql.SQL(
                    "SELECT ordinal, record_pks, record FROM {}.backfill_rows WHERE page_id = %s ORDER BY ordinal"
                ).format(s),
                (page_id,),
            ).fetchall()
            kept = [r for r in staged if tuple(r[1]) not in changed]
            _close_page(conn, s, page_id, high_lsn, [r[0] for r in staged if tuple(r[1]) in changed], len(kept))
            result = ClosedWindow(page_id, int(row[1]), str(row[2]), kept)
    conn.commit()
    return result


def _close_page(
    conn: psycopg.Connection[Any], s: sql.Identifier, page_id: int, high_lsn: int, dropped: list[int], kept: int | None
) -> int:
    """Mark a page ``closing`` at ``high_lsn``; ``kept`` None: its staged rows less the dropped ones."""
    row = conn.execute(
        sql.SQL(
            "UPDATE {}.backfill_pages SET state = 'closing', rows_emitted = coalesce(%s, rows_staged"
            " - %s), dropped = %s, high_lsn = %s, updated_at = now() WHERE id = %s RETURNING"
            " rows_emitted"
        ).format(s),
        (kept, len(dropped), dropped, high_lsn, page_id),
    ).fetchone()
    return int(row[0])  # type: ignore[index]


def _kept_rows(conn: psycopg.Connection[Any], s: sql.Identifier, page_id: int) -> list[tuple[int, list[str], str]]:
    """A closing page's staged rows that were not dropped, in order."""
    return [
        tuple(r)
        for r in conn.execute(
            sql.SQL(  # type: ignore[misc]
                "SELECT r.ordinal, r.record_pks, r.record FROM {0}.backfill_rows r JOIN {0}.backfill_pages p ON p.id = r.page_id"
                " WHERE r.page_id = %s AND NOT r.ordinal = ANY(coalesce(p.dropped, '{{}}')) ORDER BY r.ordinal"
            ).format(s),
            (page_id,),
        ).fetchall()
    ]


def _stale_pages(conn: psycopg.Connection[Any], s: sql.Identifier, page_ids: Sequence[int]) -> list[int]:
    """Make pages that are not closing or emitted ``stale``: their staged rows and their hidden
    reads go (they are read again); returns the ids that changed."""
    rows = conn.execute(
        sql.SQL(
            "UPDATE {0}.backfill_pages p SET state = 'stale', updated_at = now() FROM {0}.backfills b"
            " WHERE p.id = ANY(%s) AND b.id = p.backfill_id AND p.state IN ('open', 'staged')"
            " RETURNING p.id, b.sink, p.read_lsn"
        ).format(s),
        (list(page_ids),),
    ).fetchall()
    ids = _drop_staged_rows(conn, s, rows)
    for _id, sink, read_lsn in rows:
        if read_lsn is not None:
            conn.execute(
                sql.SQL("DELETE FROM {}.stream_messages WHERE sink = %s AND commit_lsn = %s").format(s),
                (sink, read_lsn),
            )
    return ids


READ_MESSAGE_COLUMNS = ("sink", "commit_lsn", "commit_idx", "group_id", "idempotency_key", "data", "backfill_page")


def read_messages_sql(
    reads: StoreReads, page_id: int, rows: sql.Composable, extra: sql.Composable | None = None
) -> sql.Composed:
    """``SELECT`` of a page's read messages as ``READ_MESSAGE_COLUMNS`` (``backfill.watermarks.read_rows``
    positions, ``messages.idempotency_key`` keys, ``delivery`` groups, the template's JSON) from
    ``rows``, a relation ``r`` of ``(ordinal from 0, record_pks text[], record JSON text)``, in
    ordinal order; ``extra`` adds a column. Runs in the store, or in the source when the task
    copies the rendered page straight into the stream table."""
    t, lit = reads.template, sql.Literal
    pks = sql.SQL("r.pks_json")  # computed once per row (below): it appears in the group, the key and the data
    idx = sql.SQL("({} + r.ordinal + 1)").format(lit(reads.commit_idx))
    key = sql.SQL("({} || {})").format(lit(f"backfill:{reads.backfill_id}:"), pks)
    group = (
        sql.SQL("{} || {}").format(lit(reads.group_prefix), pks)
        if reads.group_prefix is not None
        else sql.SQL("{} || {}::text").format(lit(f"{reads.commit_lsn}:"), idx)
    )
    data = (
        sql.SQL("r.record")
        if t.record_only
        else sql.SQL(
            "{} || r.record || {} || {}::text || ',\"idempotency_key\":' || to_json({})::text || ',\"record_pks\":' || {} || {}"
        ).format(lit(t.before_record), lit(t.before_idx), idx, key, pks, lit(t.after_pks))
    )
    return sql.SQL(
        "SELECT {sink}, {lsn}::bigint, {idx}, {group}, {key}, {data}, {page}::bigint{extra}"
        " FROM (SELECT r.*, to_json(r.record_pks)::text AS pks_json FROM {rows}) r ORDER BY r.ordinal"
    ).format(
        sink=lit(reads.sink),
        lsn=lit(reads.commit_lsn),
        idx=idx,
        group=group,
        key=key,
        data=data,
        page=lit(page_id),
        rows=rows,
        extra=sql.SQL(", {}").format(extra) if extra is not None else sql.SQL(""),
    )


def write_page_reads(conn: psycopg.Connection[Any], s: sql.Identifier, page_id: int, reads: StoreReads) -> None:
    """Insert a staged page's rows as the sink's read messages, hidden until the page's window
    closes (``READS_RELEASED``)."""
    conn.execute(
        sql.SQL("INSERT INTO {s}.stream_messages ({columns}) {select}").format(
            s=s,
            columns=sql.SQL(", ").join(map(sql.Identifier, READ_MESSAGE_COLUMNS)),
            select=read_messages_sql(
                reads, page_id, sql.SQL("{}.backfill_rows r WHERE r.page_id = {}").format(s, sql.Literal(page_id))
            ),
        )
    )


def stage_page_reads_copy(
    conn: psycopg.Connection[Any],
    schema: str,
    page_id: int,
    data: Iterable[CopyChunk],
    rows: int,
    cursor_after: list[str] | None,
    read_lsn: int,
    binary: bool = False,
    template: ReadMessageTemplate | None = None,
) -> bool:
    """Job side: a page's read messages as COPY text (rendered by the source, ``read_messages_sql``)
    or, with ``binary``, as COPY binary from header to trailer (``message_render.read_rows_copy_binary``),
    in chunks, written straight into the stream table, hidden until the page's window closes; the
    page is then staged. With ``template`` the messages' data is their records alone (``compact``
    reads) and the page keeps the rest, from which the store serves them whole (``READ_DATA``).
    False when the page is no longer open (nothing is written)."""
    s = ident(schema)
    with conn.transaction(), conn.cursor() as cur:
        if not _lock_open_page(cur, schema, page_id):
            return False
        with cur.copy(
            sql.SQL("COPY {}.stream_messages ({}) FROM STDIN{}").format(
                s,
                sql.SQL(", ").join(map(sql.Identifier, READ_MESSAGE_COLUMNS)),
                sql.SQL(" (FORMAT binary)" if binary else ""),
            )
        ) as copy:
            for chunk in data:
                copy.write(chunk)
        _mark_staged(cur, s, page_id, rows, cursor_after, read_lsn, template)
    conn.commit()
    return True


def closing_windows(conn: psycopg.Connection[Any], schema: str, high_lsns: Sequence[int]) -> dict[int, ClosedWindow]:
    """Pages closed at these high watermark LSNs, rebuilt from the store (a batch re-read from the slot)."""
    s = ident(schema)
    out: dict[int, ClosedWindow] = {}
    pages = conn.execute(
        sql.SQL(
            "SELECT p.id, p.backfill_id, b.sink"
            " FROM {0}.backfill_pages p JOIN {0}.backfills b ON b.id = p.backfill_id"
            " WHERE p.state = 'closing' AND p.high_lsn = ANY(%s)"
        ).format(s),
        (list(high_lsns),),
    ).fetchall()
    for page_id, backfill_id, sink in pages:
        out[int(page_id)] = ClosedWindow(int(page_id), int(backfill_id), str(sink), _kept_rows(conn, s, int(page_id)))
    conn.commit()
    return out


def finish_emitted_pages(conn: psycopg.Connection[Any], schema: str, end_lsn: int) -> int:
    """Stream side, after a batch ending at ``end_lsn`` is delivered: its closing pages are emitted."""
    s = ident(schema)
    with conn.transaction():
        ids = _drop_staged_rows(
            conn,
            s,
            conn.execute(
                sql.SQL(
                    "UPDATE {}.backfill_pages SET state = 'emitted', updated_at = now() WHERE state = 'closing'"
                    " AND high_lsn < %s RETURNING id"
                ).format(s),
                (end_lsn,),
            ).fetchall(),
        )
    conn.commit()
    return len(ids)


def _drop_staged_rows(conn: psycopg.Connection[Any], s: sql.Identifier, pages: Sequence[Sequence[Any]]) -> list[int]:
    """Delete the staged rows of the pages ``(id, …)`` just finished; returns their ids."""
    ids = [int(r[0]) for r in pages]
    if ids:
        conn.execute(sql.SQL("DELETE FROM {}.backfill_rows WHERE page_id = ANY(%s)").format(s), (ids,))
    return ids


@dataclass(frozen=True)
class ReleasedPage:
    """A page the stream app released (``closing`` or ``emitted``) that its job has not counted."""

    id: int
    rows_staged: int
    cursor_after: list[str] | None
    reads_written: bool  # the task wrote its reads (``read_lsn``)


def released_pages_after(
    conn: psycopg.Connection[Any], schema: str, backfill_id: int, range_idx: int, last_page: int | None
) -> list[ReleasedPage]:
    """The chain of released pages that follows ``last_page`` in a range (None: from its start), in
    order: what a job that stopped had in flight and the stream app released (their reads may be
    served and acked already), for the resumed job to count instead of reading their keys again."""
    rows = conn.execute(
        sql.SQL(
            """WITH RECURSIVE chain AS (
                SELECT p.id, p.rows_staged, p.cursor_after, p.read_lsn, 1 AS n FROM {0}.backfill_pages p
                 WHERE p.backfill_id = %(b)s AND p.range_idx = %(r)s AND p.after_page IS NOT DISTINCT FROM %(after)s::bigint
                   AND p.id > coalesce(%(after)s::bigint, 0) AND p.state IN ('closing', 'emitted')
                UNION ALL
                SELECT p.id, p.rows_staged, p.cursor_after, p.read_lsn, c.n + 1 FROM chain c
                  JOIN {0}.backfill_pages p ON p.after_page = c.id
                 WHERE p.backfill_id = %(b)s AND p.range_idx = %(r)s AND p.state IN ('closing', 'emitted'))
            SELECT id, rows_staged, cursor_after, read_lsn IS NOT NULL FROM chain ORDER BY n"""
        ).format(ident(schema)),
        {"b": backfill_id, "r": range_idx, "after": last_page},
    ).fetchall()
    conn.commit()
    return [ReleasedPage(int(r[0]), int(r[1]), r[2], bool(r[3])) for r in rows]


def discard_backfill_page(conn: psycopg.Connection[Any], schema: str, page_id: int) -> None:
    """Job side: give up a page that is not emitted (stale, or the job stops); its rows and hidden reads go."""
    with conn.transaction():
        _stale_pages(conn, ident(schema), [page_id])
    conn.commit()


def abandon_backfill_pages(
    conn: psycopg.Connection[Any], schema: str, backfill_id: int, range_idx: int | None = None
) -> int:
    """Pages of a backfill (or of one of its ranges) left open or staged will never be waited for
    (the job or its task restarts, or the backfill ended): they become stale, and their rows and
    hidden reads go."""
    s = ident(schema)
    with conn.transaction():
        ids = stale_backfill_pages(conn, s, backfill_id, range_idx)
    conn.commit()
    return len(ids)


def stale_backfill_pages(
    conn: psycopg.Connection[Any], s: sql.Identifier, backfill_id: int, range_idx: int | None = None
) -> list[int]:
    """In the caller's transaction: a backfill's (or one range's) open and staged pages become
    ``stale`` (their rows and hidden reads go); returns their ids. For a backfill that stopped
    (``transition_backfill``), and for a job or task that starts over."""
    return _stale_pages(
        conn,
        s,
        [
            r[0]
            for r in conn.execute(
                sql.SQL(
                    "SELECT id FROM {}.backfill_pages WHERE backfill_id = %s AND state IN ('open', 'staged')"
                    " AND (%s::integer IS NULL OR range_idx = %s::integer)"
                ).format(s),
                (backfill_id, range_idx, range_idx),
            ).fetchall()
        ],
    )


def advance_backfill_range(
    conn: psycopg.Connection[Any],
    schema: str,
    backfill_id: int,
    range_idx: int,
    cursor: list[str] | None,
    processed: int,
    emitted: int,
    done: bool,
    page_id: int | None = None,
) -> None:
    """Job side, after a page is emitted: move the range's cursor, record ``page_id`` as the last
    page it counted, and add to the backfill's counts."""
    s = ident(schema)
    with conn.transaction():
        conn.execute(
            sql.SQL(
                "UPDATE {}.backfill_ranges SET cursor = coalesce(%s, cursor), done = %s,"
                " rows_processed = rows_processed + %s, last_page = coalesce(%s, last_page)"
                " WHERE backfill_id = %s AND range_idx = %s"
            ).format(s),
            (Jsonb(cursor) if cursor is not None else None, done, processed, page_id, backfill_id, range_idx),
        )
        done_row = conn.execute(
            sql.SQL(
                "UPDATE {0}.backfills SET cursor = (SELECT jsonb_agg(jsonb_build_object('range', range_idx, 'cursor', cursor,"
                " 'done', done) ORDER BY range_idx) FROM {0}.backfill_ranges WHERE backfill_id = %s),"
                " rows_processed = rows_processed + %s, rows_emitted = rows_emitted + %s, updated_at = now()"
                " WHERE id = %s AND state = 'running' RETURNING id"
            ).format(s),
            (backfill_id, processed, emitted, backfill_id),
        ).fetchone()
        if done_row is None:
            raise BackfillError(f"backfill {backfill_id} is not running: progress not recorded")
    conn.commit()
