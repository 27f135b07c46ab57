"""Reading a backfill's rows: key ranges, keyset pages and the page protocol (DESIGN §7).

``split_key_ranges`` cuts a table's primary-key space into ranges of similar size from a
sample (any key type, composite keys included). ``RangeReader`` walks one range with keyset
pages, each query under ``statement_timeout = max_query_ms``, sized by ``PageSizeOptimizer``, and
runs each page through the watermark window protocol: open the page, emit the low watermark,
select, stage the rows in the store, emit the high watermark; the stream app then marks the page
emitted (the cursor advances) or stale (the page is read again). For a plain Sequin Stream sink
the staging writes the page's reads themselves, at a position just after the low watermark
(``read_position``) and hidden until the window closes, so the stream app only takes back the few
whose key changed. A few pages are in flight at once. Rows are rendered to record JSON with the
pgoutput decoder's own converters, so a read looks exactly like a change of the same row: for a plain
Sequin Stream sink, in this task from the page's plain COPY text (the compiled ``render_copy``, then
``message_render.read_rows_copy_binary``), so the source only reads; otherwise by the source's SQL
(``backfill.source_sql``), or in Python for tables with a column it does not render. Plain Python (no
Spark): the Spark app runs one ``RangeReader`` per task.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import psycopg
import pyarrow as pa
from psycopg import sql

from sequin_provider import store
from sequin_provider.backfill.control import (
    DEFAULT_MAX_PAGE_ROWS,
    DEFAULT_PAGES_IN_FLIGHT,
    DEFAULT_WINDOW_TIMEOUT,
    PageSizeOptimizer,
)
from sequin_provider.backfill.row_filter import row_filter_sql
from sequin_provider.backfill.source_sql import record_sql, text_array_sql
from sequin_provider.backfill.watermarks import (
    HIGH_PREFIX,
    LOW_PREFIX,
    Watermark,
    page_reads,
    read_position,
    wait_for_snapshot_horizon,
    watermark_content,
)
from sequin_provider.config import SequinConfig, SinkConfig
from sequin_provider.delivery import reads_render_in_store
from sequin_provider.message_render import COPY_BINARY_HEADER, COPY_BINARY_TRAILER, read_rows_copy_binary
from sequin_provider.messages import ReadMessageTemplate
from sequin_provider.pgoutput import (
    PgOutputDecoder,
    Relation,
    TypeRegistry,
    parse_array_literal,
    parse_copy_line,
)
from sequin_provider.pq_copy import copy_out_text
from sequin_provider.replication import REPLICATION_SESSION_OPTIONS, Catalog, emit_message, primary_key_columns
from sequin_provider.store import BackfillError, StoreReads

log = logging.getLogger(__name__)

SAMPLE_ROWS = 5_000
FIRST_PAGE_BYTES = 8 * 1024 * 1024  # a first page of about this much row data (``first_page_rows``)
FIRST_PAGE_ROWS = 1_000  # when the rows' width is unknown, or a row condition decides how far a page scans
WIDTH_SAMPLE_ROWS = 100
RENDER_PIECE_BYTES = 1 << 20
"""Bytes of a page's COPY text rendered at a time as the store takes its reads (``rendered_reads``)."""
POLL_DELAY = 0.1
"""The longest pause, in seconds, between looks at a staged page's state (they start at 10 ms)."""
FINAL_POLL_DELAY = 0.02
"""The same for a range's last page, whose emission the backfill's completion waits for."""


@dataclass(frozen=True)
class TableShape:
    """What a backfill needs to know about its table: columns as pgoutput publishes them, key and types."""

    oid: int
    schema: str
    name: str
    columns: tuple[str, ...]
    type_oids: tuple[int, ...]
    types: dict[str, str]  # column -> format_type, for casts of cursor values
    primary_key: tuple[str, ...]
    type_kinds: tuple[str, ...] = ()  # pg_type.typtype per column (a domain's: its base type's)

    @property
    def qualified(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)


def table_shape(conn: psycopg.Connection[Any], schema: str, name: str) -> TableShape:
    """The table's published columns (attnum order, no dropped or generated ones), types and key."""
    rows = conn.execute(
        "SELECT c.oid, a.attname, a.atttypid, format_type(a.atttypid, a.atttypmod),"
        " CASE WHEN t.typtype = 'd' THEN b.typtype ELSE t.typtype END FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_attribute a ON a.attrelid = c.oid"
        " JOIN pg_type t ON t.oid = a.atttypid LEFT JOIN pg_type b ON b.oid = t.typbasetype"
        " WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''"
        " ORDER BY a.attnum",
        (schema, name),
    ).fetchall()
    if not rows:
        raise BackfillError(f"table {schema}.{name} does not exist")
    oid = int(rows[0][0])
    return TableShape(
        oid,
        schema,
        name,
        tuple(r[1] for r in rows),
        tuple(int(r[2]) for r in rows),
        {r[1]: str(r[3]) for r in rows},
        tuple(primary_key_columns(conn, oid)),
        tuple(str(r[4]) for r in rows),
    )


def table_relation(decoder: PgOutputDecoder, shape: TableShape) -> Relation:
    """``decoder``'s relation of the table (its published columns and key, as pgoutput would send
    them), so that a read of a row renders exactly as a change of it."""
    return decoder.make_relation(
        shape.oid,
        shape.schema,
        shape.name,
        "d",
        list(shape.columns),
        list(shape.type_oids),
        [c in shape.primary_key for c in shape.columns],
        list(shape.primary_key),
    )


def first_page_rows(
    conn: psycopg.Connection[Any], shape: TableShape, max_rows: int, where: str | None, budget_ms: int
) -> int:
    """The size of a range's first page: about ``FIRST_PAGE_BYTES`` of rows, from the mean width
    of the published columns of a few of the table's rows (``pg_column_size`` of the row, its
    TOASTed values included), at most ``max_rows``. The page size optimizer grows a page by at most
    2x per page from there: started at 1,000 rows, a table of narrow rows took six pages to reach
    50,000, each waiting for a window of the stream. ``FIRST_PAGE_ROWS`` when that cannot be told
    within the page budget (a lock on the table, say), or when the backfill has a row condition: how
    far a page scans for its rows then depends on how many match."""
    fallback = min(FIRST_PAGE_ROWS, max_rows)
    if where is not None:
        return fallback
    # the published columns by name, as the pages read them (a role may see only those)
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in shape.columns)
    query = sql.SQL(
        "COPY (SELECT avg(pg_column_size(ROW({}))) FROM (SELECT {} FROM {} LIMIT {}) AS r) TO STDOUT"
    ).format(columns, columns, shape.qualified, sql.Literal(WIDTH_SAMPLE_ROWS))
    try:
        width = read_page(conn, query, budget_ms)[0][0]
    except psycopg.errors.QueryCanceled:
        return fallback
    if not width or float(width) <= 0:  # an empty table
        return fallback
    return max(1, min(max_rows, int(FIRST_PAGE_BYTES / float(width))))


def _cast_row(shape: TableShape, columns: Sequence[str], values: Sequence[str]) -> sql.Composed:
    return sql.SQL("ROW({})").format(
        sql.SQL(", ").join(
            sql.SQL("CAST({} AS {})").format(sql.Literal(v), sql.SQL(shape.types[c])) for c, v in zip(columns, values)
        )
    )


def _key_row(columns: Sequence[str]) -> sql.Composed:
    return sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns))


def split_key_ranges(
    conn: psycopg.Connection[Any], shape: TableShape, ranges: int, estimated_rows: int | None
) -> list[tuple[list[str] | None, list[str] | None]]:
    """Cut the primary-key space into up to ``ranges`` ranges ``(lower, upper]`` of similar size.

    Boundaries are keys at even quantiles of a Bernoulli sample of about ``SAMPLE_ROWS`` rows,
    compared as whole (composite) keys, so any key type works: integers, uuid, text.
    """
    if ranges <= 1 or not estimated_rows or estimated_rows < 2 * ranges:
        return [(None, None)]
    percent = min(100.0, 100.0 * SAMPLE_ROWS / max(estimated_rows, 1))
    # qualified names: a bare ORDER BY name would pick the text output column of the same name
    keys = sql.SQL(", ").join(sql.Identifier("k", c) for c in shape.primary_key)
    text_keys = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier("k", c)) for c in shape.primary_key)
    query = sql.SQL("SELECT {} FROM {} AS k TABLESAMPLE BERNOULLI (%s) ORDER BY {}").format(
        text_keys, shape.qualified, keys
    )
    sample = [list(r) for r in conn.execute(query, (percent,)).fetchall()]
    if len(sample) < ranges:
        return [(None, None)]
    bounds: list[list[str]] = []
    for i in range(1, ranges):
        key = sample[i * len(sample) // ranges]
        if not bounds or key != bounds[-1]:
            bounds.append(key)
    lowers: list[list[str] | None] = [None, *bounds]
    uppers: list[list[str] | None] = [*bounds, None]
    return list(zip(lowers, uppers))


@dataclass(frozen=True)
class PageQuery:
    """How one range of one backfill is paged: the order columns and the fixed conditions."""

    shape: TableShape
    order: tuple[str, ...]  # (sort column,) + primary key for partial backfills
    lower: list[str] | None
    upper: list[str] | None
    sort_column: str | None = None
    start_position: str | None = None
    where: str | None = None  # the backfill's row condition (``row_filter``), AND-ed in parentheses

    def sql(self, cursor: Sequence[str] | None, limit: int) -> sql.Composed:
        """``COPY (SELECT every column ... ORDER BY order LIMIT limit) TO STDOUT`` after ``cursor``."""
        return sql.SQL("COPY ({}) TO STDOUT").format(self.select(cursor, limit))

    def staging_sql(
        self, cursor: Sequence[str] | None, limit: int, page_id: int, record: sql.Composable
    ) -> sql.Composed:
        """The same page as ``COPY TO STDOUT`` lines of ``backfill_rows (page_id, ordinal, record_pks, record,
        order_key)``: ``record`` renders each row (``source_sql.record_sql``); the last row carries its
        order key (the page's next cursor)."""
        return sql.SQL("COPY ({}) TO STDOUT").format(self._staging_select(cursor, limit, page_id, record))

    def reads_sql(
        self, cursor: Sequence[str] | None, limit: int, page_id: int, record: sql.Composable, reads: StoreReads
    ) -> sql.Composed:
        """The same page as ``COPY TO STDOUT`` lines of the sink's read messages
        (``store.READ_MESSAGE_COLUMNS``), each followed by the order key column of ``staging_sql``."""
        rows = sql.SQL("({}) AS r (page_id, ordinal, record_pks, record, order_key)").format(
            self._staging_select(cursor, limit, page_id, record)
        )
        return sql.SQL("COPY ({}) TO STDOUT").format(
            store.read_messages_sql(reads, page_id, rows, extra=sql.SQL("r.order_key"))
        )

    def _staging_select(
        self, cursor: Sequence[str] | None, limit: int, page_id: int, record: sql.Composable
    ) -> sql.Composed:
        shape = self.shape
        oids = dict(zip(shape.columns, shape.type_oids))
        window = sql.SQL("OVER (ORDER BY {})").format(sql.SQL(", ").join(sql.Identifier("r", c) for c in self.order))
        return sql.SQL(
            "SELECT {page}, row_number() {w} - 1, {pks}, {record},"
            " CASE WHEN lead(true) {w} IS NULL THEN {order} END FROM ({select}) AS r"
        ).format(
            page=sql.Literal(page_id),
            w=window,
            record=record,
            select=self.select(cursor, limit),
            pks=text_array_sql(shape.primary_key, [oids[c] for c in shape.primary_key]),
            order=text_array_sql(self.order, [oids[c] for c in self.order]),
        )

    def select(self, cursor: Sequence[str] | None, limit: int) -> sql.Composed:
        """``SELECT every column ... ORDER BY order LIMIT limit`` after ``cursor``."""
        shape = self.shape
        where: list[sql.Composable] = [row_filter_sql(self.where)] if self.where is not None else []
        if self.sort_column is not None:
            where.append(
                sql.SQL("{} >= CAST({} AS {})").format(
                    sql.Identifier(self.sort_column),
                    sql.Literal(self.start_position),
                    sql.SQL(shape.types[self.sort_column]),
                )
            )
        if self.lower is not None:
            where.append(
                sql.SQL("{} > {}").format(_key_row(shape.primary_key), _cast_row(shape, shape.primary_key, self.lower))
            )
        if self.upper is not None:
            where.append(
                sql.SQL("{} <= {}").format(_key_row(shape.primary_key), _cast_row(shape, shape.primary_key, self.upper))
            )
        if cursor is not None:
            where.append(sql.SQL("{} > {}").format(_key_row(self.order), _cast_row(shape, self.order, cursor)))
        condition = sql.SQL(" AND ").join(where) if where else sql.SQL("true")
        return sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in shape.columns),
            shape.qualified,
            condition,
            sql.SQL(", ").join(sql.Identifier(c) for c in self.order),
            sql.Literal(limit),
        )


def copy_out(conn: psycopg.Connection[Any], query: sql.Composed, budget_ms: int | None = None) -> bytearray:
    """Run a ``COPY … TO STDOUT`` and return its text-format output (one buffer, grown in place:
    a page is tens of megabytes, and every copy of it costs; read at libpq's level,
    ``pq_copy.copy_out_text``, without psycopg's wait loop per row).

    With ``budget_ms``, that statement alone runs under ``statement_timeout`` (a timeout raises
    ``QueryCanceled``): a page's budget must not cancel the watermarks around it, which would
    fail the backfill on a slow commit instead of reading a smaller page. The connection must be
    in autocommit: the timeout is set for the session, the COPY runs as its own transaction and
    the timeout is reset after it, so a cancel can only end one statement. (In a transaction block
    with ``SET LOCAL``, its COMMIT or ROLLBACK ran under the budget too: a cancel landing there on a
    loaded machine left the session in an aborted transaction, and the page's high watermark
    failed the backfill; CI, PostgreSQL 17.)"""
    if budget_ms is None:
        return copy_out_text(conn, query)
    if not conn.autocommit:
        raise ValueError("copy_out with a budget needs an autocommit connection")
    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(budget_ms)))
    try:
        return copy_out_text(conn, query)
    finally:
        _reset_statement_timeout(conn)


def _reset_statement_timeout(conn: psycopg.Connection[Any]) -> None:
    """``RESET statement_timeout``, again if the budget still armed for it cancels it (it runs
    under the budget it resets: a loaded machine can stall it that long)."""
    for attempt in range(5):
        try:
            conn.execute("RESET statement_timeout")
            return
        except psycopg.errors.QueryCanceled:
            if attempt == 4:
                raise


def read_page(
    conn: psycopg.Connection[Any], query: sql.Composed, budget_ms: int | None = None
) -> list[list[str | None]]:
    """Run a page's COPY (under ``budget_ms``, as ``copy_out``) and return its rows as text values."""
    return [parse_copy_line(line) for line in copy_out(conn, query, budget_ms).decode("utf-8").split("\n") if line]


def page_end(data: bytes | bytearray, positions: Sequence[int]) -> tuple[int, list[str] | None]:
    """(rows, the last row's order key: its values at ``positions``) of a page of ``PageQuery.sql``."""
    if not data:
        return 0, None
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    last = parse_copy_line(bytes(data[data.rfind(b"\n", 0, end) + 1 : end]).decode("utf-8"))
    return data.count(b"\n"), [str(last[p]) for p in positions]


@dataclass(frozen=True)
class RenderedPage:
    """A page's reads rendered in the task, compact: ``rows`` reads as COPY binary ``chunks`` for
    ``store.stage_page_reads_copy``, which must be given ``template`` with them (the messages hold
    their records alone and the page keeps the rest). One value so the two cannot disagree."""

    rows: int
    chunks: Iterable[bytes | memoryview]
    """Rendered as the COPY takes them (``rendered_reads``): iterate once."""
    template: ReadMessageTemplate


def rendered_reads(
    decoder: PgOutputDecoder,
    rel: Relation,
    data: bytes | bytearray,
    reads: StoreReads,
    page_id: int,
    rows: int,
    piece_bytes: int = RENDER_PIECE_BYTES,
) -> RenderedPage:
    """A page of ``PageQuery.sql`` (``rows`` lines) as its reads for a plain Sequin Stream sink,
    rendered in this task (``PgOutputDecoder.render_copy``, then ``message_render.read_rows_copy_binary``),
    compact (their records alone: the page keeps ``reads.template``).

    The page is rendered ``piece_bytes`` of its text at a time, as the COPY takes the chunks, so the
    store inserts one piece while this task renders the next (rendered whole, the store waited for
    the whole page, and the task for the store). Rendered lines other than ``rows`` raise
    ``BackfillError`` before the COPY's end: nothing is staged."""

    def pieces() -> Iterator[bytes | memoryview]:
        yield COPY_BINARY_HEADER
        done = 0
        for piece in line_pieces(data, piece_bytes):
            records, record_offsets, pks, pk_offsets, n = decoder.render_copy(rel, piece)
            body = read_rows_copy_binary(
                replace(reads, commit_idx=reads.commit_idx + done),  # the piece's first read follows the last one's
                page_id,
                pa.StringArray.from_buffers(n, pa.py_buffer(record_offsets), pa.py_buffer(records)),
                pa.StringArray.from_buffers(n, pa.py_buffer(pk_offsets), pa.py_buffer(pks)),
                compact=True,
            )
            done += n
            yield memoryview(body)
        if done != rows:  # both count the page's lines; a mismatch would misstate progress
            raise BackfillError(f"page {page_id}: {done} rows rendered of {rows} read")
        yield COPY_BINARY_TRAILER

    return RenderedPage(rows, pieces(), reads.template)


def line_pieces(data: bytes | bytearray, size: int) -> Iterator[memoryview]:
    """``data`` (lines of COPY text) in pieces of about ``size`` bytes, each ending at a line's end
    (the last one at the data's end), without copying."""
    view, start, end = memoryview(data), 0, len(data)
    while start < end:
        cut = data.find(b"\n", min(start + size, end) - 1)
        stop = end if cut < 0 else cut + 1
        yield view[start:stop]
        start = stop


def staged_page_end(data: bytes | bytearray) -> tuple[int, list[str] | None]:
    """(rows, the last row's order key) of a page rendered by ``PageQuery.staging_sql``."""
    if not data:
        return 0, None
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    last = parse_copy_line(bytes(data[data.rfind(b"\n", 0, end) + 1 : end]).decode("utf-8"))[-1]
    if last is None:
        raise BackfillError("a rendered backfill page ends without its order key")
    return data.count(b"\n"), [str(v) for v in parse_array_literal(last)]


def without_order_key(data: bytes | bytearray) -> bytearray:
    """COPY text lines from ``PageQuery.reads_sql`` without their last column, the order key (null
    on every line but the last; a null field is ``\\N``, and tabs and newlines inside fields are
    escaped, so a line ending in a tab and ``\\N`` is a null last column, and the last line's last
    tab is the one before its order key). One copy of the page: the null keys go in one pass."""
    body = bytearray(data.replace(b"\t\\N\n", b"\n")) if isinstance(data, bytes) else data.replace(b"\t\\N\n", b"\n")
    if not body.endswith(b"\n"):
        body += b"\n"
    del body[body.rfind(b"\t") : -1]  # the last line's order key
    return body


class BackfillStopped(RuntimeError):
    """The backfill stopped being ``running`` (cancelled or failed elsewhere) while a range was read."""


@dataclass
class RangeResult:
    """What one range reader did."""

    range_idx: int
    rows_processed: int = 0
    rows_emitted: int = 0
    pages: int = 0
    stale_pages: int = 0
    done: bool = False


@dataclass(frozen=True)
class StagedPage:
    """A page up to its high watermark, waiting for the stream app: its key interval and timings."""

    page_id: int
    rows: int
    size: int  # rows asked for: fewer means the range is read to its end
    cursor_before: list[str] | None
    cursor_after: list[str] | None
    staged_at: float
    select_ms: float
    stage_ms: float
    reads_written: bool = False  # the task wrote the page's reads: its window's close is final
    after_page: int | None = None  # the page whose last key this page starts after (None: the range's start)


class RangeReader:
    """Reads one range of a backfill page by page through the watermark window protocol.

    Up to ``pages_in_flight`` pages wait for the stream app at once: the next page is read while
    the stream app emits the previous ones, so a page's round trip through the stream app is not
    paid page after page. Windows of one range never overlap (each page's low watermark follows
    the previous page's high watermark), and the range's cursor advances over emitted pages in
    order only. Each page names the page it follows, and the stream app releases a page only after
    the one it follows, so a stale page makes the pages after it stale too: they are read again from
    its start, and no row whose read was released is read twice. A job that resumes counts the
    pages its predecessor left released (``store.released_pages_after``) and reads on after them.
    """

    def __init__(
        self,
        config: SequinConfig,
        database: str,
        backfill_id: int,
        range_idx: int,
        max_page_rows: int = DEFAULT_MAX_PAGE_ROWS,
        window_timeout: float = DEFAULT_WINDOW_TIMEOUT,
        on_page: Callable[[RangeResult], None] | None = None,
        pages_in_flight: int = DEFAULT_PAGES_IN_FLIGHT,
    ) -> None:
        self.config = config
        self.database = config.database(database)
        self.backfill_id = backfill_id
        self.range_idx = range_idx
        self.max_page_rows = max_page_rows
        self.window_timeout = window_timeout
        self.on_page = on_page
        self.pages_in_flight = max(1, pages_in_flight)
        self.schema = config.store.schema

    def run(self) -> RangeResult:
        """Read the range to its end (resuming from its stored cursor)."""
        with store.connect_durable(self.config.store_dsn(self.database.name), connect_timeout=10) as store_conn:
            backfill = store.get_backfill(store_conn, self.schema, self.backfill_id)
            rng = next(
                r
                for r in store.backfill_ranges(store_conn, self.schema, self.backfill_id)
                if r.range_idx == self.range_idx
            )
            store_conn.commit()
            result = RangeResult(self.range_idx, done=rng.done)
            if rng.done:
                return result
            # the walsender's text forms (DateStyle, TimeZone…), so a read renders exactly like a change
            with psycopg.connect(
                self.database.dsn, autocommit=True, connect_timeout=10, options=REPLICATION_SESSION_OPTIONS
            ) as source:
                return self._read(source, store_conn, backfill, rng, result)

    def _read(
        self,
        source: psycopg.Connection[Any],
        store_conn: psycopg.Connection[Any],
        backfill: store.Backfill,
        rng: store.BackfillRange,
        result: RangeResult,
    ) -> RangeResult:
        shape = table_shape(source, backfill.table_schema, backfill.table_name)
        catalog = Catalog(self.database.dsn)
        try:
            decoder = PgOutputDecoder(TypeRegistry(catalog.type_info))
            rel = table_relation(decoder, shape)
            sink = self.config.sink(backfill.sink) if self.config.has_sink(backfill.sink) else None
            # a sink whose reads the task writes itself (``delivery.reads_render_in_store``)
            read_sink = sink if sink is not None and reads_render_in_store(sink, shape.schema, shape.name) else None
            # its reads are rendered here from the page's plain COPY text by the compiled decoder;
            # otherwise by the source's SQL where it can, else by the decoder in Python
            in_task = read_sink is not None and decoder.compiled
            record = None if in_task else record_sql(rel, shape.type_kinds)
            log.info(
                "backfill %d range %d: rows of %s.%s rendered by %s",
                self.backfill_id,
                self.range_idx,
                shape.schema,
                shape.name,
                "this task's compiled decoder"
                if in_task
                else "the source's SQL"
                if record is not None
                else "the decoder (Python)",
            )
            order = ((backfill.sort_column,) if backfill.sort_column else ()) + shape.primary_key
            query = PageQuery(
                shape,
                order,
                rng.lower_key,
                rng.upper_key,
                backfill.sort_column,
                backfill.start_position,
                backfill.where,
            )
            positions = [shape.columns.index(c) for c in order]
            first_rows = first_page_rows(source, shape, self.max_page_rows, backfill.where, backfill.max_query_ms)
            optimizer = PageSizeOptimizer(backfill.max_query_ms, initial_size=first_rows, max_size=self.max_page_rows)
            cursor: list[str] | None = list(rng.cursor) if rng.cursor is not None else None
            # pages an earlier attempt at this range left waiting (a retried task) go stale: only the
            # released ones count
            store.abandon_backfill_pages(store_conn, self.schema, self.backfill_id, self.range_idx)
            # pages an earlier run left released but did not count: their reads may be served (and
            # acked) already, so they are waited for and counted, and reading goes on after them
            in_flight: deque[StagedPage] = deque(self._released(store_conn, rng, cursor))
            after_page = in_flight[-1].page_id if in_flight else rng.last_page
            if in_flight:
                cursor = in_flight[-1].cursor_after
                log.info(
                    "backfill %d range %d: %d pages an earlier run left released (%d rows) are counted, not read again",
                    self.backfill_id,
                    self.range_idx,
                    len(in_flight),
                    sum(p.rows for p in in_flight),
                )
            read_all = False
            while True:
                state = store.get_backfill(store_conn, self.schema, self.backfill_id).state
                store_conn.commit()
                if state != "running":
                    raise BackfillStopped(f"backfill {self.backfill_id} is {state}")
                if not read_all:
                    page = self._stage(
                        source,
                        store_conn,
                        shape,
                        rel,
                        decoder,
                        query,
                        positions,
                        optimizer,
                        cursor,
                        after_page,
                        record,
                        read_sink,
                        in_task,
                    )
                    if page is None:  # timed out: the same page again, smaller
                        continue
                    read_all = page.rows < page.size
                    if page.rows:
                        in_flight.append(page)
                        cursor, after_page = page.cursor_after, page.page_id
                # the stream app emits pages in order; wait for the oldest once enough are in flight
                while in_flight and (read_all or len(in_flight) >= self.pages_in_flight):
                    oldest = in_flight.popleft()
                    # a range's last page waits for its batch, so a completed backfill's reads are all served
                    emitted = self._wait_emitted(store_conn, oldest, final=read_all and not in_flight)
                    if emitted is None:  # stale: read again from its start; the pages after it go stale too
                        result.stale_pages += 1
                        for later in in_flight:
                            self._wait_emitted(store_conn, later, quiet=True)
                        in_flight.clear()
                        cursor, after_page, read_all = oldest.cursor_before, oldest.after_page, False
                        break
                    done = read_all and not in_flight
                    store.advance_backfill_range(
                        store_conn,
                        self.schema,
                        self.backfill_id,
                        self.range_idx,
                        oldest.cursor_after,
                        oldest.rows,
                        emitted,
                        done,
                        oldest.page_id,
                    )
                    result.rows_processed += oldest.rows
                    result.rows_emitted += emitted
                    result.pages += 1
                    result.done = done
                    if self.on_page:
                        self.on_page(result)
                if read_all and not in_flight:
                    if not result.done:  # the last page was empty: nothing left to wait for
                        store.advance_backfill_range(
                            store_conn, self.schema, self.backfill_id, self.range_idx, cursor, 0, 0, True
                        )
                    result.done = True
                    return result
        finally:
            catalog.close()

    def _stage(
        self,
        source: psycopg.Connection[Any],
        store_conn: psycopg.Connection[Any],
        shape: TableShape,
        rel: Relation,
        decoder: PgOutputDecoder,
        query: PageQuery,
        positions: list[int],
        optimizer: PageSizeOptimizer,
        cursor: list[str] | None,
        after_page: int | None,
        record: sql.Composable | None = None,
        read_sink: SinkConfig | None = None,
        in_task: bool = False,
    ) -> StagedPage | None:
        """One page into the window protocol, up to its high watermark: the page staged (with 0 rows
        at the end of the range), or None to read it again (it timed out). With ``read_sink`` the
        page's reads are written for that sink now, hidden until the window closes: ``in_task``,
        rendered here from the page's plain COPY text (``rendered_reads``). Otherwise, with ``record``
        (``source_sql.record_sql``) the source renders the rows and they are staged as bytes;
        without it the decoder renders them in Python."""
        size = optimizer.size
        page_id = store.open_backfill_page(store_conn, self.schema, self.backfill_id, self.range_idx, after_page)
        mark = Watermark(self.backfill_id, page_id, self.range_idx, shape.schema, shape.name, shape.primary_key)
        emit_message(source, LOW_PREFIX, watermark_content(mark))
        last = False  # the page ends its range
        try:
            reads: StoreReads | None = None
            if read_sink is not None:
                position, stamp = read_position(source)
                reads = page_reads(
                    read_sink, self.database.name, self.backfill_id, shape.schema, shape.name, stamp, position
                )
            wait_for_snapshot_horizon(source)
            started = time.monotonic()
            try:
                if in_task:
                    data = copy_out(source, query.sql(cursor, size), optimizer.max_query_ms)
                elif record is not None:
                    data = copy_out(
                        source,
                        query.staging_sql(cursor, size, page_id, record)
                        if reads is None
                        else query.reads_sql(cursor, size, page_id, record, reads),
                        optimizer.max_query_ms,
                    )
                else:
                    values = read_page(source, query.sql(cursor, size), optimizer.max_query_ms)
            except psycopg.errors.QueryCanceled:
                optimizer.observe(size, 0, timed_out=True)
                log.warning(
                    "backfill %d range %d: a page of %d rows hit max_query_ms=%d; next page %d rows",
                    self.backfill_id,
                    self.range_idx,
                    size,
                    optimizer.max_query_ms,
                    optimizer.size,
                )
                if size <= optimizer.min_size:
                    raise BackfillError(
                        f"a page of {size} rows of {shape.schema}.{shape.name} still takes longer than"
                        f" max_query_ms={optimizer.max_query_ms}: raise the budget or index the"
                        f" sort column"
                    ) from None
                store.discard_backfill_page(store_conn, self.schema, page_id)
                return None
            optimizer.observe(size, (time.monotonic() - started) * 1000.0)
            staged = True
            if in_task and reads is not None:  # reads: set whenever in_task
                rows, cursor_after = page_end(data, positions)
                if rows:
                    rendered = rendered_reads(decoder, rel, data, reads, page_id, rows)
                    staged = store.stage_page_reads_copy(
                        store_conn,
                        self.schema,
                        page_id,
                        rendered.chunks,
                        rows,
                        cursor_after,
                        reads.commit_lsn,
                        binary=True,
                        template=rendered.template,
                    )
            elif record is not None:
                rows, cursor_after = staged_page_end(data)
                if rows and reads is not None:
                    staged = store.stage_page_reads_copy(
                        store_conn,
                        self.schema,
                        page_id,
                        (without_order_key(data),),
                        rows,
                        cursor_after,
                        reads.commit_lsn,
                    )
                elif rows:
                    staged = store.stage_backfill_copy(store_conn, self.schema, page_id, data, rows, cursor_after)
            else:
                rows = len(values)
                rendered = [decoder.render_values(rel, v)[::-1] for v in values]  # (record_pks, record)
                cursor_after = [str(values[-1][p]) for p in positions] if values else None
                if rows:
                    staged = store.stage_backfill_page(store_conn, self.schema, page_id, rendered, cursor_after, reads)
            last = rows < size
            if not staged:
                raise BackfillStopped(
                    f"backfill {self.backfill_id} page {page_id} was taken back before it was staged"
                    " (the backfill stopped)"
                )
            if not rows:
                store.discard_backfill_page(store_conn, self.schema, page_id)
        finally:
            emit_message(source, HIGH_PREFIX, watermark_content(replace(mark, last=last)))  # always close the window
        select_ms = optimizer.observations[-1].elapsed_ms
        return StagedPage(
            page_id,
            rows,
            size,
            cursor,
            cursor_after,
            time.monotonic(),
            select_ms,
            (time.monotonic() - started) * 1000 - select_ms,
            reads is not None,
            after_page,
        )

    def _released(
        self, store_conn: psycopg.Connection[Any], rng: store.BackfillRange, cursor: list[str] | None
    ) -> list[StagedPage]:
        """The released pages after the range's last counted page, as pages in flight."""
        pages: list[StagedPage] = []
        previous, before = rng.last_page, cursor
        for page in store.released_pages_after(
            store_conn, self.schema, self.backfill_id, self.range_idx, rng.last_page
        ):
            now = time.monotonic()
            pages.append(
                StagedPage(
                    page.id,
                    page.rows_staged,
                    page.rows_staged,
                    before,
                    page.cursor_after,
                    now,
                    0.0,
                    0.0,
                    page.reads_written,
                    previous,
                )
            )
            previous, before = page.id, page.cursor_after
        return pages

    def _wait_emitted(
        self, store_conn: psycopg.Connection[Any], page: StagedPage, quiet: bool = False, final: bool = False
    ) -> int | None:
        """Wait for the stream app to take a staged page: its reads emitted (their count), or None
        when its window was broken by a stream app restart (the page is read again). Reads the task
        wrote are settled once the window closed (``closing``: a replayed batch keeps that answer),
        so only a ``final`` page waits for the batch that makes them visible to consumers."""
        waiting_since = time.monotonic()
        deadline = waiting_since + self.window_timeout
        delay = 0.01
        # a range's last page ends the backfill's run once emitted: looked at closely, the rest are
        # behind pages still being read (pages in flight)
        longest = FINAL_POLL_DELAY if final else POLL_DELAY
        settled = ("emitted", "stale", "closing") if page.reads_written and not final else ("emitted", "stale")
        while True:
            state = store.get_backfill_page(store_conn, self.schema, page.page_id)
            if state.state in settled:
                break
            if time.monotonic() > deadline:
                store.discard_backfill_page(store_conn, self.schema, page.page_id)
                raise BackfillError(
                    f"the stream app did not take page {page.page_id} within"
                    f" {self.window_timeout:.0f}s: is the stream app (`sequin stream`) running for"
                    " this database?"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, longest)
        if not quiet:
            now = time.monotonic()
            log.info(
                "backfill %d range %d page %d: %d rows; select %.0f ms, render+stage %.0f ms, window %.0f ms"
                " (waited %.0f ms)",
                self.backfill_id,
                self.range_idx,
                page.page_id,
                page.rows,
                page.select_ms,
                page.stage_ms,
                (now - page.staged_at) * 1000,
                (now - waiting_since) * 1000,
            )
        if state.state == "stale":
            if not quiet:
                log.info(
                    "backfill %d range %d: page %d is stale (its window was broken by a stream app restart);"
                    " reading again from its start",
                    self.backfill_id,
                    self.range_idx,
                    page.page_id,
                )
            return None
        return int(state.rows_emitted or 0)
