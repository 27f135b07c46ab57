"""The Spark data source reader driven directly (as Spark's Python runner would), against real Postgres."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pyarrow as pa

from sequin_provider.config import load_config
from sequin_provider.messages import CHANGE_ARROW_SCHEMA
from sequin_provider.provisioning import initialize
from sequin_provider.replication import slot_info
from sequin_provider.spark.source import ReplicationStreamReader, SpoolPartition
from tests.conftest import execute, wait_for, write_config


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
    options = {"config": str(config), "database": "app", "spool": str(tmp_path / "spool")}
    return ReplicationStreamReader(options), f"slot_{db}"


def next_offset(reader: ReplicationStreamReader, start: dict) -> dict:
    """latestOffset until the just-committed transactions arrive (the walsender may take a moment)."""
    return wait_for(lambda: (lambda end: end if end != start else None)(reader.latestOffset(start, None)), 30,
                    what="the committed transactions to reach the reader")


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
    execute(dsn, "SET synchronous_commit = on", "INSERT INTO kv VALUES (1, 1)",
            f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_lsn())")
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


def test_spool_payload_rows_name_their_place_and_a_lost_file_is_put_back(tmp_path: Path, dsn: str,
                                                                         dbname: str) -> None:
    """``payload=spool``: Spark gets only the selection columns and each row's place in the spool
    file, and the executors' writers take the change rows from the file. A batch replayed after
    the file was lost re-reads the slot and writes the file back, so the places still resolve."""
    from sequin_provider.spark.pipeline import materialize
    from sequin_provider.spark.source import SPOOL_REFERENCE_SCHEMA

    reader, _ = reader_for(tmp_path, dsn, dbname)
    start = reader.initialOffset()
    execute(dsn, "INSERT INTO kv SELECT g, g FROM generate_series(1, 25000) g")  # one transaction: one batch
    end = next_offset(reader, start)
    full = rows_of(reader, start, end)
    assert [r["record"] for r in full] == [f'{{"id":{i},"v":{i}}}' for i in range(1, 25001)]
    spooled = ReplicationStreamReader({**reader.options, "payload": "spool", "partitions": "2"})
    spooled._spooled_rows = dict(reader._spooled_rows)  # the same process's bookkeeping, as in the app

    def through_references() -> list[dict]:
        partitions = spooled.partitions(start, end)
        assert len(partitions) == 2  # slices of one file
        rows: list[dict] = []
        for partition in partitions:
            for batch in spooled.read(partition):
                assert batch.schema == SPOOL_REFERENCE_SCHEMA
                assert "record" not in batch.schema.names
                selected = batch.append_column("_select_0", pa.array([True] * batch.num_rows))
                rows += pa.Table.from_batches([materialize(selected)]).drop_columns(["_select_0"]).to_pylist()
        return rows

    assert through_references() == full
    # rows no sink takes are not taken from the file; the others keep their order
    (first, _) = spooled.partitions(start, end)
    refs = next(iter(spooled.read(first)))
    flags = pa.array([i % 3 == 0 for i in range(refs.num_rows)])
    taken = materialize(refs.append_column("_select_0", flags).append_column("_select_1", pa.array([False] * refs.num_rows)))
    assert taken.column("record").to_pylist() == [r["record"] for r in full[:refs.num_rows:3]]
    assert taken.column("_select_1").to_pylist() == [False] * len(taken)
    none = materialize(refs.append_column("_select_0", pa.array([False] * refs.num_rows)))  # e.g. only watermarks
    assert none.num_rows == 0 and none.schema.names == list(CHANGE_ARROW_SCHEMA.names) + ["_select_0"]
    reader.stop()
    os.unlink(spooled.partitions(start, end)[0].path)  # type: ignore[attr-defined]
    assert through_references() == full
    assert Path(spooled.partitions(start, end)[0].path).exists()  # type: ignore[attr-defined]


def test_materialize_takes_rows_from_several_spool_files_in_the_batchs_order(tmp_path: Path) -> None:
    """A batch whose references name more than one spool file (runs of rows from each, interleaved):
    every selected row is taken from its own file, at its own place, in the batch's order."""
    from sequin_provider.messages import rows_to_arrow
    from sequin_provider.spark.pipeline import materialize
    from sequin_provider.spark.source import SPOOL_REFERENCE_SCHEMA, write_spool

    def change(lsn: int, idx: int, v: int) -> tuple:
        return (lsn, idx, "2026-01-01T00:00:00Z", 7, "public", "kv", "insert", f'{{"id":{v}}}', None, [str(v)],
                [], None, None)

    files = {name: [change(lsn, i, lsn * 10 + i) for i in range(4)] for name, lsn in (("a", 100), ("b", 200))}
    for name, rows in files.items():
        write_spool(str(tmp_path / f"{name}.arrow"), rows_to_arrow(rows))
    # (file, row in it, taken by the sink): runs a a | b | a | b b, one row no sink takes
    refs = [("a", 2, True), ("a", 0, True), ("b", 3, True), ("a", 1, False), ("a", 3, True), ("b", 0, True),
            ("b", 1, True)]
    columns = [[files[f][r][0] for f, r, _ in refs], [files[f][r][1] for f, r, _ in refs], ["public"] * len(refs),
               ["kv"] * len(refs), ["insert"] * len(refs), [None] * len(refs),
               [str(tmp_path / f"{f}.arrow") for f, _, _ in refs], [r for _, r, _ in refs]]
    batch = pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, SPOOL_REFERENCE_SCHEMA)],
                                       schema=SPOOL_REFERENCE_SCHEMA)
    batch = batch.append_column("_select_0", pa.array([taken for _, _, taken in refs]))
    out = materialize(batch)
    assert out.schema.names == [*CHANGE_ARROW_SCHEMA.names, "_select_0"]
    got = [(r["commit_lsn"], r["commit_idx"], r["record"]) for r in out.to_pylist()]
    assert got == [(files[f][r][0], files[f][r][1], files[f][r][7]) for f, r, taken in refs if taken]
