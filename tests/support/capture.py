"""Decoded changes of a few statements, read through a real slot with the stream app's reader."""

from __future__ import annotations

import psycopg

from sequin_provider.config import TableConfig
from sequin_provider.replication import ChangeReader, create_slot, ensure_publication
from tests.support.postgres import execute


def capture(dsn: str, tables: list[str], *statements: str) -> list[tuple]:
    """Create pub+slot for ``tables``, run ``statements``, return the decoded change rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        slot = f"slot_{conn.info.dbname}"
        ensure_publication(conn, "pub", [TableConfig("public", t) for t in tables], True)
        start = create_slot(conn, slot)
    execute(dsn, *statements)
    reader = ChangeReader(dsn, slot, "pub")
    reader.open(start)
    try:
        rows: list[tuple] = []
        for _ in range(40):
            result = reader.read(10**9, 10**12, 0.5)
            rows += result.rows
            if result.transactions == 0 and rows:
                break
        return rows
    finally:
        reader.close()
