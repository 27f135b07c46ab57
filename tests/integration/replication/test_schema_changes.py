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

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from tests.support.capture import capture
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

Change = tuple[str, str, dict[str, Any], Any, list[str]]
"""(table, action, record, changes, record_pks) of one change."""


def changes_of(rows: list[tuple]) -> list[Change]:
    """The change rows the reader decoded, as (table, action, record, changes, record_pks)."""
    return [
        (r[5], r[6], json.loads(r[7], parse_float=Decimal), None if r[8] is None else json.loads(r[8]), list(r[9]))
        for r in rows
        if r[6] != "message"
    ]


# ---------------------------------------------------------------------------------------------
# The reader over a backlog (no Spark)


def test_a_renamed_key_column_keeps_the_key_rows_were_written_under(dsn: str) -> None:
    execute(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "CREATE TABLE f (id int PRIMARY KEY, v text)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
    )
    rows = capture(
        dsn,
        ["t", "f"],
        "INSERT INTO t VALUES (1, 'a'), (2, 'b')",
        "UPDATE t SET v = 'a1' WHERE id = 1",
        "DELETE FROM t WHERE id = 2",
        "INSERT INTO f VALUES (1, 'a')",
        "ALTER TABLE t RENAME COLUMN id TO key_id",
        "ALTER TABLE f RENAME COLUMN id TO key_id",
        "INSERT INTO t VALUES (3, 'c')",
        "UPDATE t SET key_id = 4 WHERE key_id = 3",
        "DELETE FROM t WHERE key_id = 1",
        "INSERT INTO f VALUES (2, 'b')",
    )
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
    rows = capture(
        dsn,
        ["t"],
        "INSERT INTO t VALUES (1, 'a', 0), (2, 'b', 0)",
        "UPDATE t SET v = 1 WHERE id = 1",
        "ALTER TABLE t DROP CONSTRAINT t_pkey",
        "INSERT INTO t VALUES (3, 'c', 0)",  # no key at all while the table has none
        "ALTER TABLE t ADD PRIMARY KEY (code)",
        "INSERT INTO t VALUES (4, 'd', 0)",
        "UPDATE t SET v = 2 WHERE code = 'a'",
        "UPDATE t SET code = 'c2' WHERE code = 'c'",
        "DELETE FROM t WHERE code = 'b'",
    )
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
    execute(
        dsn,
        "CREATE TABLE k (a text, b int, c text, PRIMARY KEY (b, a))",
        "CREATE TABLE k2 (a text, b int, c text, PRIMARY KEY (b, a))",
    )
    rows = capture(
        dsn,
        ["k", "k2"],
        "INSERT INTO k VALUES ('x', 1, 'y')",
        "UPDATE k SET c = 'z'",
        "DELETE FROM k",
        "INSERT INTO k2 VALUES ('x', 2, 'y')",
        "DELETE FROM k2",
        "ALTER TABLE k ADD COLUMN d int",
        "INSERT INTO k VALUES ('x', 3, 'y', 4)",
        "ALTER TABLE k2 DROP CONSTRAINT k2_pkey",
        "ALTER TABLE k2 ADD PRIMARY KEY (c, b)",
        "INSERT INTO k2 VALUES ('w', 3, 'v')",
    )
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
    rows = capture(
        dsn,
        ["t"],
        "INSERT INTO t VALUES (1, 10, 1.5, 7)",
        "ALTER TABLE t ALTER COLUMN id TYPE bigint, ALTER COLUMN n TYPE bigint,"
        " ALTER COLUMN amount TYPE numeric(20,4), ALTER COLUMN code TYPE text",
        "INSERT INTO t VALUES (9000000000, 9000000000, 3.1234, 'x9')",
        "UPDATE t SET n = 11 WHERE id = 1",
    )
    assert [r[7] for r in rows] == [
        '{"id":1,"n":10,"amount":1.50,"code":7}',
        '{"id":9000000000,"n":9000000000,"amount":3.1234,"code":"x9"}',
        '{"id":1,"n":11,"amount":1.5000,"code":"7"}',
    ]
    assert [r[9] for r in rows] == [["1"], ["9000000000"], ["1"]]


# ---------------------------------------------------------------------------------------------
# The stream app: start, write, stop, DDL + writes (the backlog), start again

TABLES = ["t_add", "t_drop", "t_rename", "t_type", "t_pk", "t_recreate"]

SCHEMA = [
    "CREATE TABLE t_add (id int PRIMARY KEY, v text)",
    "CREATE TABLE t_drop (id int PRIMARY KEY, v text, gone int)",
    "CREATE TABLE t_rename (id int PRIMARY KEY, v text)",
    "CREATE TABLE t_type (id int PRIMARY KEY, n int, amount numeric(10,2), code int)",
    "CREATE TABLE t_pk (id int PRIMARY KEY, code text NOT NULL, v int)",
    "CREATE TABLE t_recreate (id int PRIMARY KEY, v text)",
    "CREATE TABLE extra (id int PRIMARY KEY, v text)",  # no sink lists it at first, nor the publication
]

CONFIG = """
databases:
  - name: shop
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
{sinks}
stream:
  checkpoint_location: {checkpoint}
"""


def config_text(dsn: str, db: str, checkpoint: Path, tables: list[str]) -> str:
    """A config with one Sequin Stream sink per table, named after it."""
    sinks = "".join(f"  - name: {t}\n    destination: {{type: sequin_stream}}\n    tables: [{t}]\n" for t in tables)
    return CONFIG.format(dsn=dsn, db=db, checkpoint=checkpoint, sinks=sinks)


def wait_counts(dsn: str, app: StreamApp, counts: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Wait until every sink holds its count of messages; all of them, per sink."""

    def enough() -> dict[str, list[dict[str, Any]]] | None:
        app.check_alive()
        got = {sink: sink_messages(dsn, sink) for sink in counts}
        return got if all(len(got[s]) >= n for s, n in counts.items()) else None

    try:
        return wait_for(enough, 240, what=f"messages in sinks {counts}")
    except TimeoutError as exc:
        got = {sink: summary(sink_messages(dsn, sink)) for sink in counts}
        raise AssertionError(f"{exc}; the sinks hold {got}\n{app.log_tail()}") from None


def summary(messages: list[dict[str, Any]]) -> list[Change]:
    """(table, action, record, changes, record_pks) of each message, in sink order."""
    return [
        (m["metadata"]["table_name"], m["action"], m["record"], m["changes"], m["metadata"]["record_pks"])
        for m in messages
    ]


def test_schema_changes_in_a_backlog_reach_the_sinks_as_written(
    pg: EmbeddedPostgres, tmp_path: Path, stream_app: Callable[..., StreamApp]
) -> None:
    db = "schema_changes"
    dsn = pg.create_database(db)
    execute(dsn, *SCHEMA)
    config = write_config(tmp_path / "sequin.yaml", config_text(dsn, db, tmp_path / "ckpt", TABLES))
    app = stream_app(config)
    app.wait_streaming(dsn)
    execute(
        dsn,
        "INSERT INTO t_add VALUES (1, 'a')",
        "INSERT INTO t_drop VALUES (1, 'a', 1)",
        "INSERT INTO t_rename VALUES (1, 'a')",
        "INSERT INTO t_type VALUES (1, 10, 1.5, 7)",
        "INSERT INTO t_pk VALUES (1, 'a', 0)",
        "INSERT INTO t_recreate VALUES (1, 'a')",
    )
    wait_counts(dsn, app, {t: 1 for t in TABLES})
    # a table added to the publication while streaming, that no sink lists: nothing breaks
    execute(
        dsn,
        f"ALTER PUBLICATION pub_{db} ADD TABLE extra",
        "INSERT INTO extra VALUES (1, 'run1')",
        "INSERT INTO t_add VALUES (10, 'marker1')",
    )
    wait_counts(dsn, app, {"t_add": 2})
    execute(dsn, "INSERT INTO t_add VALUES (11, 'marker2')")  # the batch with extra's row is committed
    wait_counts(dsn, app, {"t_add": 3})
    app.stop()

    execute(  # the backlog: writes before and after each change, some to the same keys
        dsn,
        "INSERT INTO t_add VALUES (2, 'b')",
        "ALTER TABLE t_add ADD COLUMN w int DEFAULT 7",
        "INSERT INTO t_add VALUES (3, 'c', 3)",
        "UPDATE t_add SET v = 'a2' WHERE id = 1",
        "UPDATE t_add SET w = 8 WHERE id = 2",
        "DELETE FROM t_add WHERE id = 3",
        "UPDATE t_drop SET gone = 2 WHERE id = 1",
        "ALTER TABLE t_drop DROP COLUMN gone",
        "INSERT INTO t_drop VALUES (2, 'b')",
        "UPDATE t_drop SET v = 'a2' WHERE id = 1",
        "DELETE FROM t_drop WHERE id = 2",
        "INSERT INTO t_rename VALUES (2, 'b')",
        "UPDATE t_rename SET v = 'a1' WHERE id = 1",
        "DELETE FROM t_rename WHERE id = 2",
        "ALTER TABLE t_rename RENAME COLUMN id TO key_id",
        "ALTER TABLE t_rename RENAME COLUMN v TO val",
        "INSERT INTO t_rename VALUES (3, 'c')",
        "UPDATE t_rename SET val = 'a2' WHERE key_id = 1",
        "UPDATE t_rename SET key_id = 4 WHERE key_id = 3",
        "DELETE FROM t_rename WHERE key_id = 1",
        "INSERT INTO t_type VALUES (2, 20, 2.25, 8)",
        "ALTER TABLE t_type ALTER COLUMN id TYPE bigint, ALTER COLUMN n TYPE bigint,"
        " ALTER COLUMN amount TYPE numeric(20,4), ALTER COLUMN code TYPE text",
        "INSERT INTO t_type VALUES (9000000000, 9000000000, 3.1234, 'x9')",
        "UPDATE t_type SET n = 11 WHERE id = 1",
        "DELETE FROM t_type WHERE id = 2",
        "INSERT INTO t_pk VALUES (2, 'b', 0)",
        "UPDATE t_pk SET v = 1 WHERE id = 1",
        "ALTER TABLE t_pk DROP CONSTRAINT t_pk_pkey",
        "INSERT INTO t_pk VALUES (3, 'c', 0)",
        "ALTER TABLE t_pk ADD PRIMARY KEY (code)",
        "INSERT INTO t_pk VALUES (4, 'd', 0)",
        "UPDATE t_pk SET v = 2 WHERE code = 'a'",
        "UPDATE t_pk SET code = 'c2' WHERE code = 'c'",
        "DELETE FROM t_pk WHERE code = 'b'",
        "INSERT INTO t_recreate VALUES (2, 'b')",
        "DELETE FROM t_recreate WHERE id = 1",
        "DROP TABLE t_recreate",
        # a dropped table leaves a FOR TABLE publication: the new one is added back (docs: Schema changes)
        "CREATE TABLE t_recreate (uid text PRIMARY KEY, v int)",
        f"ALTER PUBLICATION pub_{db} ADD TABLE t_recreate",
        "INSERT INTO t_recreate VALUES ('k1', 5), ('k2', 7)",
        "UPDATE t_recreate SET v = 6 WHERE uid = 'k1'",
        "DELETE FROM t_recreate WHERE uid = 'k2'",
        "INSERT INTO extra VALUES (2, 'b')",
        "UPDATE extra SET v = 'run1b' WHERE id = 1",
    )

    # a sink now lists extra: it gets extra's changes from where the stream resumes
    write_config(config, config_text(dsn, db, tmp_path / "ckpt", TABLES + ["extra"]))
    app = stream_app(config)
    app.wait_streaming(dsn)
    execute(dsn, "INSERT INTO extra VALUES (3, 'c')", "INSERT INTO t_rename VALUES (5, 'e')")
    expected: dict[str, list[Change]] = {
        "t_add": [
            ("t_add", "insert", {"id": 1, "v": "a"}, None, ["1"]),
            ("t_add", "insert", {"id": 10, "v": "marker1"}, None, ["10"]),
            ("t_add", "insert", {"id": 11, "v": "marker2"}, None, ["11"]),
            ("t_add", "insert", {"id": 2, "v": "b"}, None, ["2"]),
            ("t_add", "insert", {"id": 3, "v": "c", "w": 3}, None, ["3"]),
            ("t_add", "update", {"id": 1, "v": "a2", "w": 7}, {}, ["1"]),
            ("t_add", "update", {"id": 2, "v": "b", "w": 8}, {}, ["2"]),
            ("t_add", "delete", {"id": 3}, None, ["3"]),
        ],
        "t_drop": [
            ("t_drop", "insert", {"id": 1, "v": "a", "gone": 1}, None, ["1"]),
            ("t_drop", "update", {"id": 1, "v": "a", "gone": 2}, {}, ["1"]),
            ("t_drop", "insert", {"id": 2, "v": "b"}, None, ["2"]),
            ("t_drop", "update", {"id": 1, "v": "a2"}, {}, ["1"]),
            ("t_drop", "delete", {"id": 2}, None, ["2"]),
        ],
        "t_rename": [
            ("t_rename", "insert", {"id": 1, "v": "a"}, None, ["1"]),
            ("t_rename", "insert", {"id": 2, "v": "b"}, None, ["2"]),
            ("t_rename", "update", {"id": 1, "v": "a1"}, {}, ["1"]),
            ("t_rename", "delete", {"id": 2}, None, ["2"]),
            ("t_rename", "insert", {"key_id": 3, "val": "c"}, None, ["3"]),
            ("t_rename", "update", {"key_id": 1, "val": "a2"}, {}, ["1"]),
            ("t_rename", "update", {"key_id": 4, "val": "c"}, {"key_id": 3}, ["4"]),
            ("t_rename", "delete", {"key_id": 1}, None, ["1"]),
            ("t_rename", "insert", {"key_id": 5, "val": "e"}, None, ["5"]),
        ],
        "t_type": [
            ("t_type", "insert", {"id": 1, "n": 10, "amount": Decimal("1.50"), "code": 7}, None, ["1"]),
            ("t_type", "insert", {"id": 2, "n": 20, "amount": Decimal("2.25"), "code": 8}, None, ["2"]),
            (
                "t_type",
                "insert",
                {"id": 9000000000, "n": 9000000000, "amount": Decimal("3.1234"), "code": "x9"},
                None,
                ["9000000000"],
            ),
            ("t_type", "update", {"id": 1, "n": 11, "amount": Decimal("1.5000"), "code": "7"}, {}, ["1"]),
            ("t_type", "delete", {"id": 2}, None, ["2"]),
        ],
        "t_pk": [
            ("t_pk", "insert", {"id": 1, "code": "a", "v": 0}, None, ["1"]),
            ("t_pk", "insert", {"id": 2, "code": "b", "v": 0}, None, ["2"]),
            ("t_pk", "update", {"id": 1, "code": "a", "v": 1}, {}, ["1"]),
            ("t_pk", "insert", {"id": 3, "code": "c", "v": 0}, None, []),  # written while the table had no key
            ("t_pk", "insert", {"id": 4, "code": "d", "v": 0}, None, ["d"]),
            ("t_pk", "update", {"id": 1, "code": "a", "v": 2}, {}, ["a"]),
            ("t_pk", "update", {"id": 3, "code": "c2", "v": 0}, {"code": "c"}, ["c2"]),
            ("t_pk", "delete", {"code": "b"}, None, ["b"]),
        ],
        "t_recreate": [
            ("t_recreate", "insert", {"id": 1, "v": "a"}, None, ["1"]),
            ("t_recreate", "insert", {"id": 2, "v": "b"}, None, ["2"]),
            ("t_recreate", "delete", {"id": 1}, None, ["1"]),
            ("t_recreate", "insert", {"uid": "k1", "v": 5}, None, ["k1"]),
            ("t_recreate", "insert", {"uid": "k2", "v": 7}, None, ["k2"]),
            ("t_recreate", "update", {"uid": "k1", "v": 6}, {}, ["k1"]),
            ("t_recreate", "delete", {"uid": "k2"}, None, ["k2"]),
        ],
        "extra": [
            ("extra", "insert", {"id": 2, "v": "b"}, None, ["2"]),
            ("extra", "update", {"id": 1, "v": "run1b"}, {}, ["1"]),
            ("extra", "insert", {"id": 3, "v": "c"}, None, ["3"]),
        ],
    }
    got = wait_counts(dsn, app, {sink: len(changes) for sink, changes in expected.items()})
    assert {sink: summary(messages) for sink, messages in got.items()} == expected
    # the rendering follows the type in force: numeric(10,2) -> numeric(20,4) keeps each one's scale
    assert [str(m["record"]["amount"]) for m in got["t_type"][:4]] == ["1.50", "2.25", "3.1234", "1.5000"]
    # record_pks is the group: the same row keeps its group across the rename
    with psycopg.connect(dsn) as conn:
        groups = [
            r[0]
            for r in conn.execute(
                "SELECT group_id FROM sequin.stream_messages WHERE sink = 't_rename' ORDER BY commit_lsn, commit_idx"
            )
        ]
    assert groups == [f"public.t_rename:{json.dumps(c[4], separators=(',', ':'))}" for c in expected["t_rename"]]
