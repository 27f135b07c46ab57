"""pgoutput (protocol version 1) decoder and Postgres text value -> JSON conversion.

The decoder turns the replication payloads of one slot into change rows (``messages.ChangeRow``)
with the record and changes already rendered as JSON text. Values are rendered straight from
Postgres' text output, so ``numeric`` keeps every digit and ``json``/``jsonb`` pass through
untouched. The walsender session must use ``DateStyle=ISO``, ``TimeZone=UTC`` and
``IntervalStyle=iso_8601`` (``replication.REPLICATION_SESSION_OPTIONS``).

Value mapping (DESIGN §5): int2/4/8, oid -> JSON integers; numeric -> JSON number with every
digit, ``"NaN"``/``"Infinity"``/``"-Infinity"`` as strings; float4/8 -> JSON numbers, non-finite
values as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; bool -> true/false;
json/jsonb -> the JSON value; timestamptz -> ``2024-01-02T03:04:05.123456Z``; timestamp ->
``2024-01-02T03:04:05.123456``; timetz -> ``03:04:05+02:00``; date, time as Postgres prints them
(ISO); ``infinity`` timestamps and BC dates as Postgres prints them; interval -> ISO 8601
duration (``P1Y2M3DT4H5M6S``); bytea -> ``"\\x0102ff"`` (Postgres hex format); arrays -> nested
lists with ``null`` elements, elements converted by their type; enum, domain (as its base
type), uuid, inet, cidr, macaddr, text types and anything else -> the text value as a string.
The built-in types' rules are one table, ``pgtypes.PG_TYPES``, shared with the compiled renderer
and the backfill's SQL.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from array import array
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import partial
from itertools import accumulate
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from sequin_provider.exceptions import SequinError
from sequin_provider.pgtypes import NATIVE_KINDS, PG_TYPES, Rule

log = logging.getLogger(__name__)

PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)
_UNPACK_I16 = struct.Struct(">h").unpack_from
_UNPACK_I32 = struct.Struct(">i").unpack_from
_UNPACK_U32 = struct.Struct(">I").unpack_from
_UNPACK_I64 = struct.Struct(">q").unpack_from

UNCHANGED_TOAST = object()
"""Marker for a TOASTed value that the WAL did not carry because it did not change."""

Converter = Callable[[str], str]


def lsn_to_int(lsn: str) -> int:
    """``'16/B374D848'`` -> integer."""
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def int_to_lsn(value: int) -> str:
    """Integer -> ``'16/B374D848'``."""
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def pg_timestamp_to_iso(micros: int) -> str:
    """Microseconds since 2000-01-01 UTC (the wire format of commit timestamps) -> ISO 8601 UTC."""
    ts = PG_EPOCH + timedelta(microseconds=micros)
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------------------------------------
# Value converters: Postgres text output -> JSON text


_json_string = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":")
).encode  # a string, or a list of them (record_pks)


def as_string(text: str) -> str:
    """Any value as a JSON string."""
    return _json_string(text)


def as_raw(text: str) -> str:
    """A value whose text is already JSON (integers, json, jsonb)."""
    return text


def as_bool(text: str) -> str:
    """``t``/``f`` -> ``true``/``false``."""
    return "true" if text == "t" else "false"


NON_FINITE = {
    "NaN": '"NaN"',
    "Infinity": '"Infinity"',
    "-Infinity": '"-Infinity"',
    "inf": '"Infinity"',
    "-inf": '"-Infinity"',
    "nan": '"NaN"',
}
"""Non-finite numeric/float texts -> their JSON (a string: JSON has no such numbers)."""


def as_number(text: str) -> str:
    """numeric/float text -> JSON number, keeping every digit; non-finite values as strings."""
    special = NON_FINITE.get(text)
    return special if special is not None else text


def as_timestamptz(text: str) -> str:
    """``2024-01-02 03:04:05.1+00`` -> ``"2024-01-02T03:04:05.1Z"``; other offsets as ``+hh:mm``."""
    if not text[:1].isdigit() or text.endswith(" BC"):
        return _json_string(text)
    date_time = text.replace(" ", "T", 1)
    if date_time.endswith("+00"):
        return f'"{date_time[:-3]}Z"'
    return _json_string(_iso_offset(date_time, max(date_time.find("T"), 0)))


def as_timestamp(text: str) -> str:
    """``2024-01-02 03:04:05`` -> ``"2024-01-02T03:04:05"``."""
    if not text[:1].isdigit() or text.endswith(" BC"):
        return _json_string(text)
    return f'"{text.replace(" ", "T", 1)}"'


def as_timetz(text: str) -> str:
    """``03:04:05+02`` -> ``"03:04:05+02:00"``."""
    return _json_string(_iso_offset(text, 0))


def _iso_offset(text: str, time_start: int) -> str:
    """Write the UTC offset that follows the time part (``+hh``) as ``+hh:mm``."""
    for i in range(time_start, len(text)):
        if text[i] in "+-":
            return text + ":00" if len(text) - i == 3 else text
    return text


RULE_CONVERTERS: Mapping[Rule, Converter] = MappingProxyType(
    {
        Rule.RAW: as_raw,
        Rule.NUMBER: as_number,
        Rule.BOOL: as_bool,
        Rule.STRING: as_string,
        Rule.TIMESTAMPTZ: as_timestamptz,
        Rule.TIMESTAMP: as_timestamp,
        Rule.TIMETZ: as_timetz,
    }
)
"""The converter of each scalar rule of ``pgtypes.PG_TYPES`` (``Rule.ARRAY``: ``array_converter``)."""

CONVERTER_RULES: Mapping[Converter, Rule] = MappingProxyType({conv: rule for rule, conv in RULE_CONVERTERS.items()})
"""The rule a scalar converter renders by (array converters are not in it)."""


def parse_array_literal(text: str, delimiter: str = ",") -> list[object]:
    """Parse Postgres array output (``{1,NULL,"a b",{2,3}}``) into nested lists of str/None."""
    if text.startswith("["):  # explicit bounds: [0:2]={...}
        text = text[text.index("=") + 1 :]
    pos = 0
    length = len(text)

    if not text.startswith("{"):
        raise ValueError(f"not an array literal: {text[:80]!r}")

    def parse_level() -> list[object]:
        nonlocal pos
        if text[pos] != "{":
            raise ValueError(f"malformed array literal at {pos}: {text[:80]!r}")
        pos += 1
        items: list[object] = []
        if text[pos] == "}":
            pos += 1
            return items
        while True:
            ch = text[pos]
            if ch == "{":
                items.append(parse_level())
            elif ch == '"':
                pos += 1
                chunk: list[str] = []
                while text[pos] != '"':
                    if text[pos] == "\\":
                        pos += 1
                    chunk.append(text[pos])
                    pos += 1
                pos += 1
                items.append("".join(chunk))
            else:
                start = pos
                while pos < length and text[pos] != delimiter and text[pos] != "}":
                    pos += 1
                token = text[start:pos].strip()
                items.append(None if token == "NULL" else token)
            if text[pos] == delimiter:
                pos += 1
                continue
            if text[pos] == "}":
                pos += 1
                return items
            raise ValueError(f"malformed array literal at {pos}: {text!r}")

    return parse_level()


def array_converter(element: Converter, delimiter: str = ",") -> Converter:
    """Converter for an array whose elements use ``element``."""

    def render(value: object) -> str:
        if value is None:
            return "null"
        if isinstance(value, list):
            return "[" + ",".join(render(v) for v in value) + "]"
        return element(value)  # type: ignore[arg-type]

    def convert(text: str) -> str:
        try:
            return render(parse_array_literal(text, delimiter))
        except (ValueError, IndexError):
            return as_string(text)  # array-like types with another text form (int2vector, oidvector)

    return convert


@dataclass(frozen=True)
class TypeInfo:
    """What the catalog says about a type OID (``pg_type``)."""

    oid: int
    name: str
    typtype: str  # b base, d domain, e enum, c composite, r range, m multirange, p pseudo
    category: str  # A array, ...
    element: int  # typelem for arrays
    base: int  # typbasetype for domains
    delimiter: str = ","


class TypeRegistry:
    """Maps type OIDs to converters: the built-in types by ``pgtypes.PG_TYPES``, other OIDs looked
    up once in the catalog (domains as their base type, arrays by their element)."""

    def __init__(self, lookup: Callable[[int], TypeInfo | None] | None = None) -> None:
        self._lookup = lookup
        self._cache: dict[int, Converter] = {}

    def converter(self, oid: int, _depth: int = 0) -> Converter:
        """The JSON converter of type ``oid`` (text fallback for anything unknown)."""
        cached = self._cache.get(oid)
        if cached is not None:
            return cached
        builtin = PG_TYPES.get(oid)
        conv: Converter | None = None
        if builtin is not None:  # the table decides, without the catalog
            conv = (
                array_converter(self.converter(builtin.element, _depth + 1))
                if builtin.rule is Rule.ARRAY
                else RULE_CONVERTERS[builtin.rule]
            )
        elif self._lookup is not None and _depth < 8:
            info = self._lookup(oid)
            if info is not None:
                if info.typtype == "d" and info.base:
                    conv = self.converter(info.base, _depth + 1)
                elif info.category == "A" and info.element:
                    conv = array_converter(self.converter(info.element, _depth + 1), info.delimiter)
        if conv is None:
            conv = as_string
        self._cache[oid] = conv
        return conv


# ---------------------------------------------------------------------------------------------
# Protocol messages


@dataclass
class Relation:
    """A table as announced by a Relation message, with precomputed rendering."""

    oid: int
    schema: str
    name: str
    replica_identity: str
    columns: list[str]
    type_oids: list[int]
    key_flags: list[bool]
    primary_key: list[str]
    converters: list[Converter] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    pk_positions: list[int] = field(default_factory=list)
    kinds: bytes = b""  # CONVERTER_KINDS of the converters, for the compiled renderer
    old_key_positions: list[int] = field(default_factory=list)  # pk_positions when a key tuple ('K') carries them all


def relation_key(
    qualified: str,
    replica_identity: str,
    columns: list[str],
    key_flags: list[bool],
    catalog_key: Callable[[], list[str]] | None,
) -> list[str]:
    """The columns whose values are a change's ``record_pks``, in key order (DESIGN §6).

    REPLICA IDENTITY DEFAULT: the Relation message flags exactly the primary key as it was at this
    point of the WAL, so the flags decide; they come in column order, so today's key
    (``catalog_key``) gives the order when it has the same columns, and a row written under another
    key than today's (renamed or replaced since) keeps the column order. No flag: the table had no
    primary key then, ``[]``. FULL, USING INDEX, NOTHING: the WAL does not say which columns formed
    the key, so it is today's primary key when all of its columns are in the row as written, else
    ``[]`` (a warning is logged): the stream never makes up a key from columns the row lacks.
    ``catalog_key`` None (a decoder without a catalog): the flagged columns."""
    flagged = [c for c, k in zip(columns, key_flags) if k]
    if catalog_key is None:
        return flagged
    if replica_identity == "d":
        if len(flagged) < 2:
            return flagged
        today = catalog_key()
        if sorted(today) == sorted(flagged):
            return today
        log.info(
            "%s: rows of this point of the WAL have the primary key (%s), today's is (%s): record_pks in column order",
            qualified,
            ", ".join(flagged),
            ", ".join(today) or "none",
        )
        return flagged
    today = catalog_key()
    if not today:
        log.warning(
            "%s (REPLICA IDENTITY %s): no primary key in today's catalog (the table or its key was dropped"
            " since), and the WAL does not record it: record_pks = [] for the rows of this point of the WAL",
            qualified,
            _IDENTITY_NAMES.get(replica_identity, replica_identity),
        )
        return []
    absent = [c for c in today if c not in columns]
    if absent:
        log.warning(
            "%s (REPLICA IDENTITY %s): primary key column(s) %s of today's catalog are not in the rows of"
            " this point of the WAL (%s), which does not record the key: record_pks = [] for them",
            qualified,
            _IDENTITY_NAMES.get(replica_identity, replica_identity),
            ", ".join(absent),
            ", ".join(columns),
        )
        return []
    return today


_IDENTITY_NAMES = {"d": "DEFAULT", "f": "FULL", "i": "USING INDEX", "n": "NOTHING"}


@dataclass(frozen=True)
class LogicalMessage:
    """A ``pg_logical_emit_message`` payload."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True)
class Begin:
    """Start of a transaction: its commit LSN and commit time are known here."""

    final_lsn: int
    commit_ts: int
    xid: int


@dataclass(frozen=True)
class Commit:
    """End of a transaction; ``end_lsn`` is where the next one starts (used for offsets)."""

    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True)
class Truncate:
    """TRUNCATE of one or more captured tables: their names (for logs) and relation ids
    (``PgOutputDecoder.truncate_rows`` makes them change rows)."""

    relations: tuple[str, ...]
    relids: tuple[int, ...] = ()


ChangeRow = tuple
"""(commit_lsn, commit_idx, commit_timestamp, xid, table_schema, table_name, action, record,
changes, record_pks, unchanged_toast, backfill_id, backfill_sink) — the columns of
``messages.CHANGE_COLUMNS`` (the last two are None except for backfill reads)."""


class DecodeError(SequinError, ValueError):
    """A payload that is not valid pgoutput (or refers to an unknown relation)."""


# ---------------------------------------------------------------------------------------------
# The per-change hot path: reference definitions, and their compiled counterparts when built


CONVERTER_KINDS: dict[Converter, int] = {RULE_CONVERTERS[rule]: kind for rule, kind in NATIVE_KINDS.items()}
"""Converters the compiled renderer applies itself (``pgtypes.NATIVE_KINDS``, the codes of
``_pgoutput_c.c``); any other converter (0) is called from it."""


def parse_tuple(buf: bytes, pos: int) -> tuple[list[object], int]:
    """A TupleData at ``pos``: its values (text, None, ``UNCHANGED_TOAST``) and the position after it."""
    n = _UNPACK_I16(buf, pos)[0]
    pos += 2
    values: list[object] = []
    append = values.append
    size = len(buf)
    for _ in range(n):
        kind = buf[pos]
        pos += 1
        if kind == 116 or kind == 98:  # 't' text / 'b' binary
            length = _UNPACK_I32(buf, pos)[0]
            pos += 4
            if length < 0 or length > size - pos:
                raise DecodeError(f"truncated pgoutput tuple: value bytes ({length} at {pos} of {size})")
            append(buf[pos : pos + length].decode("utf-8"))
            pos += length
        elif kind == 110:  # 'n' null
            append(None)
        elif kind == 117:  # 'u' unchanged toast
            append(UNCHANGED_TOAST)
        else:
            raise DecodeError(f"unknown tuple value kind {chr(kind)!r}")
    return values, pos


def render_record(
    values: list[object],
    kinds: bytes,
    prefixes: list[str],
    converters: list[Converter],
    columns: list[str],
    only: Iterable[int] | None,
    fill: list[object] | None,
) -> tuple[str, list[str]]:
    """Record JSON of a row's ``values`` (of ``only`` those positions); an unchanged TOAST value is
    taken from ``fill`` or its column is reported in the returned list. ``kinds`` is unused here:
    it tells the compiled counterpart which converters it may apply itself."""
    parts: list[str] = []
    missing: list[str] = []
    for i in range(len(values)) if only is None else only:
        if i < 0:
            raise IndexError(f"negative column position {i}")
        v = values[i]
        if v is UNCHANGED_TOAST and fill is not None and i < len(fill) and fill[i] is not UNCHANGED_TOAST:
            v = fill[i]
        if v is None:
            parts.append(prefixes[i] + "null")
        elif v is UNCHANGED_TOAST:
            missing.append(columns[i])
        else:
            parts.append(prefixes[i] + converters[i](v))  # type: ignore[arg-type]
    return "{" + ",".join(parts) + "}", missing


def render_tuple(
    buf: bytes,
    pos: int,
    kinds: bytes,
    prefixes: list[str],
    converters: list[Converter],
    columns: list[str],
    pk_positions: list[int],
) -> tuple[str, list[str], list[str]]:
    """A whole TupleData at ``pos`` rendered: record JSON, ``record_pks``, unchanged TOAST columns
    (inserts, updates without old values, deletes with the full old row)."""
    values, _ = parse_tuple(buf, pos)
    record, missing = render_record(values, kinds, prefixes, converters, columns, None, None)
    return record, pk_texts(values, pk_positions), missing


RowSpec = tuple[str, str, bytes, list[str], list[Converter], list[str], list[int]]
"""What ``change_row`` needs of a relation: schema, name, and ``render_tuple``'s five lists."""


def row_spec(rel: Relation) -> RowSpec:
    """``rel`` as ``change_row`` takes it."""
    return (rel.schema, rel.name, rel.kinds, rel.prefixes, rel.converters, rel.columns, rel.pk_positions)


_SIMPLE_ACTIONS = {73: ("insert", None), 85: ("update", "{}"), 68: ("delete", None)}  # I, U, D


def render_update(
    old: list[object],
    new: list[object],
    kinds: bytes,
    prefixes: list[str],
    converters: list[Converter],
    columns: list[str],
    key_flags: list[bool] | None,
    render: Callable[..., tuple[str, list[str]]] = render_record,
) -> tuple[str, str, list[str]]:
    """An update's record JSON, its ``changes`` JSON (the old values of the columns it changed)
    and its unchanged-TOAST columns, from its ``old`` and ``new`` values. ``old`` is the whole old
    row ('O', replica identity full), or with ``key_flags`` a key tuple ('K'), whose entries that
    are not identity columns are null placeholders, not values: they neither fill an unchanged
    TOAST column of the record nor count as changed. ``render`` is ``render_record`` or its
    compiled counterpart."""
    fill = old if key_flags is None else [o if key else UNCHANGED_TOAST for o, key in zip(old, key_flags)]
    record, missing = render(new, kinds, prefixes, converters, columns, None, fill)
    changed = [
        i for i, (o, n) in enumerate(zip(fill, new)) if o is not UNCHANGED_TOAST and n is not UNCHANGED_TOAST and o != n
    ]
    changes, _ = render(old, kinds, prefixes, converters, columns, changed, None)
    return record, changes, missing


def change_row(specs: dict[int, RowSpec], head: list[Any], buf: bytes) -> ChangeRow | None:
    """The change row of an insert, an update without old values or with the whole old row ('O',
    replica identity full: ``render_update``), or a delete with the whole old row (a whole tuple at
    6, ``render_tuple``); None for any other message (an update or delete with a key tuple, 'K'),
    or one of a relation not in ``specs``, which ``PgOutputDecoder`` then decodes on its general
    path. ``head`` is the transaction's ``[commit_lsn, idx, commit_ts_iso, xid]``: the row takes
    ``idx`` and moves it on. Nearly every message of a stream is one of these, so the compiled
    counterpart does all of it in one call."""
    if len(buf) < 6:
        return None
    kind = buf[0]
    simple = _SIMPLE_ACTIONS.get(kind)
    if simple is None or (kind in (85, 68) and buf[5] == 75):
        return None  # not a change, or a key tuple ('K') before the new tuple
    spec = specs.get(_UNPACK_U32(buf, 1)[0])
    if spec is None:
        return None
    schema, name, kinds, prefixes, converters, columns, pk_positions = spec
    changes = simple[1]
    if kind == 85 and buf[5] == 79:  # 'O': the old row, then 'N' and the new one
        old, pos = parse_tuple(buf, 6)
        new, _ = parse_tuple(buf, pos + 1)
        record, changes, missing = render_update(old, new, kinds, prefixes, converters, columns, None)
        pks = pk_texts(new, pk_positions)
    else:
        record, pks, missing = render_tuple(buf, 6, kinds, prefixes, converters, columns, pk_positions)
    idx = head[1]
    head[1] = idx + 1
    return (head[0], idx, head[2], head[3], schema, name, simple[0], record, changes, pks, missing, None, None)


def pk_texts(values: list[object], pk_positions: list[int]) -> list[str]:
    """``record_pks``: the text of each primary-key value present (not null, not unchanged TOAST)."""
    return [str(values[i]) for i in pk_positions if values[i] is not None and values[i] is not UNCHANGED_TOAST]


_COPY_ESCAPE = re.compile(r"\\(.)")
_COPY_CODES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}


def parse_copy_line(line: str) -> list[str | None]:
    """One line of ``COPY ... TO STDOUT`` text format as the columns' text values (None for NULL)."""
    out: list[str | None] = []
    for text in line.split("\t"):
        if text == "\\N":
            out.append(None)
        elif "\\" in text:
            out.append(_COPY_ESCAPE.sub(lambda m: _COPY_CODES.get(m.group(1), m.group(1)), text))
        else:
            out.append(text)
    return out


def render_copy(
    data: bytes,
    kinds: bytes,
    prefixes: list[str],
    converters: list[Converter],
    columns: list[str],
    pk_positions: list[int],
) -> tuple[bytes, bytes, bytes, bytes, int]:
    """A backfill page's ``COPY … TO STDOUT`` text lines (every column of the table, in order)
    rendered as each row's record JSON and ``record_pks`` JSON: what a change of the same row
    carries. Returned as Arrow string buffers (UTF-8 data, int32 offsets) of the records, then of
    the keys, and the row count, so that a page of 50,000 rows makes no Python object per row."""
    lines = bytes(data).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline ending the last line
    records: list[bytes] = []
    pks: list[bytes] = []
    for line in lines:
        values = parse_copy_line(line.decode("utf-8"))
        if len(values) != len(columns):
            raise DecodeError(f"a COPY line of {len(values)} fields for a table of {len(columns)} columns")
        record, _ = render_record(values, kinds, prefixes, converters, columns, None, None)  # type: ignore[arg-type]
        records.append(record.encode("utf-8"))
        pks.append(_json_string(pk_texts(values, pk_positions)).encode("utf-8"))  # type: ignore[arg-type]
    return (b"".join(records), _offsets(records), b"".join(pks), _offsets(pks), len(lines))


def _offsets(parts: list[bytes]) -> bytes:
    """Arrow int32 offsets of ``parts`` laid end to end."""
    return array("i", accumulate((len(p) for p in parts), initial=0)).tobytes()


try:  # built by `pip install` from _pgoutput_c.c (optional: without a compiler the references run)
    from sequin_provider import _pgoutput_c as hot_path
except ImportError:  # pragma: no cover - depends on the build
    hot_path = None  # type: ignore[assignment]
else:
    hot_path.configure(UNCHANGED_TOAST, DecodeError)
"""The compiled hot path (the extension ``sequin_provider._pgoutput_c``, configured with this
module's ``UNCHANGED_TOAST`` and ``DecodeError``), None when it is not built."""

COMPILED = hot_path is not None
"""Whether the compiled decoder hot path is available (``PgOutputDecoder`` uses it by default)."""


class PgOutputDecoder:
    """Stateful decoder of one replication stream.

    ``decode(payload)`` returns a ``ChangeRow`` for Insert/Update/Delete, a ``Begin``/``Commit``/
    ``LogicalMessage``/``Truncate`` object for those, and None for Relation/Type/Origin.
    ``primary_key(relid, schema, name)`` tells today's primary-key columns of a table (catalog):
    ``relation_key`` says when it is asked and what of it is used.
    ``compiled`` chooses the compiled tuple parser and renderer (default: when built) or the
    Python references, which define what both do.
    """

    def __init__(
        self,
        types: TypeRegistry,
        primary_key: Callable[[int, str, str], list[str]] | None = None,
        compiled: bool = COMPILED,
    ) -> None:
        if compiled and not COMPILED:
            raise RuntimeError("the compiled pgoutput decoder (sequin_provider._pgoutput_c) is not built")
        self._parse_tuple = hot_path.parse_tuple if compiled else parse_tuple
        self._render_record = hot_path.render if compiled else render_record
        self._render_copy = hot_path.render_copy if compiled else render_copy
        self.compiled = compiled
        self.types = types
        self._primary_key = primary_key
        self.relations: dict[int, Relation] = {}
        self._specs: dict[int, RowSpec] = {}
        """``change_row``'s view of ``relations``."""
        self._head: list[Any] = [0, 0, "", 0]
        """The current transaction's commit LSN, next change index, commit time (ISO) and xid."""
        self.change_row: Callable[[bytes], ChangeRow | None] = partial(
            hot_path.change_row if compiled else change_row, self._specs, self._head
        )
        """``change_row`` of this stream: ``decode``'s result for an insert, an update without old
        values or a full-row delete of an announced relation, in one call; None for any other
        message, which ``decode`` then takes. The reader's loop calls it first."""
        self.take_rows: Callable[..., tuple[int, int, int, bytes | None]] | None = (
            partial(hot_path.read_rows, self._specs, self._head) if compiled else None
        )
        """``change_row`` over many messages of a replication connection in one call
        (``replication_protocol.ReplicationStream.read_rows``, ``_pgoutput_c.read_rows``); None with
        the Python references, whose reader takes one message at a time."""

    # -- framing --------------------------------------------------------------------------
    def decode(self, buf: bytes) -> object:
        """Decode one pgoutput message."""
        if not buf:
            raise DecodeError("empty pgoutput message")
        kind = buf[0]
        try:
            row = self.change_row(buf)  # most messages: one call
            if row is not None:
                return row
            if kind == 73 or kind == 85 or kind == 68:  # I U D with old values, of an unknown relation, or short
                rel = self._rel(buf)
                if kind == 73 or len(buf) < 6:
                    raise DecodeError(f"truncated pgoutput message {chr(kind)!r} of {len(buf)} bytes")
                return self._update(rel, buf) if kind == 85 else self._delete(rel, buf)
            if kind == 66:  # B
                final_lsn, ts, xid = _UNPACK_I64(buf, 1)[0], _UNPACK_I64(buf, 9)[0], _UNPACK_U32(buf, 17)[0]
                self._head[:] = (final_lsn, 0, pg_timestamp_to_iso(ts), xid)
                return Begin(final_lsn, ts, xid)
            if kind == 67:  # C
                return Commit(_UNPACK_I64(buf, 2)[0], _UNPACK_I64(buf, 10)[0], _UNPACK_I64(buf, 18)[0])
            if kind == 82:  # R
                self._relation(buf)
                return None
            if kind == 77:  # M
                return self._message(buf)
            if kind == 84:  # T
                return self._truncate(buf)
            if kind in (89, 79):  # Y (type), O (origin)
                return None
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise DecodeError(f"truncated or malformed pgoutput message {chr(kind)!r}: {exc}") from exc
        raise DecodeError(f"unknown pgoutput message type {chr(kind)!r}")

    # -- catalog messages -------------------------------------------------------------------
    def _relation(self, buf: bytes) -> None:
        relid = _UNPACK_U32(buf, 1)[0]
        pos = 5
        schema, pos = _cstring(buf, pos)
        name, pos = _cstring(buf, pos)
        replident = chr(buf[pos])
        ncols = _UNPACK_I16(buf, pos + 1)[0]
        pos += 3
        columns, oids, keys = [], [], []
        for _ in range(ncols):
            flags = buf[pos]
            col, pos = _cstring(buf, pos + 1)
            oids.append(_UNPACK_U32(buf, pos)[0])
            pos += 8  # type oid + typmod
            columns.append(col)
            keys.append(bool(flags & 1))
        lookup = self._primary_key
        pk = relation_key(
            f"{schema}.{name}",
            replident,
            columns,
            keys,
            None if lookup is None else lambda: lookup(relid, schema, name),
        )
        rel = self.relations[relid] = self.make_relation(relid, schema, name, replident, columns, oids, keys, pk)
        self._specs[relid] = row_spec(rel)

    def make_relation(
        self,
        relid: int,
        schema: str,
        name: str,
        replica_identity: str,
        columns: list[str],
        type_oids: list[int],
        key_flags: list[bool],
        primary_key: list[str],
    ) -> Relation:
        """A ``Relation`` with its renderers; also used by backfills to render rows read by SELECT."""
        rel = Relation(relid, schema, name, replica_identity, columns, type_oids, key_flags, primary_key)
        rel.converters = [self.types.converter(o) for o in type_oids]
        rel.kinds = bytes(CONVERTER_KINDS.get(c, 0) for c in rel.converters)
        rel.prefixes = [_json_string(c) + ":" for c in columns]
        rel.pk_positions = [columns.index(c) for c in primary_key if c in columns]
        # a key tuple ('K': deletes, USING INDEX) carries only the identity columns: when they miss
        # part of the primary key, its record_pks would be a wrong (partial) key, so it has none
        rel.old_key_positions = rel.pk_positions if all(key_flags[i] for i in rel.pk_positions) else []
        return rel

    def render_copy(self, rel: Relation, data: bytes | bytearray) -> tuple[bytes, bytes, bytes, bytes, int]:
        """A page of ``COPY … TO STDOUT`` text lines of every column of ``rel``'s table as record
        and ``record_pks`` JSON (module-level ``render_copy``): a backfill read of each row. A page
        that is not that (a value no converter takes, bytes that are not UTF-8) raises ``DecodeError``."""
        try:
            return self._render_copy(data, rel.kinds, rel.prefixes, rel.converters, rel.columns, rel.pk_positions)
        except ValueError as exc:  # UnicodeDecodeError, a converter's, DecodeError itself
            if isinstance(exc, DecodeError):
                raise
            raise DecodeError(
                f"a backfill page of {rel.schema}.{rel.name} that the decoder cannot render: {exc}"
            ) from exc

    def render_values(self, rel: Relation, values: list[object]) -> tuple[str, list[str]]:
        """Record JSON and ``record_pks`` of a full row of text values (as a change would carry them)."""
        values = values if type(values) is list else list(values)
        return self._render(rel, values)[0], self._pks(rel, values)

    def _rel(self, buf: bytes) -> Relation:
        relid = _UNPACK_U32(buf, 1)[0]
        rel = self.relations.get(relid)
        if rel is None:
            raise DecodeError(f"change for relation {relid} before its Relation message")
        return rel

    # -- tuples -----------------------------------------------------------------------------
    def _render(
        self, rel: Relation, values: list[object], only: Iterable[int] | None = None, fill: list[object] | None = None
    ) -> tuple[str, list[str]]:
        """Record JSON of ``values``; unchanged TOAST filled from ``fill`` or reported."""
        return self._render_record(values, rel.kinds, rel.prefixes, rel.converters, rel.columns, only, fill)

    def _pks(self, rel: Relation, values: list[object]) -> list[str]:
        return pk_texts(values, rel.pk_positions)

    def _row(
        self, rel: Relation, action: str, record: str, changes: str | None, pks: list[str], missing: list[str]
    ) -> ChangeRow:
        return self._positioned(rel.schema, rel.name, action, record, changes, pks, missing)

    def _positioned(
        self, schema: str, table: str, action: str, record: str, changes: str | None, pks: list[str], missing: list[str]
    ) -> ChangeRow:
        """A change row at the transaction's next position (``commit_idx`` moves only here and in
        ``change_row``)."""
        head = self._head
        idx = head[1]
        head[1] = idx + 1
        return (head[0], idx, head[2], head[3], schema, table, action, record, changes, pks, missing, None, None)

    def _update(self, rel: Relation, buf: bytes) -> ChangeRow:
        """An update with a key tuple, 'K' at 5 (``change_row`` takes the others)."""
        old, pos = self._parse_tuple(buf, 6)
        new, _ = self._parse_tuple(buf, pos + 1)  # 'N'
        key_flags = rel.key_flags if buf[5] == 75 else None
        record, changes, missing = render_update(
            old, new, rel.kinds, rel.prefixes, rel.converters, rel.columns, key_flags, self._render_record
        )
        return self._row(rel, "update", record, changes, self._pks(rel, new), missing)

    def _delete(self, rel: Relation, buf: bytes) -> ChangeRow:
        """A delete carrying only the replica identity, 'K' at 5 (``change_row`` takes full old rows)."""
        old, _ = self._parse_tuple(buf, 6)  # key only: the record carries the replica identity columns
        record, missing = self._render(rel, old, only=[i for i, k in enumerate(rel.key_flags) if k])
        return self._row(rel, "delete", record, None, pk_texts(old, rel.old_key_positions), missing)

    # -- other ------------------------------------------------------------------------------
    def message_row(self, event: LogicalMessage) -> ChangeRow:
        """A change row carrying a ``sequin:`` logical message at its place in the transaction."""
        return self._positioned("", event.prefix, "message", event.content.decode("utf-8", "replace"), None, [], [])

    def _message(self, buf: bytes) -> LogicalMessage:
        transactional = bool(buf[1])
        lsn = _UNPACK_I64(buf, 2)[0]
        prefix, pos = _cstring(buf, 10)
        length = _UNPACK_I32(buf, pos)[0]
        return LogicalMessage(transactional, lsn, prefix, bytes(buf[pos + 4 : pos + 4 + length]))

    def _truncate(self, buf: bytes) -> Truncate:
        count = _UNPACK_I32(buf, 1)[0]  # then one byte of options (CASCADE, RESTART IDENTITY)
        relids = tuple(_UNPACK_U32(buf, 6 + 4 * i)[0] for i in range(count))
        names = []
        for relid in relids:
            rel = self.relations.get(relid)
            names.append(f"{rel.schema}.{rel.name}" if rel else "?")
        return Truncate(tuple(names), relids)

    def truncate_rows(self, event: Truncate) -> list[ChangeRow]:
        """One ``truncate`` change row per table of a TRUNCATE, at its place in the transaction
        (DESIGN §5): ``record`` ``{}``, ``changes`` null, no key. The Relation message of every
        table precedes the Truncate in the stream, as it precedes a table's first change."""
        rows = []
        for relid in event.relids:
            rel = self.relations.get(relid)
            if rel is None:
                raise DecodeError(f"TRUNCATE of relation {relid} before its Relation message")
            rows.append(self._row(rel, "truncate", "{}", None, [], []))
        return rows


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(0, pos)
    return bytes(buf[pos:end]).decode("utf-8"), end + 1
