"""Backfill helpers of the tests: record one as the CLI does, watch its ranges."""

from __future__ import annotations

from pathlib import Path

import psycopg

from sequin_provider import store
from sequin_provider.backfill import create_backfill
from sequin_provider.config import load_config
from sequin_provider.store import Backfill


def backfill(
    dsn: str,
    config_path: Path,
    sink: str,
    table: str,
    sort_column: str | None = None,
    start_position: str | None = None,
    max_query_ms: int = 5000,
) -> Backfill:
    """Record a backfill as the CLI and the operator do."""
    config = load_config(config_path)
    with psycopg.connect(dsn, autocommit=True) as source, psycopg.connect(dsn) as conn:
        return create_backfill(source, conn, config, sink, table, sort_column, start_position, max_query_ms)


def ranges_moved(dsn: str, backfill_id: int) -> bool:
    """Whether the backfill has its two ranges and both cursors have moved."""
    with psycopg.connect(dsn) as conn:
        cursors = [r.cursor for r in store.backfill_ranges(conn, "sequin", backfill_id)]
    return len(cursors) == 2 and all(c is not None for c in cursors)
