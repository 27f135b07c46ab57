"""backfill_reader on a real Postgres: a page's query budget covers that query and nothing else; a
page's COPY bytes lose their order key column exactly; a range's first page holds about
``FIRST_PAGE_BYTES`` of rows."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from sequin_provider.backfill.reader import (
    FIRST_PAGE_BYTES,
    FIRST_PAGE_ROWS,
    PageQuery,
    copy_out,
    first_page_rows,
    read_page,
    staged_page_end,
    table_shape,
    without_order_key,
)


def test_a_page_budget_cancels_the_page_query_and_only_it(dsn: str) -> None:
    """The watermarks around a page run on the same connection: the budget must not outlive the page
    (CI once failed a backfill when a high watermark's commit took longer than a 300 ms budget)."""
    slow = sql.SQL("COPY (SELECT pg_sleep(0.6), 1) TO STDOUT")
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = conn.execute("SHOW statement_timeout").fetchone()
        with pytest.raises(psycopg.errors.QueryCanceled):
            copy_out(conn, slow, budget_ms=100)
        # after a cancelled page and after a page that fit, the session is as it was
        assert read_page(conn, sql.SQL("COPY (SELECT E'a\\tb', NULL) TO STDOUT"), budget_ms=5000) == [["a\tb", None]]
        assert conn.execute("SHOW statement_timeout").fetchone() == before
        started = conn.execute("SELECT clock_timestamp()").fetchone()
        conn.execute("SELECT pg_sleep(0.3), pg_logical_emit_message(true, 'sequin:test', '')")  # a slow watermark
        assert conn.execute("SELECT clock_timestamp() - %s >= interval '0.3 s'", started).fetchone() == (True,)
        assert copy_out(conn, slow) == b"\t1\n"  # no budget: the statement runs to its end


def test_wherever_a_budget_cancel_lands_the_session_is_left_idle_and_as_it_was(dsn: str) -> None:
    """Budgets about as long as the page, so the cancel lands anywhere from before the first row to
    the statement's end: after each page, cancelled or not, no transaction is open, the session's
    timeout is its own and a watermark can be written. (CI failed a backfill on PostgreSQL 17 when a
    cancel left the session in an aborted transaction; the race could not be made to happen on
    purpose, so this asserts the state it broke on every landing point it can reach.)"""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS budget_pages AS SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, 60000) g"
        )
        before = conn.execute("SHOW statement_timeout").fetchone()
        cancelled = 0
        for i in range(60):
            rows = 5000 + (i * 997) % 55000
            try:
                copy_out(conn, sql.SQL(f"COPY (SELECT * FROM budget_pages ORDER BY id LIMIT {rows}) TO STDOUT"), 15)
            except psycopg.errors.QueryCanceled:
                cancelled += 1
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert conn.execute("SHOW statement_timeout").fetchone() == before
            conn.execute("SELECT pg_logical_emit_message(true, 'sequin:test', '')")
        assert cancelled > 0
        with pytest.raises(ValueError, match="autocommit"):
            conn.autocommit = False
            copy_out(conn, sql.SQL("COPY (SELECT 1) TO STDOUT"), 15)


def test_a_reads_page_loses_exactly_its_order_key_column(dsn: str) -> None:
    """Every line but the last has a null order key; values that look like one (a text ``\\N``, tabs,
    newlines, backslashes) stay as they are: the result is what Postgres writes for the page without
    that column."""
    values = ["plain", "\\N", "ends in \\", "tab\there", "line\nbreak", "\\N\t", "", None, "last"]
    rows = sql.SQL(", ").join(
        sql.SQL("({}, {}::int)").format(sql.Literal(v), sql.Literal(i)) for i, v in enumerate(values)
    )
    page = sql.SQL(
        "SELECT v, i, CASE WHEN i = {} THEN ARRAY[v, E'k\\t\\\\N'] END FROM (VALUES {}) AS t (v, i) ORDER BY i"
    ).format(sql.Literal(len(values) - 1), rows)
    with psycopg.connect(dsn, autocommit=True) as conn:
        data = copy_out(conn, sql.SQL("COPY ({}) TO STDOUT").format(page))
        expected = copy_out(conn, sql.SQL("COPY (SELECT v, i FROM ({}) AS p) TO STDOUT").format(page))
    assert staged_page_end(data) == (len(values), ["last", "k\t\\N"])
    assert bytes(without_order_key(data)) == bytes(expected)
    assert bytes(without_order_key(bytes(data))) == bytes(expected)


def test_pages_with_a_condition_walk_the_keyset_and_hold_exactly_the_matching_rows(dsn: str) -> None:
    """The condition is AND-ed in parentheses with the keyset predicate: small pages over two key
    ranges (and a partial backfill's start) read exactly the matching rows, each once, in key order;
    an ``OR`` in it does not widen a page past its cursor or its range."""
    where = "status = 'paid' AND region = 'eu' OR id = 3"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS paid_orders")
        conn.execute("CREATE TABLE paid_orders (id int PRIMARY KEY, status text, region text, at int)")
        conn.execute(
            "INSERT INTO paid_orders SELECT g, CASE WHEN g % 3 = 0 THEN 'paid' ELSE 'open' END,"
            " CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g % 50 FROM generate_series(1, 997) g"
        )
        shape = table_shape(conn, "public", "paid_orders")

        def walk(query: PageQuery) -> list[int]:
            ids: list[int] = []
            cursor = None
            for _ in range(200):  # a condition that escaped its parentheses would page forever
                rows = read_page(conn, query.sql(cursor, 7))
                if not rows:
                    return ids
                ids += [int(r[0]) for r in rows]  # type: ignore[arg-type]
                cursor = [str(rows[-1][shape.columns.index(c)]) for c in query.order]
            raise AssertionError(f"pages did not end: {ids[:20]}")

        full = [
            i
            for lower, upper in ((None, ["500"]), (["500"], None))
            for i in walk(PageQuery(shape, ("id",), lower, upper, where=where))
        ]
        assert full == [3] + [g for g in range(1, 998) if g % 6 == 0]
        partial = walk(PageQuery(shape, ("at", "id"), None, None, "at", "40", where=where))
        assert sorted(partial) == [g for g in range(1, 998) if g % 6 == 0 and g % 50 >= 40]
        assert len(partial) == len(set(partial))


def test_a_first_page_holds_about_its_bytes_of_rows_whatever_their_width(dsn: str) -> None:
    """Narrow rows start at the page ceiling, wide (TOASTed) rows at a few; an empty table, a backfill
    with a row condition and a table locked past the page budget at ``FIRST_PAGE_ROWS``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE fp_narrow (id bigint PRIMARY KEY, n int)")
        conn.execute("INSERT INTO fp_narrow SELECT g, g FROM generate_series(1, 1000) g")
        # 200 kB of incompressible text per row: stored out of line, counted at its full size
        conn.execute("CREATE TABLE fp_wide (id bigint PRIMARY KEY, body text)")
        conn.execute(
            "INSERT INTO fp_wide SELECT g, (SELECT string_agg(md5(g::text || ':' || i), '')"
            " FROM generate_series(1, 6250) i) FROM generate_series(1, 20) g"
        )
        conn.execute("CREATE TABLE fp_empty (id bigint PRIMARY KEY)")
        narrow, wide, empty = (table_shape(conn, "public", t) for t in ("fp_narrow", "fp_wide", "fp_empty"))
        narrow_width = conn.execute("SELECT avg(pg_column_size(ROW(id, n))) FROM fp_narrow").fetchone()[0]

        assert first_page_rows(conn, narrow, 50_000, None, 5000) == 50_000
        assert first_page_rows(conn, narrow, 10_000_000, None, 5000) == int(FIRST_PAGE_BYTES / float(narrow_width))
        assert (
            FIRST_PAGE_BYTES // 200_100
            <= first_page_rows(conn, wide, 50_000, None, 5000)
            <= FIRST_PAGE_BYTES // 200_000
        )
        assert first_page_rows(conn, empty, 50_000, None, 5000) == FIRST_PAGE_ROWS
        assert first_page_rows(conn, narrow, 50_000, "n > 5", 5000) == FIRST_PAGE_ROWS
        assert first_page_rows(conn, narrow, 500, "n > 5", 5000) == 500
        with psycopg.connect(dsn) as locker:  # a lock held past the budget: the default, not a wait
            locker.execute("LOCK TABLE fp_narrow IN ACCESS EXCLUSIVE MODE")
            assert first_page_rows(conn, narrow, 50_000, None, 200) == FIRST_PAGE_ROWS


def test_a_first_page_reads_only_the_published_columns(dsn: str) -> None:
    """A role that may read the published columns and not a generated one still gets its first page
    sized (a ``SELECT *`` sample would be refused)."""
    role = f"fp_reader_{psycopg.conninfo.conninfo_to_dict(dsn)['dbname']}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE fp_cols (id bigint PRIMARY KEY, n int, doubled int GENERATED ALWAYS AS (n * 2) STORED)"
        )
        conn.execute("INSERT INTO fp_cols (id, n) SELECT g, g FROM generate_series(1, 100) g")
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("GRANT SELECT (id, n) ON fp_cols TO {}").format(sql.Identifier(role)))
            shape = table_shape(conn, "public", "fp_cols")
        assert shape.columns == ("id", "n")
        with psycopg.connect(dsn, user=role, autocommit=True) as reader:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                reader.execute("SELECT * FROM fp_cols LIMIT 1")
            assert first_page_rows(reader, shape, 50_000, None, 5000) == 50_000
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {0}; DROP ROLE {0}").format(sql.Identifier(role)))


def test_a_page_rendered_piece_by_piece_is_the_page_rendered_whole(dsn: str) -> None:
    """``rendered_reads`` renders a page's COPY text a piece at a time as the COPY takes it: whatever
    the piece size (every line its own piece, a few lines, the whole page), the bytes are those of the
    page rendered at once, the reads numbered on across pieces; a page that renders other than the
    lines counted raises before its last chunk (the COPY is never completed)."""
    import pyarrow as pa

    from sequin_provider.backfill.reader import line_pieces, rendered_reads
    from sequin_provider.backfill.watermarks import page_reads
    from sequin_provider.config import parse_config
    from sequin_provider.message_render import COPY_BINARY_HEADER, COPY_BINARY_TRAILER, read_rows_copy_binary
    from sequin_provider.pgoutput import PgOutputDecoder, TypeRegistry
    from sequin_provider.replication import Catalog
    from sequin_provider.store import BackfillError

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE pieces (id int PRIMARY KEY, v text, j jsonb)")
        conn.execute(  # lines of different lengths; text with a newline and a tab (escaped in COPY text)
            "INSERT INTO pieces SELECT g, repeat('x', g % 50) || E'\\n\\t' || g, jsonb_build_object('g', g)"
            " FROM generate_series(1, 300) g"
        )
        shape = table_shape(conn, "public", "pieces")
        data = copy_out(conn, sql.SQL("COPY (SELECT * FROM {} ORDER BY id) TO STDOUT").format(shape.qualified))
    catalog = Catalog(dsn)
    try:
        decoder = PgOutputDecoder(TypeRegistry(catalog.type_info))
        rel = decoder.make_relation(
            shape.oid, shape.schema, shape.name, "d", list(shape.columns), list(shape.type_oids),
            [c in shape.primary_key for c in shape.columns], list(shape.primary_key),
        )  # fmt: skip
    finally:
        catalog.close()
    config = parse_config(
        {
            "databases": [{"name": "app", "dsn": dsn}],
            "sinks": [{"name": "s", "tables": ["pieces"], "destination": {"type": "sequin_stream"}}],
        },
        "sequin.yaml",
        environ={},
    )
    reads = page_reads(config.sinks[0], "app", 7, "public", "pieces", "2026-12-02T07:00:00Z", 5_000, 3)
    assert reads is not None
    records, record_offsets, pks, pk_offsets, rows = decoder.render_copy(rel, data)
    assert rows == 300
    whole = read_rows_copy_binary(
        reads,
        11,
        pa.StringArray.from_buffers(rows, pa.py_buffer(record_offsets), pa.py_buffer(records)),
        pa.StringArray.from_buffers(rows, pa.py_buffer(pk_offsets), pa.py_buffer(pks)),
        compact=True,
    )
    expected = COPY_BINARY_HEADER + whole.to_pybytes() + COPY_BINARY_TRAILER
    for size in (1, 100, 5_000, len(data)):
        assert b"".join(bytes(p) for p in line_pieces(data, size)) == bytes(data)
        pieces = list(line_pieces(data, size))
        assert all(bytes(p).endswith(b"\n") for p in pieces)
        rendered = rendered_reads(decoder, rel, data, reads, 11, rows, piece_bytes=size)
        assert rendered.rows == rows and rendered.template == reads.template
        assert b"".join(bytes(c) for c in rendered.chunks) == expected, size
    chunks = iter(rendered_reads(decoder, rel, data, reads, 11, rows + 1, piece_bytes=100).chunks)
    with pytest.raises(BackfillError, match="300 rows rendered of 301"):
        for chunk in chunks:
            assert chunk != COPY_BINARY_TRAILER  # the error comes before the trailer
