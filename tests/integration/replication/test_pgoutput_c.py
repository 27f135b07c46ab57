"""The compiled decoder hot path (``_pgoutput_c``) against its Python references in ``pgoutput``.

The same raw pgoutput payloads, captured from a real server, go through a decoder using the
compiled functions and one using the references; every result must be identical, and so must
every failure on the same payloads truncated or with bytes overwritten (hostile input).
"""

from __future__ import annotations

import gc
import random
import struct
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from sequin_provider import pgoutput
from sequin_provider.change_arrow import CHANGE_COLUMN_KINDS, rows_to_arrow
from sequin_provider.config import TableConfig
from sequin_provider.messages import open_transaction_row
from sequin_provider.pgoutput import (
    UNCHANGED_TOAST,
    DecodeError,
    PgOutputDecoder,
    TypeRegistry,
    hot_path,
)
from sequin_provider.replication import (
    REPLICATION_SESSION_OPTIONS,
    Catalog,
    create_slot,
    ensure_publication,
)
from tests.support.pgoutput_messages import insert_message, relation_message
from tests.support.postgres import execute
from tests.support.type_matrix import TYPE_MATRIX

CHANGE_KINDS = (b"I", b"U", b"D")


def raw_payloads(dsn: str, tables: list[str], *statements: str) -> list[bytes]:
    """The pgoutput payloads (Relation, Begin, changes, Commit, ...) of ``statements``, undecoded,
    as the walsender would send them (its session settings, ``REPLICATION_SESSION_OPTIONS``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_publication(conn, "pub", [TableConfig("public", t) for t in tables], True)
        create_slot(conn, "raw")
        execute(dsn, "SET synchronous_commit = on", *statements)  # decoding by SQL stops at the flushed WAL
        for setting in REPLICATION_SESSION_OPTIONS.split("-c ")[1:]:
            name, value = setting.strip().split("=")
            conn.execute(f"SET {name} = {value}")
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes('raw', NULL, NULL, 'proto_version', '1',"
            " 'publication_names', 'pub')"
        ).fetchall()
        conn.execute("SELECT pg_drop_replication_slot('raw')")
    return [bytes(r[0]) for r in rows]


def outcome(decoder: PgOutputDecoder, payload: bytes) -> object:
    """What decoding ``payload`` gives: the result, or the class of the exception raised."""
    try:
        return decoder.decode(payload)
    except Exception as exc:  # noqa: BLE001 - compared between the two implementations
        return type(exc)


@pytest.fixture
def corpus(dsn: str) -> tuple[str, list[bytes]]:
    """Payloads of every decoding path: the type matrix, replica identity default/full/key change,
    unchanged TOAST, a relation change, text needing JSON escapes, NULLs, deletes; and updates under
    replica identity full of a row wider than the compiled path's stack tuple (``SMALL_TUPLE``):
    to and from null, through a Python converter, of the key, and of nothing."""
    columns = ", ".join(f"c{i} {typ}" for i, (typ, _, _) in enumerate(TYPE_MATRIX))
    values = ", ".join(value for _, value, _ in TYPE_MATRIX)
    big = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 100) i)"  # 3.2 kB, kept out of line
    escapes = "E'q\"b\\\\s\\x01\\x1f\\b\\f\\n\\r\\t \\x7f é 日本 😀'"
    execute(
        dsn,
        "CREATE TYPE mood AS ENUM ('sad', 'happy')",
        "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
        "CREATE DOMAIN email AS text",
        f"CREATE TABLE matrix (id int PRIMARY KEY, {columns})",
        "CREATE TABLE d (id int PRIMARY KEY, big text, n int, t text, ts timestamptz, b bool)",
        "ALTER TABLE d ALTER COLUMN big SET STORAGE EXTERNAL",
        "CREATE TABLE f (id int PRIMARY KEY, big text, n int)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
        "ALTER TABLE f ALTER COLUMN big SET STORAGE EXTERNAL",
        "CREATE TABLE k (a text, b int, c text, PRIMARY KEY (b, a))",
        "CREATE TABLE fw (id int PRIMARY KEY, arr int[], flag bool, t text, "
        + ", ".join(f"x{i} int" for i in range(40))
        + ")",
        "ALTER TABLE fw REPLICA IDENTITY FULL",
    )
    payloads = raw_payloads(
        dsn,
        ["matrix", "d", "f", "k", "fw"],
        f"INSERT INTO matrix VALUES (1, {values})",
        f"INSERT INTO d VALUES (1, {big}, 0, {escapes}, '2024-01-02 03:04:05.5+00', true),"
        " (2, NULL, NULL, NULL, NULL, NULL), (3, 'small', 3, '', 'infinity', false)",
        f"INSERT INTO f VALUES (1, {big}, 0)",
        "INSERT INTO k VALUES ('x', 1, 'y'), (E'\\\\', 2, NULL)",
        "UPDATE d SET n = 1",
        "UPDATE f SET n = 1",
        "UPDATE f SET big = big || 'x'",
        "INSERT INTO fw (id, arr, flag, t) VALUES (1, '{1,2}', true, 'a'), (2, NULL, NULL, NULL)",
        "UPDATE fw SET arr = '{3}', flag = NULL, t = E'x\"y', x39 = 1 WHERE id = 1",
        "UPDATE fw SET t = 'set' WHERE id = 2",
        "UPDATE fw SET id = 3 WHERE id = 2",
        "UPDATE fw SET x0 = x0 WHERE id = 1",
        "UPDATE d SET id = 10 WHERE id = 1",
        "UPDATE k SET c = 'z'",
        "UPDATE k SET b = 3 WHERE b = 1",
        "ALTER TABLE d ADD COLUMN extra numeric DEFAULT 'NaN'",
        "UPDATE d SET t = 'after' WHERE id = 2",
        "DELETE FROM d",
        "DELETE FROM f",
        "DELETE FROM k",
        "DELETE FROM fw",
        "SELECT pg_logical_emit_message(true, 'sequin:x', 'm')",
    )
    return dsn, payloads


def test_the_compiled_hot_path_is_built() -> None:
    # `make venv` builds it (setup.py); were the build to fail silently, the references would run
    # and this suite would compare them with themselves.
    assert pgoutput.COMPILED
    with pytest.raises(RuntimeError, match="not built"):
        saved, pgoutput.COMPILED = pgoutput.COMPILED, False
        try:
            PgOutputDecoder(TypeRegistry(), compiled=True)
        finally:
            pgoutput.COMPILED = saved


def test_both_implementations_decode_every_payload_identically(corpus: tuple[str, list[bytes]]) -> None:
    dsn, payloads = corpus
    catalog = Catalog(dsn)
    try:
        compiled = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key, compiled=True)
        reference = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key, compiled=False)
        got = [outcome(compiled, p) for p in payloads]
        want = [outcome(reference, p) for p in payloads]
    finally:
        catalog.close()
    rows = [w for w in want if type(w) is tuple]
    assert got == want
    # the corpus reaches every path: inserts, updates with and without old values, both deletes,
    # unchanged TOAST flagged, JSON escapes, and the compiled renderer calling Python converters
    assert [r[6] for r in rows].count("insert") == 9 and [r[6] for r in rows].count("delete") == 8
    assert any(r[10] == ["big"] for r in rows) and any(r[8] not in (None, "{}") for r in rows)
    assert any('"t":"q\\"b\\\\s\\u0001\\u001f\\b\\f\\n\\r\\t \x7f é 日本 😀"' in r[7] for r in rows)
    assert any('"c29":[[1,null],[3,4]]' in r[7] for r in rows)  # int4[] through array_converter
    assert any(r[5] == "k" and r[9] == ["3", "x"] for r in rows)  # composite key in key order
    # replica identity full: the old row fills unchanged TOAST and gives the changed columns' old values
    f_updates = [(r[8], r[10], '"big":"' in r[7]) for r in rows if r[5] == "f" and r[6] == "update"]
    assert f_updates[0] == ('{"n":0}', [], True)
    assert f_updates[1][0].startswith('{"big":"c4ca4238') and f_updates[1][1:] == ([], True)
    fw_updates = [(r[8], r[9]) for r in rows if r[5] == "fw" and r[6] == "update"]
    assert fw_updates == [
        ('{"arr":[1,2],"flag":true,"t":"a","x39":null}', ["1"]),
        ('{"t":null}', ["2"]),
        ('{"id":2}', ["3"]),
        ("{}", ["1"]),
    ]


def test_hostile_payloads_fail_alike(corpus: tuple[str, list[bytes]]) -> None:
    dsn, payloads = corpus
    catalog = Catalog(dsn)
    rng = random.Random(7)
    try:
        compiled = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key, compiled=True)
        reference = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key, compiled=False)
        compared = failures = 0
        for payload in payloads:
            variants = [payload]
            if payload[:1] in CHANGE_KINDS:
                cuts = range(len(payload)) if len(payload) < 600 else rng.sample(range(len(payload)), 300)
                variants += [payload[:k] for k in cuts]
                for _ in range(150):
                    mutated = bytearray(payload)
                    for _ in range(rng.randint(1, 3)):
                        mutated[rng.randrange(1, len(mutated))] = rng.choice(
                            (0, 0xFF, 0x80, 0x74, 0x75, 0x6E, rng.randrange(256))
                        )
                    variants.append(bytes(mutated))
            for variant in variants:
                got, want = outcome(compiled, variant), outcome(reference, variant)
                assert got == want, f"{variant!r}: compiled {got!r}, reference {want!r}"
                compared += 1
                failures += isinstance(want, type)
    finally:
        catalog.close()
    assert failures > 1000 and compared - failures > 300  # both kinds of outcome were compared
    assert all(f in (DecodeError,) for f in {outcome(reference, p[:7]) for p in payloads if p[:1] in CHANGE_KINDS})


def change_row_outcome(change_row: Any, payload: bytes, specs: dict, head: list[Any]) -> object:
    """What ``change_row`` gives for ``payload``: its row or None, or the class of its exception
    (``DecodeError`` for those ``PgOutputDecoder.decode`` reports as one)."""
    try:
        return change_row(specs, head, payload)
    except (struct.error, IndexError, UnicodeDecodeError):
        return DecodeError
    except Exception as exc:  # noqa: BLE001 - compared between the two implementations
        return type(exc)


def test_change_row_takes_the_common_changes_alike(corpus: tuple[str, list[bytes]]) -> None:
    """The one-call path (``change_row``) takes inserts, updates without old values or with the
    whole old row, and full-row deletes, whole and hostile, as its reference does, and leaves every
    other message (a key tuple's) to the decoder's general path, with the transaction's change
    index moved on only by a row."""
    dsn, payloads = corpus
    catalog = Catalog(dsn)
    rng = random.Random(11)
    try:
        decoder = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key, compiled=False)
        for payload in payloads:  # the specs and the head of the last transaction, as the decoder keeps them
            decoder.decode(payload)
    finally:
        catalog.close()
    specs = {relid: pgoutput.row_spec(rel) for relid, rel in decoder.relations.items()}
    taken: list[tuple[str, str]] = []
    for payload in payloads:
        variants = [payload]
        if payload[:1] in CHANGE_KINDS:
            variants += [payload[:k] for k in rng.sample(range(len(payload)), min(len(payload), 120))]
            variants += [payload[:1] + b"\0\0\0\1" + payload[5:]]  # a relation never announced
            for _ in range(60):
                mutated = bytearray(payload)
                mutated[rng.randrange(5, len(mutated))] = rng.choice((0, 0xFF, 0x80, 0x74, 0x75, 0x6E))
                variants.append(bytes(mutated))
        for variant in variants:
            got_head, want_head = [7, 3, "ts", 9], [7, 3, "ts", 9]
            got = change_row_outcome(pgoutput.hot_path.change_row, variant, specs, got_head)
            want = change_row_outcome(pgoutput.change_row, variant, specs, want_head)
            assert got == want, f"{variant!r}: compiled {got!r}, reference {want!r}"
            assert got_head == want_head == [7, 4 if type(want) is tuple else 3, "ts", 9]
            if variant is payload and type(want) is tuple:
                assert want[:4] == (7, 3, "ts", 9) and want[11:] == (None, None)
                taken.append((want[5], want[6]))
                # the compiled row and its lists are left out of the cyclic GC's walks (acyclic)
                assert not any(gc.is_tracked(o) for o in (got, got[9], got[10]))
    # default replica identity (d, k): inserts, updates, key-only deletes; full (f, fw): every change
    assert taken.count(("d", "insert")) == 3 and ("f", "delete") in taken and ("d", "delete") not in taken
    assert ("d", "update") in taken and ("k", "delete") not in taken
    assert taken.count(("f", "update")) == 2 and taken.count(("fw", "update")) == 4
    non_changes = [p for p in payloads if p[:1] not in CHANGE_KINDS]
    assert non_changes and all(pgoutput.hot_path.change_row(specs, [0, 0, "", 0], p) is None for p in non_changes)


def arrow_outcome(rows: list[tuple], compiled: bool) -> object:
    """What ``rows_to_arrow`` gives: the batch, or the class of its exception."""
    try:
        return rows_to_arrow(rows, compiled=compiled)
    except Exception as exc:  # noqa: BLE001 - compared between the two implementations
        return type(exc)


def test_change_rows_become_the_same_arrow_batch(corpus: tuple[str, list[bytes]]) -> None:
    """``rows_to_arrow``'s compiled pass (``column_sizes``, ``fill_columns``) builds the batch Arrow
    builds from the same tuples: the corpus's rows (every type, TOAST, escapes, 4-byte UTF-8), a
    backfill read, the open-transaction marker, nulls everywhere they may be; a row it must refuse
    (a value of another type) fails as Arrow's reading fails."""
    dsn, payloads = corpus
    catalog = Catalog(dsn)
    try:
        decoder = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key)
        rows = [r for r in (decoder.decode(p) for p in payloads) if type(r) is tuple]
    finally:
        catalog.close()
    rows += [
        (5, 2, "2024-01-02T03:04:05Z", 9, "public", "d", "read", '{"id":1}', None, ["1", "é😀"], [], 3, "sink-a"),
        open_transaction_row(rows[0], 4),
        (2**63 - 1, -(2**31), "", 0, "", "", "", "", "", [""], ["x", "", "y"], -(2**63), ""),
    ]
    assert hot_path.column_sizes(rows, CHANGE_COLUMN_KINDS)  # the compiled pass takes them all
    compiled, reference = rows_to_arrow(rows, compiled=True), rows_to_arrow(rows, compiled=False)
    compiled.validate(full=True)
    assert compiled.equals(reference) and compiled.schema == reference.schema
    assert compiled.to_pylist() == reference.to_pylist() and compiled.num_rows == len(rows) > 20
    for i in range(0, len(rows), 7):  # every slice of rows: null bitmaps crossing bytes at other places
        assert rows_to_arrow(rows[i:], compiled=True).equals(rows_to_arrow(rows[i:], compiled=False))
    # rows the compiled pass refuses are Arrow's to read: a tuple as a list (taken), a str as an
    # int, an int as a str, a short row (refused)
    odd = ((*rows[0][:9], ("1",), *rows[0][10:]), (rows[0][0], "1", *rows[0][2:]), (*rows[0][:7], 7, *rows[0][8:]))
    outcomes = [arrow_outcome([*rows[:3], row], c) for row in (*odd, rows[0][:12]) for c in (True, False)]
    assert outcomes[0] == outcomes[1] and isinstance(outcomes[0], pa.RecordBatch)
    assert outcomes[2::2] == outcomes[3::2] and all(isinstance(o, type) for o in outcomes[2:])
    with pytest.raises(TypeError):
        hot_path.column_sizes([*rows[:3], (rows[0][0], "1", *rows[0][2:])], CHANGE_COLUMN_KINDS)


def test_render_record_fills_and_selects_alike() -> None:
    from sequin_provider import _pgoutput_c

    types = TypeRegistry()
    rel = PgOutputDecoder(types).make_relation(
        1, "public", "t", "d", ["a", "b", "c", "d"], [23, 25, 16, 1184], [True, False, False, False], ["a"]
    )
    cases = [
        (["1", UNCHANGED_TOAST, "t", None], None, None),
        (["1", UNCHANGED_TOAST, "f", "2024-01-02 03:04:05+02"], None, ["0", "old", None, None]),
        (["1", UNCHANGED_TOAST, "x", "infinity"], [3, 0], [UNCHANGED_TOAST] * 4),
        (["1", "2"], [-1], None),
        (["1", "2", "t", "2024-01-02 03:04:05+00", "extra"], None, None),  # more values than columns
        (["1", "2"], [7], None),
    ]
    for values, only, fill in cases:
        args = (values, rel.kinds, rel.prefixes, rel.converters, rel.columns, only, fill)
        want: object
        try:
            want = pgoutput.render_record(*args)
        except IndexError:
            want = IndexError
        try:
            got: object = _pgoutput_c.render(*args)
        except IndexError:
            got = IndexError
        assert got == want, (values, only, fill)
    assert pgoutput.render_record(
        *cases[1][0:1], rel.kinds, rel.prefixes, rel.converters, rel.columns, None, cases[1][2]
    ) == ('{"a":1,"b":"old","c":false,"d":"2024-01-02T03:04:05+02:00"}', [])


def test_bytes_that_are_not_utf8_fail_alike_in_every_converter() -> None:
    # every converter kind the compiled renderer applies itself, and one it calls (int4[])
    types = [
        (23, b"1"),
        (16, b"t"),
        (1700, b"1.5"),
        (25, b"a"),
        (1184, b"2024-01-02 03:04:05+00"),
        (1114, b"2024-01-02 03:04:05"),
        (3802, b"{}"),
        (1007, b"{1}"),
    ]
    columns = [(f"c{i}", oid) for i, (oid, _) in enumerate(types)]
    for position in range(len(types)):
        for bad in (b"\xff", b"\x80", b"t\xc3", b"\xed\xa0\x80"):  # invalid, lone continuation, cut, surrogate
            values: list[bytes | None] = [v for _, v in types]
            values[position] = bad
            results = []
            for compiled in (True, False):
                decoder = PgOutputDecoder(TypeRegistry(), compiled=compiled)
                decoder.decode(relation_message(9, columns))
                results.append(outcome(decoder, insert_message(9, values)))
            assert results == [DecodeError, DecodeError], (position, bad)
    decoder = PgOutputDecoder(TypeRegistry())
    decoder.decode(relation_message(9, columns))
    row = decoder.decode(insert_message(9, [v for _, v in types]))
    assert row[7] == (
        '{"c0":1,"c1":true,"c2":1.5,"c3":"a","c4":"2024-01-02T03:04:05Z","c5":"2024-01-02T03:04:05","c6":{},"c7":[1]}'
    ) and row[9] == ["1"]


@pytest.fixture
def copy_page(dsn: str) -> tuple[str, bytes]:
    """A backfill page as ``COPY … TO STDOUT`` gives it (the walsender's session settings): the type
    matrix, a row of NULLs, COPY's escapes (tab, newline, backslash) and JSON's, a composite key."""
    columns = ", ".join(f"c{i} {typ}" for i, (typ, _, _) in enumerate(TYPE_MATRIX))
    values = ", ".join(value for _, value, _ in TYPE_MATRIX)
    nulls = ", ".join("NULL" for _ in TYPE_MATRIX)
    execute(
        dsn,
        "CREATE TYPE mood AS ENUM ('sad', 'happy')",
        "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
        "CREATE DOMAIN email AS text",
        f"CREATE TABLE page (k1 text, k2 int, {columns}, PRIMARY KEY (k2, k1))",
        f"INSERT INTO page VALUES ('a', 1, {values}), (E'tab\\there\\nnew\\\\back \\x01 é', 2, {nulls}),"
        f" ('\\N', 3, {values})",
    )
    with psycopg.connect(dsn, autocommit=True, options=REPLICATION_SESSION_OPTIONS) as conn, conn.cursor() as cur:
        data = bytearray()
        with cur.copy("COPY (SELECT * FROM page ORDER BY k2) TO STDOUT") as copy:
            while chunk := copy.read():
                data += chunk
    return dsn, bytes(data)


def page_decoders(dsn: str) -> tuple[PgOutputDecoder, PgOutputDecoder, pgoutput.Relation]:
    """A compiled and a reference decoder, and the ``page`` table's relation as backfills make it."""
    from sequin_provider.backfill.reader import table_relation, table_shape

    catalog = Catalog(dsn)
    try:
        with psycopg.connect(dsn) as conn:
            shape = table_shape(conn, "public", "page")
        decoders = tuple(PgOutputDecoder(TypeRegistry(catalog.type_info), compiled=c) for c in (True, False))
        rel = table_relation(decoders[0], shape)
        for decoder in decoders:  # the converters look their types up once
            decoder.render_copy(rel, b"")
    finally:
        catalog.close()
    return decoders[0], decoders[1], rel


def copy_outcome(decoder: PgOutputDecoder, rel: pgoutput.Relation, data: bytes) -> object:
    try:
        return decoder.render_copy(rel, data)
    except Exception as exc:  # noqa: BLE001 - compared between the two implementations
        return type(exc)


def test_a_copy_page_renders_as_the_decoder_renders_each_row(copy_page: tuple[str, bytes]) -> None:
    import pyarrow as pa

    dsn, data = copy_page
    compiled, reference, rel = page_decoders(dsn)
    got = compiled.render_copy(rel, data)
    assert got == reference.render_copy(rel, data)
    records, record_offsets, pks, pk_offsets, rows = got
    # what the backfill's Python path makes of each line: the decoder's record and record_pks
    lines = data.decode().split("\n")[:-1]
    want = [reference.render_values(rel, pgoutput.parse_copy_line(line)) for line in lines]
    assert rows == 3
    assert pa.StringArray.from_buffers(rows, pa.py_buffer(record_offsets), pa.py_buffer(records)).to_pylist() == [
        w[0] for w in want
    ]
    assert pa.StringArray.from_buffers(rows, pa.py_buffer(pk_offsets), pa.py_buffer(pks)).to_pylist() == [
        '["1","a"]',
        '["2","tab\\there\\nnew\\\\back \\u0001 é"]',
        '["3","\\\\N"]',
    ]
    assert '"k1":"tab\\there\\nnew\\\\back \\u0001 é"' in want[1][0] and '"c29":[[1,null],[3,4]]' in want[0][0]
    assert compiled.render_copy(rel, data[:-1]) == got  # a last line without its newline
    assert compiled.render_copy(rel, b"")[4] == 0


def test_hostile_copy_pages_fail_alike(copy_page: tuple[str, bytes]) -> None:
    dsn, data = copy_page
    compiled, reference, rel = page_decoders(dsn)
    rng = random.Random(11)
    variants = [data[:k] for k in rng.sample(range(len(data)), 400)]
    for _ in range(1500):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(len(mutated))] = rng.choice(
                b'\t\n\\N\xff\x80\xc3\x00{}[],"tf' + bytes([rng.randrange(256)])
            )
        variants.append(bytes(mutated))
    outcomes = []
    for variant in variants:
        got, want = copy_outcome(compiled, rel, variant), copy_outcome(reference, rel, variant)
        assert got == want, f"{variant!r}: compiled {got!r}, reference {want!r}"
        outcomes.append(want)
    assert {o for o in outcomes if isinstance(o, type)} == {DecodeError}  # every failure is a clear DecodeError
    assert sum(isinstance(o, type) for o in outcomes) > 500 and sum(type(o) is tuple for o in outcomes) > 200


def test_utf8_is_checked_as_python_checks_it_at_every_offset(copy_page: tuple[str, bytes]) -> None:
    """The compiled renderer checks a page's UTF-8 itself (ASCII eight bytes at a time, then each
    sequence by its lead byte) and asks Python's decoder only for the error: every edge of RFC 3629
    (overlong forms, surrogates, beyond U+10FFFF, cut sequences), at every offset within an eight-byte
    word, must be taken or refused exactly as the reference does."""
    dsn, data = copy_page
    compiled, reference, rel = page_decoders(dsn)
    first = data[: data.index(b"\n") + 1]
    assert first.startswith(b"a\t")
    valid = ["é", "€", "😀", "\U0010ffff", "\ud7ff", "\ue000", "\u0800", "\u0080"]
    invalid = [
        b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf",
        b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\x80",
        b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3\xc3", b"\xe2\x28\xa1",
    ]  # fmt: skip
    for text in [v.encode("utf-8", "surrogatepass") for v in valid] + invalid:
        for pad in range(10):
            page = b"x" * pad + text + b"y" * (9 - pad) + first[1:]
            got, want = copy_outcome(compiled, rel, page), copy_outcome(reference, rel, page)
            assert got == want, (text, pad, got, want)
            assert (want is DecodeError) == (text in invalid), (text, pad, want)
