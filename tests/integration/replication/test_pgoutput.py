"""pgoutput decoding against a real server: the type matrix, replica identity, TOAST, relations."""

from __future__ import annotations

import json
import struct
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from sequin_provider.pgoutput import (
    COMPILED,
    DecodeError,
    PgOutputDecoder,
    TypeRegistry,
    parse_array_literal,
)
from tests.support import type_matrix
from tests.support.capture import capture
from tests.support.postgres import execute


def record(row: tuple) -> dict[str, Any]:
    return json.loads(row[7], parse_float=Decimal)


def test_type_matrix_round_trips_exactly(dsn: str) -> None:
    execute(dsn, *type_matrix.SETUP)
    rows = capture(dsn, ["matrix"], type_matrix.INSERT)
    assert len(rows) == 1
    type_matrix.assert_record(record(rows[0]))
    # numeric digits survive on the wire, not just after Decimal parsing
    assert '"c3":12345678901234567890.123456789012345678901234567890' in rows[0][7]


def test_replica_identity_default_vs_full(dsn: str) -> None:
    execute(
        dsn,
        "CREATE TABLE d (id int PRIMARY KEY, a text, b int)",
        "CREATE TABLE f (id int PRIMARY KEY, a text, b int)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
    )
    rows = capture(
        dsn,
        ["d", "f"],
        "INSERT INTO d VALUES (1, 'x', 1)",
        "INSERT INTO f VALUES (1, 'x', 1)",
        "UPDATE d SET a = 'y' WHERE id = 1",
        "UPDATE f SET a = 'y' WHERE id = 1",
        "UPDATE d SET id = 2 WHERE id = 1",
        "DELETE FROM d WHERE id = 2",
        "DELETE FROM f WHERE id = 1",
    )
    got = [(r[5], r[6], record(r), None if r[8] is None else json.loads(r[8]), r[9]) for r in rows]
    assert got == [
        ("d", "insert", {"id": 1, "a": "x", "b": 1}, None, ["1"]),
        ("f", "insert", {"id": 1, "a": "x", "b": 1}, None, ["1"]),
        ("d", "update", {"id": 1, "a": "y", "b": 1}, {}, ["1"]),
        ("f", "update", {"id": 1, "a": "y", "b": 1}, {"a": "x"}, ["1"]),
        ("d", "update", {"id": 2, "a": "y", "b": 1}, {"id": 1}, ["2"]),  # key change: old key travels
        ("d", "delete", {"id": 2}, None, ["2"]),  # DEFAULT: the key only
        ("f", "delete", {"id": 1, "a": "y", "b": 1}, None, ["1"]),  # FULL: the whole old row
    ]


def test_unchanged_toast_is_filled_or_flagged(dsn: str) -> None:
    big = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 40000) i)"  # 1.28 MB, incompressible
    execute(
        dsn,
        "CREATE TABLE d (id int PRIMARY KEY, big text, n int)",
        "CREATE TABLE f (id int PRIMARY KEY, big text, n int)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
        f"INSERT INTO d VALUES (1, {big}, 0)",
        f"INSERT INTO f VALUES (1, {big}, 0)",
    )
    with psycopg.connect(dsn) as conn:
        expected_big = conn.execute(f"SELECT {big}").fetchone()[0]
    rows = capture(dsn, ["d", "f"], "UPDATE d SET n = 1", "UPDATE f SET n = 1")
    d, f = rows
    assert record(d) == {"id": 1, "n": 1} and d[10] == ["big"]  # flagged, not silently null
    assert record(f) == {"id": 1, "big": expected_big, "n": 1} and f[10] == []  # filled from the old tuple
    assert json.loads(f[8]) == {"n": 0}


def test_relation_change_adds_column(dsn: str) -> None:
    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    rows = capture(
        dsn,
        ["t"],
        "INSERT INTO t VALUES (1)",
        "ALTER TABLE t ADD COLUMN note text DEFAULT 'n'",
        "INSERT INTO t VALUES (2, 'hello')",
        "UPDATE t SET note = 'x' WHERE id = 1",
    )
    assert [record(r) for r in rows] == [{"id": 1}, {"id": 2, "note": "hello"}, {"id": 1, "note": "x"}]


def test_transaction_positions(dsn: str) -> None:
    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    rows = capture(
        dsn,
        ["t"],
        "BEGIN; INSERT INTO t VALUES (1); INSERT INTO t VALUES (2); UPDATE t SET id = 3 WHERE id = 1; COMMIT",
        "INSERT INTO t VALUES (4)",
    )
    assert [(r[1], r[6]) for r in rows] == [(0, "insert"), (1, "insert"), (2, "update"), (0, "insert")]
    assert rows[0][0] == rows[1][0] == rows[2][0] < rows[3][0]
    assert rows[0][3] != rows[3][3]  # xid


def test_malformed_payloads_raise_decode_errors() -> None:
    decoder = PgOutputDecoder(TypeRegistry())
    for payload in (b"", b"Z", b"I\x00\x00\x00\x01N", b"B\x00\x01", b"I\x00\x00\x00\x09N\x00\x01t\x00\x00"):
        with pytest.raises(DecodeError):
            decoder.decode(payload)


def test_array_literal_parser() -> None:
    assert parse_array_literal('{{"a b",NULL},{"\\\\x",c}}') == [["a b", None], ["\\x", "c"]]
    assert parse_array_literal("[2:3]={7,8}") == ["7", "8"]
    assert parse_array_literal("{(1,2);(3,4)}", ";") == ["(1,2)", "(3,4)"]


def test_key_change_without_old_values_flags_untouched_toast_instead_of_null(dsn: str) -> None:
    big = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 40000) i)"
    execute(dsn, "CREATE TABLE d (id int PRIMARY KEY, big text, n int)", f"INSERT INTO d VALUES (1, {big}, 0)")
    (row,) = capture(dsn, ["d"], "UPDATE d SET id = 2")
    assert record(row) == {"id": 2, "n": 0} and row[10] == ["big"]  # not "big": null
    assert json.loads(row[8]) == {"id": 1}


def test_vector_types_fall_back_to_text(dsn: str) -> None:
    execute(dsn, "CREATE TABLE v (id int PRIMARY KEY, iv int2vector, ov oidvector)")
    (row,) = capture(dsn, ["v"], "INSERT INTO v VALUES (1, '1 2 3', '4 5')")
    assert record(row) == {"id": 1, "iv": "1 2 3", "ov": "4 5"}


def relation_payload(relid: int, replica_identity: str, columns: list[tuple[str, int, bool]]) -> bytes:
    """A Relation message: (name, type oid, key flag) per column, in column order."""
    body = b"".join(
        bytes([1 if key else 0]) + name.encode() + b"\0" + struct.pack(">Ii", oid, -1) for name, oid, key in columns
    )
    return (
        b"R"
        + struct.pack(">I", relid)
        + b"public\0t\0"
        + replica_identity.encode()
        + struct.pack(">h", len(columns))
        + body
    )


def tuple_payload(kind: bytes, relid: int, values: list[str | None], old: bytes = b"") -> bytes:
    """An Insert ('I', new tuple) or Delete ('D', ``old`` 'K' or 'O') of text values."""
    data = b"".join(b"n" if v is None else b"t" + struct.pack(">i", len(v.encode())) + v.encode() for v in values)
    return kind + struct.pack(">I", relid) + (old or b"N") + struct.pack(">h", len(values)) + data


def key_decoder(today: list[str] | None, compiled: bool) -> tuple[PgOutputDecoder, list[int]]:
    """A decoder whose catalog says today's primary key is ``today``; the list counts lookups."""
    asked: list[int] = []

    def lookup(relid: int, schema: str, name: str) -> list[str]:
        asked.append(relid)
        return list(today or [])

    return PgOutputDecoder(TypeRegistry(), None if today is None else lookup, compiled=compiled), asked


DECODERS = [False, True] if COMPILED else [False]


@pytest.mark.parametrize("compiled", DECODERS)
def test_replica_identity_default_key_flags_decide_record_pks(compiled: bool) -> None:
    cols = [("a", 25, True), ("b", 23, True), ("c", 25, False)]
    # today's key has the flagged columns: its order (b, a), as backfills read it
    decoder, asked = key_decoder(["b", "a"], compiled)
    decoder.decode(relation_payload(1, "d", cols))
    assert decoder.decode(tuple_payload(b"I", 1, ["x", "1", "y"]))[9] == ["1", "x"]
    assert decoder.decode(tuple_payload(b"D", 1, ["x", "1", None], b"K"))[7:10] == ('{"a":"x","b":1}', None, ["1", "x"])
    # today's key is another (the key changed since): the flags, in column order, never today's columns
    decoder, _ = key_decoder(["c"], compiled)
    decoder.decode(relation_payload(1, "d", cols))
    assert decoder.decode(tuple_payload(b"I", 1, ["x", "1", "y"]))[9] == ["x", "1"]
    # one key column: the catalog is not asked; no key column (no primary key then): []
    decoder, asked = key_decoder(["c"], compiled)
    decoder.decode(relation_payload(1, "d", [("id", 23, True), ("c", 25, False)]))
    decoder.decode(relation_payload(2, "d", [("id", 23, False), ("c", 25, False)]))
    assert decoder.decode(tuple_payload(b"I", 1, ["5", "y"]))[9] == ["5"]
    assert decoder.decode(tuple_payload(b"I", 2, ["5", "y"]))[9] == []
    assert asked == []


@pytest.mark.parametrize("compiled", DECODERS)
def test_replica_identity_full_and_index_use_todays_key_when_the_row_has_it(compiled: bool) -> None:
    full = [("id", 23, True), ("code", 25, True), ("v", 25, True)]
    decoder, _ = key_decoder(["id"], compiled)
    decoder.decode(relation_payload(1, "f", full))
    assert decoder.decode(tuple_payload(b"I", 1, ["1", "a", "x"]))[9] == ["1"]
    assert decoder.decode(tuple_payload(b"D", 1, ["1", "a", "x"], b"O"))[9] == ["1"]
    # today's key column is not in the row as written (renamed since): no key rather than a wrong one
    decoder, _ = key_decoder(["key_id"], compiled)
    decoder.decode(relation_payload(1, "f", full))
    assert decoder.decode(tuple_payload(b"I", 1, ["1", "a", "x"]))[9] == []
    # no primary key today (the table was dropped since): no key either
    decoder, _ = key_decoder([], compiled)
    decoder.decode(relation_payload(1, "f", full))
    assert decoder.decode(tuple_payload(b"I", 1, ["1", "a", "x"]))[9] == []
    # USING INDEX on code, primary key id: inserts carry the key; a delete's key tuple has only
    # code, so its record_pks are [] rather than a partial key
    index = [("id", 23, False), ("code", 25, True), ("v", 25, False)]
    decoder, _ = key_decoder(["id"], compiled)
    decoder.decode(relation_payload(1, "i", index))
    assert decoder.decode(tuple_payload(b"I", 1, ["1", "a", "x"]))[9] == ["1"]
    assert decoder.decode(tuple_payload(b"D", 1, [None, "a", None], b"K"))[7:10] == ('{"code":"a"}', None, [])
    # a decoder without a catalog: the flagged columns
    decoder, _ = key_decoder(None, compiled)
    decoder.decode(relation_payload(1, "f", full))
    assert decoder.decode(tuple_payload(b"I", 1, ["1", "a", "x"]))[9] == ["1", "a", "x"]
