"""``sequin_provider.freshness`` on a real Postgres: a sink with a message parked before the mark is
behind, and a mark the slot never confirms makes no sink complete (never ahead of what is delivered,
end to end under ``dag.test`` with concurrent writes: tests/integration/airflow/test_dags.py)."""

from __future__ import annotations

import threading
from datetime import datetime

import psycopg

from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.freshness import measure_freshness, sinks_parked_below, take_mark
from sequin_provider.pgoutput import lsn_to_int
from tests.support.postgres import execute


def test_a_mark_follows_every_commit_made_before_its_time(dsn: str) -> None:
    """Transactions commit concurrently while marks are taken; every transaction whose commit time is
    at or before a mark's time has its commit record ending at or before the mark's position (read from
    the WAL with test_decoding, which gives each commit's end position and time)."""
    execute(
        dsn,
        "CREATE TABLE t (id serial PRIMARY KEY)",
        "SELECT pg_create_logical_replication_slot('mark_check', 'test_decoding')",
    )
    stop = threading.Event()

    def writer() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("INSERT INTO t DEFAULT VALUES")

    threads = [threading.Thread(target=writer, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            # marks only once the writers commit: a first mark taken before any commit has nothing
            # before it to check (CI saw one on a loaded machine)
            wait_for(lambda: conn.execute("SELECT count(*) FROM t").fetchone()[0] >= 3, 30, what="the writers")
            # at least 30 marks, taken until the writers have committed 150 times around them: CI saw
            # a loaded machine commit only 57 times in 30 marks, too few to interleave with them
            marks = [take_mark(conn) for _ in range(30)]

            def another_mark_then_enough_commits() -> bool:
                marks.append(take_mark(conn))
                return conn.execute("SELECT count(*) FROM t").fetchone()[0] >= 150  # type: ignore[index,no-any-return]

            wait_for(another_mark_then_enough_commits, 60, interval=0.05, what="150 commits among the marks")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_switch_wal()")  # the test cluster commits asynchronously: flush the WAL
            commits = [
                (lsn_to_int(lsn), datetime.fromisoformat(data.rsplit("(at ", 1)[1].rstrip(")")))
                for lsn, data in conn.execute(
                    "SELECT lsn::text, data FROM pg_logical_slot_get_changes('mark_check', NULL, NULL,"
                    " 'include-timestamp', 'on') WHERE data LIKE 'COMMIT %'"
                ).fetchall()
            ]
    finally:
        execute(dsn, "SELECT pg_drop_replication_slot('mark_check')")
    assert len(commits) > 100
    for mark in marks:
        before = [lsn for lsn, at in commits if at <= mark.at]
        assert before and max(before) <= mark.lsn, mark  # test_decoding reports a commit's end position
    assert [m.lsn for m in marks] == sorted(m.lsn for m in marks)


def test_a_sink_with_a_message_parked_before_the_mark_is_behind(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        store.park_messages(
            conn,
            "sequin",
            [
                store.ParkRow("hooks", 100, 0, "g1", "k1", "{}", None, 1, "HTTP 500"),
                store.ParkRow("late", 500, 0, "g1", "k2", "{}", None, 1, "HTTP 500"),
            ],
        )
        conn.commit()
        assert sinks_parked_below(conn, "sequin", ["hooks", "late", "clean"], 300) == {"hooks"}
        assert sinks_parked_below(conn, "sequin", ["hooks", "late", "clean"], 100) == set()
        conn.execute("UPDATE sequin.buffered_messages SET state = 'discarded' WHERE sink = 'hooks'")
        conn.commit()
        assert sinks_parked_below(conn, "sequin", ["hooks"], 300) == set()  # discarded: not waited for


def test_no_sink_is_complete_through_a_mark_the_slot_does_not_confirm(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    execute(dsn, "SELECT pg_create_logical_replication_slot('fresh_idle', 'pgoutput')", "CREATE TABLE w (id int)")
    try:
        execute(dsn, "INSERT INTO w VALUES (1)")  # WAL after the slot: nobody reads it
        measured = measure_freshness(dsn, dsn, "sequin", "fresh_idle", ["a", "b"], timeout=1.0)
        assert measured.confirmed_lsn is None and measured.complete == () and measured.behind == ("a", "b")
        missing = measure_freshness(dsn, dsn, "sequin", "no_such_slot", ["a"], timeout=0.5)
        assert missing.confirmed_lsn is None and missing.complete == ()
    finally:
        execute(dsn, "SELECT pg_drop_replication_slot('fresh_idle')")
