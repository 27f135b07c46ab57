"""The version matrix: the product on PostgreSQL 12, 13, 14, 16, 17 and 18, each from its own binaries.

The rest of the suite runs on the default server (the system's, 15 on CI). Here every major gets one
cluster (binaries fetched once into ``var/postgres`` by ``postgres_binaries``), one ``sequin init``,
one stream app, and the smoke the issue asks for, in order: init, the type matrix through the stream,
three tables and a SIGKILL with nothing lost, heartbeats keeping an idle slot bounded, and a backfill
racing writes (14+) or refused with its reason (12/13). Two versions keep their store on another
major's cluster (source 12 with the store on 17, and the reverse). Test ids name the version
(``[pg12]``); ``SEQUIN_PG_MATRIX=13,17`` narrows the matrix.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.backfill import create_backfill
from sequin_provider.cli import main as cli_main
from sequin_provider.config import load_config
from sequin_provider.replication import slot_info
from tests.support import type_matrix
from tests.support.config import write_config
from tests.support.key_workload import KeyWorkload, check_against_workload, replay
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

VERSIONS = [v.strip() for v in os.environ.get("SEQUIN_PG_MATRIX", "12,13,14,16,17,18").split(",") if v.strip()]
STORE_ON = {"12": "17", "17": "12"}  # source major -> the major of the cluster holding its store
BUSY_ROWS = 20_000

SCHEMA = [
    "CREATE TABLE kv (id int PRIMARY KEY, v int)",
    "CREATE TABLE accounts (id int PRIMARY KEY, name text NOT NULL, balance numeric(20,2))",
    "CREATE TABLE orders (id bigint PRIMARY KEY, account_id int NOT NULL, status text, tags text[])",
    "ALTER TABLE orders REPLICA IDENTITY FULL",
    "CREATE TABLE busy (id int PRIMARY KEY, v int)",
    f"INSERT INTO busy SELECT g, 0 FROM generate_series(1, {BUSY_ROWS}) g",
    *type_matrix.SETUP,
]

CONFIG = """
databases:
  - name: shop
    dsn: {dsn}
    slot: {{name: slot_matrix}}
    publication: {{name: pub_matrix}}
    heartbeat_interval: 1s
{store}sinks:
  - {{name: kv, tables: [kv], destination: {{type: sequin_stream}}}}
  - {{name: accounts, tables: [accounts], destination: {{type: sequin_stream}}}}
  - {{name: orders, tables: [orders], destination: {{type: sequin_stream}}}}
  - {{name: busy, tables: [busy], destination: {{type: sequin_stream}}}}
  - {{name: matrix, tables: [matrix], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {checkpoint}
  max_batch_wait: 100ms
"""


@dataclass
class Deployment:
    """One major's source database, its store (maybe on another major's cluster) and stream app."""

    major: int
    source: EmbeddedPostgres
    dsn: str
    store_dsn: str
    config: Path
    tmp: Path
    apps: list[StreamApp] = field(default_factory=list)

    def start_app(self) -> StreamApp:
        """Start (or restart) the stream app and wait for its first micro-batch."""
        app = StreamApp(self.config, self.tmp / f"app-{len(self.apps)}.log").start()
        self.apps.append(app)
        app.wait_streaming(self.store_dsn)
        return app

    def messages(self, sink: str) -> list[dict[str, Any]]:
        """The sink's visible messages in position order."""
        return sink_messages(self.store_dsn, sink)


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"pg{v}")
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A cluster of the parametrized major (fetched on first use), its schema and a config; the store on
    ``STORE_ON``'s major where one is named."""
    version: str = request.param
    with ExitStack() as stack:
        source = stack.enter_context(EmbeddedPostgres(version=version, use_env_dsn=False))
        dsn = source.create_database("shop")
        store_dsn, store_yaml = dsn, ""
        if version in STORE_ON:
            elsewhere = stack.enter_context(EmbeddedPostgres(version=STORE_ON[version], use_env_dsn=False))
            store_dsn = elsewhere.create_database("sequin_store")
            store_yaml = f"store: {{dsn: '{store_dsn}'}}\n"
        execute(dsn, *SCHEMA)
        tmp = tmp_path_factory.mktemp(f"pg{version}")
        config = write_config(tmp / "sequin.yaml", CONFIG.format(dsn=dsn, store=store_yaml, checkpoint=tmp / "ckpt"))
        deployed = Deployment(source.major, source, dsn, store_dsn, config, tmp)
        assert deployed.major == int(version)
        try:
            yield deployed
        finally:
            for app in deployed.apps:
                app.stop()


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """The backfill app's Spark (local mode), shared by every version."""
    from sequin_provider.spark.app import spark_session

    session = spark_session("sequin-version-matrix", "local[2]")
    yield session
    session.stop()


def server_version(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.info.server_version


def test_init_creates_what_the_version_needs(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    d = deployment
    assert server_version(d.dsn) // 10000 == d.major
    assert cli_main(["--config", str(d.config), "init"]) == 0
    assert "replication slot" in capsys.readouterr().out
    with psycopg.connect(d.dsn) as conn:
        published = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_publication_tables WHERE pubname = 'pub_matrix'").fetchall()
        }
        heartbeat_table = conn.execute("SELECT to_regclass('public.sequin_heartbeat') IS NOT NULL").fetchone()[0]
        info = slot_info(conn, "slot_matrix")
        failover = (
            conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = 'slot_matrix'").fetchone()[0]
            if d.major >= 17
            else None
        )
    assert info is not None and info.plugin == "pgoutput"
    tables = {"kv", "accounts", "orders", "busy", "matrix"}
    if d.major < 14:  # no logical messages in pgoutput: heartbeats are upserts into a published table
        assert heartbeat_table and published == tables | {"sequin_heartbeat"}
    else:
        assert not heartbeat_table and published == tables
    assert failover in (None, False)  # 17+: a plain slot; docs/postgres-versions.md says what failover needs
    with psycopg.connect(d.store_dsn) as conn:
        assert store.schema_version(conn) == store.SCHEMA_VERSION
    d.start_app()


def test_the_type_matrix_arrives_exactly(deployment: Deployment) -> None:
    execute(deployment.dsn, type_matrix.INSERT)
    got = wait_for(lambda: deployment.messages("matrix"), 120, what="the type matrix row")
    assert len(got) == 1 and got[0]["action"] == "insert"
    type_matrix.assert_record(got[0]["record"])


def test_three_tables_survive_a_sigkill_with_nothing_lost(deployment: Deployment) -> None:
    d = deployment
    with psycopg.connect(d.dsn) as conn:  # one transaction over two tables, then one more change each
        conn.execute("INSERT INTO accounts VALUES (1, 'ada', 10.50), (2, 'bob', 0)")
        conn.execute("INSERT INTO orders VALUES (10, 1, 'new', ARRAY['a', NULL])")
        conn.commit()
        conn.execute("UPDATE orders SET status = 'paid' WHERE id = 10")
        conn.execute("DELETE FROM accounts WHERE id = 2")
        conn.commit()
    workload = KeyWorkload(d.dsn, seed=d.major).start()
    wait_for(lambda: len(d.messages("kv")) > 100, 120, what="kv progress before the kill")
    d.apps[-1].kill()
    time.sleep(random.Random(d.major).uniform(0.5, 2.0))
    d.start_app()
    time.sleep(1.0)
    workload.stop()
    wait_for(lambda: len(d.messages("kv")) >= workload.committed, 180, what="every committed kv change")
    time.sleep(2)  # a duplicate would show up now
    check_against_workload(d.messages("kv"), workload)
    assert [(m["action"], m["record"]) for m in d.messages("accounts")] == [
        ("insert", {"id": 1, "name": "ada", "balance": 10.5}),
        ("insert", {"id": 2, "name": "bob", "balance": 0}),
        ("delete", {"id": 2}),
    ]
    orders = d.messages("orders")
    assert [(m["action"], m["record"]["status"], m["changes"]) for m in orders] == [
        ("insert", "new", None),
        ("update", "paid", {"status": "new"}),
    ]
    assert orders[0]["record"]["tags"] == ["a", None]


def test_heartbeats_keep_an_idle_slot_bounded(deployment: Deployment) -> None:
    d = deployment
    execute(d.dsn, "SELECT pg_create_logical_replication_slot('idle_control', 'pgoutput')")
    busy = d.source.create_database("elsewhere")
    execute(busy, "CREATE TABLE filler (id serial PRIMARY KEY, pad text)")
    for _ in range(4):  # ~50 MB of WAL in another database; the watched one stays idle
        execute(busy, "INSERT INTO filler (pad) SELECT repeat(md5(g::text), 8) FROM generate_series(1, 30000) g")
    execute(busy, "CHECKPOINT")

    def retained(slot: str) -> int:
        with psycopg.connect(d.dsn) as conn:
            info = slot_info(conn, slot)
        assert info is not None and info.retained_bytes is not None
        return info.retained_bytes

    def released() -> bool:
        # a slot's restart point moves up to what its consumer confirmed when the server logs the running
        # transactions: the background writer does every 15 s, a checkpoint does at once
        execute(d.dsn, "CHECKPOINT")
        return retained("slot_matrix") < 16 * 1024 * 1024

    before = len(d.messages("kv"))
    assert retained("idle_control") > 32 * 1024 * 1024
    wait_for(released, 90, interval=1.0, what="the heartbeat to let the idle slot release WAL")
    assert retained("idle_control") > 32 * 1024 * 1024  # the checkpoints release nothing by themselves
    assert len(d.messages("kv")) == before  # heartbeats are not messages
    execute(d.dsn, "SELECT pg_drop_replication_slot('idle_control')")


def test_a_backfill_races_writes_or_is_refused_with_the_reason(
    deployment: Deployment, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    d = deployment
    if d.major < 14:  # watermarks are logical messages, which pgoutput streams from 14 on
        assert cli_main(["--config", str(d.config), "backfill", "start", "busy", "busy", "--no-run"]) != 0
        assert (
            f"backfills need PostgreSQL 14 or later (logical messages in pgoutput); the source is {d.major}"
            in capsys.readouterr().err
        )
        with psycopg.connect(d.store_dsn) as conn:
            assert store.list_backfills(conn, "sequin") == []
        return
    from sequin_provider.spark.backfill_app import run_backfill

    spark = request.getfixturevalue("spark")  # Spark starts only if a version needs it
    config = load_config(d.config)
    with psycopg.connect(d.dsn, autocommit=True) as source, psycopg.connect(d.store_dsn) as conn:
        created = create_backfill(source, conn, config, "busy", "busy", max_query_ms=50)
    workload = KeyWorkload(
        d.dsn, keys=BUSY_ROWS + 1, seed=d.major, state={k: 0 for k in range(1, BUSY_ROWS + 1)}, table="busy"
    )
    workload.start()
    try:
        final = run_backfill(spark, str(d.config), created.id)
    finally:
        workload.stop()
    assert final.state == "completed", final.error
    assert workload.committed > 100  # the race really happened
    execute(d.dsn, "INSERT INTO busy VALUES (-1, -1)")  # not a workload key: in the sink = the stream caught up
    wait_for(lambda: any(m["record"]["id"] == -1 for m in d.messages("busy")[-50:]), 180, what="the final change")
    messages = d.messages("busy")
    rows, stale = replay(messages)
    assert stale == []
    with psycopg.connect(d.dsn) as conn:
        assert rows == {r[0]: {"id": r[0], "v": r[1]} for r in conn.execute("SELECT id, v FROM busy")}
    reads = [m["record"]["id"] for m in messages if m["action"] == "read"]
    assert len(reads) == len(set(reads)) == final.rows_emitted > 0
