"""``sinks.change_message.parse_change``: what the postgres_table sink reads of a message, beside
``json.loads`` of the same text, and the record's text byte for byte."""

from __future__ import annotations

import json

import pytest

from sequin_provider.sinks.change_message import parse_change

RECORD = '{"id":123456789012345678901234567890,"amount":12.50,"doc":{"b": 1,  "a":[1.0, "x"]},"name":"a\\"b\\u00e9"}'
RENDERED = (
    '{"record":' + RECORD + ',"changes":{"amount":1.10},"action":"update","metadata":{"table_schema":"public",'
    '"table_name":"t","commit_timestamp":"2026-12-01T00:00:00Z","commit_lsn":10,"commit_idx":2,'
    '"unchanged_toast_columns":["big"],"consumer":{"id":"c","name":"n"}}}'
)


def test_the_fields_match_json_loads_and_the_record_text_is_the_messages_own() -> None:
    parsed, loaded = parse_change(RENDERED), json.loads(RENDERED)
    assert parsed.record_text == RECORD
    assert parsed.record == loaded["record"]  # the big key exact, floats as json.loads gives them
    assert (parsed.action, parsed.position) == ("update", (10, 2))
    assert (parsed.table_schema, parsed.table_name, parsed.unchanged_toast_columns) == ("public", "t", ["big"])
    assert parsed.routing_view() == {
        "action": "update",
        "metadata": {"table_schema": "public", "table_name": "t"},
        "record": loaded["record"],
    }


def test_any_layout_and_numbers_beyond_a_double_read_as_json_loads_reads_them() -> None:
    text = ' { "metadata" : {"commit_lsn": 1, "commit_idx": 0}, "action":"insert", "record" : {"id": 1, "x": 1e400} } '
    parsed = parse_change(text)
    assert parsed.record == json.loads(text)["record"] and parsed.record_text == '{"id": 1, "x": 1e400}'
    truncate = parse_change('{"record":null,"action":"truncate","metadata":{"commit_lsn":5,"commit_idx":1}}')
    assert (truncate.record, truncate.record_text, truncate.table_name) == (None, "null", None)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not json", "JSON"),
        ("[1]", "Expected `object`"),
        ('{"action":"insert","metadata":{"commit_lsn":1,"commit_idx":0}}', "missing required field `record`"),
        ('{"record":{},"metadata":{"commit_lsn":1,"commit_idx":0}}', "missing required field `action`"),
        ('{"record":{},"action":"insert","metadata":{"commit_idx":0}}', "missing required field `commit_lsn`"),
        ('{"record":{},"action":"insert","metadata":{"commit_lsn":"x","commit_idx":0}}', "Expected `int`"),
    ],
)
def test_what_is_not_a_change_message_raises_value_error_saying_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_change(text)
