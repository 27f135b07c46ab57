"""The Spark data source reader driven directly (as Spark's Python runner would), against real Postgres."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow as pa

from sequin_provider.config import load_config
from sequin_provider.messages import CHANGE_ARROW_SCHEMA
from sequin_provider.provisioning import initialize
from sequin_provider.replication import slot_info
from sequin_provider.spark.source import ReplicationStreamReader
from tests.conftest import execute, write_config


def reader_for(tmp_path: Path, dsn: str, db: str) -> tuple[ReplicationStreamReader, str]:
    config = write_config(tmp_path / "sequin.yaml", f"""
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
        stream: {{max_batch_wait: 300ms}}
        """)
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    initialize(load_config(config))
    return ReplicationStreamReader({"config": str(config), "database": "app"}), f"slot_{db}"


def batches(it: object) -> list[pa.RecordBatch]:
    return list(it)  # type: ignore[call-overload]


def test_offsets_reads_replays_and_acknowledgement(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, slot = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    execute(dsn, "INSERT INTO kv VALUES (1, 1)", "INSERT INTO kv VALUES (2, 2)")
    it, end = reader.read(start)
    (batch,) = batches(it)
    assert batch.schema == CHANGE_ARROW_SCHEMA and batch.num_rows == 2
    assert end["lsn"] > start["lsn"]
    it, again = reader.read(end)  # nothing new: same offset, no rows
    assert again == end and batches(it) == []
    # a deterministic re-read of the same range, from another reader (another process in Spark)
    other = ReplicationStreamReader({"config": reader.config_path, "database": "app"})
    reader.stop()
    (replayed,) = batches(other.readBetweenOffsets(start, end))
    assert replayed.to_pylist() == batch.to_pylist()
    # the slot moves only on commit, and a commit from a non-streaming reader lets go of the slot
    with psycopg.connect(dsn) as conn:
        assert slot_info(conn, slot).confirmed_flush_lsn == start["lsn"]  # type: ignore[union-attr]
    other.commit(end)
    with psycopg.connect(dsn) as conn:
        info = slot_info(conn, slot)
    assert info is not None and info.confirmed_flush_lsn == end["lsn"] and not info.active


def test_initial_offset_is_stable_when_the_slot_moves(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, slot = reader_for(tmp_path, dsn, dbname)
    first = reader.initialOffset()
    execute(dsn, "SET synchronous_commit = on", "INSERT INTO kv VALUES (1, 1)", f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_lsn())")
    with psycopg.connect(dsn) as conn:
        assert slot_info(conn, slot).confirmed_flush_lsn > first["lsn"]  # type: ignore[union-attr,operator]
    assert reader.initialOffset() == first


def test_heartbeat_only_transactions_advance_the_offset_with_a_batch(tmp_path: Path, dsn: str, dbname: str) -> None:
    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    execute(dsn, "SELECT pg_logical_emit_message(true, 'sequin:heartbeat', '{}')")
    it, end = reader.read(start)
    assert end["lsn"] > start["lsn"]
    assert [b.num_rows for b in batches(it)] == [0]
    reader.stop()


def test_empty_range_is_read_without_the_slot(tmp_path: Path, dsn: str, dbname: str) -> None:
    """Spark replays batch 0 as (initial, initial) when the first read found nothing, while the
    streaming reader holds the slot: that must not need the slot."""
    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    it, end = reader.read(start)  # nothing committed: the reader now streams and holds the slot
    assert end == start and batches(it) == []
    other = ReplicationStreamReader({"config": reader.config_path, "database": "app"})
    assert batches(other.readBetweenOffsets(start, start)) == []
    reader.stop()
