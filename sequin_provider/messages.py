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

CHANGE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("commit_lsn", "bigint"),
    ("commit_idx", "int"),
    ("commit_timestamp", "string"),
    ("xid", "bigint"),
    ("table_schema", "string"),
    ("table_name", "string"),
    ("action", "string"),
    ("record", "string"),
    ("changes", "string"),
    ("record_pks", "array<string>"),
    ("unchanged_toast", "array<string>"),
    # Backfill reads only (null for changes): which backfill produced the row, for which sink.
    ("backfill_id", "bigint"),
    ("backfill_sink", "string"),
)
"""A change row's columns and their Spark SQL types, in order (their Arrow types: ``change_arrow``)."""
CHANGE_SCHEMA_DDL = ", ".join(f"{name} {ddl}" for name, ddl in CHANGE_COLUMNS)
CHANGE_FIELD_NAMES = tuple(name for name, _ in CHANGE_COLUMNS)


OPEN_TRANSACTION_PREFIX = "sequin:open-transaction"
"""The prefix of the marker row that ends a batch which ends inside a transaction."""


def open_transaction_row(row: tuple, taken: int) -> tuple:
    """The marker row of a batch that ends after the first ``taken`` rows of the transaction that
    ``row`` (one of those rows) belongs to: a logical-message row at that transaction's commit LSN.
    No sink selects it; the pipeline reads it to keep the transaction's messages invisible to
    consumers until the batch that completes it (``change_arrow.open_transaction_lsn``)."""
    return (row[0], taken, row[2], row[3], "", OPEN_TRANSACTION_PREFIX, "message", "", None, [], [], None, None)


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
