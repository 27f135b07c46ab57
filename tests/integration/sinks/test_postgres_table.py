"""The postgres_table sink against real Postgres: the test cluster's database is the source, a second
database of the same cluster the target (a separate cluster only where password authentication is
needed). The stream tests compare the whole target with the source, row for row, in text form.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres, free_port
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.config import ConfigError, load_config, parse_config
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.provisioning import initialize
from sequin_provider.sinks.postgres_table import PostgresTableSink
from tests.support.backfills import backfill
from tests.support.config import write_config
from tests.support.key_workload import KeyWorkload
from tests.support.postgres import execute
from tests.support.stream_app import cli
from tests.support.tcp_proxy import TcpProxy
from tests.support.type_matrix import INSERT as MATRIX_INSERT
from tests.support.type_matrix import SETUP as MATRIX_SETUP

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: mirror
    tables: [{tables}]
    destination: {{type: postgres_table, dsn: "{target}", table: "mirror.{{table_name}}", create_table: {create},
                   batch_size: {batch_size}, timeout: 5s}}
stream:
  checkpoint_location: {ckpt}
"""


def write(
    tmp_path: Path, dsn: str, db: str, target: str, tables: str, create: bool = True, batch_size: int = 50
) -> Path:
    return write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(
            dsn=dsn,
            db=db,
            target=target,
            tables=tables,
            create="true" if create else "false",
            batch_size=batch_size,
            ckpt=tmp_path / "ckpt",
        ),
    )


@pytest.fixture
def target(pg: EmbeddedPostgres, dbname: str) -> str:
    """A second, empty database of the test cluster: the mirror."""
    return pg.create_database(f"{dbname[:40]}_mirror")


def rows(dsn: str, table: str, columns: str = "*", key: str = "1") -> list[str]:
    """The table's rows as text (``columns`` of it), ordered by ``key``."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET TimeZone = 'UTC'")
        return [r[0] for r in conn.execute(f"SELECT t::text FROM (SELECT {columns} FROM {table} ORDER BY {key}) t")]


def source_columns(dsn: str, table: str) -> str:
    with psycopg.connect(dsn) as conn:
        names = conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped"
            " ORDER BY attnum",
            (table,),
        ).fetchall()
    return ", ".join(f'"{n}"' for (n,) in names)


def assert_mirrored(source: str, target: str, tables: dict[str, str]) -> None:
    """Every table (``{name: key order}``) of the target holds exactly the source's rows."""
    for table, key in tables.items():
        columns = source_columns(source, table)
        assert rows(target, f"mirror.{table}", columns, key) == rows(source, table, columns, key), table


def wait_mirrored(source: str, target: str, tables: dict[str, str], timeout: float = 180) -> None:
    def same() -> bool:
        try:
            assert_mirrored(source, target, tables)
        except (AssertionError, psycopg.Error):
            return False
        return True

    wait_for(same, timeout, 0.5, what="the mirror to equal the source")


# --- options ---------------------------------------------------------------------------------------


def config_of(destination: dict[str, Any], environ: dict[str, str] | None = None) -> Any:
    data = {
        "databases": [{"name": "app", "dsn": "postgresql://127.0.0.1/app"}],
        "sinks": [{"name": "mirror", "tables": ["t"], "destination": {"type": "postgres_table", **destination}}],
    }
    return parse_config(data, "sequin.yaml", environ=environ or {})


@pytest.mark.parametrize(
    ("destination", "path", "reason"),
    [
        ({"dsn": "postgresql://h/db"}, "sinks[0].destination.table", "is required"),
        ({"table": "m.{table_name}"}, "sinks[0].destination.dsn", "is required"),
        ({"dsn": "x", "conn_id": "y", "table": "t"}, "sinks[0].destination", "either dsn or conn_id"),
        ({"conn_id": "nope", "table": "t"}, "sinks[0].destination.conn_id", "not found"),
        ({"dsn": "x", "table": "m.{nope}"}, "sinks[0].destination.table", "unknown placeholder"),
        ({"dsn": "x", "table": "t", "columns": ["a"]}, "sinks[0].destination.columns", "expected a mapping"),
        ({"dsn": "x", "table": "t", "columns": {"a": "b", "c": "b"}}, "sinks[0].destination.columns", "same target"),
        ({"dsn": "x", "table": "t", "columns": {"a": "_sequin_lsn"}}, "sinks[0].destination.columns", "own columns"),
        ({"dsn": "x", "table": "t", "create_table": "yes"}, "sinks[0].destination.create_table", "true or false"),
        ({"dsn": "x", "table": "t", "batch_size": 0}, "sinks[0].destination.batch_size", "between 1 and 10000"),
        ({"dsn": "x", "table": "t", "bogus": 1}, "sinks[0].destination.bogus", "unknown key"),
    ],
)
def test_bad_options_name_the_key(destination: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_of(destination)
    assert caught.value.path == path and reason in caught.value.reason, str(caught.value)


def test_options_and_a_conn_id_resolved_like_the_databases() -> None:
    config = config_of(
        {"conn_id": "mirror_db", "table": "mirror.{table_name}", "columns": {"v": "value"}, "create_table": True},
        environ={"AIRFLOW_CONN_MIRROR_DB": "postgresql://u:p@db.example:5433/mirror"},
    )
    options = config.sink("mirror").destination.options
    assert options.dsn == "postgresql://u:p@db.example:5433/mirror" and options.conn_id == "mirror_db"
    assert options.columns == {"v": "value"} and options.create_table and options.batch_size == 500
    assert config.connections()["mirror_db"] == options.dsn  # handed to the Spark apps with the others


# --- the writer, request by request ---------------------------------------------------------------


def change(action: str, lsn: int, idx: int, record: dict[str, Any], **metadata: Any) -> str:
    meta = {"table_schema": "public", "table_name": "kv", "commit_lsn": lsn, "commit_idx": idx, **metadata}
    return json.dumps({"record": record, "changes": None, "action": action, "metadata": meta})


@pytest.fixture
def writer(target: str) -> Iterator[PostgresTableSink]:
    """A writer of a sink renaming ``v`` to ``value``, its target ``mirror.kv`` with the position columns
    (its schema's side tables are created by the writer: a route may name targets init never saw)."""
    execute(
        target,
        "CREATE SCHEMA mirror",
        "CREATE TABLE mirror.kv (id int PRIMARY KEY, value text, big text,"
        " _sequin_lsn bigint NOT NULL DEFAULT 0, _sequin_idx int NOT NULL DEFAULT 0)",
    )
    sink = config_of({"dsn": target, "table": "mirror.{table_name}", "columns": {"v": "value"}}).sink("mirror")
    pusher = sink.destination.kind.pusher(sink)
    yield pusher
    pusher.close()


def kv(target: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(target) as conn:
        return conn.execute("SELECT id, value, big FROM mirror.kv ORDER BY id").fetchall()


def test_changes_apply_in_order_and_replays_change_nothing(target: str, writer: PostgresTableSink) -> None:
    batch = [
        change("insert", 10, 0, {"id": 1, "v": "a", "big": "B"}),
        change("insert", 10, 1, {"id": 2, "v": "b", "big": "B"}),
        change("update", 11, 0, {"id": 1, "v": "a2", "big": "B"}),
        change("update", 12, 0, {"id": 1, "v": "a3"}, unchanged_toast_columns=["big"]),  # partial: keeps big
        change("delete", 12, 1, {"id": 2}),
        change("insert", 13, 0, {"id": 3, "v": "c", "big": None}),
    ]
    writer.send(batch, [])
    assert kv(target) == [(1, "a3", "B"), (3, "c", None)]
    writer.send(batch, [])  # the same request again (a replay)
    assert kv(target) == [(1, "a3", "B"), (3, "c", None)]
    for message in batch:  # and each message alone, in order, as the buffer's retry sends them
        writer.send([message], [])
    assert kv(target) == [(1, "a3", "B"), (3, "c", None)]
    # older after newer: an older update, the older insert of the deleted row, an older backfill read
    writer.send([change("update", 11, 0, {"id": 1, "v": "old", "big": "old"})], [])
    writer.send([change("insert", 10, 1, {"id": 2, "v": "b", "big": "B"})], [])  # the tombstone keeps it deleted
    writer.send([change("read", 12, 5, {"id": 3, "v": "stale", "big": None})], [])
    assert kv(target) == [(1, "a3", "B"), (3, "c", None)]
    # a newer read lands; a newer insert of the deleted row brings it back
    writer.send(
        [
            change("read", 20, 0, {"id": 3, "v": "read", "big": "x"}),
            change("insert", 20, 1, {"id": 2, "v": "b2", "big": None}),
        ],
        [],
    )
    assert kv(target) == [(1, "a3", "B"), (2, "b2", None), (3, "read", "x")]
    with psycopg.connect(target) as conn:  # the row is back: its tombstone is gone
        assert conn.execute("SELECT count(*) FROM mirror._sequin_tombstones").fetchone() == (0,)

    # a truncate at its position: what is older goes, and stays gone; a row applied after it stays
    writer.send([change("update", 31, 0, {"id": 3, "v": "after", "big": None})], [])  # newer than the truncate
    writer.send([change("truncate", 30, 0, {})], [])
    assert kv(target) == [(3, "after", None)]
    writer.send([change("insert", 25, 0, {"id": 7, "v": "before", "big": None})], [])  # older than the truncate
    writer.send([change("truncate", 30, 0, {})], [])  # replayed
    assert kv(target) == [(3, "after", None)]
    writer.send([change("insert", 32, 0, {"id": 7, "v": "new", "big": None}), change("truncate", 33, 0, {})], [])
    assert kv(target) == []  # nothing newer: a real TRUNCATE


def test_what_cannot_be_applied_raises_delivery_error_and_the_batch_is_all_or_nothing(
    target: str, writer: PostgresTableSink
) -> None:
    ok = change("insert", 10, 0, {"id": 1, "v": "a", "big": None})
    cases = [
        (change("insert", 10, 1, {"id": 2, "nope": 1}), "no column 'nope'"),
        (change("insert", 10, 1, {"id": "x"}), "invalid input syntax"),
        (change("insert", 10, 1, {"v": "no key"}), "no key column 'id'"),
        (json.dumps({"id": 1}), "not a change message"),
        (change("insert", 10, 1, {"id": 2}, table_name="missing"), "mirror.missing does not exist"),
    ]
    for bad, reason in cases:
        with pytest.raises(DeliveryError, match=reason):
            writer.send([ok, bad], [])
        assert kv(target) == []  # the good change rolled back with the bad one
    writer.send([ok], [])  # the writer's connection is still usable
    assert kv(target) == [(1, "a", None)]


def test_a_connection_the_server_closed_while_idle_is_replaced_without_failing_a_request(
    target: str, writer: PostgresTableSink
) -> None:
    """The server ends the writer's idle connection (``pg_terminate_backend``, as a restart or an
    ``idle_session_timeout`` would): the next request opens another one instead of failing (and
    being parked) on the dead one."""
    writer.send([change("insert", 10, 0, {"id": 1, "v": "a", "big": None})], [])
    others = (
        "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend'"
    )
    with psycopg.connect(target, autocommit=True) as conn:
        ended = conn.execute(f"SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) {others}").fetchone()
        assert ended == (1,)  # the writer's one idle connection
        # its backend gone: its FATAL sent and its socket closed
        wait_for(lambda: conn.execute(f"SELECT count(*) {others}").fetchone() == (0,), 30, what="the backend's exit")
    writer.send([change("insert", 11, 0, {"id": 2, "v": "b", "big": None})], [])
    assert kv(target) == [(1, "a", None), (2, "b", None)]


# --- sequin init: prepare ------------------------------------------------------------------------


def test_prepare_refuses_an_unusable_target_naming_the_sink(dsn: str, dbname: str, target: str, tmp_path: Path) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text)")

    def init(target_dsn: str, create: bool = False) -> Any:
        return initialize(load_config(write(tmp_path, dsn, dbname, target_dsn, "kv", create=create)))

    with pytest.raises(DestinationError, match=r"sink 'mirror': .*cannot connect") as caught:
        init(f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    assert caught.value.sink == "mirror"
    with pytest.raises(
        DestinationError, match=r"sink 'mirror': target table mirror.kv does not exist \(create_table is off\)"
    ):
        init(target)
    execute(target, "CREATE SCHEMA mirror", "CREATE TABLE mirror.kv (id int PRIMARY KEY)")
    with pytest.raises(DestinationError, match=r"sink 'mirror': target table mirror.kv has no column v"):
        init(target)
    execute(target, "DROP TABLE mirror.kv", "CREATE TABLE mirror.kv (id int, v text)")
    with pytest.raises(DestinationError, match=r"sink 'mirror': target table mirror.kv has no primary key"):
        init(target)
    execute(target, "DROP TABLE mirror.kv")
    report = init(target, create=True)
    assert "table mirror.kv (from public.kv)" in report.created
    config = load_config(tmp_path / "sequin.yaml")
    assert config.sink("mirror").destination.kind.health(config.sink("mirror")) == "ok"
    assert init(target, create=True).created == []  # the second time: nothing to do


def test_prepare_refuses_a_wrong_password(dsn: str, dbname: str, tmp_path: Path) -> None:
    """A cluster of its own: the test cluster trusts every local connection."""
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text)")
    folder = Path(tempfile.mkdtemp(prefix="sequin-hba-"))  # readable by the server's unprivileged user
    folder.chmod(0o755)
    hba = folder / "pg_hba.conf"
    hba.write_text("host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
    hba.chmod(0o644)
    cluster = EmbeddedPostgres(use_env_dsn=False, settings={"hba_file": str(hba)})
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs a second Postgres cluster: {exc}")
    try:
        execute(cluster.dsn(), "CREATE ROLE mirror LOGIN PASSWORD 'right'")
        wrong = f"postgresql://mirror:wrong@127.0.0.1:{cluster.port}/postgres"
        with pytest.raises(DestinationError, match=r"sink 'mirror': .*password authentication failed"):
            initialize(load_config(write(tmp_path, dsn, dbname, wrong, "kv", create=True)))
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


# --- through the stream app ------------------------------------------------------------------------

STREAM_TABLES = {"kv_a": "id", "kv_b": "id", "lines": "order_id, line", "matrix": "id"}


def stream_setup(dsn: str, target: str, seeded: int) -> None:
    """The source's tables (``kv_a`` with ``seeded`` rows only a backfill delivers) and the target's types."""
    execute(
        dsn,
        "CREATE TABLE kv_a (id int PRIMARY KEY, v int)",
        "CREATE TABLE kv_b (id int PRIMARY KEY, v int)",
        "CREATE TABLE lines (order_id int, line int, qty int, note text, PRIMARY KEY (order_id, line))",
        *MATRIX_SETUP,
        f"INSERT INTO kv_a SELECT g, 0 FROM generate_series(0, {seeded - 1}) g",
    )
    execute(target, *MATRIX_SETUP[:3])  # the enum and domains the matrix's columns are of


def lines_and_matrix(dsn: str) -> None:
    """Changes of the composite-key table and the type matrix (every kind of value, then updated)."""
    execute(
        dsn,
        "INSERT INTO lines SELECT o, l, o * l, repeat('x', 3000 * (o % 2)) FROM generate_series(1, 20) o,"
        " generate_series(1, 3) l",
        "UPDATE lines SET qty = qty + 1 WHERE line = 2",  # unchanged TOAST: note is left out of the record
        "DELETE FROM lines WHERE order_id % 5 = 0",
        MATRIX_INSERT,
        MATRIX_INSERT.replace("VALUES (1,", "VALUES (2,"),
        "UPDATE matrix SET c0 = 1 WHERE id = 2",
    )


def test_three_tables_a_racing_backfill_truncates_and_a_sigkill_leave_the_mirror_equal_to_the_source(
    dsn: str, dbname: str, target: str, tmp_path: Path, stream_app: Any
) -> None:
    seeded = 300
    stream_setup(dsn, target, seeded)
    config = write(tmp_path, dsn, dbname, target, ", ".join(STREAM_TABLES), create=True)
    report = initialize(load_config(config))
    assert {f"table mirror.{t} (from public.{t})" for t in STREAM_TABLES} <= set(report.created)
    app = stream_app(config)
    app.wait_streaming(dsn)
    a = KeyWorkload(dsn, keys=400, seed=11, state=dict.fromkeys(range(seeded), 0), table="kv_a").start()
    b = KeyWorkload(dsn, keys=100, seed=12, table="kv_b").start()
    try:
        lines_and_matrix(dsn)
        created = backfill(dsn, config, "mirror", "public.kv_a")
        backfill_run: dict[str, Any] = {}
        runner = threading.Thread(
            target=lambda: backfill_run.update(done=cli(config, "backfill", "run", str(created.id))), daemon=True
        )
        runner.start()  # the backfill races the writes
        time.sleep(4)
        execute(dsn, "TRUNCATE kv_b")
        time.sleep(2)
        app.kill()  # mid-run: batches in flight are delivered again by the restarted app
        time.sleep(2)
        execute(dsn, "TRUNCATE kv_b", "UPDATE lines SET qty = 0 WHERE order_id = 1")
        app = stream_app(config)
        app.wait_streaming(dsn)
        time.sleep(4)
        runner.join(600)
        assert backfill_run["done"].returncode == 0, backfill_run["done"].stdout + backfill_run["done"].stderr
    finally:
        a.stop()
        b.stop()
    assert a.committed > 100 and b.committed > 100
    wait_mirrored(dsn, target, STREAM_TABLES)
    with psycopg.connect(dsn) as conn:
        assert store.list_buffered(conn, "sequin", "mirror") == []


def test_the_target_down_then_back_parks_and_the_retry_mirrors_the_source(
    dsn: str, dbname: str, target: str, tmp_path: Path, stream_app: Any
) -> None:
    stream_setup(dsn, target, 0)
    port = int(psycopg.conninfo.conninfo_to_dict(target).get("port") or 5432)
    with TcpProxy(port) as proxy:
        through = psycopg.conninfo.make_conninfo(target, host="127.0.0.1", port=proxy.port)
        config = write(tmp_path, dsn, dbname, through, "kv_a, kv_b", create=True)
        initialize(load_config(config))
        app = stream_app(config)
        app.wait_streaming(dsn)
        rng = random.Random(5)

        def some_writes(n: int) -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for _ in range(n):
                    table, key = rng.choice(("kv_a", "kv_b")), rng.randrange(50)
                    if rng.random() < 0.2:
                        conn.execute(f"DELETE FROM {table} WHERE id = %s", (key,))
                    else:
                        conn.execute(
                            f"INSERT INTO {table} VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v",
                            (key, rng.randrange(1000)),
                        )

        some_writes(200)
        wait_mirrored(dsn, target, {"kv_a": "id", "kv_b": "id"})
        proxy.down()
        some_writes(200)
        execute(dsn, "TRUNCATE kv_b")
        some_writes(100)

        def parked() -> list[Any]:
            with psycopg.connect(dsn) as conn:
                return store.list_buffered(conn, "sequin", "mirror")

        held = wait_for(parked, 120, what="changes parked while the target is down")
        assert any("postgres_table mirror" in (m.last_error or "") for m in held)
        proxy.up()
        some_writes(100)  # their groups wait behind the parked ones

        def retried() -> bool:
            done = cli(config, "buffer", "retry", "--sink", "mirror")
            return "still parked 0" in done.stdout

        wait_for(retried, 240, 1.0, what="the retry delivering every parked change")
        wait_mirrored(dsn, target, {"kv_a": "id", "kv_b": "id"})
