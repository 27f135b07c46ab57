"""Iceberg rows of messages: a message's JSON as a changelog row or as the source table's row
(``sinks.iceberg``), and the Iceberg schemas of both.

Values are read exactly: numbers as ``Decimal`` (a numeric keeps every digit), and the JSON text
of a value (a changelog's ``record``, a ``json`` or array column) is the message's own text, not a
re-serialization. A value that does not fit its column (``"NaN"`` in a ``numeric(12,2)``,
``"infinity"`` in a ``date``) raises ``DeliveryError``: the message is parked with its group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from sequin_provider.exceptions import DeliveryError
from sequin_provider.sinks.change_message import decode_wire

if TYPE_CHECKING:
    from pyiceberg.schema import Schema

_DECODER = json.JSONDecoder(parse_float=Decimal)
_SPACE = " \t\n\r"

Position = tuple[int, int]


def members(text: str) -> dict[str, tuple[Any, str]]:
    """The members of the JSON object ``text``: key -> (value, the value's own JSON text)."""
    out: dict[str, tuple[Any, str]] = {}
    i = _skip(text, 0)
    if text[i : i + 1] != "{":
        raise ValueError("not a JSON object")
    i = _skip(text, i + 1)
    if text[i : i + 1] == "}":
        return out
    while True:
        key, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if text[i : i + 1] != ":":
            raise ValueError("expected ':'")
        start = _skip(text, i + 1)
        value, end = _DECODER.raw_decode(text, start)
        out[key] = (value, text[start:end])
        i = _skip(text, end)
        if text[i : i + 1] == "}":
            return out
        if text[i : i + 1] != ",":
            raise ValueError("expected ',' or '}'")
        i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


@dataclass
class Message:
    """The parts of a message an Iceberg row is made of (not frozen: a frozen dataclass's
    ``__init__`` costs twice as much, and one is made per message)."""

    position: Position
    action: str
    idempotency_key: str
    table_schema: str
    table_name: str
    commit_timestamp: datetime | None
    record_pks: list[str]
    record_text: str
    """The record's JSON text as the message holds it (``null``: none)."""
    changes_text: str | None
    unchanged_toast: tuple[str, ...]

    @cached_property
    def record(self) -> dict[str, tuple[Any, str]]:
        """Column -> (value, its JSON text), read exactly when first asked (a mirror's rows; a
        changelog keeps the text). ``DeliveryError`` if the record is not a JSON object."""
        return {} if self.record_text == "null" else _members_of(self.record_text, "record")

    @cached_property
    def changes(self) -> dict[str, tuple[Any, str]] | None:
        """The old values of an update's changed columns, read exactly, or None."""
        return None if self.changes_text is None else _members_of(self.changes_text, "changes")


def _members_of(text: str, what: str) -> dict[str, tuple[Any, str]]:
    try:
        return members(text)
    except (TypeError, ValueError) as exc:
        raise DeliveryError(f"iceberg: not a change message ({what}: {type(exc).__name__}: {exc})") from None


def parse_message(text: str) -> Message:
    """A rendered message (docs/messages.md) read for its row: typed by msgspec, the record and the
    changes kept as their own text (read exactly only when a mirror needs their values); a message
    msgspec's types refuse (a transform's shape) is read the exact way, key by key. ``DeliveryError``
    if it lacks a part."""
    try:
        wire = decode_wire(text)
    except msgspec.DecodeError:
        return parse_message_exactly(text)
    metadata = wire.metadata
    if metadata.idempotency_key is None or metadata.table_schema is None or metadata.table_name is None:
        return parse_message_exactly(text)  # which names the part missing
    changes = bytes(wire.changes).decode()
    try:
        stamp = None if metadata.commit_timestamp is None else _timestamp(metadata.commit_timestamp, True)
    except ValueError as exc:
        raise DeliveryError(f"iceberg: not a change message (ValueError: {exc})") from None
    return Message(
        (metadata.commit_lsn, metadata.commit_idx),
        wire.action or "record",  # a record sink's message: the row's latest state
        metadata.idempotency_key,
        metadata.table_schema,
        metadata.table_name,
        stamp,
        metadata.record_pks or [],
        bytes(wire.record).decode(),
        None if changes == "null" else changes,
        tuple(metadata.unchanged_toast_columns or ()),
    )


def parse_message_exactly(text: str) -> Message:
    """``parse_message`` of any layout and value types, every part read exactly."""
    try:
        top = members(text)
        metadata = top["metadata"][0]
        record_text = top["record"][1] if top["record"][0] is not None else "null"
        changes_text = top["changes"][1] if "changes" in top and top["changes"][0] is not None else None
        stamp = metadata.get("commit_timestamp")
        return Message(
            (int(metadata["commit_lsn"]), int(metadata["commit_idx"])),
            top["action"][0] if "action" in top else "record",  # a record sink's message: the row's latest state
            metadata["idempotency_key"],
            metadata["table_schema"],
            metadata["table_name"],
            None if stamp is None else _timestamp(stamp, True),
            [str(k) for k in metadata.get("record_pks") or []],
            record_text,
            changes_text,
            tuple(metadata.get("unchanged_toast_columns") or ()),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DeliveryError(f"iceberg: not a change message ({type(exc).__name__}: {exc})") from None


def changelog_schema() -> Schema:
    """The changelog table's schema; its identifier is the position (unique per message)."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import ListType, LongType, NestedField, StringType, TimestamptzType

    return Schema(
        NestedField(1, "commit_lsn", LongType(), required=True),
        NestedField(2, "commit_idx", LongType(), required=True),
        NestedField(3, "action", StringType(), required=True),
        NestedField(4, "idempotency_key", StringType(), required=True),
        NestedField(5, "table_schema", StringType(), required=True),
        NestedField(6, "table_name", StringType(), required=True),
        NestedField(7, "commit_timestamp", TimestamptzType(), required=False),
        NestedField(8, "record_pks", ListType(9, StringType(), element_required=True), required=False),
        NestedField(10, "record", StringType(), required=False),
        NestedField(11, "changes", StringType(), required=False),
        identifier_field_ids=[1, 2],
    )


def changelog_table(messages: list[Message], schema: Any) -> Any:
    """The messages as changelog rows: a pyarrow Table of ``schema`` (``changelog_schema`` in
    pyarrow's terms), built column by column (a dict per row and ``from_pylist`` cost twice as much)."""
    import pyarrow as pa

    columns = {
        "commit_lsn": [m.position[0] for m in messages],
        "commit_idx": [m.position[1] for m in messages],
        "action": [m.action for m in messages],
        "idempotency_key": [m.idempotency_key for m in messages],
        "table_schema": [m.table_schema for m in messages],
        "table_name": [m.table_name for m in messages],
        "commit_timestamp": [m.commit_timestamp for m in messages],
        "record_pks": [m.record_pks for m in messages],
        "record": [m.record_text for m in messages],
        "changes": [m.changes_text for m in messages],
    }
    return pa.Table.from_pydict(columns, schema=schema)


@dataclass(frozen=True)
class SourceColumn:
    """A column of a source table as the source's catalog describes it."""

    name: str
    base_type: str
    """``pg_type.typname`` of its type (of a domain's base type); ``_...`` for arrays."""
    precision: int | None
    scale: int | None
    not_null: bool


SOURCE_COLUMNS_SQL = """
SELECT a.attname,
       CASE WHEN bt.typcategory = 'A' THEN '_array' ELSE bt.typname END,
       CASE WHEN bt.typname = 'numeric' AND coalesce(nullif(t.typtypmod, -1), a.atttypmod) >= 4
            THEN ((coalesce(nullif(t.typtypmod, -1), a.atttypmod) - 4) >> 16) & 65535 END,
       CASE WHEN bt.typname = 'numeric' AND coalesce(nullif(t.typtypmod, -1), a.atttypmod) >= 4
            THEN (coalesce(nullif(t.typtypmod, -1), a.atttypmod) - 4) & 65535 END,
       a.attnotnull OR coalesce(t.typnotnull, false),
       coalesce((SELECT k.n FROM unnest(pk.indkey::int2[]) WITH ORDINALITY k(att, n) WHERE k.att = a.attnum), 0)
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
JOIN pg_type bt ON bt.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
LEFT JOIN pg_index pk ON pk.indrelid = a.attrelid AND pk.indisprimary
WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""
"""A source table's columns (name, base type, numeric precision/scale, not null, position in the primary key)."""


def source_columns(conn: Any, schema: str, table: str) -> tuple[list[SourceColumn], list[str]]:
    """A source table's columns and its primary key's columns (in key order), from its catalog."""
    from psycopg import sql

    qualified = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table)).as_string(conn)
    rows = conn.execute(SOURCE_COLUMNS_SQL, (qualified,)).fetchall()
    columns = [
        SourceColumn(name, base, precision, scale, bool(not_null)) for name, base, precision, scale, not_null, _ in rows
    ]
    key = [name for name, *_, at in sorted(rows, key=lambda r: r[5]) if at]
    return columns, key


def _iceberg_type(column: SourceColumn) -> Any:
    from pyiceberg import types as t

    simple = {
        "int2": t.IntegerType(),
        "int4": t.IntegerType(),
        "int8": t.LongType(),
        "oid": t.LongType(),
        "float4": t.FloatType(),
        "float8": t.DoubleType(),
        "bool": t.BooleanType(),
        "date": t.DateType(),
        "timestamp": t.TimestampType(),
        "timestamptz": t.TimestamptzType(),
        "bytea": t.BinaryType(),
    }
    if column.base_type in simple:
        return simple[column.base_type]
    if column.base_type == "numeric" and column.precision is not None and 0 < column.precision <= 38:
        return t.DecimalType(column.precision, column.scale or 0)
    return t.StringType()  # text and the rest: the message's string, or a value's JSON text


def mirror_schema(columns: list[SourceColumn], key: list[str]) -> Schema:
    """A mirror table's schema: the source's columns with Iceberg types (docs/iceberg.md), its
    primary key as the identifier fields (required)."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import NestedField

    fields = [NestedField(i, c.name, _iceberg_type(c), required=c.name in key) for i, c in enumerate(columns, start=1)]
    ids = [i for name in key for i, c in enumerate(columns, start=1) if c.name == name]
    return Schema(*fields, identifier_field_ids=ids)


@lru_cache(maxsize=4096)
def _timestamp(value: str, aware: bool) -> datetime:
    """A timestamp's text as a datetime (cached: a transaction's messages share their commit's)."""
    stamp = datetime.fromisoformat(value.replace("Z", "+00:00") if aware else value)
    if aware != (stamp.tzinfo is not None):
        raise ValueError(f"timestamp {value!r}")
    return stamp


def _float(value: Any) -> float:
    return float(value)  # numbers and "NaN", "Infinity", "-Infinity"


def _decimal(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, Decimal)):
        raise ValueError(f"not a finite number: {value!r}")
    return Decimal(value)


def _bytes(value: Any) -> bytes:
    if not isinstance(value, str) or not value.startswith("\\x"):
        raise ValueError(f"not bytea hex: {value!r}")
    return bytes.fromhex(value[2:])


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"not a boolean: {value!r}")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"not an integer: {value!r}")
    return value


def converter(iceberg_type: Any) -> Callable[[Any, str], Any]:
    """The function (value, JSON text) -> Python value of a mirror column of ``iceberg_type``."""
    from pyiceberg import types as t

    if isinstance(iceberg_type, (t.IntegerType, t.LongType)):
        return lambda v, _: _integer(v)
    if isinstance(iceberg_type, (t.FloatType, t.DoubleType)):
        return lambda v, _: _float(v)
    if isinstance(iceberg_type, t.DecimalType):
        return lambda v, _: _decimal(v)
    if isinstance(iceberg_type, t.BooleanType):
        return lambda v, _: _boolean(v)
    if isinstance(iceberg_type, t.DateType):
        return lambda v, _: date.fromisoformat(v)
    if isinstance(iceberg_type, t.TimestamptzType):
        return lambda v, _: _timestamp(v, True)
    if isinstance(iceberg_type, t.TimestampType):
        return lambda v, _: _timestamp(v, False)
    if isinstance(iceberg_type, t.BinaryType):
        return lambda v, _: _bytes(v)
    return lambda v, text: v if isinstance(v, str) else text  # strings; JSON text of the rest


class RowShape:
    """How a mirror table's rows are made from records: its columns' converters and its key."""

    def __init__(self, schema: Schema) -> None:
        self.columns = {f.name: converter(f.field_type) for f in schema.fields}
        names = {f.field_id: f.name for f in schema.fields}
        self.key = [names[i] for i in schema.identifier_field_ids]

    def row(self, record: dict[str, tuple[Any, str]]) -> dict[str, Any]:
        """A record's values by column (only the columns it has); ``DeliveryError`` on a value
        that does not fit or a column the table lacks (the caller evolves the schema first)."""
        out: dict[str, Any] = {}
        for name, (value, text) in record.items():
            convert = self.columns.get(name)
            if convert is None:
                raise DeliveryError(f"iceberg: the table has no column {name!r}")
            try:
                out[name] = None if value is None else convert(value, text)
            except (ValueError, TypeError, InvalidOperation) as exc:
                raise DeliveryError(f"iceberg: column {name!r}: {exc}") from None
        return out

    def key_of(self, row: dict[str, Any]) -> tuple[Any, ...]:
        """The primary key of a row; ``DeliveryError`` if a key column is missing."""
        try:
            return tuple(row[k] for k in self.key)
        except KeyError as exc:
            raise DeliveryError(f"iceberg: the record lacks key column {exc.args[0]!r}") from None
