"""A change message read for what a destination that applies changes needs: its action, position,
table and unchanged TOAST columns, and its record both parsed and as its exact JSON text, without
building the rest (``changes``, the other metadata) in Python.

The postgres_table sink hands the server the records' own text (every digit of a numeric, a json
column's text as it was) and reads the rest itself: ``json.loads`` of a whole message cost it about
as much CPU as the server's upsert; msgspec's typed decoding (unknown fields skipped, the record kept
raw) costs a tenth of that (docs/postgres_table.md#cost).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec


class _Metadata(msgspec.Struct):
    commit_lsn: int
    commit_idx: int
    table_schema: str | None = None
    table_name: str | None = None
    unchanged_toast_columns: list[str] | None = None


class _Message(msgspec.Struct):
    record: msgspec.Raw
    action: str
    metadata: _Metadata


_DECODER = msgspec.json.Decoder(_Message)


@dataclass(frozen=True)
class ChangeMessage:
    """The fields of a change message a change-applying destination reads."""

    action: str
    position: tuple[int, int]
    """(commit_lsn, commit_idx)."""
    table_schema: str | None
    table_name: str | None
    unchanged_toast_columns: list[str] | None
    record: Any
    """The record parsed (a dict for every action but a truncate), values as ``json.loads`` gives them."""
    record_text: str
    """The record's JSON text exactly as the message holds it."""

    def routing_view(self) -> dict[str, Any]:
        """What a template route reads of a message (``sinks.routing``): the action, the table and
        the record; a function route needs the whole message (``json.loads``)."""
        metadata = {"table_schema": self.table_schema, "table_name": self.table_name}
        return {"action": self.action, "metadata": metadata, "record": self.record}


def parse_change(text: str) -> ChangeMessage:
    """``text`` (a message's JSON) read as a change message; ``ValueError`` saying what is wrong
    (not JSON, or ``record``, ``action``, ``metadata.commit_lsn``/``commit_idx`` missing or mistyped)."""
    try:
        message = _DECODER.decode(text)
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise ValueError(str(exc)) from None
    raw = bytes(message.record)
    try:
        record = msgspec.json.decode(raw)
    except msgspec.DecodeError:  # a number beyond a double (json.loads makes it inf): as json.loads reads it
        record = json.loads(raw)
    metadata = message.metadata
    return ChangeMessage(
        message.action,
        (metadata.commit_lsn, metadata.commit_idx),
        metadata.table_schema,
        metadata.table_name,
        metadata.unchanged_toast_columns,
        record,
        raw.decode(),
    )
