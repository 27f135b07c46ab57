"""The type matrix: one column of every kind of type, the SQL literal written, the JSON value expected.

Shared by the decoder's test (tests/integration/replication/test_pgoutput.py) and the Postgres version matrix
(tests/system/test_postgres_versions.py), which sends the same row through the stream app on each major.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

TYPE_MATRIX: list[tuple[str, str, Any]] = [
    ("int2", "32767", 32767),
    ("int4", "-2147483648", -2147483648),
    ("int8", "9223372036854775807", 9223372036854775807),
    (
        "numeric",
        "12345678901234567890.123456789012345678901234567890",
        Decimal("12345678901234567890.123456789012345678901234567890"),
    ),
    ("numeric", "'NaN'", "NaN"),
    ("numeric(10,3)", "1.5", Decimal("1.500")),
    ("float4", "1.5", Decimal("1.5")),
    ("float8", "0.1", Decimal("0.1")),
    ("float8", "'NaN'", "NaN"),
    ("float8", "'Infinity'", "Infinity"),
    ("float8", "'-Infinity'", "-Infinity"),
    ("float8", "1e300", Decimal("1e+300")),
    ("bool", "true", True),
    ("bool", "false", False),
    ("text", "E'h\\u00e9llo \"q\" \\n \\\\ \\t end'", 'héllo "q" \n \\ \t end'),
    ("varchar(10)", "'abc'", "abc"),
    ("char(5)", "'ab'", "ab   "),
    ("uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("date", "'2024-02-29'", "2024-02-29"),
    ("time", "'13:14:15.123456'", "13:14:15.123456"),
    ("timetz", "'13:14:15+05:30'", "13:14:15+05:30"),
    ("timetz", "'13:14:15-08'", "13:14:15-08:00"),
    ("timestamp", "'2024-01-02 03:04:05.678'", "2024-01-02T03:04:05.678"),
    ("timestamptz", "'2024-01-02 03:04:05+02'", "2024-01-02T01:04:05Z"),
    ("timestamptz", "'infinity'", "infinity"),
    ("interval", "'1 year 2 months 3 days 04:05:06.5'", "P1Y2M3DT4H5M6.5S"),
    ("json", '\'{"b": 1,  "a": [1.10, null]}\'', {"b": 1, "a": [Decimal("1.10"), None]}),
    ("jsonb", '\'{"b": 1, "a": [1.10, null, "x"]}\'', {"a": [Decimal("1.10"), None, "x"], "b": 1}),
    ("bytea", "'\\x00ff10'::bytea", "\\x00ff10"),
    ("int4[]", "'{{1,NULL},{3,4}}'", [[1, None], [3, 4]]),
    ("text[]", "ARRAY['a,b', 'c\"d', NULL, 'NULL', '{x}']", ["a,b", 'c"d', None, "NULL", "{x}"]),
    ("numeric[]", "'{1.10,NaN}'", [Decimal("1.10"), "NaN"]),
    ("bool[]", "'{t,f,NULL}'", [True, False, None]),
    ("jsonb[]", "ARRAY['{\"a\":1}'::jsonb, NULL]", [{"a": 1}, None]),
    ("timestamptz[]", "ARRAY['2024-01-02 03:04:05+00'::timestamptz]", ["2024-01-02T03:04:05Z"]),
    ("mood", "'happy'", "happy"),
    ("mood[]", "'{sad,happy}'", ["sad", "happy"]),
    ("posint", "5", 5),
    ("email", "'a@b.c'", "a@b.c"),
    ("posint[]", "'{1,2}'", [1, 2]),
    ("inet", "'192.168.0.1/24'", "192.168.0.1/24"),
    ("cidr", "'10.0.0.0/8'", "10.0.0.0/8"),
    ("macaddr", "'08:00:2b:01:02:03'", "08:00:2b:01:02:03"),
    ("point", "'(1,2)'", "(1,2)"),
    ("int4range", "'[1,5)'", "[1,5)"),
    ("text", "NULL", None),
    ("int4[]", "'{}'", []),
]

SETUP = [
    "CREATE TYPE mood AS ENUM ('sad', 'happy')",
    "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
    "CREATE DOMAIN email AS text",
    "CREATE TABLE matrix (id int PRIMARY KEY, "
    + ", ".join(f"c{i} {typ}" for i, (typ, _, _) in enumerate(TYPE_MATRIX))
    + ")",
]
INSERT = "INSERT INTO matrix VALUES (1, " + ", ".join(value for _, value, _ in TYPE_MATRIX) + ")"


def assert_record(got: dict[str, Any]) -> None:
    """``got`` (a message's record, parsed with decimals) holds exactly the expected values, types and order."""
    expected = {"id": 1, **{f"c{i}": want for i, (_, _, want) in enumerate(TYPE_MATRIX)}}
    for key, want in expected.items():
        kind = TYPE_MATRIX[int(key[1:])][0] if key != "id" else "int"
        assert got[key] == want and type(got[key]) is type(want), f"{key} ({kind}): {got[key]!r} != {want!r}"
    assert list(got) == list(expected)  # column order kept
