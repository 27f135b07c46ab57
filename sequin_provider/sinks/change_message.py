"""A change message read typed, for the destinations that apply changes (postgres_table, Iceberg):
its position, action, table, keys and unchanged TOAST columns, with its record and changes kept as
their exact JSON text, without building the rest in Python.

``json.loads`` of a whole message cost those sinks about as much CPU as the work they exist for;
msgspec's typed decoding (unknown fields skipped, the record kept raw) costs a tenth of that
(docs/postgres_table.md#cost). ``decode_wire`` is the one reading; each sink takes what it needs
from it (``parse_change`` here, ``iceberg_rows.parse_message``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec


class WireMetadata(msgspec.Struct):
    """The metadata of a change message as msgspec reads it (docs/messages.md)."""

    commit_lsn: int
    commit_idx: int
    idempotency_key: str | None = None
    table_schema: str | None = None
    table_name: str | None = None
    commit_timestamp: str | None = None
    record_pks: list[str] | None = None
    unchanged_toast_columns: list[str] | None = None


class WireMessage(msgspec.Struct):
    """A change message as msgspec reads it: the record and changes as their own JSON text
    (``msgspec.Raw``); ``action`` is absent from a record sink's messages."""

    record: msgspec.Raw
    metadata: WireMetadata
    action: str | None = None
    changes: msgspec.Raw = msgspec.Raw(b"null")


_DECODER = msgspec.json.Decoder(WireMessage)


def decode_wire(text: str | bytes) -> WireMessage:
    """``text`` read as a change message; ``msgspec.DecodeError`` (a ``ValueError``) if it is not
    JSON or a part is missing or of another type than ``WireMessage`` says."""
    return _DECODER.decode(text)


def loads_json(text: bytes) -> Any:
    """``text`` parsed as ``json.loads`` parses it, by msgspec (several times faster); a number
    beyond a double, which msgspec refuses and ``json.loads`` makes ``inf``, the ``json.loads`` way."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


@dataclass(slots=True)
class ChangeMessage:
    """The fields of a change message a change-applying destination reads (not frozen: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``, a third of the cost of
    reading a message)."""

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
        return routing_view(self.action, self.table_schema, self.table_name, self.record)


def routing_view(action: str | None, table_schema: str | None, table_name: str | None, record: Any) -> dict[str, Any]:
    """The parts of a message a template route reads (``sinks.routing``), in the message's layout."""
    return {"action": action, "metadata": {"table_schema": table_schema, "table_name": table_name}, "record": record}


def parse_change(text: str) -> ChangeMessage:
    """``text`` (a message's JSON) read as a change message; ``ValueError`` saying what is wrong
    (not JSON, or ``record``, ``action``, ``metadata.commit_lsn``/``commit_idx`` missing or mistyped)."""
    try:
        message = decode_wire(text)
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise ValueError(str(exc)) from None
    if message.action is None:
        raise ValueError("Object missing required field `action`")
    raw = bytes(message.record)
    record = loads_json(raw)
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
