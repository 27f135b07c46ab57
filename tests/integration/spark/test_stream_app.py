"""The replication stream app end to end: real Postgres, real Spark (local mode), the store as sink.

One app serves the workloads of this module's first tests and, idle, the heartbeat test (Spark
starts once for them); another, with its store in a database of its own and a stand-in supervisor,
serves the store-outage test and then the supervisor test, which ends it; the tests that kill the
app or need it to fail start their own.
"""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.config import load_config
from sequin_provider.pgoutput import lsn_to_int
from sequin_provider.replication import slot_info
from sequin_provider.spark.class_archive import archive_path
from sequin_provider.spark.pipeline import payload_mode
from tests.support.config import write_config
from tests.support.key_workload import KeyWorkload, check_against_workload
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp, spark_jvm, spark_jvm_arguments

SCHEMA = [
    "CREATE TABLE accounts (id int PRIMARY KEY, name text NOT NULL, balance numeric(20,2))",
    "CREATE TABLE orders (id bigint PRIMARY KEY, account_id int NOT NULL, status text, total numeric, tags text[],"
    " placed_at timestamptz)",
    "ALTER TABLE orders REPLICA IDENTITY FULL",
    "CREATE TABLE items (order_id bigint, line int, sku text, qty int, PRIMARY KEY (order_id, line))",
    "CREATE TABLE evolving (id int PRIMARY KEY)",
    "CREATE TABLE bulk (id int PRIMARY KEY, payload text)",
    "CREATE TABLE docs_default (id int PRIMARY KEY, body text, n int)",
    "CREATE TABLE docs_full (id int PRIMARY KEY, body text, n int)",
    "ALTER TABLE docs_full REPLICA IDENTITY FULL",
]

CONFIG = """
databases:
  - name: shop
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: everything
    tables: [accounts, orders, items]
  - name: paid_orders
    tables: [{{name: orders, group_column_names: [account_id]}}]
    actions: [insert, update]
    filter: "record.status = 'paid' AND cast(record.total AS decimal(10,2)) >= 10"
  - name: account_rows
    tables: [accounts]
    message_kind: record
  - name: item_records
    tables: [items]
    transform: record_only
  - name: tagged
    tables: [accounts]
    transform: "tests.support.transforms:tag"
    message_grouping: false
  - name: evolving
    tables: [evolving]
  - name: bulk
    tables: [bulk]
  - name: docs
    tables: [docs_default, docs_full]
stream:
  checkpoint_location: {checkpoint}
"""


def with_destinations(text: str) -> str:
    """Every sink of these tests is a Sequin Stream."""
    return text.replace("    tables:", "    destination: {type: sequin_stream}\n    tables:")


@pytest.fixture(scope="module")
def shop(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, StreamApp, Path]]:
    """A database with the shop schema and a running stream app."""
    db = "shop_stream"
    dsn = pg.create_database(db)
    execute(dsn, *SCHEMA)
    tmp = tmp_path_factory.mktemp("shop")
    config = write_config(
        tmp / "sequin.yaml", with_destinations(CONFIG.format(dsn=dsn, db=db, checkpoint=tmp / "ckpt"))
    )
    app = StreamApp(config, tmp / "app.log").start()
    try:
        app.wait_streaming(dsn)
        yield dsn, app, config
    finally:
        app.stop()


def messages_when(dsn: str, sink: str, count: int, app: StreamApp, timeout: float = 180.0) -> list[dict[str, Any]]:
    """Wait until ``sink`` holds at least ``count`` messages, then return them all."""

    def enough() -> list[dict[str, Any]] | None:
        app.check_alive()
        got = sink_messages(dsn, sink)
        return got if len(got) >= count else None

    return wait_for(enough, timeout, what=f"{count} messages in sink {sink}")


def check_metadata(msg: dict[str, Any], sink: str, consumer_id: str, table: str, started: datetime) -> None:
    meta = msg["metadata"]
    assert meta["table_schema"] == "public" and meta["table_name"] == table
    assert meta["consumer"] == {"id": consumer_id, "name": sink}
    assert meta["database_name"] == "shop"
    assert meta["idempotency_key"] == f"{meta['commit_lsn']}:{meta['commit_idx']}"
    ts = datetime.strptime(meta["commit_timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    assert started <= ts <= datetime.now(timezone.utc)


def test_changes_across_tables_arrive_exactly_and_in_commit_order(shop: tuple[str, StreamApp, Path]) -> None:
    dsn, app, config_path = shop
    config = load_config(config_path)
    consumer = {s.name: s.consumer_id for s in config.sinks}
    started = datetime.now(timezone.utc).replace(microsecond=0)
    # T1: several statements, three tables
    execute(
        dsn,
        "BEGIN",
        "INSERT INTO accounts VALUES (1, 'Ada', 100.50), (2, 'Bob', 0)",
        "INSERT INTO orders VALUES (10, 1, 'draft', 25.00, '{a,b}', '2024-05-01 10:00:00+00')",
        "INSERT INTO items VALUES (10, 1, 'sku-1', 2), (10, 2, 'sku-2', 1)",
        "COMMIT",
    )
    # T2 and T3 interleave: T3 commits first, so it must come first.
    t2, t3 = psycopg.connect(dsn), psycopg.connect(dsn)
    t2.execute("UPDATE orders SET status = 'paid' WHERE id = 10")
    t3.execute("INSERT INTO orders VALUES (11, 2, 'paid', 5, NULL, NULL)")
    t2.execute("UPDATE accounts SET balance = 75.50 WHERE id = 1")
    t3.execute("UPDATE items SET qty = 3 WHERE order_id = 10 AND line = 2")
    t3.commit()
    t2.commit()
    t2.close()
    t3.close()
    # T4: deletes and a key change
    execute(
        dsn,
        "BEGIN",
        "DELETE FROM items WHERE order_id = 10 AND line = 1",
        "UPDATE accounts SET id = 3 WHERE id = 2",
        "DELETE FROM orders WHERE id = 11",
        "UPDATE orders SET total = 30 WHERE id = 10",
        "COMMIT",
    )

    order10 = {
        "id": 10,
        "account_id": 1,
        "status": "draft",
        "total": Decimal("25.00"),
        "tags": ["a", "b"],
        "placed_at": "2024-05-01T10:00:00Z",
    }
    order10_paid = {**order10, "status": "paid"}
    order11 = {"id": 11, "account_id": 2, "status": "paid", "total": 5, "tags": None, "placed_at": None}
    expected = [  # (txn, table, action, record, changes, record_pks)
        (1, "accounts", "insert", {"id": 1, "name": "Ada", "balance": Decimal("100.50")}, None, ["1"]),
        (1, "accounts", "insert", {"id": 2, "name": "Bob", "balance": Decimal("0.00")}, None, ["2"]),
        (1, "orders", "insert", order10, None, ["10"]),
        (1, "items", "insert", {"order_id": 10, "line": 1, "sku": "sku-1", "qty": 2}, None, ["10", "1"]),
        (1, "items", "insert", {"order_id": 10, "line": 2, "sku": "sku-2", "qty": 1}, None, ["10", "2"]),
        (3, "orders", "insert", order11, None, ["11"]),
        (3, "items", "update", {"order_id": 10, "line": 2, "sku": "sku-2", "qty": 3}, {}, ["10", "2"]),
        (2, "orders", "update", order10_paid, {"status": "draft"}, ["10"]),
        (2, "accounts", "update", {"id": 1, "name": "Ada", "balance": Decimal("75.50")}, {}, ["1"]),
        (4, "items", "delete", {"order_id": 10, "line": 1}, None, ["10", "1"]),
        (4, "accounts", "update", {"id": 3, "name": "Bob", "balance": Decimal("0.00")}, {"id": 2}, ["3"]),
        (4, "orders", "delete", order11, None, ["11"]),
        (4, "orders", "update", {**order10_paid, "total": 30}, {"total": Decimal("25.00")}, ["10"]),
    ]
    got = messages_when(dsn, "everything", len(expected), app)
    assert len(got) == len(expected)
    assert [
        (m["metadata"]["table_name"], m["action"], m["record"], m["changes"], m["metadata"]["record_pks"]) for m in got
    ] == [e[1:] for e in expected]
    # positions: one commit LSN per transaction, increasing in commit order; idx counts within it
    by_txn: dict[int, list[dict[str, Any]]] = {}
    for (txn, *_), m in zip(expected, got):
        by_txn.setdefault(txn, []).append(m)
        check_metadata(m, "everything", consumer["everything"], m["metadata"]["table_name"], started)
    lsn_sets = {txn: {m["metadata"]["commit_lsn"] for m in ms} for txn, ms in by_txn.items()}
    assert all(len(v) == 1 for v in lsn_sets.values())
    lsns = {txn: next(iter(v)) for txn, v in lsn_sets.items()}
    assert lsns[1] < lsns[3] < lsns[2] < lsns[4]
    assert [m["metadata"]["commit_idx"] for m in by_txn[4]] == [0, 1, 2, 3]

    # filter + actions + custom grouping: paid orders with total >= 10, no deletes
    paid = messages_when(dsn, "paid_orders", 2, app)
    assert [(m["action"], m["record"]["id"], m["record"]["total"]) for m in paid] == [
        ("update", 10, Decimal("25.00")),
        ("update", 10, 30),
    ]
    # record sink: latest rows, no deletes, no action/changes keys
    rows = messages_when(dsn, "account_rows", 4, app)
    assert [m["record"] for m in rows] == [e[3] for e in expected if e[1] == "accounts"]
    assert all(set(m) == {"record", "metadata"} for m in rows)
    # record_only transform: the record itself
    item_records = messages_when(dsn, "item_records", 4, app)
    assert item_records == [e[3] for e in expected if e[1] == "items"]
    # module:function transform
    tagged = messages_when(dsn, "tagged", 4, app)
    assert tagged == [{"id": e[3]["id"], "action": e[2], "tag": "custom"} for e in expected if e[1] == "accounts"]

    # the plain sinks' changes are stored compact (the messages above came back whole through
    # READ_DATA); a custom group, the record alone or a transform keep them whole
    with psycopg.connect(dsn) as conn:
        stored = conn.execute(
            "SELECT sink, idempotency_key, group_id, template IS NOT NULL FROM sequin.stream_messages"
            " WHERE sink IN ('everything', 'paid_orders', 'account_rows', 'item_records', 'tagged')"
        ).fetchall()
    groups = {f"{sink}/{key}": group for sink, key, group, _ in stored}
    first = got[0]["metadata"]
    assert groups[f"everything/{first['idempotency_key']}"] == 'public.accounts:["1"]'
    assert groups[f"everything/{got[3]['metadata']['idempotency_key']}"] == 'public.items:["10","1"]'
    assert groups[f"paid_orders/{got[7]['metadata']['idempotency_key']}"] == 'public.orders:["1"]'
    tag_key = got[0]["metadata"]["idempotency_key"]
    assert groups[f"tagged/{tag_key}"] == tag_key  # grouping off: every message its own group
    compact: dict[str, set[bool]] = {}
    for sink, _, _, is_compact in stored:
        compact.setdefault(sink, set()).add(is_compact)
    assert compact == {
        "everything": {True},
        "account_rows": {True},
        "paid_orders": {False},
        "item_records": {False},
        "tagged": {False},
    }
    # every stored message is below its sink's visibility watermark once its batch is whole
    with psycopg.connect(dsn) as conn:
        for sink in ("everything", "paid_orders", "account_rows", "item_records", "tagged"):
            top = conn.execute(
                "SELECT max(commit_lsn) FROM sequin.stream_messages WHERE sink = %s", (sink,)
            ).fetchone()[0]
            assert store.visible_lsn(conn, "sequin", sink) >= top


def test_add_column_mid_stream(shop: tuple[str, StreamApp, Path]) -> None:
    dsn, app, _ = shop
    execute(dsn, "INSERT INTO evolving VALUES (1)")
    messages_when(dsn, "evolving", 1, app)
    execute(
        dsn,
        "ALTER TABLE evolving ADD COLUMN label text",
        "INSERT INTO evolving VALUES (2, 'two')",
        "UPDATE evolving SET label = 'one' WHERE id = 1",
    )
    got = messages_when(dsn, "evolving", 3, app)
    assert [m["record"] for m in got] == [{"id": 1}, {"id": 2, "label": "two"}, {"id": 1, "label": "one"}]


def test_one_transaction_of_200k_rows(shop: tuple[str, StreamApp, Path]) -> None:
    dsn, app, _ = shop
    execute(dsn, "INSERT INTO bulk SELECT g, md5(g::text) FROM generate_series(1, 200000) g")
    got = messages_when(dsn, "bulk", 200_000, app, timeout=600)
    assert len(got) == 200_000
    assert len({m["metadata"]["commit_lsn"] for m in got}) == 1
    assert [m["metadata"]["commit_idx"] for m in got] == list(range(200_000))
    assert [m["record"]["id"] for m in got] == list(range(1, 200_001))
    assert got[-1]["record"]["payload"] == hashlib.md5(b"200000").hexdigest()


def test_5mb_toasted_value_updated_without_touching_it(shop: tuple[str, StreamApp, Path]) -> None:
    dsn, app, _ = shop
    big = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 160000) i)"  # 5.1 MB, incompressible
    execute(
        dsn,
        f"INSERT INTO docs_default VALUES (1, {big}, 0)",
        f"INSERT INTO docs_full VALUES (1, {big}, 0)",
        "UPDATE docs_default SET n = 1",
        "UPDATE docs_full SET n = 1",
    )
    with psycopg.connect(dsn) as conn:
        body = conn.execute(f"SELECT {big}").fetchone()[0]
    assert len(body) == 5_120_000
    got = messages_when(dsn, "docs", 4, app)
    inserts = [m for m in got if m["action"] == "insert"]
    assert [m["record"]["body"] == body for m in inserts] == [True, True]
    default_update, full_update = (m for m in got if m["action"] == "update")
    assert default_update["metadata"]["table_name"] == "docs_default"
    assert default_update["record"] == {"id": 1, "n": 1}
    assert default_update["metadata"]["unchanged_toast_columns"] == ["body"]
    assert full_update["record"] == {"id": 1, "body": body, "n": 1}
    assert full_update["changes"] == {"n": 0}
    assert "unchanged_toast_columns" not in full_update["metadata"]


def test_every_batch_with_changes_has_its_spark_phases_logged(shop: tuple[str, StreamApp, Path]) -> None:
    """Spark's phase timings of each micro-batch that carried changes reach the app's log, polled
    from the query (a Python listener cost the JVM more than the changes did); batches that end
    between two polls are not skipped."""
    dsn, app, _ = shop
    for n in range(4):  # separate transactions, read while earlier batches run: several batches
        execute(dsn, f"INSERT INTO accounts VALUES ({9000 + n}, 'progress {n}', 1)")
        time.sleep(0.3)

    def logged() -> tuple[set[str], set[str]] | None:
        app.check_alive()
        text = app.log_path.read_text(errors="replace")
        batches = set(re.findall(r"INFO sequin_provider\.spark\.pipeline: batch (\d+): \d+ changes ->", text))
        phases = set(
            re.findall(r"progress batch (\d+): \d+ input rows, .*latestOffset=\d+.*triggerExecution=\d+", text)
        )
        return (batches, phases) if len(batches) >= 2 and batches <= phases else None

    batches, phases = wait_for(logged, 60, what="every batch with changes to have its phases logged")
    assert batches == phases  # and no progress line for a batch without changes


def test_a_jvm_that_evaluates_sinks_sql_keeps_the_optimising_jit_tier(shop: tuple[str, StreamApp, Path]) -> None:
    """This app's sinks have a filter and custom group columns (``payload=full``): Spark SQL runs
    over every change, so its JVM keeps C2 (a ``payload=spool`` app's runs C1 only, test_webhook)."""
    _, app, config = shop
    assert payload_mode(load_config(config).sinks) == "full"
    arguments = spark_jvm_arguments(app)
    assert "-XX:+UseParallelGC" in arguments and not any(a.startswith("-XX:TieredStopAtLevel") for a in arguments)


def test_the_jvm_maps_the_class_archive_make_wrote(shop: tuple[str, StreamApp, Path]) -> None:
    """Spark's classes come from the class-data-sharing archive (``spark.class_archive``; ``make``
    writes it before the tests): the JVM was told to map it, and did (a JVM that cannot use an
    archive skips it silently, so its command line alone proves nothing)."""
    _, app, _ = shop
    archive = archive_path()
    assert archive is not None and archive.is_file(), "no class archive: make spark-archive writes it"
    jvm = spark_jvm(app)
    assert f"-XX:SharedArchiveFile={archive}" in jvm.cmdline()
    assert str(archive) in {m.path for m in jvm.memory_maps()}


# ---------------------------------------------------------------------------------------------
# Faults


def simple_config(
    tmp_path: Path,
    dsn: str,
    db: str,
    store_dsn: str | None = None,
    heartbeat: str = "1s",
    driver_batch_rows: int | None = None,
    trigger_interval: str | None = None,
) -> Path:
    store = f"store: {{dsn: {store_dsn}}}\n        " if store_dsn else ""
    extra = "" if driver_batch_rows is None else f"\n          driver_batch_rows: {driver_batch_rows}"
    if trigger_interval is not None:
        extra += f"\n          trigger_interval: {trigger_interval}"
    return write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases:
          - name: shop
            dsn: {dsn}
            slot: {{name: slot_{db}}}
            publication: {{name: pub_{db}}}
            heartbeat_interval: {heartbeat}
        {store}sinks:
          - name: kv
            tables: [kv]
            destination: {{type: sequin_stream}}
        stream:
          checkpoint_location: {tmp_path / "ckpt"}
          max_batch_wait: 100ms{extra}
        """,
    )


@pytest.mark.parametrize("driver_batch_rows", [100, 0])
def test_small_batches_are_written_by_the_driver_and_large_ones_by_spark_in_one_order(
    tmp_path: Path, dsn: str, dbname: str, stream_app: Any, driver_batch_rows: int
) -> None:
    """Batches of up to ``stream.driver_batch_rows`` changes are written by the driver from their
    spool files (named by Spark's offset log), larger ones by the Spark job, and 0 sends every batch
    through the job: the same messages, in the same order, either way."""
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    app = stream_app(simple_config(tmp_path, dsn, dbname, driver_batch_rows=driver_batch_rows))
    app.wait_streaming(dsn)
    # each small change is in the sink before the next commits, so it is a batch of its own however
    # slowly the app's first batches go (a loaded machine coalesced changes 0.3 s apart)
    for n in range(1, 6):
        execute(dsn, f"INSERT INTO kv VALUES ({n}, 0)")
        wait_for(lambda n=n: len(sink_messages(dsn, "kv")) >= n, 60, what=f"insert {n} in the sink")
    execute(dsn, "INSERT INTO kv SELECT g, 0 FROM generate_series(6, 505) g")  # one batch of 500 changes
    wait_for(lambda: len(sink_messages(dsn, "kv")) >= 505, 120, what="the 500 inserts in the sink")
    for n in range(1, 6):
        execute(dsn, f"UPDATE kv SET v = {n} WHERE id = {n}")
        wait_for(lambda n=n: len(sink_messages(dsn, "kv")) >= 505 + n, 60, what=f"update {n} in the sink")
    wait_for(lambda: len(sink_messages(dsn, "kv")) >= 510, 120, what="every change in the sink")
    time.sleep(1)  # anything extra (a duplicate) would show up now
    messages = sink_messages(dsn, "kv")
    assert [(m["action"], m["record"]["id"], m["record"]["v"]) for m in messages] == [
        ("insert", n, 0) for n in range(1, 506)
    ] + [("update", n, n) for n in range(1, 6)]
    log = app.log_path.read_text(errors="replace")
    driver_batches = dict(
        re.findall(r"batch (\d+): (\d+) changes -> \d+ new messages in \S+ written by the driver", log)
    )
    by_driver = [int(n) for n in driver_batches.values()]
    by_spark = [int(n) for n in re.findall(r"batch \d+: (\d+) changes -> \d+ new messages in \S+ \(store COPY", log)]
    assert any(n >= 500 for n in by_spark), log[-3000:]
    if not driver_batch_rows:
        assert not by_driver
        return
    assert len(by_driver) >= 10 and max(by_driver) <= driver_batch_rows, log[-3000:]

    def phases_logged() -> bool:  # Spark counts no input rows for them: the app says whose they were
        text = app.log_path.read_text(errors="replace")
        said = re.findall(
            r"progress batch (\d+): 0 input rows, .*triggerExecution=\d+.* \(written by the driver: (\d+) changes\)",
            text,
        )
        return driver_batches.items() <= dict(said).items()

    wait_for(phases_logged, 30, what="the Spark phases of every batch the driver wrote in the log")


def test_a_trigger_interval_gathers_the_changes_of_each_interval_into_one_micro_batch(
    tmp_path: Path, dsn: str, dbname: str, stream_app: Any
) -> None:
    """``stream.trigger_interval``: micro-batches start at most once per interval (Spark's
    processing-time trigger), so ten changes committed one by one over about two seconds arrive in
    at most two of them, where back to back most would take a batch of their own; none is lost,
    doubled or reordered."""
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    app = stream_app(simple_config(tmp_path, dsn, dbname, trigger_interval="5s"))
    app.wait_streaming(dsn)
    # a first change through the app first: a young app's first micro-batch can outlast the interval
    # (7.1 s on a loaded run), and Spark then starts the next ones at once, not at the interval
    execute(dsn, "INSERT INTO kv VALUES (0, 0)")
    wait_for(lambda: len(sink_messages(dsn, "kv")) >= 1, 120, what="the first change in the sink")
    mark = len(app.log_path.read_text(errors="replace"))
    for n in range(1, 11):
        execute(dsn, f"INSERT INTO kv VALUES ({n}, 0)")
        time.sleep(0.15)
    wait_for(lambda: len(sink_messages(dsn, "kv")) >= 11, 120, what="every change in the sink")
    time.sleep(1)  # anything extra (a duplicate) would show up now
    assert [(m["action"], m["record"]["id"]) for m in sink_messages(dsn, "kv")] == [("insert", n) for n in range(0, 11)]
    log = app.log_path.read_text(errors="replace")
    assert "micro-batches at most every 5s" in log
    batches = [int(n) for n in re.findall(r"batch \d+: (\d+) changes -> \d+ new messages in", log[mark:])]
    assert sum(batches) == 10 and len(batches) <= 2, log[-3000:]


def test_sigkill_mid_workload_loses_and_duplicates_nothing(
    tmp_path: Path, dsn: str, dbname: str, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    config = simple_config(tmp_path, dsn, dbname)
    app = stream_app(config)
    app.wait_streaming(dsn)
    workload = KeyWorkload(dsn).start()
    rng = random.Random(11)
    for _ in range(3):
        wait_for(lambda: len(sink_messages(dsn, "kv")) > workload.committed // 3, 120, what="progress before kill")
        time.sleep(rng.uniform(0.2, 2.0))
        app.kill()
        time.sleep(rng.uniform(0.5, 2.0))
        app = stream_app(config)
        app.wait_streaming(dsn)
    workload.stop()
    wait_for(
        lambda: (lambda m: m if len(m) >= workload.committed else None)(sink_messages(dsn, "kv")),
        240,
        what="all committed changes in the sink",
    )
    time.sleep(2)  # anything extra (a duplicate) would show up now
    check_against_workload(sink_messages(dsn, "kv"), workload)
    assert workload.committed > 500


@dataclass
class Supervised:
    """The source database, the store's database, the supervisor process the app watches, and the app."""

    dsn: str
    db: str
    store_db: str
    store_dsn: str
    supervisor: subprocess.Popen[bytes]
    app: StreamApp


@pytest.fixture(scope="module")
def supervised(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    """A stream app with its store in another database, watching a stand-in for its supervisor (the
    Airflow task process): the store-outage test runs on it, then the supervisor test ends it."""
    db = "stream_supervised"
    dsn, store_dsn = pg.create_database(db), pg.create_database(f"{db}_store")
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    tmp = tmp_path_factory.mktemp("supervised")
    supervisor = subprocess.Popen(["sleep", "600"])
    app = StreamApp(
        simple_config(tmp, dsn, db, store_dsn=store_dsn),
        tmp / "stream-app.log",
        {"SEQUIN_SUPERVISOR_PID": str(supervisor.pid)},
    )
    try:
        app.start().wait_streaming(store_dsn)
        yield Supervised(dsn, db, f"{db}_store", store_dsn, supervisor, app)
    finally:
        app.stop()
        supervisor.kill()
        supervisor.wait()


def test_slot_does_not_pass_undelivered_changes_while_store_is_down(
    pg: EmbeddedPostgres, supervised: Supervised
) -> None:
    dsn, dbname, store_db, store_dsn = supervised.dsn, supervised.db, supervised.store_db, supervised.store_dsn
    execute(dsn, "INSERT INTO kv VALUES (1, 1)")
    wait_for(lambda: len(sink_messages(store_dsn, "kv")) == 1, what="first message")

    execute(
        pg.dsn("postgres"),
        f"ALTER DATABASE {store_db} WITH ALLOW_CONNECTIONS false",
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{store_db}'",
    )
    try:
        with psycopg.connect(dsn) as conn:
            before = lsn_to_int(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        execute(dsn, "INSERT INTO kv VALUES (2, 2)", "UPDATE kv SET v = 3 WHERE id = 1")
        time.sleep(8)  # several heartbeats and micro-batch attempts
        with psycopg.connect(dsn) as conn:
            during = slot_info(conn, f"slot_{dbname}")
        assert during is not None and during.confirmed_flush_lsn is not None
        assert during.confirmed_flush_lsn <= before, "the slot advanced past changes that never reached the store"
    finally:
        execute(pg.dsn("postgres"), f"ALTER DATABASE {store_db} WITH ALLOW_CONNECTIONS true")
    got = wait_for(lambda: (lambda m: m if len(m) == 3 else None)(sink_messages(store_dsn, "kv")), 120, what="catch-up")
    assert [(m["action"], m["record"]) for m in got] == [
        ("insert", {"id": 1, "v": 1}),
        ("insert", {"id": 2, "v": 2}),
        ("update", {"id": 1, "v": 3}),
    ]

    def advanced() -> bool:
        with psycopg.connect(dsn) as conn:
            info = slot_info(conn, f"slot_{dbname}")
        return bool(info and info.confirmed_flush_lsn and info.confirmed_flush_lsn > before)

    wait_for(advanced, 60, what="the slot to advance after delivery")


def test_heartbeats_keep_an_idle_slot_from_retaining_wal(
    pg: EmbeddedPostgres, shop: tuple[str, StreamApp, Path]
) -> None:
    """The module's app, idle now (none of its tables changes), beside a slot that nobody reads."""
    dsn, app, config = shop
    slot = load_config(config).database().slot.name

    def stored() -> int:
        with psycopg.connect(dsn) as conn:
            return int(conn.execute("SELECT count(*) FROM sequin.stream_messages").fetchone()[0])

    before = stored()
    execute(dsn, "SELECT pg_create_logical_replication_slot('idle_control', 'pgoutput')")
    try:
        busy = pg.create_database("shop_stream_busy")
        execute(busy, "CREATE TABLE filler (id serial PRIMARY KEY, pad text)")
        for _ in range(8):  # ~100 MB of WAL in another database
            execute(busy, "INSERT INTO filler (pad) SELECT repeat(md5(g::text), 8) FROM generate_series(1, 30000) g")
        execute(busy, "CHECKPOINT")

        def retained(slot: str) -> int:
            with psycopg.connect(dsn) as conn:
                info = slot_info(conn, slot)
            assert info is not None and info.retained_bytes is not None
            return info.retained_bytes

        assert retained("idle_control") > 64 * 1024 * 1024  # without a consumer the WAL piles up

        def released() -> bool:
            # Postgres moves a slot's restart point up to what its consumer confirmed when it logs the
            # running transactions: its background writer does every 15 s, a checkpoint does at once
            execute(dsn, "CHECKPOINT")
            return retained(slot) < 16 * 1024 * 1024

        wait_for(released, 90, interval=1.0, what="the heartbeat to let the idle slot release WAL")
        assert retained("idle_control") > 64 * 1024 * 1024  # the checkpoints release nothing by themselves
        app.check_alive()
        assert stored() == before  # heartbeats are not messages
    finally:
        execute(dsn, "SELECT pg_drop_replication_slot('idle_control')")


def test_invalid_filter_stops_the_app_with_a_clear_error(
    tmp_path: Path, dsn: str, dbname: str, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    config = simple_config(tmp_path, dsn, dbname)
    config.write_text(config.read_text().replace("tables: [kv]", 'tables: [kv]\n    filter: "record.v >>> 1"'))
    app = stream_app(config)
    assert app.proc is not None
    assert app.proc.wait(180) == 2
    assert "sinks[0].filter: invalid SQL" in app.log_tail()


def test_stream_app_stops_when_its_supervisor_dies(supervised: Supervised) -> None:
    """A supervisor killed without stopping the app (a lost worker): the app notices and stops
    cleanly instead of holding the slot against the next supervisor."""
    dsn, store_dsn, supervisor, app = supervised.dsn, supervised.store_dsn, supervised.supervisor, supervised.app
    count = len(sink_messages(store_dsn, "kv"))
    execute(dsn, "INSERT INTO kv VALUES (100, 1)")
    wait_for(
        lambda: [m["record"] for m in sink_messages(store_dsn, "kv")[count:]] == [{"id": 100, "v": 1}],
        120,
        what="the insert in the sink",
    )
    assert app.proc is not None and app.proc.poll() is None  # still running while the supervisor lives
    supervisor.kill()
    supervisor.wait()
    assert app.proc.wait(180) == 0  # stopped as on SIGTERM
    assert f"the supervisor (pid {supervisor.pid}) is gone: stopping" in app.log_path.read_text(errors="replace")


# ---------------------------------------------------------------------------------------------
# The session


def test_python_workers_talk_over_unix_sockets_and_shuffles_follow_the_cores() -> None:
    """The apps' session (``spark_session``) runs its Python workers over Unix domain sockets (over
    loopback TCP a task's first input waited for a delayed ACK: docs/performance.md), sizes
    shuffles by the cores Spark has, at least 2, instead of Spark's 200, and broadcasts each job's
    task binary into 512 kB blocks instead of 4 MB ones (``TUNED_SPARK_CONF``)."""
    from sequin_provider.spark.app import spark_session

    def worker_socket(batches: Iterator[Any]) -> Iterator[Any]:  # in a Python worker: its socket family
        import os

        import pyarrow as pa

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"unix": [os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED", "false")]})

    spark = spark_session("sequin-session-tests", "local[1]")
    try:
        assert spark.sparkContext.getConf().get("spark.python.unix.domain.socket.enabled") == "true"
        assert spark.sparkContext.getConf().get("spark.broadcast.blockSize") == "512k"
        assert spark.conf.get("spark.sql.shuffle.partitions") == "2"  # local[1]: at least 2
        rows = spark.range(10, numPartitions=1).mapInArrow(worker_socket, "unix string").collect()
        assert [r.unix.lower() for r in rows] == ["true"]
    finally:
        spark.stop()
