"""The test helper ``tests.support.capture`` returns every change of its statements, however long
the walsender takes between them (CI once lost the last insert of a schema-change test: the
walsender was slower than one of the helper's reads, and the helper took the empty read as the end)."""

from __future__ import annotations

from tests.support.capture import capture
from tests.support.postgres import execute


def test_capture_waits_for_transactions_the_walsender_is_slow_to_decode(dsn: str) -> None:
    """A large transaction on a table outside the publication keeps the walsender decoding for
    seconds while it sends nothing; the insert committed after it must still be captured."""
    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE unpublished (id int, pad text)")
    rows = capture(
        dsn,
        ["t"],
        "INSERT INTO t VALUES (1)",
        "INSERT INTO unpublished SELECT i, repeat('x', 200) FROM generate_series(1, 1500000) i",
        "INSERT INTO t VALUES (2)",
    )
    assert [(r[5], r[6], r[7]) for r in rows if r[6] != "message"] == [
        ("t", "insert", '{"id":1}'),
        ("t", "insert", '{"id":2}'),
    ]
