"""The one table of how each built-in Postgres type's text value is rendered as JSON.

Three renderers must agree on every value: the decoder's Python converters (``pgoutput``, the
definition), the compiled hot path (``_pgoutput_c.c``) and the backfill's SQL
(``backfill.source_sql``), so that a backfilled row looks exactly like a streamed one. They all
take their per-type choices from ``PG_TYPES`` (type OID -> ``PgType``):

- ``pgoutput.TypeRegistry`` gives each OID the converter of its ``Rule`` (an array: its element's,
  per element); an OID not in the table is looked up in the catalog (domains as their base type,
  other arrays by their element) and is otherwise a JSON string;
- the compiled renderer dispatches on ``NATIVE_KINDS``, the codes of its ``KIND_<RULE>`` enum
  (any other rule calls the Python converter);
- ``backfill.source_sql`` takes a value's text with ``::text`` where ``PgType.text_cast`` says
  that cast is the output function, and renders each rule but ``ARRAY`` in SQL.

``tests/integration/replication/test_pgtypes.py`` holds the three to the table. Imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Mapping


class Rule(str, Enum):
    """How a type's text value becomes JSON (``pgoutput.RULE_CONVERTERS`` has the converter of each)."""

    RAW = "raw"  # the text is already JSON: integers, oid, json, jsonb
    NUMBER = "number"  # numeric/float: every digit; NaN, Infinity, -Infinity as strings
    BOOL = "bool"  # t/f -> true/false
    STRING = "string"  # the text as a JSON string
    TIMESTAMPTZ = "timestamptz"  # 2024-01-02T03:04:05Z (other offsets +hh:mm); infinity, BC as text
    TIMESTAMP = "timestamp"  # 2024-01-02T03:04:05; infinity, BC as text
    TIMETZ = "timetz"  # 03:04:05+02:00
    ARRAY = "array"  # nested lists, null elements, each element by its type's rule


@dataclass(frozen=True)
class PgType:
    """A built-in type: its OID, ``pg_type.typname``, rule, element type (arrays) and whether its
    cast to text is its output function (what pgoutput sends), so SQL may use ``::text``."""

    oid: int
    name: str
    rule: Rule
    element: int = 0
    text_cast: bool = False


def _scalar(oid: int, name: str, rule: Rule, text_cast: bool) -> PgType:
    return PgType(oid, name, rule, 0, text_cast)


def _array(oid: int, element: int) -> PgType:
    return PgType(oid, "_" + _SCALARS[element].name, Rule.ARRAY, element, False)


_SCALARS: dict[int, PgType] = {
    t.oid: t
    for t in (
        _scalar(16, "bool", Rule.BOOL, False),
        _scalar(20, "int8", Rule.RAW, True),
        _scalar(21, "int2", Rule.RAW, True),
        _scalar(23, "int4", Rule.RAW, True),
        _scalar(26, "oid", Rule.RAW, True),
        _scalar(114, "json", Rule.RAW, True),
        _scalar(3802, "jsonb", Rule.RAW, True),
        _scalar(700, "float4", Rule.NUMBER, True),
        _scalar(701, "float8", Rule.NUMBER, True),
        _scalar(1700, "numeric", Rule.NUMBER, True),
        _scalar(1184, "timestamptz", Rule.TIMESTAMPTZ, True),
        _scalar(1114, "timestamp", Rule.TIMESTAMP, True),
        _scalar(1266, "timetz", Rule.TIMETZ, True),
        _scalar(17, "bytea", Rule.STRING, False),
        _scalar(18, "char", Rule.STRING, False),
        _scalar(19, "name", Rule.STRING, False),
        _scalar(25, "text", Rule.STRING, True),
        _scalar(142, "xml", Rule.STRING, False),
        _scalar(650, "cidr", Rule.STRING, False),
        _scalar(774, "macaddr8", Rule.STRING, False),
        _scalar(790, "money", Rule.STRING, False),
        _scalar(829, "macaddr", Rule.STRING, False),
        _scalar(869, "inet", Rule.STRING, False),
        _scalar(1042, "bpchar", Rule.STRING, False),
        _scalar(1043, "varchar", Rule.STRING, True),
        _scalar(1082, "date", Rule.STRING, True),
        _scalar(1083, "time", Rule.STRING, True),
        _scalar(1186, "interval", Rule.STRING, True),
        _scalar(1560, "bit", Rule.STRING, False),
        _scalar(1562, "varbit", Rule.STRING, False),
        _scalar(2950, "uuid", Rule.STRING, True),
    )
}

_ARRAYS: dict[int, PgType] = {
    t.oid: t
    for t in (
        _array(1000, 16),
        _array(1001, 17),
        _array(1002, 18),
        _array(1003, 19),
        _array(1005, 21),
        _array(1007, 23),
        _array(1016, 20),
        _array(1009, 25),
        _array(1014, 1042),
        _array(1015, 1043),
        _array(1021, 700),
        _array(1022, 701),
        _array(1231, 1700),
        _array(2951, 2950),
        _array(199, 114),
        _array(3807, 3802),
        _array(1182, 1082),
        _array(1183, 1083),
        _array(1115, 1114),
        _array(1185, 1184),
        _array(1187, 1186),
        _array(1270, 1266),
        _array(1041, 869),
        _array(651, 650),
        _array(1040, 829),
        _array(775, 774),
        _array(1028, 26),
        _array(143, 142),
        _array(791, 790),
        _array(1561, 1560),
        _array(1563, 1562),
    )
}

PG_TYPES: Mapping[int, PgType] = MappingProxyType({**_SCALARS, **_ARRAYS})
"""Type OID -> its rendering, for the built-in types the decoder knows without the catalog."""

NATIVE_KINDS: Mapping[Rule, int] = MappingProxyType(
    {
        Rule.RAW: 1,
        Rule.STRING: 2,
        Rule.BOOL: 3,
        Rule.NUMBER: 4,
        Rule.TIMESTAMPTZ: 5,
        Rule.TIMESTAMP: 6,
    }
)
"""Rules the compiled renderer applies itself: ``_pgoutput_c.c``'s ``KIND_<RULE>`` codes (its
``convert_native`` switch). Other rules are code 0, ``KIND_CALL``: it calls the Python converter."""
