"""``sinks.iceberg_rows.parse_message``: the typed reading (msgspec) gives what the exact key-by-key
reading gives, the record and the changes as their own text and, when a mirror asks, their values
exactly (``Decimal``); what msgspec's types refuse is read the exact way; a message without its parts
is a ``DeliveryError``."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest

from sequin_provider.exceptions import DeliveryError
from sequin_provider.sinks.iceberg_rows import parse_message, parse_message_exactly

RECORD = '{"id":123456789012345678901234567890,"amount":12.50,"doc":{"b": 1,  "a":[1.0, "x"]},"big":1e400}'
METADATA = (
    '"metadata":{"table_schema":"public","table_name":"t","commit_timestamp":"2026-12-01T10:00:00.5Z",'
    '"commit_lsn":10,"commit_idx":2,"record_pks":["123456789012345678901234567890"],"idempotency_key":"10:2",'
    '"unchanged_toast_columns":["big"],"consumer":{"id":"c","name":"n"}}'
)
MESSAGES = [
    '{"record":' + RECORD + ',"changes":{"amount":1.10},"action":"update",' + METADATA + "}",  # the pipeline's layout
    '{"record":' + RECORD + ',"changes":null,"action":"insert",' + METADATA + "}",
    '{"record":null,"changes":null,"action":"truncate",' + METADATA + "}",
    '{"record":' + RECORD + "," + METADATA + "}",  # a record sink's message
    ' { "action" : "delete" , "record" : {"id": 1} , ' + METADATA + " } ",  # a transform's layout
]


def _fields(message: object) -> dict[str, object]:
    out = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}  # type: ignore[arg-type]
    return {**out, "record": message.record, "changes": message.changes}  # type: ignore[attr-defined]


@pytest.mark.parametrize("text", MESSAGES)
def test_the_typed_reading_equals_the_exact_one(text: str) -> None:
    assert _fields(parse_message(text)) == _fields(parse_message_exactly(text))


def test_the_record_and_changes_are_their_own_text_and_read_exactly_on_demand() -> None:
    message = parse_message(MESSAGES[0])
    assert (message.record_text, message.changes_text) == (RECORD, '{"amount":1.10}')
    assert message.record["amount"] == (Decimal("12.50"), "12.50")
    assert message.record["id"][0] == 123456789012345678901234567890
    assert message.changes == {"amount": (Decimal("1.10"), "1.10")}
    assert (message.position, message.action, message.record_pks) == (
        (10, 2),
        "update",
        ["123456789012345678901234567890"],
    )
    assert message.unchanged_toast == ("big",) and message.commit_timestamp is not None


def test_what_msgspec_refuses_is_read_the_exact_way() -> None:
    odd = (
        MESSAGES[1]
        .replace('"commit_lsn":10', '"commit_lsn":"10"')
        .replace('"record_pks":["123456789012345678901234567890"]', '"record_pks":[123456789012345678901234567890]')
    )
    message = parse_message(odd)
    assert message.position == (10, 2) and message.record_pks == ["123456789012345678901234567890"]


@pytest.mark.parametrize(
    "text",
    [
        '{"record":{"id":1},"action":"insert"}',
        '{"action":"insert",' + METADATA + "}",
        '{"record":{"id":1},"action":"insert","metadata":{"commit_lsn":1}}',
        "not json",
        '{"record":{"id":1},"action":"insert",' + METADATA.replace("2026-12-01T10:00:00.5Z", "yesterday") + "}",
    ],
)
def test_a_message_without_its_parts_is_a_delivery_error(text: str) -> None:
    with pytest.raises(DeliveryError, match="iceberg: not a change message"):
        parse_message(text)


def test_a_changelog_table_holds_each_message_as_its_row() -> None:
    from datetime import datetime, timezone

    from pyiceberg.io.pyarrow import schema_to_pyarrow

    from sequin_provider.sinks.iceberg_rows import changelog_schema, changelog_table

    messages = [parse_message(text) for text in MESSAGES[:3]]
    rows = changelog_table(messages, schema_to_pyarrow(changelog_schema(), include_field_ids=False)).to_pylist()
    stamp = datetime(2026, 12, 1, 10, 0, 0, 500000, tzinfo=timezone.utc)
    common = {"commit_lsn": 10, "commit_idx": 2, "idempotency_key": "10:2", "table_schema": "public"}
    common |= {"table_name": "t", "commit_timestamp": stamp, "record_pks": ["123456789012345678901234567890"]}
    assert rows == [
        {**common, "action": "update", "record": RECORD, "changes": '{"amount":1.10}'},
        {**common, "action": "insert", "record": RECORD, "changes": None},
        {**common, "action": "truncate", "record": "null", "changes": None},
    ]
