"""Schema changes with a backlog pending (DESIGN §6 "Schema changes"): every change flows through
with the row as the Relation message in force described it (columns, key columns), never with
today's catalog.

The first tests read a backlog with the change reader alone (no Spark): the DDL and the writes
around it are all in the WAL before the reader starts, so the catalog it could look at is the
final one, as when a stopped stream app is started again. The last test does the same through the
stream app and the Sequin Stream sink: start, write, stop, DDL + writes, start again.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import psycopg
import pytest

from sequin_provider.embedded_postgres import EmbeddedPostgres
from tests.conftest import StreamApp, execute, sink_messages, wait_for, write_config
from tests.test_pgoutput import capture

Change = tuple[str, str, dict[str, Any], Any, list[str]]
"""(table, action, record, changes, record_pks) of one change."""


def changes_of(rows: list[tuple]) -> list[Change]:
    """The change rows the reader decoded, as (table, action, record, changes, record_pks)."""
    return [(r[5], r[6], json.loads(r[7], parse_float=Decimal), None if r[8] is None else json.loads(r[8]),
             list(r[9])) for r in rows if r[6] != "message"]


# ---------------------------------------------------------------------------------------------
# The reader over a backlog (no Spark)


def test_a_renamed_key_column_keeps_the_key_rows_were_written_under(dsn: str) -> None:
    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)", "CREATE TABLE f (id int PRIMARY KEY, v text)",
            "ALTER TABLE f REPLICA IDENTITY FULL")
    rows = capture(dsn, ["t", "f"],
                   "INSERT INTO t VALUES (1, 'a'), (2, 'b')", "UPDATE t SET v = 'a1' WHERE id = 1",
                   "DELETE FROM t WHERE id = 2", "INSERT INTO f VALUES (1, 'a')",
                   "ALTER TABLE t RENAME COLUMN id TO key_id", "ALTER TABLE f RENAME COLUMN id TO key_id",
                   "INSERT INTO t VALUES (3, 'c')", "UPDATE t SET key_id = 4 WHERE key_id = 3",
                   "DELETE FROM t WHERE key_id = 1", "INSERT INTO f VALUES (2, 'b')")
    assert changes_of(rows) == [
        ("t", "insert", {"id": 1, "v": "a"}, None, ["1"]),
        ("t", "insert", {"id": 2, "v": "b"}, None, ["2"]),
        ("t", "update", {"id": 1, "v": "a1"}, {}, ["1"]),
        ("t", "delete", {"id": 2}, None, ["2"]),
        # FULL: the WAL does not say which columns are the key; today's key is not in the row as written
        ("f", "insert", {"id": 1, "v": "a"}, None, []),
        ("t", "insert", {"key_id": 3, "v": "c"}, None, ["3"]),
        ("t", "update", {"key_id": 4, "v": "c"}, {"key_id": 3}, ["4"]),
        ("t", "delete", {"key_id": 1}, None, ["1"]),
        ("f", "insert", {"key_id": 2, "v": "b"}, None, ["2"]),
    ]


def test_a_primary_key_change_keeps_the_key_rows_were_written_under(dsn: str) -> None:
    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL, v int)")
    rows = capture(dsn, ["t"],
                   "INSERT INTO t VALUES (1, 'a', 0), (2, 'b', 0)", "UPDATE t SET v = 1 WHERE id = 1",
                   "ALTER TABLE t DROP CONSTRAINT t_pkey",
                   "INSERT INTO t VALUES (3, 'c', 0)",  # no key at all while the table has none
                   "ALTER TABLE t ADD PRIMARY KEY (code)",
                   "INSERT INTO t VALUES (4, 'd', 0)", "UPDATE t SET v = 2 WHERE code = 'a'",
                   "UPDATE t SET code = 'c2' WHERE code = 'c'", "DELETE FROM t WHERE code = 'b'")
    assert changes_of(rows) == [
        ("t", "insert", {"id": 1, "code": "a", "v": 0}, None, ["1"]),
        ("t", "insert", {"id": 2, "code": "b", "v": 0}, None, ["2"]),
        ("t", "update", {"id": 1, "code": "a", "v": 1}, {}, ["1"]),
        ("t", "insert", {"id": 3, "code": "c", "v": 0}, None, []),
        ("t", "insert", {"id": 4, "code": "d", "v": 0}, None, ["d"]),
        ("t", "update", {"id": 1, "code": "a", "v": 2}, {}, ["a"]),
        ("t", "update", {"id": 3, "code": "c2", "v": 0}, {"code": "c"}, ["c2"]),
        ("t", "delete", {"code": "b"}, None, ["b"]),
    ]


def test_a_key_declared_out_of_column_order_keeps_its_key_order(dsn: str) -> None:
    """The Relation message flags key columns in column order; ``record_pks`` is in key order
    (as backfills read it) whenever today's key has the same columns, and in column order for rows
    written under another key than today's (which the stream cannot order otherwise)."""
    execute(dsn, "CREATE TABLE k (a text, b int, c text, PRIMARY KEY (b, a))",
            "CREATE TABLE k2 (a text, b int, c text, PRIMARY KEY (b, a))")
    rows = capture(dsn, ["k", "k2"],
                   "INSERT INTO k VALUES ('x', 1, 'y')", "UPDATE k SET c = 'z'", "DELETE FROM k",
                   "INSERT INTO k2 VALUES ('x', 2, 'y')", "DELETE FROM k2",
                   "ALTER TABLE k ADD COLUMN d int", "INSERT INTO k VALUES ('x', 3, 'y', 4)",
                   "ALTER TABLE k2 DROP CONSTRAINT k2_pkey", "ALTER TABLE k2 ADD PRIMARY KEY (c, b)",
                   "INSERT INTO k2 VALUES ('w', 3, 'v')")
    assert changes_of(rows) == [
        ("k", "insert", {"a": "x", "b": 1, "c": "y"}, None, ["1", "x"]),
        ("k", "update", {"a": "x", "b": 1, "c": "z"}, {}, ["1", "x"]),
        ("k", "delete", {"a": "x", "b": 1}, None, ["1", "x"]),
        ("k2", "insert", {"a": "x", "b": 2, "c": "y"}, None, ["x", "2"]),  # not today's key: column order
        ("k2", "delete", {"a": "x", "b": 2}, None, ["x", "2"]),
        ("k", "insert", {"a": "x", "b": 3, "c": "y", "d": 4}, None, ["3", "x"]),
        ("k2", "insert", {"a": "w", "b": 3, "c": "v"}, None, ["v", "3"]),
    ]


def test_type_changes_render_by_the_type_in_force(dsn: str) -> None:
    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY, n int, amount numeric(10,2), code int)")
    rows = capture(dsn, ["t"],
                   "INSERT INTO t VALUES (1, 10, 1.5, 7)",
                   "ALTER TABLE t ALTER COLUMN id TYPE bigint, ALTER COLUMN n TYPE bigint,"
                   " ALTER COLUMN amount TYPE numeric(20,4), ALTER COLUMN code TYPE text",
                   "INSERT INTO t VALUES (9000000000, 9000000000, 3.1234, 'x9')", "UPDATE t SET n = 11 WHERE id = 1")
    assert [r[7] for r in rows] == [
        '{"id":1,"n":10,"amount":1.50,"code":7}',
        '{"id":9000000000,"n":9000000000,"amount":3.1234,"code":"x9"}',
        '{"id":1,"n":11,"amount":1.5000,"code":"7"}',
    ]
    assert [r[9] for r in rows] == [["1"], ["9000000000"], ["1"]]
