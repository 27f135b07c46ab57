"""Store migrations and stream writes against real Postgres."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from sequin_provider import store
from sequin_provider.exceptions import StoreError
from sequin_provider.sinks import kind
from sequin_provider.sinks.sequin_stream import SequinStreamSink


def rows(sink: str, positions: list[tuple[int, int]]) -> list[store.StreamRow]:
    return [(sink, lsn, idx, f"g{idx % 3}", f"{lsn}:{idx}", f'{{"n": {idx}}}') for lsn, idx in positions]


def test_migrations_are_versioned_and_idempotent(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        assert store.schema_version(conn, "custom") == 0
        assert store.migrate(conn, "custom") == [m[0] for m in store.MIGRATIONS]
        assert store.migrate(conn, "custom") == []
        assert store.schema_version(conn, "custom") == store.SCHEMA_VERSION


def test_a_store_migrated_by_a_newer_install_is_refused_with_a_clear_error(dsn: str) -> None:
    """An older install must not use a store a newer one migrated (it would misread what the newer
    one writes, e.g. compact backfill reads): ``migrate``, which every app runs first, says so."""
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "newer")
        conn.execute(
            "INSERT INTO newer.schema_migrations (version, name) VALUES (%s, 'from the future')",
            (store.SCHEMA_VERSION + 1,),
        )
        conn.commit()
        with pytest.raises(StoreError, match=rf"version {store.SCHEMA_VERSION + 1}, newer than this install"):
            store.migrate(conn, "newer")


def test_wide_messages_are_stored_lz4_compressed_and_read_back_whole(dsn: str) -> None:
    """Migration 19: on PostgreSQL 14+ a message's data over the TOAST threshold is compressed with
    lz4 (half pglz's cost for the store's backend; docs/performance.md), and reads back byte for byte."""
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "wide")
        if conn.info.server_version < 140000:
            pytest.skip("column compression methods came with PostgreSQL 14")
        (methods_built,) = conn.execute(
            "SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'"
        ).fetchone()
        if "lz4" not in methods_built:  # e.g. the embedded builds of SEQUIN_PG_VERSION: pglz, as before
            assert store.insert_stream_messages(conn, "wide", [("s", 1, 0, "g", "1:0", "{}")]) == 1
            pytest.skip("this server was built without lz4")
        methods = dict(
            conn.execute(
                "SELECT c.relname || '.' || a.attname, a.attcompression FROM pg_attribute a"
                " JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = 'wide' AND a.attcompression <> ''"
            ).fetchall()
        )
        assert methods == {
            "stream_messages.data": "l",
            "buffered_messages.data": "l",
            "buffered_messages.source": "l",
            "backfill_rows.record": "l",
        }
        record = ", ".join(f'"c{i}": "{i * 7919 % 10007:05d} value of column {i}"' for i in range(120))
        wide = [("s", 100, 0, "g", "100:0", f'{{"record": {{{record}}}}}')]
        assert store.insert_stream_messages(conn, "wide", wide) == 1
        assert len(wide[0][5]) > 4000
        stored = conn.execute("SELECT pg_column_compression(data) FROM wide.stream_messages").fetchone()
        assert stored == ("lz4",)
        assert [m.data for m in store.stream_messages(conn, "wide", "s")] == [wide[0][5]]


def test_replayed_batches_add_nothing_and_keep_position_order(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn)
        first = rows("s", [(100, 0), (100, 1), (200, 0)])
        assert store.insert_stream_messages(conn, "sequin", first) == 3
        # a replay of the same batch plus new rows, in a different order: only the new rows land
        replay = rows("s", [(300, 0), (200, 0), (100, 1), (250, 0), (100, 0)])
        assert store.insert_stream_messages(conn, "sequin", replay) == 2
        assert store.insert_stream_messages(conn, "sequin", rows("other", [(100, 0)])) == 1
        got = store.stream_messages(conn, "sequin", "s")
        assert [(m.commit_lsn, m.commit_idx) for m in got] == [(100, 0), (100, 1), (200, 0), (250, 0), (300, 0)]
        assert [m.data for m in got][:2] == ['{"n": 0}', '{"n": 1}']
        assert [kind("sequin_stream").counts(conn, "sequin", s)["total"] for s in ("s", "other")] == [5, 1]


def test_status_row_upserts_and_counts(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn)
        store.update_status(conn, "sequin", "app", add_rows=10, slot="s", last_batch_id=1)
        store.update_status(conn, "sequin", "app", add_rows=5, last_batch_id=2)
        (row,) = store.read_status(conn, "sequin")
        assert (row["slot"], row["last_batch_id"], row["total_rows"]) == ("s", 2, 15)


def test_streamed_chunks_and_replays_of_them(dsn: str) -> None:
    chunks = [store.copy_line(r) + "\n" for r in rows("s", [(1, 0), (1, 1), (2, 0)])]
    with psycopg.connect(dsn) as conn:
        store.migrate(conn)
        assert store.insert_stream_copy(conn, "sequin", iter(chunks[:2])) == 2
        taken: list[store.CopyChunk] = []
        # a replay overlapping what is stored, from a generator: the fallback must see every chunk once
        assert store.insert_stream_copy(conn, "sequin", (c for c in chunks), taken) == 1
        assert taken == chunks
        assert [(m.commit_lsn, m.commit_idx) for m in store.stream_messages(conn, "sequin", "s")] == [
            (1, 0),
            (1, 1),
            (2, 0),
        ]


def test_visibility_watermark_is_per_sink_and_never_moves_back(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn)
        assert store.visible_lsn(conn, "sequin", "a") is None
        store.advance_visible_lsn(conn, "sequin", ["a", "b"], 200)
        store.advance_visible_lsn(conn, "sequin", ["a"], 100)  # an older batch finishing late changes nothing
        store.advance_visible_lsn(conn, "sequin", ["b"], 300)
        assert (store.visible_lsn(conn, "sequin", "a"), store.visible_lsn(conn, "sequin", "b")) == (200, 300)


def test_data_path_commits_are_durable_whatever_the_server_default(dsn: str) -> None:
    """The slot moves past what the store committed: a commit a store crash could still lose
    (synchronous_commit = off) would lose messages, so the data path's sessions insist on on."""
    lossy = make_conninfo(dsn, options="-c synchronous_commit=off")
    with psycopg.connect(lossy) as plain:
        assert plain.execute("SHOW synchronous_commit").fetchone() == ("off",)
    with store.connect_durable(lossy) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    sink = SequinStreamSink(lossy, "sequin")
    try:
        assert sink.retrying(lambda conn: conn.execute("SHOW synchronous_commit").fetchone()) == ("on",)
    finally:
        sink.close()
