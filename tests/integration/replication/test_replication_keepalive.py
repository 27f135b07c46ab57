"""The slot never passes what is not durable, whatever the walsender's keepalives ask (DESIGN §2.8).

The dangerous moment, made deterministic: transaction T_long wrote all its rows before T1
committed, so when the walsender replays T_long (at its commit) every one of its messages starts
below T1's end, which we have acknowledged. T3 committed after T1 and before T_long: received, not
acknowledged. The reader freezes (the test hook) right after T_long's first message, longer than
half the walsender's ``wal_sender_timeout``: the walsender, its send buffer full, asks for a reply
with a keepalive whose ``wal_end`` is past T3. psycopg2 answered such a keepalive on its own by
confirming that ``wal_end`` (its keepalive branch: our last explicit flush was at or past the start
of the last data message it read), so the slot passed T3, and a crash lost it.
"""

from __future__ import annotations

import time

import psycopg

from devtools.stream_process import wait_for
from sequin_provider.replication import ChangeReader, create_slot, slot_info

WAL_SENDER_TIMEOUT = 8.0
STALL = WAL_SENDER_TIMEOUT * 0.6
"""Past half the timeout, when the walsender asks for a reply; the reader sends a status as the stall
starts, so the rest (3.2 s) is left to read the backlog queued before that request and answer it (a
CI run once saw the connection closed when the stall began 1-2 s after the last status, as the stall
hook then did not send one)."""
LONG_ROWS = 60_000  # several MB of pgoutput: more than the socket buffers hold, so the walsender blocks


def _confirmed(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        info = slot_info(conn, "slot")
    assert info is not None and info.confirmed_flush_lsn is not None
    return info.confirmed_flush_lsn


def _read_rows(reader: ChangeReader, count: int) -> list[tuple]:
    """The next ``count`` rows (transactions come in chunks)."""
    rows: list[tuple] = []
    deadline = time.monotonic() + 60
    while len(rows) < count and time.monotonic() < deadline:
        rows += reader.read(count, 1 << 30, 1.0).rows
    return rows


def test_a_keepalive_during_a_stall_never_confirms_an_unacknowledged_transaction(dsn: str, monkeypatch) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {dbname} SET wal_sender_timeout = '{int(WAL_SENDER_TIMEOUT * 1000)}ms'")
        conn.execute("CREATE TABLE kv (id int PRIMARY KEY, v text)")
        conn.execute("CREATE PUBLICATION pub FOR TABLE kv")
        start = create_slot(conn, "slot")
    long_txn = psycopg.connect(dsn)
    long_txn.execute("INSERT INTO kv SELECT g, repeat('x', 200) FROM generate_series(1, %s) g", (LONG_ROWS,))
    execute_one = lambda statement: psycopg.connect(dsn, autocommit=True).execute(statement)  # noqa: E731
    execute_one(f"INSERT INTO kv VALUES ({LONG_ROWS + 1}, 't1')")  # T1

    monkeypatch.setenv("SEQUIN_TEST_READER_STALL", str(STALL))
    reader = ChangeReader(dsn, "slot", "pub")
    reader.open(start)
    try:
        t1 = reader.read(1, 1 << 30, 10.0)
        assert [r[7] for r in t1.rows] == [f'{{"id":{LONG_ROWS + 1},"v":"t1"}}']
        reader.acknowledge(t1.end_lsn)  # T1 is durable in every sink
        execute_one(f"INSERT INTO kv VALUES ({LONG_ROWS + 2}, 't3')")  # T3: will be received, never acknowledged
        wait_for(lambda: reader._ready_rows >= 1, 10, what="T3 to be received")  # noqa: SLF001 - test probe
        long_txn.commit()  # T_long: replayed at its commit, every message of it below T1's end
        t3_and_long = _read_rows(reader, LONG_ROWS + 1)
        assert t3_and_long[0][7] == f'{{"id":{LONG_ROWS + 2},"v":"t3"}}'
        time.sleep(1.0)  # a reply to the keepalive, if any, has reached the server
        # the slot stays where we acknowledged it: a crash now must not lose T3
        assert _confirmed(dsn) <= t1.end_lsn
    finally:
        reader.close()  # as a crash would: nothing more is acknowledged
        long_txn.close()

    again = ChangeReader(dsn, "slot", "pub")
    again.open(t1.end_lsn)  # where the stream app restarts: its last committed offset
    try:
        rows = _read_rows(again, LONG_ROWS + 1)
    finally:
        again.close()
    assert rows[0][7] == f'{{"id":{LONG_ROWS + 2},"v":"t3"}}'  # T3 is not lost
    assert len(rows) == LONG_ROWS + 1
