"""Decoded changes of a few statements, read through a real slot with the stream app's reader."""

from __future__ import annotations

import time

import psycopg

from sequin_provider.config import TableConfig
from sequin_provider.replication import ChangeReader, create_slot, ensure_publication
from tests.support.postgres import execute

CAPTURE_TIMEOUT = 120.0
"""Seconds to wait for the statements' transactions to reach the reader."""


def pending_commits(dsn: str, slot: str, publication: str) -> int:
    """Commits pgoutput will send for what is in ``slot`` now: the slot peeked (not advanced) with
    the reader's protocol, its Commit messages (``C``) counted.

    The SQL interface, like the walsender, decodes only flushed WAL, and the harness's cluster runs
    ``synchronous_commit=off``: first wait for the WAL writer to flush what is written now.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        inserted = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
        deadline = time.monotonic() + CAPTURE_TIMEOUT
        while not conn.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (inserted,)).fetchone()[0]:  # type: ignore[index]
            if time.monotonic() > deadline:
                raise TimeoutError(f"WAL not flushed up to {inserted} in {CAPTURE_TIMEOUT:.0f} s")
            time.sleep(0.02)
        row = conn.execute(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s) WHERE get_byte(data, 0) = 67",
            (slot, publication),
        ).fetchone()
    return int(row[0]) if row else 0


def capture(dsn: str, tables: list[str], *statements: str) -> list[tuple]:
    """Create pub+slot for ``tables``, run ``statements``, return the decoded change rows.

    Reads until the reader has handed out every transaction pgoutput sends for the statements (an
    empty read is no end: the walsender may still be decoding a large transaction it sends nothing of).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        slot = f"slot_{conn.info.dbname}"
        ensure_publication(conn, "pub", [TableConfig("public", t) for t in tables], True)
        start = create_slot(conn, slot)
    execute(dsn, *statements)
    expected = pending_commits(dsn, slot, "pub")
    reader = ChangeReader(dsn, slot, "pub")
    reader.open(start)
    try:
        rows: list[tuple] = []
        transactions = 0
        deadline = time.monotonic() + CAPTURE_TIMEOUT
        while transactions < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"captured {transactions} of {expected} transactions in {CAPTURE_TIMEOUT:.0f} s")
            result = reader.read(10**9, 10**12, 0.5)
            rows += result.rows
            transactions += result.transactions
        return rows
    finally:
        reader.close()
