"""Watermark payloads and which change rows a micro-batch may hold back (``watermarks``)."""

from __future__ import annotations

from sequin_provider.backfill.watermarks import (
    HIGH_PREFIX,
    LOW_PREFIX,
    Watermark,
    holdable,
    parse_watermark,
    watermark_content,
)

MARK = Watermark(7, 42, 1, "public", 'we"ird', ("id", "k"))


def _row(action: str, prefix: str = "", content: str = "") -> tuple:
    return (100, 0, "2026-11-22T08:00:00.000000Z", 9, "", prefix, action, content, None, [], [], None, None)


def test_payload_round_trips_and_marks_only_a_range_end() -> None:
    assert parse_watermark(watermark_content(MARK)) == MARK
    last = Watermark(7, 42, 1, "public", 'we"ird', ("id", "k"), last=True)
    assert parse_watermark(watermark_content(last)) == last
    assert '"last"' not in watermark_content(MARK)  # a plain mark reads the same as before the flag existed
    assert parse_watermark("not json") is None and parse_watermark('{"page": 1}') is None


def test_only_logical_messages_other_than_a_range_end_may_wait() -> None:
    assert holdable(_row("message", LOW_PREFIX, watermark_content(MARK)))
    assert holdable(_row("message", HIGH_PREFIX, watermark_content(MARK)))
    assert not holdable(
        _row("message", HIGH_PREFIX, watermark_content(Watermark(7, 42, 1, "public", "t", ("id",), last=True)))
    )
    assert holdable(_row("message", HIGH_PREFIX, "{malformed"))  # ignored by the tracker too
    for action in ("insert", "update", "delete", "read"):
        assert not holdable(_row(action))
