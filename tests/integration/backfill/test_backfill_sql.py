"""Rows rendered by the source's SQL (backfill_sql) are byte for byte what pgoutput's changes carry.

Every scalar type of the decoder's type matrix, with hostile values (control characters, padding,
infinities, BC dates, offsets, NaN, -0, whitespace kept by json), is inserted through a real slot
and rendered by ``record_sql`` on the same rows: the two record JSON texts must be equal. Tables
with columns the SQL does not render (arrays, composite types) keep the Python rendering.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from sequin_provider.backfill.reader import PageQuery, staged_page_end, table_relation, table_shape
from sequin_provider.backfill.source_sql import record_sql
from sequin_provider.pgoutput import PgOutputDecoder, Relation, TypeRegistry
from sequin_provider.replication import REPLICATION_SESSION_OPTIONS, Catalog
from tests.support.capture import capture
from tests.support.postgres import execute
from tests.support.type_matrix import TYPE_MATRIX

EDGE_VALUES: dict[str, list[str]] = {
    "text": ["E'tab\\tnl\\ncr\\r bs\\\\ q\" \\x01 \\x1f \\x7f \\u00fc \\U0001F600 \\u2028 \\b\\f'", "''", "'{\"x\"}'"],
    "char(5)": ["''", "'a b'", "'abcde'"],
    "bool": ["false"],
    "int8": ["-9223372036854775808", "0"],
    "numeric": ["'Infinity'", "'-Infinity'", "'-0.000'", "1e-20", "0"],
    "float8": ["'-0'", "1e-300", "1.7976931348623157e308", "'NaN'", "0.30000000000000004"],
    "float4": ["3.4028235e38", "1.17549435e-38", "'-Infinity'"],
    "timestamptz": [
        "'-infinity'",
        "'0044-03-15 12:00:00+00 BC'",
        "'10000-01-01 00:00:00+00'",
        "'2024-01-02 03:04:05.123456+00'",
        "'1900-01-01 00:00:00+00'",
    ],
    "timestamp": ["'infinity'", "'0001-01-01 00:00:00 BC'", "'2024-01-02 03:04:05'", "'12345-06-07 08:09:10'"],
    "timetz": ["'00:00:00+14'", "'23:59:59.999999-12:30'", "'24:00:00+00'"],
    "time": ["'24:00:00'"],
    "date": ["'infinity'", "'4713-01-01 BC'"],
    "interval": ["'-1 day'", "'0'", "'1 mon -2 days 00:00:00.000001'"],
    "inet": ["'192.168.0.1'", "'::1'"],
    "json": ["'  [1, 2,  \"\\u0001\"]  '", "'null'"],
    "jsonb": ['\'{"z": 1, "a": "\\u00e9\\u0001"}\'', "'\"x\"'"],
    "bytea": ["'\\x'::bytea"],
    "oid": ["4294967295"],
    '"char"': ["'a'"],
    "name": ["'a name'"],
    "flag": ["true", "false"],
    "stamp": ["'2024-05-06 07:08:09.5+00'"],
}
"""More values per type (the matrix holds one each); every type also gets a NULL."""

TYPES = list(dict.fromkeys([typ for typ, _, _ in TYPE_MATRIX if not typ.endswith("[]")] + list(EDGE_VALUES)))


def relation(dsn: str, table: str) -> tuple[Relation, Any]:
    """The decoder's relation of ``table`` (as a backfill makes it) and its shape."""
    with psycopg.connect(dsn) as conn:
        shape = table_shape(conn, "public", table)
    catalog = Catalog(dsn)
    try:
        decoder = PgOutputDecoder(TypeRegistry(catalog.type_info))
        rel = table_relation(decoder, shape)
    finally:
        catalog.close()
    return rel, shape


def test_every_scalar_type_renders_in_sql_exactly_as_the_change_carries_it(dsn: str) -> None:
    execute(
        dsn,
        "CREATE TYPE mood AS ENUM ('sad', 'happy')",
        "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
        "CREATE DOMAIN email AS text",
        "CREATE DOMAIN flag AS bool",
        "CREATE DOMAIN stamp AS timestamptz",
    )
    tables, inserts = [], []
    for i, typ in enumerate(TYPES):
        values = [v for t, v, _ in TYPE_MATRIX if t == typ] + EDGE_VALUES.get(typ, []) + ["NULL"]
        tables.append(f"t{i}")
        execute(dsn, f"CREATE TABLE t{i} (id int PRIMARY KEY, v {typ})")
        inserts += [f"INSERT INTO t{i} VALUES ({n}, {v})" for n, v in enumerate(values)]
    changes = capture(dsn, tables, "BEGIN; " + "; ".join(inserts) + "; COMMIT")
    by_change = {(row[5], row[9][0]): row[7] for row in changes}
    assert len(by_change) == len(inserts)

    compared = 0
    # another TimeZone and DateStyle on the server side must not matter: the session sets the walsender's
    with psycopg.connect(dsn, autocommit=True, options=REPLICATION_SESSION_OPTIONS) as conn:
        for i, typ in enumerate(TYPES):
            rel, shape = relation(dsn, f"t{i}")
            record = record_sql(rel, shape.type_kinds)
            assert record is not None, f"{typ} should render in SQL"
            rows = conn.execute(
                sql.SQL("SELECT r.id::text, {} FROM {} AS r ORDER BY r.id").format(record, sql.Identifier(f"t{i}"))
            ).fetchall()
            for pk, rendered in rows:
                assert rendered == by_change[(f"t{i}", pk)], (
                    f"{typ} row {pk}: {rendered!r} != {by_change[(f't{i}', pk)]!r}"
                )
                compared += 1
    assert compared == len(inserts)


def test_arrays_and_composites_keep_the_python_rendering(dsn: str) -> None:
    execute(
        dsn,
        "CREATE TYPE pair AS (a int, b text)",
        "CREATE DOMAIN pairs AS pair",
        "CREATE TABLE arr (id int PRIMARY KEY, v int[])",
        "CREATE TABLE comp (id int PRIMARY KEY, v pair)",
        "CREATE TABLE dcomp (id int PRIMARY KEY, v pairs)",
        "CREATE TABLE plain (id int PRIMARY KEY, v text)",
    )
    for table, rendered in (("arr", False), ("comp", False), ("dcomp", False), ("plain", True)):
        rel, shape = relation(dsn, table)
        assert (record_sql(rel, shape.type_kinds) is not None) is rendered, table


def test_a_rendered_page_carries_keys_and_its_order_key_through_copy(dsn: str) -> None:
    """Keys with tabs, newlines, quotes, braces and backslashes survive COPY into ``record_pks``, and
    the last row's order key (the next cursor) parses back to the key's text."""
    keys = ["a\tb", "c\nd", 'q"r', "{s}", "back\\slash", "NULL", "sp ace", "ü"]
    execute(dsn, "CREATE TABLE k (name text, n int, PRIMARY KEY (name, n))")
    with psycopg.connect(dsn) as conn:
        conn.cursor().executemany("INSERT INTO k VALUES (%s, %s)", [(key, i) for i, key in enumerate(keys)])
    rel, shape = relation(dsn, "k")
    record = record_sql(rel, shape.type_kinds)
    assert record is not None
    query = PageQuery(shape, shape.primary_key, None, None)
    with psycopg.connect(dsn, autocommit=True, options=REPLICATION_SESSION_OPTIONS) as conn:
        with conn.cursor() as cur, cur.copy(query.staging_sql(None, 5, 77, record)) as copy:
            data = b"".join(bytes(d) for d in copy)
        conn.execute(
            "CREATE TEMP TABLE staged (page_id bigint, ordinal int, record_pks text[], record text, order_key text[])"
        )
        with conn.cursor() as cur, cur.copy("COPY staged FROM STDIN") as copy:
            copy.write(data)
        staged = conn.execute(
            "SELECT page_id, ordinal, record_pks, record, order_key FROM staged ORDER BY ordinal"
        ).fetchall()
    with psycopg.connect(dsn) as conn:  # the page: the first 5 keys in the table's key order
        expected = [tuple(r) for r in conn.execute("SELECT name, n::text FROM k ORDER BY name, n LIMIT 5").fetchall()]
    assert [tuple(r[2]) for r in staged] == expected
    assert [r[0] for r in staged] == [77] * 5 and [r[1] for r in staged] == list(range(5))
    assert [r[4] for r in staged] == [None] * 4 + [list(expected[-1])]
    decoder_records = [PgOutputDecoder(TypeRegistry()).render_values(rel, list(key))[0] for key in expected]
    assert [r[3] for r in staged] == decoder_records
    assert staged_page_end(data) == (5, list(expected[-1]))
    assert staged_page_end(b"") == (0, None)


def test_a_page_without_its_order_key_is_an_error() -> None:
    from sequin_provider.store import BackfillError

    with pytest.raises(BackfillError, match="order key"):
        staged_page_end(b"1\t0\t{1}\t{}\t\\N\n")
