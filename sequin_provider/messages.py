"""The change row (source -> pipeline contract) and the message JSON shapes (DESIGN §5).

A *change row* is what the replication source emits, sink-independent, with ``record`` and
``changes`` already rendered as JSON text by ``pgoutput``. A *message* is what a sink receives:
``{"record", "changes", "action", "metadata"}`` for change sinks, ``{"record", "metadata"}``
for record sinks (reference/001). Messages are rendered by string assembly so the JSON values
of the record pass through byte for byte (every digit of a numeric survives).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa

CHANGE_COLUMNS: tuple[tuple[str, str, pa.DataType], ...] = (
    ("commit_lsn", "bigint", pa.int64()),
    ("commit_idx", "int", pa.int32()),
    ("commit_timestamp", "string", pa.string()),
    ("xid", "bigint", pa.int64()),
    ("table_schema", "string", pa.string()),
    ("table_name", "string", pa.string()),
    ("action", "string", pa.string()),
    ("record", "string", pa.string()),
    ("changes", "string", pa.string()),
    ("record_pks", "array<string>", pa.list_(pa.string())),
    ("unchanged_toast", "array<string>", pa.list_(pa.string())),
)
CHANGE_SCHEMA_DDL = ", ".join(f"{name} {ddl}" for name, ddl, _ in CHANGE_COLUMNS)
CHANGE_ARROW_SCHEMA = pa.schema([pa.field(name, typ) for name, _, typ in CHANGE_COLUMNS])
CHANGE_FIELD_NAMES = tuple(name for name, _, _ in CHANGE_COLUMNS)

ACTION_MESSAGE = "message"
"""``action`` of a row that carries a logical message (watermarks), never delivered to sinks."""


def rows_to_arrow(rows: Sequence[tuple]) -> pa.RecordBatch:
    """Build one Arrow batch of change rows (tuples in ``CHANGE_COLUMNS`` order)."""
    columns = list(zip(*rows)) if rows else [[] for _ in CHANGE_COLUMNS]
    arrays = [pa.array(col, type=typ) for col, (_, _, typ) in zip(columns, CHANGE_COLUMNS)]
    return pa.RecordBatch.from_arrays(arrays, schema=CHANGE_ARROW_SCHEMA)


def idempotency_key(commit_lsn: int, commit_idx: int) -> str:
    """Stable key of a change: its position. Unique per sink, identical across replays."""
    return f"{commit_lsn}:{commit_idx}"


@dataclass(frozen=True)
class Consumer:
    """The sink as it appears in ``metadata.consumer``, plus the source database's name."""

    id: str
    name: str
    database_name: str

    def json_fragment(self) -> str:
        """``{"id":…,"name":…}`` rendered once per sink."""
        return json.dumps({"id": self.id, "name": self.name}, separators=(",", ":"))


_dump = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def render_metadata(consumer: Consumer, consumer_json: str, commit_lsn: int, commit_idx: int,
                    commit_timestamp: str, table_schema: str, table_name: str, record_pks: Sequence[str],
                    unchanged_toast: Sequence[str] | None = None) -> str:
    """The ``metadata`` object. ``unchanged_toast_columns`` lists record columns left out because
    the WAL did not carry their (unchanged, TOASTed) value and no old tuple had it."""
    meta = (
        f'{{"table_schema":{_dump(table_schema)},"table_name":{_dump(table_name)},'
        f'"commit_timestamp":"{commit_timestamp}","commit_lsn":{commit_lsn},"commit_idx":{commit_idx},'
        f'"idempotency_key":"{commit_lsn}:{commit_idx}","record_pks":{_dump(list(record_pks))},'
        f'"database_name":{_dump(consumer.database_name)},"consumer":{consumer_json}'
    )
    if unchanged_toast:
        meta += f',"unchanged_toast_columns":{_dump(list(unchanged_toast))}'
    return meta + "}"


def render_change_message(metadata: str, action: str, record: str, changes: str | None) -> str:
    """The change message JSON (reference/001 plus Sequin's extra metadata)."""
    return (f'{{"record":{record},"changes":{"null" if changes is None else changes},'
            f'"action":"{action}","metadata":{metadata}}}')


def render_record_message(metadata: str, record: str) -> str:
    """The row message JSON of a ``message_kind: record`` sink (latest row, no action)."""
    return f'{{"record":{record},"metadata":{metadata}}}'


def parse_message(text: str) -> dict[str, Any]:
    """Parse message JSON keeping numeric precision (decimals as ``Decimal``)."""
    from decimal import Decimal

    return json.loads(text, parse_float=Decimal)
