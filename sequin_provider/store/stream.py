"""The stream table: writing a micro-batch's messages (COPY, replays, the acked ledger), the
visibility watermark, and reading messages back for tests and tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

import psycopg
from psycopg import sql

from sequin_provider.messages import MessageTemplate
from sequin_provider.store.connection import ident

READS_RELEASED = """(m.backfill_page IS NULL OR EXISTS (SELECT 1 FROM {s}.backfill_pages p
                   WHERE p.id = m.backfill_page AND p.state IN ('closing', 'emitted')))"""
"""SQL condition on a message ``m`` of ``stream_messages``: not a backfill read still waiting for its
page's window to close (``{s}``: the store's schema identifier)."""

READ_DATA = """CASE WHEN {m}.template IS NOT NULL THEN {m}.data || {t}.before_ts || {m}.commit_timestamp
    || '","commit_lsn":' || {m}.commit_lsn || ',"commit_idx":' || {m}.commit_idx || ',"idempotency_key":"'
    || {m}.idempotency_key || '","record_pks":' || substr({m}.group_id, {t}.pks_from) || {t}.after_pks
    WHEN {m}.backfill_page IS NULL THEN {m}.data ELSE coalesce((SELECT p.read_template[1] || {m}.data
    || p.read_template[2] || {m}.commit_idx || ',"idempotency_key":' || to_json({m}.idempotency_key)::text
    || ',"record_pks":' || substr({m}.idempotency_key, length(p.backfill_id::text) + 11) || p.read_template[3]
    FROM {s}.backfill_pages p WHERE p.id = {m}.backfill_page), {m}.data) END"""
"""SQL of the whole message JSON of a message ``{m}`` of ``stream_messages``, as consumers are served
it. A change stored compact (``message_render.render``'s ``compact``) holds its own part of the
message and its commit timestamp, and names its template (``messages.MessageTemplate``); the rest
comes from its position, key and group id; the query joins the template as ``{t}``
(``TEMPLATE_JOIN``: a join, where a subquery per message cost 0.8 µs more of the store's CPU per
message served). A backfill read the task wrote compact (``message_render.read_rows_copy_binary``) holds its
record alone, and its page the template around it (``backfill_pages.read_template``: before the
record, before the index, after the keys, as ``messages.ReadMessageTemplate``); the message is put
together here as the renderer would have written it: the key as a JSON string (``to_json``, as
``read_messages_sql``) and the keys JSON from the key, ``backfill:<id>:<keys JSON>``. Every other
message (a null template) holds its whole JSON."""


TEMPLATE_JOIN = "LEFT JOIN {s}.message_templates {t} ON {t}.id = {template}"
"""SQL joining a message's template (``message_templates``) as ``{t}`` for ``READ_DATA``, by the
message's ``{template}`` column."""


StreamRow = tuple
"""(sink, commit_lsn, commit_idx, group_id, idempotency_key, data JSON[, barrier]): a truncate
message's barrier (migration 12); without it, null. Its message is whole (a null template)."""

STREAM_COLUMNS = (
    "sink",
    "commit_lsn",
    "commit_idx",
    "group_id",
    "idempotency_key",
    "data",
    "barrier",
    "template",
    "commit_timestamp",
)
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
    fields = [copy_text(v) for v in row[:6]]
    fields.append(copy_text(row[6]) if len(row) > 6 and row[6] is not None else "\\N")
    fields += ["\\N", "\\N"]  # whole: no template, no commit timestamp of its own
    return "\t".join(fields)


def insert_stream_messages(conn: psycopg.Connection[Any], schema: str, rows: Sequence[StreamRow]) -> int:
    """Durably add messages to the stream; a replayed batch adds nothing, and no message whose
    position its sink acked (``stream_acked``). Returns the new count."""
    lsns = [int(r[1]) for r in rows]
    span = (min(lsns), max(lsns)) if lsns else None
    return insert_stream_copy(conn, schema, ["".join(copy_line(r) + "\n" for r in rows)], span=lambda: span)


CopyChunk = Union[str, bytes, memoryview]
Span = Callable[[], tuple[int, int] | None]
"""The lowest and highest commit LSN of the rows a write took, asked once its chunks are consumed
(None: it took none)."""
_ANY_POSITION = (0, (1 << 63) - 1)


def insert_stream_copy(
    conn: psycopg.Connection[Any],
    schema: str,
    chunks: Iterable[CopyChunk],
    consumed: list[CopyChunk] | None = None,
    binary: bool = False,
    span: Span | None = None,
) -> int:
    """Like ``insert_stream_messages`` for rows already in COPY format, streamed chunk by chunk.

    Chunks are whole lines (``copy_line`` + newline), or with ``binary`` the pieces of one COPY
    binary stream (header, tuples, trailer: ``message_render``), and are sent as they come, so the server
    works while the producer renders the next chunk. Fast path: COPY straight into the table.
    When a row is already there (the batch is a replay after a crash), the COPY fails on the
    primary key (the position) and the rows go through a temporary table with
    ``ON CONFLICT DO NOTHING`` instead. Every chunk taken is appended to ``consumed`` (so a
    caller can retry after a connection failure). Returns the number of new rows; commits.

    Rows at positions their sink acked (``stream_acked``: a replay of a batch consumers took part
    of) are taken out again before the commit, by a statement of their own (``drop_acked``).
    ``span`` bounds the positions to look up; without it every ledger entry is. A batch that is not
    a replay lies above every acked position, so for it the look-up finds nothing in the index.
    """
    seen: list[CopyChunk] = consumed if consumed is not None else []
    pending = iter(chunks)  # one pass: after a failure, only what was not taken remains
    copy_format = sql.SQL("(FORMAT binary)" if binary else "")
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in STREAM_COLUMNS)
    target = sql.SQL("{}.stream_messages").format(ident(schema))
    try:
        with conn.transaction(), conn.cursor() as cur:
            with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN {}").format(target, columns, copy_format)) as copy:
                for chunk in pending:
                    seen.append(chunk)
                    copy.write(chunk)
            copied = max(cur.rowcount, 0)
            bounds = span() if span is not None else _ANY_POSITION
            return copied - drop_acked(cur, schema, *bounds) if copied and bounds is not None else copied
    except psycopg.errors.UniqueViolation:
        seen.extend(pending)  # whatever the failed COPY did not take yet
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(
            "CREATE TEMP TABLE IF NOT EXISTS sequin_incoming (sink text, commit_lsn bigint, commit_idx integer,"
            " group_id text, idempotency_key text, data text, barrier text, template integer, commit_timestamp text)"
            " ON COMMIT DELETE ROWS"
        )
        with cur.copy(sql.SQL("COPY sequin_incoming ({}) FROM STDIN {}").format(columns, copy_format)) as copy:
            for chunk in seen:
                copy.write(chunk)
        cur.execute(
            sql.SQL(
                "INSERT INTO {} ({}) SELECT {} FROM sequin_incoming ORDER BY commit_lsn, commit_idx"
                " ON CONFLICT DO NOTHING"
            ).format(target, columns, columns)
        )
        inserted = max(cur.rowcount, 0)
        lowest, highest = cur.execute("SELECT min(commit_lsn), max(commit_lsn) FROM sequin_incoming").fetchone() or (
            None,
            None,
        )
        return inserted - drop_acked(cur, schema, lowest, highest) if inserted else 0


def message_template_ids(conn: psycopg.Connection[Any], schema: str, templates: Sequence[MessageTemplate]) -> list[int]:
    """The store's id of each of ``templates`` (``message_templates``), adding those it lacks; for
    writing compact changes (``message_render.stream_rows_copy_binary``). One round trip when all
    are known, as they are after a sink's first write; commits."""
    s = ident(schema)
    columns = (
        [t.before_ts for t in templates],
        [t.after_pks for t in templates],
        [t.pks_from for t in templates],
    )
    known = sql.SQL(
        "SELECT t.id FROM unnest(%s::text[], %s::text[], %s::integer[]) WITH ORDINALITY w(b, a, p, n)"
        " LEFT JOIN {}.message_templates t ON t.before_ts = w.b AND t.after_pks = w.a AND t.pks_from = w.p"
        " ORDER BY w.n"
    ).format(s)
    with conn.transaction():
        ids = [row[0] for row in conn.execute(known, columns)]
        if None in ids:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.message_templates (before_ts, after_pks, pks_from)"
                    " SELECT DISTINCT * FROM unnest(%s::text[], %s::text[], %s::integer[]) ON CONFLICT DO NOTHING"
                ).format(s),
                columns,
            )
            ids = [row[0] for row in conn.execute(known, columns)]
    conn.commit()
    return [int(i) for i in ids]


def drop_acked(cur: psycopg.Cursor[Any], schema: str, lowest: int, highest: int) -> int:
    """Delete the stream rows at positions their sink acked (``stream_acked``) among the ledger
    entries whose LSN range meets ``lowest``..``highest``; returns how many.

    For a write, in the write's transaction but in statements of their own after it: an ack that
    deleted a row the write then waited for (its key) has committed by then, and these statements'
    snapshots see its ledger entry (the write's did not), so the row written again goes. The
    positions are read first (none for a batch that is not a replay: one index look-up), then
    deleted by key: one statement joining the ledger to the stream table may be planned as a hash
    join over the whole table (measured before the ledger was analyzed: 385 ms for a 1,000,000-row
    table, against 4 ms by key)."""
    s = ident(schema)
    found = cur.execute(
        sql.SQL(
            "SELECT a.sink, p.lsn, p.idx FROM {}.stream_acked a, unnest(a.lsns, a.idxs) p(lsn, idx)"
            " WHERE a.max_lsn >= %s AND a.min_lsn <= %s"
        ).format(s),
        (lowest, highest),
    ).fetchall()
    if not found:
        return 0
    sinks, lsns, idxs = (list(column) for column in zip(*found))
    cur.execute(
        sql.SQL(
            "DELETE FROM {}.stream_messages m USING unnest(%s::text[], %s::bigint[], %s::integer[]) x(sink, lsn, idx)"
            " WHERE m.sink = x.sink AND m.commit_lsn = x.lsn AND m.commit_idx = x.idx"
        ).format(s),
        (sinks, lsns, idxs),
    )
    return max(cur.rowcount, 0)


def prune_acked(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str], lsn: int) -> int:
    """The slot has passed ``lsn`` (the stream app acknowledged it, after Spark committed the batch
    that ends there): no replay can bring back a message of ``sinks`` committed below it, so the
    ledger entries whose positions all lie below it go, and later acks of such messages record
    nothing (``passed_lsn``, never moves back). Returns how many positions were forgotten; commits."""
    s = ident(schema)
    with conn.transaction():
        conn.execute(
            sql.SQL("UPDATE {}.stream_visibility SET passed_lsn = %s WHERE sink = ANY(%s) AND passed_lsn < %s").format(
                s
            ),
            (lsn, list(sinks), lsn),
        )
        dropped = conn.execute(
            sql.SQL(
                "WITH gone AS (DELETE FROM {}.stream_acked WHERE max_lsn < %s AND sink = ANY(%s)"
                " RETURNING cardinality(lsns) AS n) SELECT coalesce(sum(n), 0) FROM gone"
            ).format(s),
            (lsn, list(sinks)),
        ).fetchone()
    conn.commit()
    return int(dropped[0]) if dropped else 0


def acked_positions(conn: psycopg.Connection[Any], schema: str, sink: str) -> list[tuple[int, int]]:
    """The positions of ``sink`` in the acked ledger (acked, not yet passed by the slot), in order."""
    return [
        (int(lsn), int(idx))
        for lsn, idx in conn.execute(
            sql.SQL(
                "SELECT p.lsn, p.idx FROM {}.stream_acked a, unnest(a.lsns, a.idxs) p(lsn, idx) WHERE a.sink = %s"
                " ORDER BY p.lsn, p.idx"
            ).format(ident(schema)),
            (sink,),
        ).fetchall()
    ]


def advance_visible_lsn(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str], lsn: int) -> None:
    """Make the sinks' messages up to commit LSN ``lsn`` visible to readers (never moves back).

    Called once every partition of a micro-batch has committed: a batch written in several
    transactions, or interrupted by a crash, stays invisible until it is whole, so a reader never
    sees a later message of a group without the earlier ones. Readers serve only messages with
    ``commit_lsn <= visible_lsn``.
    """
    with conn.transaction():
        conn.execute(
            sql.SQL(
                "INSERT INTO {0}.stream_visibility (sink, visible_lsn) SELECT unnest(%s::text[]), %s"
                " ON CONFLICT (sink) DO UPDATE SET visible_lsn = greatest({0}.stream_visibility.visible_lsn,"
                " EXCLUDED.visible_lsn), updated_at = now()"
            ).format(ident(schema)),
            (list(sinks), lsn),
        )
        # wake long-polling receivers of these sinks (delivered at commit; payload: schema/sink)
        conn.execute(
            "SELECT pg_notify(%s, %s || '/' || s) FROM unnest(%s::text[]) s", (VISIBLE_CHANNEL, schema, list(sinks))
        )
    conn.commit()


VISIBLE_CHANNEL = "sequin_visible"
"""NOTIFY channel announcing that a sink has new visible messages (payload ``schema/sink``)."""


def visible_lsn(conn: psycopg.Connection[Any], schema: str, sink: str) -> int | None:
    """Up to which commit LSN a sink's messages are complete and may be served."""
    row = conn.execute(
        sql.SQL("SELECT visible_lsn FROM {}.stream_visibility WHERE sink = %s").format(ident(schema)), (sink,)
    ).fetchone()
    return None if row is None else int(row[0])


@dataclass(frozen=True)
class StoredMessage:
    """A message as it sits in the stream table."""

    sink: str
    commit_lsn: int
    commit_idx: int
    group_id: str
    idempotency_key: str
    data: str


def stream_messages(
    conn: psycopg.Connection[Any], schema: str, sink: str | None = None, visible_only: bool = False
) -> list[StoredMessage]:
    """All messages of a sink (or all sinks), in position order.

    ``visible_only`` returns what a consumer may be served: messages at or below their sink's
    visibility watermark (a batch still being written is left out), without the backfill reads
    whose window is still open.
    """
    conditions = [sql.SQL("m.sink = %s")] if sink else []
    if visible_only:
        conditions.append(
            sql.SQL("m.commit_lsn <= (SELECT v.visible_lsn FROM {}.stream_visibility v WHERE v.sink = m.sink)").format(
                ident(schema)
            )
        )
        conditions.append(sql.SQL(READS_RELEASED).format(s=ident(schema)))
    where = sql.SQL("WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    s, m, t = ident(schema), sql.Identifier("m"), sql.Identifier("t")
    query = sql.SQL(
        "SELECT m.sink, m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key, {}"
        " FROM {}.stream_messages m {} {} ORDER BY m.sink, m.commit_lsn, m.commit_idx"
    ).format(
        sql.SQL(READ_DATA).format(m=m, s=s, t=t),
        s,
        sql.SQL(TEMPLATE_JOIN).format(s=s, t=t, template=sql.SQL("m.template")),
        where,
    )
    return [StoredMessage(*r) for r in conn.execute(query, (sink,) if sink else ()).fetchall()]
