"""The Spark data source reader driven directly (as Spark's Python runner would), against real Postgres."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pyarrow as pa

from devtools.stream_process import wait_for
from sequin_provider.change_arrow import CHANGE_ARROW_SCHEMA
from sequin_provider.config import load_config
from sequin_provider.provisioning import initialize
from sequin_provider.replication import slot_info
from sequin_provider.spark.source import ReplicationStreamReader, SpoolPartition
from tests.support.config import write_config
from tests.support.postgres import execute


def reader_for(
    tmp_path: Path, dsn: str, db: str, stream: str = "max_batch_wait: 300ms"
) -> tuple[ReplicationStreamReader, str]:
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases:
          - name: app
            dsn: {dsn}
            slot: {{name: slot_{db}}}
            publication: {{name: pub_{db}}}
            heartbeat_interval: 0
        sinks:
          - name: kv
            tables: [kv]
            destination: {{type: sequin_stream}}
        stream: {{{stream}}}
        """,
    )
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    initialize(load_config(config))
    options = {"config": str(config), "database": "app", "spool": str(tmp_path / "spool")}
    return ReplicationStreamReader(options), f"slot_{db}"


def next_offset(reader: ReplicationStreamReader, start: dict) -> dict:
    """latestOffset until the just-committed transactions arrive (the walsender may take a moment)."""
    return wait_for(
        lambda: (lambda end: end if end != start else None)(reader.latestOffset(start, None)),
        30,
        what="the committed transactions to reach the reader",
    )


def rows_of(reader: ReplicationStreamReader, start: dict, end: dict) -> list[dict]:
    (partition,) = reader.partitions(start, end)
    batches = list(reader.read(partition))
    assert all(b.schema == CHANGE_ARROW_SCHEMA for b in batches)
    return pa.Table.from_batches(batches, CHANGE_ARROW_SCHEMA).to_pylist()


def test_offsets_spool_replays_and_acknowledgement(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, slot = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    # one transaction: with two, next_offset could return once the first had arrived (seen on CI)
    execute(dsn, "INSERT INTO kv VALUES (1, 1), (2, 2)")
    end = next_offset(reader, start)
    assert end["lsn"] > start["lsn"]
    assert reader.latestOffset(end, None) == end  # nothing new
    spooled = rows_of(reader, start, end)
    assert [(r["action"], r["record"]) for r in spooled] == [("insert", '{"id":1,"v":1}'), ("insert", '{"id":2,"v":2}')]
    # the same range re-read from the slot by another reader (the spool lost), while nobody streams
    reader.stop()
    (partition,) = reader.partitions(start, end)
    assert isinstance(partition, SpoolPartition)
    os.unlink(partition.path)
    other = ReplicationStreamReader(reader.options)
    assert rows_of(other, start, end) == spooled
    # the slot moves only on commit; a commit from a non-streaming reader lets go of the slot
    with psycopg.connect(dsn) as conn:
        assert slot_info(conn, slot).confirmed_flush_lsn == start["lsn"]  # type: ignore[union-attr]
    other.commit(end)
    with psycopg.connect(dsn) as conn:
        info = slot_info(conn, slot)
    # at least to the end of the batch; an idle reader may also confirm a server keepalive's position
    # beyond it (WAL of other databases of the cluster: nothing of this slot's lies in between)
    assert info is not None and info.confirmed_flush_lsn is not None and not info.active
    assert info.confirmed_flush_lsn >= end["lsn"]


def test_commit_removes_spooled_batches_up_to_the_offset(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    execute(dsn, "INSERT INTO kv VALUES (1, 1)")
    middle = next_offset(reader, start)
    execute(dsn, "INSERT INTO kv VALUES (2, 2)")
    end = next_offset(reader, middle)
    assert len(list((tmp_path / "spool").glob("*.arrow"))) == 2
    reader.commit(middle)
    assert [p.name for p in (tmp_path / "spool").glob("*.arrow")] == [Path(reader.partitions(middle, end)[0].path).name]  # type: ignore[attr-defined]
    reader.stop()


def test_initial_offset_is_stable_when_the_slot_moves(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, slot = reader_for(tmp_path, dsn, dbname)
    first = reader.initialOffset()
    execute(
        dsn,
        "SET synchronous_commit = on",
        "INSERT INTO kv VALUES (1, 1)",
        f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_lsn())",
    )
    with psycopg.connect(dsn) as conn:
        assert slot_info(conn, slot).confirmed_flush_lsn > first["lsn"]  # type: ignore[union-attr,operator]
    assert reader.initialOffset() == first


def test_heartbeat_only_transactions_advance_the_offset(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    execute(dsn, "SELECT pg_logical_emit_message(true, 'sequin:heartbeat', '{}')")
    end = next_offset(reader, start)
    assert end["lsn"] > start["lsn"]
    assert rows_of(reader, start, end) == []
    reader.stop()


def test_empty_range_is_read_without_the_slot(tmp_path: Path, dsn: str, dbname: str) -> None:
    """Spark runs batch 0 as (initial, initial) when the first read found nothing, while the
    streaming reader holds the slot: that must not need the slot."""
    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    assert reader.latestOffset(start, None) == start  # nothing committed; the reader holds the slot
    other = ReplicationStreamReader(reader.options)
    assert rows_of(other, start, start) == []
    reader.stop()


def test_spool_payload_rows_name_slices_and_a_lost_file_is_put_back(tmp_path: Path, dsn: str, dbname: str) -> None:
    """``payload=spool``: Spark gets one row per slice of the spool file (no change row crosses into
    the JVM), and the executors' writers take the change rows from the file, in order, in chunks.
    A batch replayed after the file was lost re-reads the slot and writes the file back, so the
    slices still resolve."""
    from sequin_provider.spark.source import SLICE_CHUNK_ROWS, SPOOL_SLICE_SCHEMA, spool_slice_rows

    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    execute(dsn, "INSERT INTO kv SELECT g, g FROM generate_series(1, 45000) g")  # one transaction: one batch
    end = next_offset(reader, start)
    full = rows_of(reader, start, end)
    assert [r["record"] for r in full] == [f'{{"id":{i},"v":{i}}}' for i in range(1, 45001)]
    spooled = ReplicationStreamReader({**reader.options, "payload": "spool", "partitions": "2"})
    spooled._spooled_rows = dict(reader._spooled_rows)  # the same process's bookkeeping, as in the app

    def through_slices() -> list[dict]:
        partitions = spooled.partitions(start, end)
        assert len(partitions) == 2  # slices of one file
        rows: list[dict] = []
        for partition in partitions:
            (slice_row,) = spooled.read(partition)
            assert slice_row.schema == SPOOL_SLICE_SCHEMA and slice_row.num_rows == 1
            chunks = list(spool_slice_rows(slice_row))
            assert [c.num_rows for c in chunks] == [SLICE_CHUNK_ROWS, 22500 - SLICE_CHUNK_ROWS]
            assert all(c.schema == CHANGE_ARROW_SCHEMA for c in chunks)
            rows += pa.Table.from_batches(chunks).to_pylist()
        return rows

    assert through_slices() == full
    reader.stop()
    os.unlink(spooled.partitions(start, end)[0].path)  # type: ignore[attr-defined]
    assert through_slices() == full
    assert Path(spooled.partitions(start, end)[0].path).exists()  # type: ignore[attr-defined]


def test_a_large_transaction_spans_batches_and_the_slot_moves_only_at_its_commit(
    tmp_path: Path, dsn: str, dbname: str
) -> None:
    """A transaction larger than a batch is handed on in chunks (bounded memory): its batches end
    at ``{"lsn", "idx"}`` offsets, each but the last carries the open-transaction marker, a commit
    inside it acknowledges only the last commit boundary, and a batch that ends inside it is re-read
    from the slot identically (the first rows of the transaction skipped)."""
    from sequin_provider.messages import OPEN_TRANSACTION_PREFIX

    reader, slot = reader_for(tmp_path, dsn, dbname, "max_batch_wait: 300ms, max_batch_rows: 1000")
    start = reader.initialOffset()
    execute(dsn, "INSERT INTO kv VALUES (0, 0)")  # a small transaction before the large one
    execute(dsn, "INSERT INTO kv SELECT g, g FROM generate_series(1, 3500) g")
    offsets, batches = [start], []
    while sum(r["action"] != "message" for b in batches for r in b) < 3501:
        end = next_offset(reader, offsets[-1])
        batches.append(rows_of(reader, offsets[-1], end))
        offsets.append(end)
    changes = [r for b in batches for r in b if r["action"] != "message"]
    assert [r["record"] for r in changes] == ['{"id":0,"v":0}'] + [f'{{"id":{i},"v":{i}}}' for i in range(1, 3501)]
    large = changes[1]["commit_lsn"]
    assert [r["commit_idx"] for r in changes[1:]] == list(range(3500))
    inside = [o for o in offsets if o.get("idx")]
    assert len(inside) >= 3
    assert all(len([r for r in b if r["action"] != "message"]) <= 1000 for b in batches)
    for batch, end in zip(batches, offsets[1:]):
        markers = [r for r in batch if r["table_name"] == OPEN_TRANSACTION_PREFIX]
        assert markers == ([{**markers[0], "commit_lsn": large, "commit_idx": end["idx"]}] if end.get("idx") else [])
    # a commit inside the transaction acknowledges its start, not more
    boundary = max(o["lsn"] for o in offsets if o.get("idx"))
    reader.commit(inside[-1])
    with psycopg.connect(dsn) as conn:
        assert slot_info(conn, slot).confirmed_flush_lsn <= boundary  # type: ignore[union-attr,operator]
    # batches inside the transaction re-read from the slot by another reader (spool lost): the same rows
    reader.stop()
    other = ReplicationStreamReader(reader.options)
    for first, end, batch in list(zip(offsets, offsets[1:], batches))[1:]:
        (partition,) = other.partitions(first, end)
        if os.path.exists(partition.path):  # type: ignore[attr-defined]
            os.unlink(partition.path)  # type: ignore[attr-defined]
        assert rows_of(other, first, end) == batch
    other.commit(offsets[-1])
    with psycopg.connect(dsn) as conn:
        assert slot_info(conn, slot).confirmed_flush_lsn >= offsets[-1]["lsn"]  # type: ignore[union-attr,operator]
