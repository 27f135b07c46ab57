"""The consumer-group queries under the pull API: the pending counter, HOT receives (ack ids:
tests/unit/test_ack_ids.py).

Real Postgres. The API's HTTP behaviour is tested in test_stream_api.py; these tests pin what the
queries keep in the store.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from sequin_provider import store, stream_queue
from tests.support.postgres import put_stream_messages

SINK = "q"
T = TypeVar("T")


def pending(conn: psycopg.Connection) -> tuple[int, int]:
    """(the sink's pending counter, the exact count of received and neither acked nor nacked messages)."""
    counter = conn.execute("SELECT pending FROM sequin.stream_pending WHERE sink = %s", (SINK,)).fetchone()
    exact = conn.execute(
        "SELECT count(*) FROM sequin.stream_messages WHERE sink = %s AND state = 'delivered'", (SINK,)
    ).fetchone()
    return (int(counter[0]) if counter else 0), int(exact[0]) if exact else 0


def lsns(deliveries: list[stream_queue.Delivery]) -> list[int]:
    return [json.loads(d.data)["metadata"]["commit_lsn"] for d in deliveries]


@pytest.fixture
def conn(dsn: str) -> psycopg.Connection:
    with psycopg.connect(dsn, autocommit=True) as c:  # autocommit: each receive has its own now()
        store.migrate(c)
        yield c


def test_the_pending_counter_follows_receives_acks_nacks_redeliveries_and_stale_ids(
    dsn: str, conn: psycopg.Connection
) -> None:
    put_stream_messages(dsn, SINK, [(10, 0, "a"), (20, 0, "b"), (30, 0, "c"), (40, 0, "a")])
    first = stream_queue.receive(conn, "sequin", SINK, 10, 0.3, 100)
    assert lsns(first) == [10, 20, 30] and pending(conn) == (3, 3)
    time.sleep(0.5)  # visibility timed out: redeliveries are still the same pending messages
    again = stream_queue.receive(conn, "sequin", SINK, 10, 30, 100)
    assert lsns(again) == [10, 20, 30] and pending(conn) == (3, 3)
    assert {d.ack_id for d in again}.isdisjoint(d.ack_id for d in first)
    assert stream_queue.ack(conn, "sequin", SINK, [first[0].ack_id, first[1].ack_id]) == 0  # expired ids
    assert pending(conn) == (3, 3)
    assert stream_queue.ack(conn, "sequin", SINK, [again[0].ack_id, again[0].ack_id, str(uuid.uuid4())]) == 1
    assert pending(conn) == (2, 2)
    assert stream_queue.ack(conn, "sequin", SINK, [again[0].ack_id]) == 0  # acked twice: once counts
    assert stream_queue.nack(conn, "sequin", SINK, [again[1].ack_id]) == 1
    assert pending(conn) == (1, 1)
    assert stream_queue.nack(conn, "sequin", SINK, [again[1].ack_id]) == 0
    # 40 (group a) follows the acked 10; 20 comes back after its nack
    third = stream_queue.receive(conn, "sequin", SINK, 10, 30, 100)
    assert lsns(third) == [20, 40] and pending(conn) == (3, 3)
    assert stream_queue.ack(conn, "sequin", SINK, [d.ack_id for d in third] + [again[2].ack_id]) == 3
    assert pending(conn) == (0, 0)
    assert store.stream_counts(conn, "sequin", SINK)["total"] == 0


def test_a_counter_gone_wrong_is_recounted_when_it_reads_full(dsn: str, conn: psycopg.Connection) -> None:
    put_stream_messages(dsn, SINK, [(i, 0, f"g{i}") for i in range(1, 6)])
    got = stream_queue.receive(conn, "sequin", SINK, 2, 30, 3)
    assert lsns(got) == [1, 2] and pending(conn) == (2, 2)
    # the counter drifts (say an operator deleted pending rows by hand) and reads full
    conn.execute("DELETE FROM sequin.stream_messages WHERE sink = %s AND commit_lsn = 1", (SINK,))
    conn.execute("UPDATE sequin.stream_pending SET pending = 50, checked_at = now() WHERE sink = %s", (SINK,))
    # recounted at most every RECOUNT_SECONDS: until then the counter is trusted
    assert stream_queue.receive(conn, "sequin", SINK, 10, 30, 3) == []
    conn.execute("UPDATE sequin.stream_pending SET checked_at = now() - interval '1 hour' WHERE sink = %s", (SINK,))
    assert lsns(stream_queue.receive(conn, "sequin", SINK, 10, 30, 3)) == [3, 4]  # 1 pending (lsn 2) + 2 new
    assert pending(conn) == (3, 3)


def round_trips(conn: psycopg.Connection, trace: Path, operation: Callable[[], T]) -> tuple[T, int]:
    """What ``operation`` returns, and how many round trips to the server it made on ``conn`` (its
    protocol trace's ReadyForQuery messages: one per statement, BEGIN and COMMIT included)."""
    with trace.open("w") as out:
        conn.pgconn.trace(out.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            result = operation()
        finally:
            conn.pgconn.untrace()  # flushes the trace
    return result, trace.read_text().count("\tReadyForQuery")


def test_a_receive_and_an_ack_are_one_round_trip_each_on_an_autocommit_connection(
    dsn: str, conn: psycopg.Connection, tmp_path: Path
) -> None:
    """What the API's connections do (autocommit): a receive that finds its batch in the head and an
    ack are one statement each, committed with their answer, no BEGIN or COMMIT of their own (the
    pull API's round trips: docs/performance.md, "Pull API")."""
    put_stream_messages(dsn, SINK, [(i, 0, f"g{i % 7}") for i in range(1, 41)])
    trace = tmp_path / "trace"
    with psycopg.connect(dsn, autocommit=True) as c:
        got, trips = round_trips(c, trace, lambda: stream_queue.receive(c, "sequin", SINK, 5, 30, 1000))
        assert lsns(got) == [1, 2, 3, 4, 5] and trips == 1
        ids = [d.ack_id for d in got]
        assert round_trips(c, trace, lambda: stream_queue.ack(c, "sequin", SINK, ids)) == (5, 1)
        assert round_trips(c, trace, lambda: stream_queue.nack(c, "sequin", SINK, ids)) == (0, 1)
    assert pending(conn) == (0, 0)


def test_an_ack_is_durable_when_it_returns_whatever_the_session_commits(dsn: str, conn: psycopg.Connection) -> None:
    """An ack is one autocommit statement, and still durable when it returns on a session with
    ``synchronous_commit = off`` (``store.DURABLE_COMMIT`` inside it): the WAL is flushed past
    where it began. Without it the flush lags its commit (the WAL writer flushes every 200 ms)."""
    put_stream_messages(dsn, SINK, [(i, 0, f"g{i}") for i in range(1, 11)])
    with psycopg.connect(make_conninfo(dsn, options="-c synchronous_commit=off"), autocommit=True) as c:
        for _ in range(10):
            got = stream_queue.receive(c, "sequin", SINK, 1, 30, 1000)
            began = c.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
            assert stream_queue.ack(c, "sequin", SINK, [got[0].ack_id]) == 1
            flushed = c.execute("SELECT pg_current_wal_flush_lsn(), pg_current_wal_flush_lsn() > %s::pg_lsn", (began,))
            assert flushed.fetchone()[1], (began, "not flushed")


def test_a_counter_below_zero_reads_as_zero(dsn: str, conn: psycopg.Connection) -> None:
    """Every change to the counter is clamped at zero, but one set below by hand must not make the
    head's size negative (every receive failing, and no recount, since it never reads full)."""
    put_stream_messages(dsn, SINK, [(1, 0, "a"), (2, 0, "b")])
    conn.execute("INSERT INTO sequin.stream_pending (sink, pending) VALUES (%s, -5000)", (SINK,))
    assert lsns(stream_queue.receive(conn, "sequin", SINK, 10, 30, 1000)) == [1, 2]


def test_receiving_writes_no_index_entry(dsn: str, conn: psycopg.Connection) -> None:
    """A receive updates only unindexed columns, so its updates are HOT (the table's fillfactor leaves
    room on the page for nearly all of them): this is what lets the pull API keep up
    (docs/architecture.md, "The pull API's store side"). An index on a column a receive sets makes none of them HOT and fails this test."""
    put_stream_messages(dsn, SINK, [(i, 0, f"g{i}") for i in range(1, 201)])
    with conn.transaction():  # pg_stat_xact_user_tables counts this transaction's updates
        got = stream_queue.receive(conn, "sequin", SINK, 200, 30, 1000)
        updated, hot = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
            " WHERE schemaname = 'sequin' AND relname = 'stream_messages'"
        ).fetchone()
    assert len(got) == 200
    assert updated == 200 and hot >= 180, (updated, hot)


def test_a_claim_fetches_the_rows_it_locked_without_a_descent_each(dsn: str, conn: psycopg.Connection) -> None:
    """A receive of 200 scans the primary key once (the head) and updates the rows it locked by their
    ctid: joining them on the key again descended the index once per message, about a tenth of the
    store's CPU per receive (docs/architecture.md, "The pull API's store side")."""
    put_stream_messages(dsn, SINK, [(i, 0, f"g{i}") for i in range(1, 201)])
    with conn.transaction():  # pg_stat_xact_user_tables counts this transaction's index scans
        got = stream_queue.receive(conn, "sequin", SINK, 200, 30, 1000)
        (scans,) = conn.execute(
            "SELECT idx_scan FROM pg_stat_xact_user_tables WHERE schemaname = 'sequin' AND relname = 'stream_messages'"
        ).fetchone()
    assert len(got) == 200
    assert scans <= 2, scans


def test_a_receive_reads_past_a_long_head_of_waiting_messages(dsn: str, conn: psycopg.Connection) -> None:
    """A receive first reads a short head of the stream (its pending messages and four times the batch):
    when a group's backlog fills it, the receive reads further (``HEAD_GROWTH``) and still finds
    the other groups' first messages, while the backlog's group waits behind its received one."""
    backlog = [(i, 0, "a") for i in range(1, 301)]
    put_stream_messages(dsn, SINK, backlog + [(400, 0, "b"), (401, 0, "a"), (402, 0, "c"), (403, 0, "b")])
    assert lsns(stream_queue.receive(conn, "sequin", SINK, 1, 30, 1000)) == [1]
    assert lsns(stream_queue.receive(conn, "sequin", SINK, 2, 30, 1000)) == [400, 402]
    assert stream_queue.receive(conn, "sequin", SINK, 10, 30, 1000) == []  # a, b, c: each has one pending
    # with max_ack_pending reached, redeliveries are found past the backlog too
    conn.execute("UPDATE sequin.stream_messages SET not_visible_until = now() WHERE sink = %s", (SINK,))
    assert lsns(stream_queue.receive(conn, "sequin", SINK, 10, 30, 3)) == [1, 400, 402]


def test_a_receive_failing_after_its_first_statement_gives_back_what_that_claimed(
    dsn: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an autocommit session a receive's first statement commits its claim; when reading on fails
    (the store failing between two statements: simulated, it cannot be timed here), those messages
    are released, not left received by nobody until their visibility timeout."""
    put_stream_messages(dsn, SINK, [(i, 0, "a") for i in range(1, 21)] + [(30, 0, "b")])

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise psycopg.OperationalError("the store went away")

    monkeypatch.setattr(store, "claim_from_head", failing)
    with pytest.raises(psycopg.OperationalError):
        stream_queue.receive(conn, "sequin", SINK, 2, 30, 1000)  # its first head: eight of group a
    assert pending(conn) == (0, 0)
    assert conn.execute(
        "SELECT deliver_count, not_visible_until FROM sequin.stream_messages WHERE sink = %s AND commit_lsn = 1",
        (SINK,),
    ).fetchone() == (0, None)
    monkeypatch.undo()
    assert lsns(stream_queue.receive(conn, "sequin", SINK, 2, 30, 1000)) == [1, 30]


def test_a_message_row_writes_one_index_entry(conn: psycopg.Connection) -> None:
    """The stream table's only index is its primary key (the position): a message row is the largest
    cost of the stream and of a backfill, and a receive finds groups' first messages without an
    index on groups (docs/performance.md, "Pull API"). An index added here should come with its measurement."""
    indexes = conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'sequin' AND tablename = 'stream_messages'"
    ).fetchall()
    assert [i[0].split(" USING ")[1] for i in indexes] == ["btree (sink, commit_lsn, commit_idx)"]


def test_a_burst_s_pages_are_kept_when_consumers_empty_the_table_and_the_next_burst_reuses_them(
    dsn: str, conn: psycopg.Connection
) -> None:
    """Migration 20: a VACUUM after consumers acked every message leaves the stream table's pages
    (no ACCESS EXCLUSIVE lock to cut them off, which stops receives and writes while held), and the
    next burst fills those pages instead of extending the file one page at a time again (0.6 µs of
    CPU per backfill read on PostgreSQL 15; docs/performance.md, "Backfills")."""

    def pages() -> int:
        return int(
            conn.execute(
                "SELECT pg_relation_size('sequin.stream_messages') / current_setting('block_size')::integer"
            ).fetchone()[0]
        )

    def burst(first: int) -> None:
        put_stream_messages(dsn, SINK, [(first + i, 0, f"g{i}") for i in range(3000)])
        while got := stream_queue.receive(conn, "sequin", SINK, 500, 30, 1_000_000):
            assert stream_queue.ack(conn, "sequin", SINK, [d.ack_id for d in got]) == len(got)

    burst(1)
    grown = pages()
    conn.execute("VACUUM sequin.stream_messages")
    assert conn.execute("SELECT count(*) FROM sequin.stream_messages").fetchone()[0] == 0
    assert pages() == grown > 10
    burst(10_001)
    conn.execute("VACUUM sequin.stream_messages")
    assert grown <= pages() < grown * 1.1  # the second burst's messages went into the first one's pages


def test_every_queue_table_keeps_its_pages_when_emptied(conn: psycopg.Connection) -> None:
    """Migration 20 covers the three tables whose size swings with bursts: the stream's messages, a
    push sink's buffer and a filtered backfill's staged rows (the test above exercises the first)."""
    kept = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'sequin' AND 'vacuum_truncate=false' = ANY(c.reloptions) ORDER BY c.relname"
    ).fetchall()
    assert [k[0] for k in kept] == ["backfill_rows", "buffered_messages", "stream_messages"]


def test_concurrent_receivers_acks_nacks_and_timeouts_keep_each_group_in_order(
    dsn: str, conn: psycopg.Connection
) -> None:
    """Four receivers on one sink, each acking most of what it gets, nacking some and dropping
    some (their visibility times out): every message is acked exactly once; a message is never
    held by two receivers at once; a group's messages are received strictly in position order
    (never a later one while an earlier one is pending); no receive, ack or nack fails; and the
    pending counter ends exact."""
    timeout = 2.0
    put_stream_messages(dsn, SINK, [(i, i % 3, f"g{i % 30}") for i in range(1, 301)])
    held: list[tuple[str, int, int, float, float | None]] = []  # group, lsn, idx, received, settled (None: dropped)
    acked: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def consumer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and sum(acked) < 300:
                    got = stream_queue.receive(c, "sequin", SINK, rng.choice([1, 5, 20]), timeout, 1000)
                    at = time.monotonic()
                    for d in got:
                        record = json.loads(d.data)["record"]
                        roll, settled = rng.random(), time.monotonic()
                        if roll < 0.85:
                            n = stream_queue.ack(c, "sequin", SINK, [d.ack_id])
                        elif roll < 0.95:
                            n = stream_queue.nack(c, "sequin", SINK, [d.ack_id])
                        with lock:
                            held.append(
                                (record["g"], record["lsn"], record["idx"], at, settled if roll < 0.95 else None)
                            )
                            if roll < 0.85:
                                acked.append(n)
                    if not got:
                        time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=consumer, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(acked) == 300 and store.stream_counts(conn, "sequin", SINK)["total"] == 0
    assert pending(conn) == (0, 0)
    by_message: dict[tuple[int, int], list[tuple[float, float | None]]] = {}
    by_group: dict[str, list[tuple[float, int, int]]] = {}
    for group, lsn, idx, received, settled in held:
        by_message.setdefault((lsn, idx), []).append((received, settled))
        by_group.setdefault(group, []).append((received, lsn, idx))
    for position, holds in by_message.items():  # settled well within its timeout: nobody else had it meanwhile
        holds.sort()
        for (start, end), (next_start, _) in zip(holds, holds[1:]):
            if end is not None and end - start < timeout / 2:
                assert next_start >= end, (position, holds)
    for group, receipts in by_group.items():  # in the order they were received: positions never go back
        positions = [(lsn, idx) for _, lsn, idx in sorted(receipts)]
        assert positions == sorted(positions), (group, positions)
