"""The type table (``pgtypes.PG_TYPES``) against the three renderers that must agree with it.

- The compiled renderer (``_pgoutput_c.c``) dispatches on kind codes, never on type OIDs: its
  source is parsed, and its ``KIND_*`` enum and the cases of its ``convert_native`` switch must be
  exactly ``pgtypes.NATIVE_KINDS`` (a ``case <number>:`` there, an OID switch, fails as well).
- A value of every OID of the table (with hostile texts besides) renders identically through the
  compiled functions and the Python references (``render``, ``change_row``, ``render_copy``).
- The Python reference gives every OID its rule's converter, and ``backfill.source_sql`` has SQL
  for every rule but arrays; on a real server, the SQL renders every scalar sample as the
  converter does, the table's names and elements are ``pg_type``'s, the samples are what the
  server prints, and ``text_cast`` holds where the table says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from sequin_provider import pgoutput
from sequin_provider.backfill.source_sql import RULE_SQL, record_sql, value_sql
from sequin_provider.pgoutput import (
    CONVERTER_KINDS,
    RULE_CONVERTERS,
    UNCHANGED_TOAST,
    PgOutputDecoder,
    TypeRegistry,
)
from sequin_provider.pgtypes import NATIVE_KINDS, PG_TYPES, Rule
from sequin_provider.replication import REPLICATION_SESSION_OPTIONS
from tests.support.pgoutput_messages import insert_message, relation_message

C_SOURCE = Path(__file__).resolve().parents[3] / "sequin_provider" / "_pgoutput_c.c"

SAMPLES: dict[str, list[str]] = {
    "bool": ["t", "f"],
    "int2": ["32767", "-1"],
    "int4": ["-2147483648", "0"],
    "int8": ["9223372036854775807"],
    "oid": ["4294967295"],
    "json": ['  [1, 2,  "\\u0001"]  ', "null"],
    "jsonb": ['{"a": "é", "z": 1}', '"x"'],
    "float4": ["1.5", "NaN", "-Infinity", "3.4028235e+38"],
    "float8": ["0.1", "Infinity", "-0", "1e-300"],
    "numeric": ["12345678901234567890.123456789", "NaN", "0.000"],
    "timestamptz": [
        "2024-01-02 03:04:05.123456+00",
        "infinity",
        "-infinity",
        "0044-03-15 12:00:00+00 BC",
        "10000-01-01 00:00:00+00",
    ],
    "timestamp": ["2024-01-02 03:04:05", "infinity", "0001-01-01 00:00:00 BC"],
    "timetz": ["13:14:15+05:30", "13:14:15-08", "23:59:59.999999-12:30"],
    "bytea": ["\\x00ff10", "\\x"],
    "char": ["a"],
    "name": ["a name"],
    "text": ['h"é\\ \n\t\x01 end 😀', ""],
    "xml": ["<a>x</a>"],
    "cidr": ["10.0.0.0/8"],
    "macaddr8": ["08:00:2b:01:02:03:04:05"],
    "money": ["$1,234.50"],
    "macaddr": ["08:00:2b:01:02:03"],
    "inet": ["192.168.0.1", "::1", "192.168.0.1/24"],
    "bpchar": ["ab   "],
    "varchar": ["abc"],
    "date": ["2024-02-29", "infinity", "4713-01-01 BC"],
    "time": ["13:14:15.123456", "24:00:00"],
    "interval": ["P1Y2M3DT4H5M6.5S", "P-1D", "PT0S"],
    "bit": ["101"],
    "varbit": ["10110"],
    "uuid": ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"],
    "_bool": ["{t,f,NULL}"],
    "_bytea": ['{"\\\\x00ff",NULL}'],
    "_char": ["{a,b}"],
    "_name": ['{"a b",c}'],
    "_int2": ["{1,NULL}"],
    "_int4": ["{{1,NULL},{3,4}}", "{}"],
    "_int8": ["{9223372036854775807}"],
    "_text": ['{"a,b","c\\"d",NULL,"NULL","{x}"}'],
    "_bpchar": ['{"ab "}'],
    "_varchar": ["{abc}"],
    "_float4": ["{1.5,NaN}"],
    "_float8": ["{-Infinity,0.1}"],
    "_numeric": ["{1.10,NaN}"],
    "_uuid": ["{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}"],
    "_json": ['{"{\\"a\\": 1}",NULL}'],
    "_jsonb": ['{"{\\"a\\": 1}"}'],
    "_date": ["{2024-02-29,infinity}"],
    "_time": ["{13:14:15}"],
    "_timestamp": ['{"2024-01-02 03:04:05",infinity}'],
    "_timestamptz": ['{"2024-01-02 03:04:05+00","0044-03-15 12:00:00+00 BC"}'],
    "_interval": ["{P1D,PT0S}"],
    "_timetz": ["{13:14:15+05:30}"],
    "_inet": ["{::1,10.0.0.1}"],
    "_cidr": ["{10.0.0.0/8}"],
    "_macaddr": ["{08:00:2b:01:02:03}"],
    "_macaddr8": ["{08:00:2b:01:02:03:04:05}"],
    "_oid": ["{1,2}"],
    "_xml": ["{<a>x</a>}"],
    "_money": ["{$1.00}"],
    "_bit": ["{101}"],
    "_varbit": ["{1,10}"],
}
"""Values of every type of the table, as the server prints them in the walsender's session."""

HOSTILE = [
    "",
    "x",
    "1 2",
    "+00",
    "2024-01-02 03:04:05+05:30",
    "2024-01-02 03:04:05-08",
    'q"\\\n\t\x01é😀',
    "{",
    "{1,",
    "{{1},{2}}",
    "[0:1]={1,2}",
    '{a,"b"}',
    "NaN",
    "inf",
    "-inf",
    "t",
    "true",
]
"""Texts that are no type's output (or another type's), rendered by every OID too: the two
implementations must agree on them as well, failures included."""


def c_kinds() -> tuple[dict[str, int], set[str], list[str]]:
    """From ``_pgoutput_c.c``: its ``KIND_*`` enum, the ``KIND_*`` cases of ``convert_native``
    and any ``case <number>:`` label anywhere (a switch over type OIDs)."""
    source = C_SOURCE.read_text()
    enum = re.search(r"enum\s*\{([^}]*KIND_CALL[^}]*)\}", source)
    assert enum is not None, "the KIND_ enum of _pgoutput_c.c"
    kinds = {name: int(value) for name, value in re.findall(r"\b(KIND_\w+)\s*=\s*(\d+)", enum.group(1))}
    body = re.search(r"static int convert_native\([^)]*\)\s*\{(.*?)\n\}", source, re.S)
    assert body is not None, "convert_native in _pgoutput_c.c"
    cases = set(re.findall(r"\bcase\s+(KIND_\w+)\s*:", body.group(1)))
    numeric = re.findall(r"\bcase\s+(\d+)\s*:", source)
    return kinds, cases, numeric


def test_the_compiled_switch_is_the_tables_native_kinds() -> None:
    kinds, cases, numeric = c_kinds()
    native = {f"KIND_{rule.name}": code for rule, code in NATIVE_KINDS.items()}
    assert kinds == {"KIND_CALL": 0, **native}, "_pgoutput_c.c's KIND_ enum is not pgtypes.NATIVE_KINDS"
    assert cases == set(native), "convert_native's cases are not pgtypes.NATIVE_KINDS"
    assert not numeric, f"_pgoutput_c.c switches over numbers {numeric}: type OIDs belong in pgtypes.PG_TYPES"
    assert set(CONVERTER_KINDS.values()) == set(NATIVE_KINDS.values())
    assert all(CONVERTER_KINDS[RULE_CONVERTERS[rule]] == code for rule, code in NATIVE_KINDS.items())


def test_the_table_is_consistent() -> None:
    assert all(oid == t.oid for oid, t in PG_TYPES.items())
    assert len({t.name for t in PG_TYPES.values()}) == len(PG_TYPES)
    for t in PG_TYPES.values():
        if t.rule is Rule.ARRAY:
            element = PG_TYPES[t.element]
            assert element.rule is not Rule.ARRAY and t.name == "_" + element.name and not t.text_cast
        else:
            assert t.element == 0
    assert {t.rule for t in PG_TYPES.values()} == set(Rule)  # every rule is some type's
    assert set(SAMPLES) == {t.name for t in PG_TYPES.values()}, "every type of the table needs its samples here"


def test_the_python_reference_renders_every_oid_by_its_rule() -> None:
    assert set(RULE_CONVERTERS) == set(Rule) - {Rule.ARRAY}
    looked_up: list[int] = []
    types = TypeRegistry(lambda oid: looked_up.append(oid))  # type: ignore[func-returns-value]
    for oid, t in PG_TYPES.items():
        conv = types.converter(oid)
        if t.rule is Rule.ARRAY:
            element = RULE_CONVERTERS[PG_TYPES[t.element].rule]
            assert conv not in CONVERTER_KINDS and conv('{"a",NULL}') == "[" + element("a") + ",null]"
        else:
            assert conv is RULE_CONVERTERS[t.rule]
    assert looked_up == []  # the table's types are known without the catalog


def relation(compiled: bool) -> tuple[PgOutputDecoder, pgoutput.Relation, list[int]]:
    """A decoder and a relation with one column per OID of the table, in OID order."""
    oids = sorted(PG_TYPES)
    decoder = PgOutputDecoder(TypeRegistry(), compiled=compiled)
    decoder.decode(relation_message(5, [(f"c{oid}", oid) for oid in oids]))
    return decoder, decoder.relations[5], oids


def rows() -> list[list[str | None]]:
    """Rows of every OID: each sample of its type, then each hostile text, then NULL."""
    oids = sorted(PG_TYPES)
    texts = {oid: SAMPLES[PG_TYPES[oid].name] + HOSTILE + [None] for oid in oids}  # type: ignore[operator]
    depth = max(len(v) for v in texts.values())
    return [[texts[oid][i % len(texts[oid])] for oid in oids] for i in range(depth)]


def outcome(call: object, *args: object) -> object:
    try:
        return call(*args)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - compared between the two implementations
        return type(exc)


def copy_field(text: str | None) -> str:
    """A text value as a field of COPY's text format."""
    if text is None:
        return "\\N"
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def test_every_oid_renders_alike_compiled_and_in_python() -> None:
    from sequin_provider import _pgoutput_c

    (compiled, rel, oids), (reference, _, _) = relation(True), relation(False)
    assert rel.kinds == bytes(NATIVE_KINDS.get(PG_TYPES[oid].rule, 0) for oid in oids)
    rendered = 0
    for values in rows():
        args = (values, rel.kinds, rel.prefixes, rel.converters, rel.columns, None, None)
        want = pgoutput.render_record(*args)  # type: ignore[arg-type]
        assert _pgoutput_c.render(*args) == want, values
        message = insert_message(5, [None if v is None else v.encode() for v in values])
        got_row, want_row = outcome(compiled.decode, message), outcome(reference.decode, message)
        assert got_row == want_row and type(want_row) is tuple and want_row[7] == want[0], values
        # each column alone, so that a failure names its type
        for i, oid in enumerate(oids):
            one = (
                [values[i]],
                rel.kinds[i : i + 1],
                rel.prefixes[i : i + 1],
                rel.converters[i : i + 1],
                rel.columns[i : i + 1],
                None,
                None,
            )
            assert _pgoutput_c.render(*one) == pgoutput.render_record(*one), (PG_TYPES[oid].name, values[i])  # type: ignore[arg-type]
            rendered += 1
    page = "".join("\t".join(copy_field(v) for v in values) + "\n" for values in rows()).encode()
    copied = outcome(reference.render_copy, rel, page)
    assert type(copied) is tuple and outcome(compiled.render_copy, rel, page) == copied
    assert rendered >= len(PG_TYPES) * (len(HOSTILE) + 2)
    fill = pgoutput.render_record(
        [UNCHANGED_TOAST] * len(oids), rel.kinds, rel.prefixes, rel.converters, rel.columns, None, rows()[0]
    )
    assert fill == _pgoutput_c.render(
        [UNCHANGED_TOAST] * len(oids), rel.kinds, rel.prefixes, rel.converters, rel.columns, None, rows()[0]
    )


def test_the_backfill_sql_has_a_rule_for_every_scalar_type_and_arrays_stay_python() -> None:
    assert set(RULE_SQL) == set(RULE_CONVERTERS) == set(Rule) - {Rule.ARRAY}
    _, rel, oids = relation(False)
    column = sql.Identifier("r", "v")
    for i, oid in enumerate(oids):
        rendered = value_sql(column, oid, rel.converters[i])
        assert (rendered is None) is (PG_TYPES[oid].rule is Rule.ARRAY), PG_TYPES[oid].name
    scalar = [i for i, oid in enumerate(oids) if PG_TYPES[oid].rule is not Rule.ARRAY]
    only_scalars = PgOutputDecoder(TypeRegistry()).make_relation(
        6, "public", "t", "d", [rel.columns[i] for i in scalar], [oids[i] for i in scalar], [False] * len(scalar), []
    )
    assert record_sql(only_scalars, ["b"] * len(scalar)) is not None
    assert record_sql(rel, ["b"] * len(oids)) is None


def typed(oid: int, text: str) -> sql.Composable:
    """``text`` read as a value of type ``oid`` (by the table's name)."""
    return sql.SQL("CAST({} AS {})").format(sql.Literal(text), sql.Identifier("pg_catalog", PG_TYPES[oid].name))


@pytest.fixture
def session(dsn: str) -> psycopg.Connection:
    """A connection with the walsender's session settings (its text forms)."""
    with psycopg.connect(dsn, autocommit=True, options=REPLICATION_SESSION_OPTIONS) as conn:
        yield conn


def test_the_table_and_samples_are_the_servers(session: psycopg.Connection) -> None:
    catalog = {
        int(oid): (name, int(elem))
        for oid, name, elem in session.execute(
            "SELECT oid, typname, CASE typcategory WHEN 'A' THEN typelem ELSE 0 END FROM pg_type WHERE oid = ANY(%s)",
            (list(PG_TYPES),),
        ).fetchall()
    }
    assert catalog == {oid: (t.name, t.element) for oid, t in PG_TYPES.items()}
    for oid, t in PG_TYPES.items():
        for text in SAMPLES[t.name]:
            value = typed(oid, text)
            printed, cast = session.execute(sql.SQL("SELECT format('%s', {0}), {0}::text").format(value)).fetchone()
            assert printed == text, f"{t.name}: the server prints {text!r} as {printed!r}"
            if t.text_cast:
                assert cast == printed, f"{t.name}: ::text is not its output function"


def test_the_sql_renders_every_scalar_sample_as_the_converter(session: psycopg.Connection) -> None:
    compared = 0
    for oid, t in PG_TYPES.items():
        if t.rule is Rule.ARRAY:
            continue
        converter = RULE_CONVERTERS[t.rule]
        rendered = value_sql(sql.Identifier("r", "v"), oid, converter)
        assert rendered is not None
        for text in SAMPLES[t.name]:
            got = session.execute(
                sql.SQL("SELECT {} FROM (SELECT {} AS v) AS r").format(rendered, typed(oid, text))
            ).fetchone()[0]
            assert got == converter(text), f"{t.name} {text!r}: SQL {got!r}, decoder {converter(text)!r}"
            compared += 1
    assert compared > len(PG_TYPES) // 2
