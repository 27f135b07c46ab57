"""An acked message never comes back: a replayed micro-batch adds nothing its consumer group acked.

A Sequin Stream sink is one consumer group. Its acked messages are deleted, and their positions
are kept in the store's acked ledger until the slot has passed them (``store.prune_acked``), so a
batch Spark replays after a crash between the store commit and its offset commit skips them.
The store-level tests need no Spark; the last one crashes the real stream app at that moment.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

from devtools.stream_process import streaming_status, wait_for
from sequin_provider import store, stream_queue
from sequin_provider.spark.pipeline import TEST_STALL_AFTER_STORE_ENV
from tests.support.config import write_config
from tests.support.postgres import execute

SINK = "s"


def rows(positions: list[tuple[int, int]], sink: str = SINK) -> list[store.StreamRow]:
    """Stream rows at these positions, one group each."""
    return [
        (sink, lsn, idx, f"g{lsn}.{idx}", f"{lsn}:{idx}", json.dumps({"lsn": lsn, "idx": idx}))
        for lsn, idx in positions
    ]


def receive_ack(conn: psycopg.Connection[Any], n: int, sink: str = SINK) -> list[tuple[int, int]]:
    """Receive up to ``n`` messages of ``sink`` and ack them; their positions."""
    got = stream_queue.receive(conn, "sequin", sink, n, 60.0, 10_000)
    assert stream_queue.ack(conn, "sequin", sink, [d.ack_id for d in got]) == len(got)
    return [(json.loads(d.data)["lsn"], json.loads(d.data)["idx"]) for d in got]


def positions(conn: psycopg.Connection[Any], sink: str = SINK) -> list[tuple[int, int]]:
    return [(m.commit_lsn, m.commit_idx) for m in store.stream_messages(conn, "sequin", sink)]


def test_a_replayed_batch_skips_what_its_consumer_group_acked(dsn: str) -> None:
    batch = [(100, i) for i in range(6)] + [(200, 0), (200, 1)]
    with psycopg.connect(dsn) as conn:
        store.migrate(conn)
        assert store.insert_stream_messages(conn, "sequin", rows(batch)) == 8
        assert store.insert_stream_messages(conn, "sequin", rows([(100, 0)], "other")) == 1
        store.advance_visible_lsn(conn, "sequin", [SINK, "other"], 200)
        acked = receive_ack(conn, 3)
        assert acked == [(100, 0), (100, 1), (100, 2)]
        assert store.acked_positions(conn, "sequin", SINK) == acked
        counts = store.stream_counts(conn, "sequin", SINK)
        assert (counts["total"], counts["outstanding"]) == (5, 0)  # the ledger is not pending, nor stored messages

        # the replay meets stored rows (the fallback path): only what is neither stored nor acked lands
        assert store.insert_stream_messages(conn, "sequin", rows(batch + [(300, 0)])) == 1
        assert positions(conn) == batch[3:] + [(300, 0)]
        # every row of this replay was acked (COPY straight in: no conflict); the other sink's
        # message at the same position is its own
        assert store.insert_stream_messages(conn, "sequin", rows(acked)) == 0
        assert store.insert_stream_copy(conn, "sequin", [store.copy_line(r) + "\n" for r in rows(acked[:1])]) == 0
        assert positions(conn) == batch[3:] + [(300, 0)]
        assert positions(conn, "other") == [(100, 0)]

        # a consumer drains the sink: what it gets is exactly what was not acked, once
        assert receive_ack(conn, 100) == batch[3:]
        assert receive_ack(conn, 100) == []  # (300, 0) is not visible yet
        store.advance_visible_lsn(conn, "sequin", [SINK], 300)
        assert receive_ack(conn, 100) == [(300, 0)]
        assert positions(conn) == []


def test_acked_positions_are_kept_until_the_slot_passes_them(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn)
        store.insert_stream_messages(conn, "sequin", rows([(100, 0), (100, 1), (200, 0), (300, 0)]))
        store.advance_visible_lsn(conn, "sequin", [SINK], 300)
        assert receive_ack(conn, 2) == [(100, 0), (100, 1)]
        assert receive_ack(conn, 1) == [(200, 0)]

        # the slot passed the transaction committed at 100 (its end LSN is 150), not the one at 200
        assert store.prune_acked(conn, "sequin", [SINK, "unknown"], 150) == 2
        assert store.acked_positions(conn, "sequin", SINK) == [(200, 0)]
        assert store.prune_acked(conn, "sequin", [SINK], 120) == 0  # never moves back
        assert store.insert_stream_messages(conn, "sequin", rows([(200, 0)])) == 0  # still skipped
        # a message the slot has passed cannot be replayed: acking it needs no ledger entry
        assert store.insert_stream_messages(conn, "sequin", rows([(120, 0)])) == 1
        assert receive_ack(conn, 10) == [(120, 0), (300, 0)]
        assert store.acked_positions(conn, "sequin", SINK) == [(200, 0), (300, 0)]

        assert store.prune_acked(conn, "sequin", [SINK], 10_000) == 2
        assert store.acked_positions(conn, "sequin", SINK) == []
        store.insert_stream_messages(conn, "sequin", rows([(10_000, 0)]))
        store.advance_visible_lsn(conn, "sequin", [SINK], 10_000)
        assert receive_ack(conn, 10) == [(10_000, 0)]
        assert store.acked_positions(conn, "sequin", SINK) == [(10_000, 0)]  # at the passed LSN: not passed yet


def test_an_ack_racing_a_replay_is_not_undone(dsn: str) -> None:
    """A consumer acks a message while a replay of its batch is writing: the replay waits for the
    ack's row and then finds the position in the ledger, so the message does not come back."""
    with psycopg.connect(dsn) as conn, psycopg.connect(dsn) as consumer:
        store.migrate(conn)
        store.insert_stream_messages(conn, "sequin", rows([(100, 0), (100, 1)]))
        store.advance_visible_lsn(conn, "sequin", [SINK], 100)
        got = stream_queue.receive(consumer, "sequin", SINK, 2, 60.0, 10_000)
        assert len(got) == 2
        # the ack deletes its rows, and has not committed yet when the replay writes them again
        consumer.execute("SELECT 1")  # a transaction in progress: the ack's own is a savepoint in it
        assert stream_queue.ack(consumer, "sequin", SINK, [d.ack_id for d in got]) == 2
        written: list[int] = []
        replay = threading.Thread(
            target=lambda: written.append(
                store.insert_stream_messages(conn, "sequin", rows([(100, 0), (100, 1), (200, 0)]))
            )
        )
        replay.start()
        with psycopg.connect(dsn, autocommit=True) as watcher:  # the write waits on the rows the ack deletes
            wait_for(
                lambda: watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).fetchone()[0],
                30,
                what="the replay to wait for the ack",
            )
        assert replay.is_alive()
        consumer.commit()
        replay.join(30)
        assert written == [1]
        assert positions(conn) == [(200, 0)]


CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: kv
    tables: [kv]
    destination: {{type: sequin_stream}}
stream:
  checkpoint_location: {checkpoint}
  max_batch_wait: 100ms
"""


def batch_ids(folder: Path) -> set[int]:
    """The micro-batch ids Spark logged in a checkpoint folder (``offsets`` or ``commits``)."""
    return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.is_dir() else set()


def received_ids(conn: psycopg.Connection[Any], n: int) -> tuple[list[int], list[str]]:
    """Receive up to ``n`` messages of sink ``kv``: their rows' ids, and their ack ids."""
    got = stream_queue.receive(conn, "sequin", "kv", n, 60.0, 10_000)
    return [json.loads(d.data)["record"]["id"] for d in got], [d.ack_id for d in got]


def test_a_crash_between_the_store_commit_and_the_offset_commit_brings_back_no_acked_message(
    tmp_path: Path, dsn: str, dbname: str, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    checkpoint = tmp_path / "ckpt"
    config = write_config(tmp_path / "sequin.yaml", CONFIG.format(dsn=dsn, db=dbname, checkpoint=checkpoint))
    trigger = tmp_path / "stall"
    trigger.touch()  # the first batch that writes messages stalls once they are visible
    app = stream_app(config, {TEST_STALL_AFTER_STORE_ENV: str(trigger)})
    app.wait_streaming(dsn)
    execute(dsn, "INSERT INTO kv SELECT g, g FROM generate_series(1, 300) g")  # one transaction, one batch
    stalled = tmp_path / "stall.stalled"
    wait_for(
        lambda: app.check_alive() or stalled.exists(), 120, what="the batch in the store, its offset not committed"
    )

    received: list[int] = []
    with psycopg.connect(dsn) as conn:
        ids, ack_ids = received_ids(conn, 100)  # a consumer takes part of the batch and acks it
        assert len(ids) == 100
        assert stream_queue.ack(conn, "sequin", "kv", ack_ids) == 100
    acked_before_crash = set(ids)
    received += ids
    assert max(batch_ids(checkpoint / "app" / "offsets")) > max(batch_ids(checkpoint / "app" / "commits"), default=-1)
    killed_at = datetime.now(timezone.utc)
    app.kill()

    app = stream_app(config)  # Spark replays the batch whose offset it had not committed
    wait_for(
        lambda: app.check_alive() or streaming_status(dsn, after=killed_at),
        180,
        what="the restarted app's first micro-batch (the replay)",
    )
    execute(dsn, "INSERT INTO kv SELECT g, g FROM generate_series(301, 350) g")
    with psycopg.connect(dsn) as conn:

        def drained() -> bool:
            ids, ack_ids = received_ids(conn, 100)
            stream_queue.ack(conn, "sequin", "kv", ack_ids)
            received.extend(ids)
            return len(set(received)) == 350

        wait_for(drained, 120, interval=0.2, what="every message received")
        time.sleep(2.0)  # a late duplicate would show up now
        assert received_ids(conn, 100)[0] == []
    again = sorted(i for i in received[100:] if i in acked_before_crash)
    assert again == [], f"{len(again)} messages acked before the crash were received again: {again[:10]}..."
    assert Counter(received) == Counter(range(1, 351))  # every message exactly once
    with psycopg.connect(dsn) as conn:  # the app forgets the acked positions once the slot has passed them
        wait_for(
            lambda: app.check_alive() or not store.acked_positions(conn, "sequin", "kv"),
            60,
            what="the acked ledger pruned",
        )
