"""Change rows and sink renderings of the message_render tests."""

from __future__ import annotations

from pathlib import Path

from sequin_provider.config import load_config
from sequin_provider.message_render import SinkRendering
from tests.support.config import write_config

# Keys and values that break naive escaping: quotes, backslashes, control characters, non-ASCII, empty.
HOSTILE = [
    "plain",
    'quote " and \\ backslash',
    "tab\tnew\nline\rcr\bbs\fff",
    "ünïcødé ✓ 😀",
    "it's",
    '["x"]',
    "unit\x1fsep\x0bvt\x01",
    "\x7fdel\u2028ls",
    "",
]


def sinks(tmp_path: Path) -> dict[str, SinkRendering]:
    """Four sinks' renderings (change, record, record_only, ungrouped) of one config."""
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            """
        databases: [{name: app, dsn: "postgresql://u@localhost/app"}]
        sinks:
          - {name: changes, tables: [public.t, other.t2], destination: {type: sequin_stream}}
          - {name: rows, tables: [public.t], message_kind: record, destination: {type: sequin_stream}}
          - {name: bare, tables: [public.t], transform: record_only, destination: {type: sequin_stream}}
          - {name: loose, tables: [public.t], message_grouping: false, destination: {type: sequin_stream}}
        """,
        )
    )
    return {s.name: SinkRendering.of(s, "app") for s in config.sinks}


def change(
    lsn: int,
    idx: int,
    record: str,
    pks: list[str],
    *,
    action: str = "update",
    changes: str | None = None,
    toast: list[str] | None = None,
    table: tuple[str, str] = ("public", "t"),
    backfill: int | None = None,
) -> tuple:
    """A change row as the stream app hands it to the renderer."""
    return (
        lsn,
        idx,
        "2026-11-22T08:00:00.123456Z",
        7,
        table[0],
        table[1],
        action,
        record,
        changes,
        pks,
        toast or [],
        backfill,
        "changes" if backfill is not None else None,
    )
