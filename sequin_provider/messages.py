"""The change row (source -> pipeline contract) and the message JSON shapes (DESIGN §5).

A *change row* is what the replication source emits, sink-independent, with ``record`` and
``changes`` already rendered as JSON text by ``pgoutput``. A *message* is what a sink receives:
``{"record", "changes", "action", "metadata"}`` for change sinks, ``{"record", "metadata"}``
for record sinks (reference/001). Messages are rendered by string concatenation so the JSON values
of the record pass through byte for byte (every digit of a numeric survives): the pipeline's
rendering is ``message_render`` (vectorized over Arrow batches), the store's for backfill reads is
SQL around ``read_message_template``; this module holds the parts they share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from sequin_provider.pgoutput import COMPILED, hot_path

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
    # Backfill reads only (null for changes): which backfill produced the row, for which sink.
    ("backfill_id", "bigint", pa.int64()),
    ("backfill_sink", "string", pa.string()),
)
CHANGE_SCHEMA_DDL = ", ".join(f"{name} {ddl}" for name, ddl, _ in CHANGE_COLUMNS)
CHANGE_ARROW_SCHEMA = pa.schema([pa.field(name, typ) for name, _, typ in CHANGE_COLUMNS])
CHANGE_FIELD_NAMES = tuple(name for name, _, _ in CHANGE_COLUMNS)


CHANGE_ARROW_STRUCT = pa.struct(list(CHANGE_ARROW_SCHEMA))


CHANGE_COLUMN_KINDS = bytes(
    {pa.int64(): b"q", pa.int32(): b"i", pa.string(): b"s", pa.list_(pa.string()): b"l"}[typ][0]
    for _, _, typ in CHANGE_COLUMNS
)
"""Each change column's kind for ``_pgoutput_c.column_sizes`` and ``fill_columns``."""


def rows_to_arrow(rows: Sequence[tuple], compiled: bool = COMPILED) -> pa.RecordBatch:
    """Build one Arrow batch of change rows (tuples in ``CHANGE_COLUMNS`` order).

    The compiled hot path sizes each column, then writes its Arrow buffers (taken from Arrow's
    memory pool) in one pass over the tuples (``_pgoutput_c.column_sizes``, ``fill_columns``).
    Arrow reading the tuples as structs (``compiled=False``, and wherever the compiled pass
    refuses a row: a value of another type, strings past 2 GiB) is the definition; its generic
    converter checks every value's type (transposing in Python first, ``zip(*rows)``, was slower)."""
    if compiled and not COMPILED:
        raise RuntimeError("the compiled change-row pass (sequin_provider._pgoutput_c) is not built")
    if compiled and type(rows) is list and rows:
        try:
            return _compiled_rows_to_arrow(rows)
        except (TypeError, ValueError, OverflowError):  # Arrow decides, raising what it raises
            pass
    return pa.RecordBatch.from_struct_array(pa.array(rows, type=CHANGE_ARROW_STRUCT))


def _compiled_rows_to_arrow(rows: list[tuple]) -> pa.RecordBatch:
    n = len(rows)
    sizes = hot_path.column_sizes(rows, CHANGE_COLUMN_KINDS)
    buffers = []
    for kind, (nbytes, items) in zip(CHANGE_COLUMN_KINDS, sizes):
        valid = pa.allocate_buffer((n + 7) // 8)
        if kind in b"qi":
            buffers.append((valid, pa.allocate_buffer(n * (8 if kind == ord("q") else 4))))
        elif kind == ord("s"):
            buffers.append((valid, pa.allocate_buffer(4 * (n + 1)), pa.allocate_buffer(nbytes)))
        else:
            buffers.append(
                (
                    valid,
                    pa.allocate_buffer(4 * (n + 1)),
                    pa.allocate_buffer(4 * (items + 1)),
                    pa.allocate_buffer(nbytes),
                )
            )
    nulls = hot_path.fill_columns(rows, CHANGE_COLUMN_KINDS, buffers)
    arrays = []
    for (_, _, typ), bufs, null_count in zip(CHANGE_COLUMNS, buffers, nulls):
        valid = bufs[0] if null_count else None
        if len(bufs) == 4:
            items = pa.Array.from_buffers(pa.string(), bufs[2].size // 4 - 1, [None, bufs[2], bufs[3]])
            arrays.append(pa.Array.from_buffers(typ, n, [valid, bufs[1]], null_count, children=[items]))
        else:
            arrays.append(pa.Array.from_buffers(typ, n, [valid, *bufs[1:]], null_count))
    return pa.RecordBatch.from_arrays(arrays, schema=CHANGE_ARROW_SCHEMA)


OPEN_TRANSACTION_PREFIX = "sequin:open-transaction"
"""The prefix of the marker row that ends a batch which ends inside a transaction."""


def open_transaction_row(row: tuple, taken: int) -> tuple:
    """The marker row of a batch that ends after the first ``taken`` rows of the transaction that
    ``row`` (one of those rows) belongs to: a logical-message row at that transaction's commit LSN.
    No sink selects it; the pipeline reads it to keep the transaction's messages invisible to
    consumers until the batch that completes it (``open_transaction_lsn``)."""
    return (row[0], taken, row[2], row[3], "", OPEN_TRANSACTION_PREFIX, "message", "", None, [], [], None, None)


def open_transaction_lsn(changes: pa.RecordBatch) -> int | None:
    """The commit LSN of the transaction a batch of change rows ends inside, if its marker is among them."""
    marked = pc.and_(
        pc.equal(changes.column("action"), "message"), pc.equal(changes.column("table_name"), OPEN_TRANSACTION_PREFIX)
    )
    return pc.min(changes.column("commit_lsn").filter(marked)).as_py()


def idempotency_key(
    commit_lsn: int, commit_idx: int, backfill_id: int | None = None, record_pks: Sequence[str] | None = None
) -> str:
    """Stable key of a message: a change's position, or (backfill, primary key) for a backfill read.

    Unique per sink and identical across replays (a read re-read after a restart keeps its key).
    """
    if backfill_id is None:
        return f"{commit_lsn}:{commit_idx}"
    return f"backfill:{backfill_id}:{json_text(list(record_pks or []))}"


def replay_key(replay_id: int, position: str) -> str:
    """The idempotency key of a change replayed by replay ``replay_id``: ``replay:<id>:<lsn>:<idx>``
    (``position`` is ``"<lsn>:<idx>"``), so a sink that dedupes takes each replay once, and its
    original message's key (the position) stays the original's."""
    return f"replay:{int(replay_id)}:{position}"


def sql_string(value: str) -> str:
    """A Spark SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


json_text = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""Compact JSON text, escaped as PostgreSQL's ``to_json`` escapes (non-ASCII kept, ``\\u00xx`` lower case)."""


def metadata_head(table_schema: str, table_name: str) -> str:
    """The start of ``metadata`` for a table: ``{"table_schema":…,"table_name":…`` (JSON text)."""
    return '{"table_schema":' + json_text(table_schema) + ',"table_name":' + json_text(table_name)


def metadata_tail(consumer_id: str, consumer_name: str, database_name: str) -> str:
    """The per-sink part of ``metadata`` after ``record_pks``: database and consumer (JSON text, unclosed)."""
    return (
        ',"database_name":'
        + json_text(database_name)
        + ',"consumer":'
        + json_text({"id": consumer_id, "name": consumer_name})
    )


@dataclass(frozen=True)
class ReadMessageTemplate:
    """A backfill read's message JSON around its per-row parts, for rendering it outside Spark.

    A read's message is ``before_record + record + before_idx + commit_idx + ',"idempotency_key":'
    + key as a JSON string + ',"record_pks":' + record_pks as JSON + after_pks`` (the record alone
    when ``record_only``): exactly what ``message_render.render`` renders for the same read (tested).
    """

    record_only: bool
    before_record: str
    before_idx: str
    after_pks: str


def read_message_template(
    kind: str, table_schema: str, table_name: str, commit_timestamp: str, commit_lsn: int, tail: str
) -> ReadMessageTemplate:
    """The template of the reads of one table emitted at one position (``kind`` as in ``message_render``,
    ``tail`` from ``metadata_tail``)."""
    metadata = (
        metadata_head(table_schema, table_name)
        + ',"commit_timestamp":"'
        + commit_timestamp
        + '","commit_lsn":'
        + str(commit_lsn)
        + ',"commit_idx":'
    )
    if kind == "record":
        return ReadMessageTemplate(False, '{"record":', ',"metadata":' + metadata, tail + "}}")
    return ReadMessageTemplate(
        kind == "record_only", '{"record":', ',"changes":null,"action":"read","metadata":' + metadata, tail + "}}"
    )


@dataclass(frozen=True)
class MessageTemplate:
    """What the change messages of one sink and table share, for storing them compact.

    A compact change's data is its own part of the message, ``{"record":…`` up to the metadata
    (``,"changes":…,"action":"…"`` included for a change message), its commit timestamp is a
    column of its own, and its message is ``data + before_ts + commit_timestamp + '","commit_lsn":'
    + lsn + ',"commit_idx":' + idx + ',"idempotency_key":"' + key + '","record_pks":'
    + group_id[pks_from - 1:] + after_pks``: exactly what ``message_render.render`` renders whole
    (tested); the store puts it together (``store.READ_DATA``). ``pks_from`` is where the keys
    start in the table's default group id ``schema.table:[keys]`` (1-based, in characters, as
    SQL's ``substr`` counts)."""

    before_ts: str
    after_pks: str
    pks_from: int


def message_template(table_schema: str, table_name: str, tail: str) -> MessageTemplate | None:
    """The template of one table's changes for a sink whose metadata ends with ``tail``
    (``metadata_tail``); None when the table's name is not ASCII (its group id's characters
    would not count as bytes in every store encoding, so its changes are stored whole)."""
    if not (table_schema.isascii() and table_name.isascii()):
        return None
    return MessageTemplate(
        ',"metadata":' + metadata_head(table_schema, table_name) + ',"commit_timestamp":"',
        tail + "}}",
        len(table_schema) + len(table_name) + 3,
    )


def parse_message(text: str) -> dict[str, Any]:
    """Parse message JSON keeping numeric precision (decimals as ``Decimal``)."""
    from decimal import Decimal

    return json.loads(text, parse_float=Decimal)
