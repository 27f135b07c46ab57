"""Iceberg sink: the stream app writes Iceberg tables through a SQL catalog in the test cluster and a
warehouse under the test's tmp_path; read back with pyiceberg and compared exactly.

Changelog: the messages of a Sequin Stream sink of the same tables (the reference path) are the
changelog's rows, in position order, each once, plus a backfill's reads; a batch replayed after a
crash adds no row and no snapshot. Mirror: after inserts, updates (a key change too), deletes, a
TRUNCATE, a backfill and a SIGKILL, each Iceberg table equals its source table.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import threading
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools.sqlalchemy_url import sqlalchemy_url
from devtools.stream_process import wait_for
from sequin_provider.config import load_config
from sequin_provider.delivery import Outgoing
from sequin_provider.exceptions import ConfigError, DestinationError
from sequin_provider.provisioning import initialize
from sequin_provider.sinks.iceberg_tables import POSITION_PROPERTY, open_catalog
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.tcp_proxy import TcpProxy

pytest.importorskip("pyiceberg", reason="needs pip install 'sequin-provider[iceberg]'")

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: lake
    tables: [a, b, c]
    destination:
      type: iceberg
      catalog: {{uri: "{catalog}", warehouse: "{warehouse}"}}
      namespace: {namespace}
      mode: {mode}
      partition_by: {partition_by}
      create_table: {create}
      commit_timeout: {commit_timeout}{filter}
{reference}stream:
  checkpoint_location: {ckpt}
"""
FULL_PAYLOAD_FILTER = "\n    filter: \"action <> 'none'\""
REFERENCE = """  - name: ref
    tables: [a, b, c]
    destination: {type: sequin_stream}
"""
TABLES = (
    "CREATE TABLE a (id int PRIMARY KEY, v text, n numeric(20,5))",
    "CREATE TABLE b (id bigint PRIMARY KEY, t timestamptz, ok boolean, f double precision)",
    "CREATE TABLE c (k text, m int, d date, j jsonb, PRIMARY KEY (k, m))",
)


def catalog_uri(dsn: str, port: int | None = None) -> str:
    """The SQLAlchemy URL of the test database (through ``port`` when given)."""
    return sqlalchemy_url(dsn) if port is None else sqlalchemy_url(dsn, host="127.0.0.1", port=port)


def make_config(tmp_path: Path, dsn: str, dbname: str, mode: str, **overrides: Any) -> Path:
    values = {
        "dsn": dsn,
        "db": dbname,
        "catalog": catalog_uri(dsn),
        "warehouse": f"file://{tmp_path}/warehouse",
        "namespace": f"ns_{dbname}",
        "mode": mode,
        "partition_by": "[]",
        "create": "true",
        "commit_timeout": "30s",
        "reference": REFERENCE,
        "filter": "",
        "ckpt": tmp_path / "ckpt",
    }
    values.update(overrides)
    return write_config(tmp_path / "sequin.yaml", CONFIG.format(**values))


def iceberg_rows(config: Path, table: str) -> list[dict[str, Any]]:
    """The rows of the sink's Iceberg table of ``public.<table>`` (none if it does not exist yet)."""
    from pyiceberg.exceptions import NoSuchTableError

    options = load_config(config).sink("lake").destination.options
    catalog = open_catalog(options)
    try:
        return catalog.load_table(options.identifier("public", table)).scan().to_arrow().to_pylist()
    except NoSuchTableError:
        return []
    finally:
        catalog.engine.dispose()


def table_state(config: Path, table: str) -> tuple[int, str | None]:
    """(snapshots, recorded position) of the sink's Iceberg table of ``public.<table>``."""
    options = load_config(config).sink("lake").destination.options
    catalog = open_catalog(options)
    try:
        found = catalog.load_table(options.identifier("public", table))
        return len(found.snapshots()), found.properties.get(POSITION_PROPERTY)
    finally:
        catalog.engine.dispose()


def source_rows(dsn: str, table: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(f"SELECT * FROM {table}").fetchall()


def normal(row: dict[str, Any]) -> tuple[Any, ...]:
    """A row comparable between the source and Iceberg: a jsonb value as its parsed JSON, a
    timestamp in UTC, NaN as text."""
    out = []
    for name in sorted(row):
        value = row[name]
        if name == "j":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif isinstance(value, datetime):
            value = value.astimezone(timezone.utc).isoformat()
        elif isinstance(value, float) and math.isnan(value):
            value = "NaN"
        out.append((name, value))
    return tuple(out)


def mirrored(config: Path, dsn: str, table: str) -> bool:
    return sorted(map(normal, iceberg_rows(config, table)), key=repr) == sorted(
        map(normal, source_rows(dsn, table)), key=repr
    )


def workload(dsn: str, rng: random.Random, steps: int, truncate: bool = False) -> None:
    """Random inserts, updates (sometimes of a key), deletes over a, b, c, in small transactions."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for step in range(steps):
            with conn.transaction():
                for _ in range(rng.randint(1, 4)):
                    i = rng.randint(1, 60)
                    roll = rng.random()
                    if roll < 0.5:
                        conn.execute(
                            "INSERT INTO a VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v, n = EXCLUDED.n",
                            (
                                i,
                                f"v{step}'\"\\",
                                Decimal(f"{rng.randint(-(10**9), 10**9)}.{rng.randint(0, 99999):05d}"),
                            ),
                        )
                        conn.execute(
                            "INSERT INTO b VALUES (%s, now(), %s, %s) ON CONFLICT (id) DO UPDATE SET ok = NOT b.ok,"
                            " f = EXCLUDED.f",
                            (i, rng.random() < 0.5, rng.random() * 1e6),
                        )
                        conn.execute(
                            "INSERT INTO c VALUES (%s, %s, current_date, %s) ON CONFLICT (k, m) DO UPDATE SET j = EXCLUDED.j",
                            (f"k{i % 7}", i, json.dumps({"s": step, "l": [1, None, "x"]})),
                        )
                    elif roll < 0.7:
                        fresh = 1000 + step * 10 + rng.randint(0, 9) + rng.randint(0, 10**6) * 1000
                        conn.execute(  # a key change (to a key not taken)
                            "UPDATE a SET id = %s WHERE id = %s AND NOT EXISTS (SELECT FROM a WHERE id = %s)",
                            (fresh, i, fresh),
                        )
                    elif roll < 0.9:
                        conn.execute("DELETE FROM a WHERE id = %s", (i,))
                        conn.execute("DELETE FROM b WHERE id = %s", (i,))
                        conn.execute("DELETE FROM c WHERE m = %s", (i,))
                    else:
                        conn.execute("UPDATE b SET f = 'NaN' WHERE id = %s", (i,))
            if truncate and step == steps // 2:
                conn.execute("TRUNCATE b")


def test_bad_options_name_the_key_path(tmp_path: Path) -> None:
    cases = {
        "mode: merge": "destination.mode",
        'table: "{action}"': "destination.table",
        'table: "m:f"': "destination.table",
        "partition_by: [week(commit_timestamp)]": "destination.partition_by[0]",
        "partition_by: [bucket(commit_lsn)]": "destination.partition_by[0]",
        "partition_by: [nope]": "destination.partition_by[0]",
        "catalog: {uri: 'http://x', warehouse: /tmp/w}": "destination.catalog.uri",
        "catalog: {uri: 'sqlite:///x.db', warehouse: relative}": "destination.catalog.warehouse",
        "catalog: {uri: 'sqlite:///x.db'}": "destination.catalog",
        "flavour: x": "destination",
    }
    for option, where in cases.items():
        body = (
            "databases: [{name: app, dsn: 'postgresql://127.0.0.1/x', slot: {name: s}, publication: {name: p}}]\n"
            "sinks:\n  - name: lake\n    tables: [a]\n    destination:\n      type: iceberg\n"
            "      catalog: {uri: 'sqlite:///x.db', warehouse: /tmp/w}\n"
            f"      {option}\n"
        )
        with pytest.raises(ConfigError) as caught:
            load_config(write_config(tmp_path / "bad.yaml", body))
        assert where in str(caught.value), (option, str(caught.value))
    body = (
        "databases: [{name: app, dsn: 'postgresql://127.0.0.1/x', slot: {name: s}, publication: {name: p}}]\n"
        "sinks:\n  - name: lake\n    tables: [a]\n    destination:\n      type: iceberg\n"
        "      catalog: {uri: 'sqlite:///x.db', warehouse: /tmp/w}\n      mode: mirror\n"
        "      partition_by: [day(t), id, 'bucket(8, id)']\n"
    )
    options = load_config(write_config(tmp_path / "good.yaml", body)).sink("lake").destination.options
    assert options.partition_by == (("day", "t", None), ("identity", "id", None), ("bucket", "id", 8))
    assert options.warehouse == "file:///tmp/w" and options.identifier("public", "a") == ("sequin", "public_a")


def test_init_checks_the_catalog_and_names_the_sink(dsn: str, dbname: str, tmp_path: Path, pg: Any) -> None:
    for sql in TABLES:
        execute(dsn, sql)
    config = make_config(tmp_path, dsn, dbname, "changelog", reference="")
    report = initialize(load_config(config))
    assert f"iceberg table ns_{dbname}.public_a" in report.created  # a changelog's tables made at init
    assert table_state(config, "a") == (0, None)
    good = load_config(config).sink("lake")
    assert good.destination.kind.health(good) == "ok"

    unreachable = make_config(
        tmp_path, dsn, dbname, "changelog", catalog="postgresql+psycopg2://postgres@127.0.0.1:9/x"
    )
    with pytest.raises(DestinationError) as caught:
        initialize(load_config(unreachable))
    assert "lake" in str(caught.value) and "catalog" in str(caught.value)

    wrong_user = make_config(tmp_path, dsn, dbname, "changelog", catalog=sqlalchemy_url(dsn, user="nobody"))
    with pytest.raises(DestinationError) as caught:
        initialize(load_config(wrong_user))
    assert "lake" in str(caught.value) and "nobody" in str(caught.value)

    missing = make_config(tmp_path, dsn, dbname, "mirror", namespace="other", create="false")
    with pytest.raises(DestinationError) as caught:
        initialize(load_config(missing))
    assert "lake" in str(caught.value) and "does not exist" in str(caught.value)
    health = load_config(missing).sink("lake").destination.kind.health(load_config(missing).sink("lake"))
    assert health == "namespace 'other' missing"


def _messages(dsn: str) -> Outgoing:
    """Three messages of table a, rendered as the stream renders them."""
    rows = [
        (10, 0, "insert", {"id": 1, "v": "x", "n": 1.5}),
        (10, 1, "insert", {"id": 2, "v": "y", "n": None}),
        (11, 0, "delete", {"id": 1}),
    ]
    out = Outgoing()
    for lsn, idx, action, record in rows:
        meta = {
            "table_schema": "public",
            "table_name": "a",
            "commit_timestamp": "2024-05-01T10:00:00.123456Z",
            "commit_lsn": lsn,
            "commit_idx": idx,
            "idempotency_key": f"{lsn}:{idx}",
            "record_pks": [str(record["id"])],
        }
        out.extend(
            Outgoing(
                [lsn],
                [idx],
                [f"public.a:[{record['id']}]"],
                [f"{lsn}:{idx}"],
                [json.dumps({"record": record, "changes": None, "action": action, "metadata": meta})],
            )
        )
    return out


def test_a_replayed_batch_commits_nothing_and_a_down_catalog_is_waited_for(
    dsn: str, dbname: str, tmp_path: Path, pg: Any
) -> None:
    for sql in TABLES:
        execute(dsn, sql)
    with TcpProxy(pg.port) as proxy:
        for mode, expected in (("changelog", 3), ("mirror", 1)):
            config = make_config(
                tmp_path, dsn, dbname, mode, reference="", catalog=catalog_uri(dsn, proxy.port), namespace=f"{mode}_ns"
            )
            loaded = load_config(config)
            initialize(loaded)
            sink = loaded.sink("lake")
            store = SequinStreamSink(loaded.store_dsn("app"), "sequin", 10)
            kind = sink.destination.kind
            assert kind.commit_batch(loaded, sink, _messages(dsn), store) == (3, 0)
            before = table_state(config, "a")
            assert before[1] == "11:0" and len(iceberg_rows(config, "a")) == expected
            assert kind.commit_batch(loaded, sink, _messages(dsn), store) == (3, 0)  # replayed: skipped
            assert table_state(config, "a") == before and len(iceberg_rows(config, "a")) == expected

            # the catalog down for a while: the commit waits (the batch with it), then is made once
            proxy.down()
            later = _messages(dsn)
            later.commit_lsn[:] = [20, 20, 21]
            later.data[:] = [d.replace('"commit_lsn": 1', '"commit_lsn": 2') for d in later.data]
            threading.Timer(3.0, proxy.up).start()
            started = time.monotonic()
            assert kind.commit_batch(loaded, sink, later, store) == (3, 0)
            assert time.monotonic() - started >= 2.5
            assert table_state(config, "a") == (before[0] + (1 if mode == "changelog" else 2), "21:0")
            if mode == "mirror":  # a value that does not fit its column: parked, and its group's next behind it
                bad = _messages(dsn)
                bad.commit_lsn[:] = [30, 30, 31]
                bad.data[:] = [
                    d.replace('"commit_lsn": 1', '"commit_lsn": 3').replace('"n": 1.5', '"n": "NaN"') for d in bad.data
                ]
                assert kind.commit_batch(loaded, sink, bad, store) == (1, 2)
                assert table_state(config, "a")[1] == "30:1"  # id 2's insert went on
                with psycopg.connect(dsn) as conn:
                    parked = conn.execute(
                        "SELECT commit_lsn, commit_idx, attempts FROM sequin.buffered_messages ORDER BY 1, 2"
                    ).fetchall()
                assert parked == [(30, 0, 1), (31, 0, 0)]
            store.close()
            kind.tables(sink, None).reset()
        # down past commit_timeout: the batch fails (Spark replays it when the app restarts)
        quick = make_config(
            tmp_path, dsn, dbname, "changelog", reference="", catalog=catalog_uri(dsn, proxy.port), commit_timeout="2s"
        )
        loaded = load_config(quick)
        initialize(loaded)
        proxy.down()
        sink = loaded.sink("lake")
        with pytest.raises(Exception) as failed:
            sink.destination.kind.commit_batch(loaded, sink, _messages(dsn), SequinStreamSink(dsn, "sequin", 10))
        assert not isinstance(failed.value, DestinationError)
        proxy.up()


def test_messages_parked_for_a_missing_table_are_applied_by_the_buffer_retry_once_it_exists(
    dsn: str, dbname: str, tmp_path: Path
) -> None:
    """``sequin buffer retry`` of an Iceberg sink: each parked message in its own commit, in group order."""
    from dataclasses import replace

    from sequin_provider import store as store_module
    from sequin_provider.sinks.iceberg_tables import IcebergTables
    from sequin_provider.sinks.retry import retry_sinks

    for sql in TABLES:
        execute(dsn, sql)
    config = make_config(tmp_path, dsn, dbname, "mirror", reference="", create="false")
    loaded = load_config(config)
    sink = loaded.sink("lake")
    options = sink.destination.options
    with psycopg.connect(dsn) as conn:
        store_module.migrate(conn, "sequin")
    catalog = open_catalog(options)
    catalog.create_namespace_if_not_exists(options.namespace)
    store = SequinStreamSink(loaded.store_dsn("app"), "sequin", 10)
    kind = sink.destination.kind
    try:
        assert kind.commit_batch(loaded, sink, _messages(dsn), store) == (0, 3)  # no table: all parked
        with psycopg.connect(dsn) as conn:
            parked = conn.execute(
                "SELECT commit_lsn, commit_idx, last_error FROM sequin.buffered_messages ORDER BY 1, 2"
            )
            rows = parked.fetchall()
        assert [(r[0], r[1]) for r in rows] == [(10, 0), (10, 1), (11, 0)]
        assert "does not exist (create_table is off)" in rows[1][2]
        (report,) = retry_sinks(loaded, "lake")  # the table still missing: nothing goes, nothing is lost
        assert (report.delivered, report.still_parked) == (0, 3)
        IcebergTables(sink.name, replace(options, create_table=True), dsn, catalog).table(
            options.identifier("public", "a"), ("public", "a")
        )
        with psycopg.connect(dsn, autocommit=True) as conn:  # due now (the retry backed off)
            conn.execute("UPDATE sequin.buffered_messages SET next_attempt_at = now()")
        (report,) = retry_sinks(loaded, "lake")
        assert (report.delivered, report.still_parked, report.discarded) == (3, 0, 0)
        assert [(r["id"], r["v"]) for r in iceberg_rows(config, "a")] == [(2, "y")]  # 1 inserted, then deleted
        assert table_state(config, "a")[1] == "11:0"
    finally:
        store.close()
        kind.tables(sink, None).reset()
        catalog.engine.dispose()


def _changelog_key(m: dict[str, Any]) -> tuple[Any, ...]:
    meta = m["metadata"]
    return (meta["commit_lsn"], meta["commit_idx"], m["action"], meta["idempotency_key"], meta["table_name"])


def test_changelog_of_three_tables_and_a_backfill_with_a_crash_replayed(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    for sql in TABLES:
        execute(dsn, sql)
    execute(dsn, "INSERT INTO a SELECT g, 'pre' || g, g / 7.0 FROM generate_series(100, 399) g")
    config = make_config(tmp_path, dsn, dbname, "changelog", partition_by="[day(commit_timestamp), table_name]")
    stall = tmp_path / "stall"
    app = stream_app(config, {"SEQUIN_TEST_STALL_AFTER_STORE": str(stall)})
    app.wait_streaming(dsn)
    rng = random.Random(7)
    workload(dsn, rng, 40)
    present = sorted(r["id"] for r in source_rows(dsn, "a"))  # what the backfill reads (nothing writes meanwhile)
    out = subprocess.run(
        cli_args(config, "backfill", "start", "lake", "a"), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    workload(dsn, rng, 40)

    # a crash after the batch's commit, before Spark commits its offset: the batch is replayed
    def settled() -> bool:
        ref = [m for m in sink_messages(dsn, "ref") if m["action"] != "read"]
        return _changelog_count(config) - _reads(config) == len(ref) and len(ref) > 0

    def settle(marker: int) -> None:
        """Wait for every change so far (a marker row last) in the changelog and the reference."""
        execute(dsn, f"INSERT INTO b (id) VALUES ({-marker})")
        wait_for(
            lambda: any(r["record_pks"] == [str(-marker)] for r in iceberg_rows(config, "b")) and settled(),
            240,
            what="the changelog holding every change",
        )

    settle(1)
    stall.touch()
    execute(dsn, "INSERT INTO c VALUES ('stall', 1, NULL, NULL)")
    wait_for(lambda: Path(f"{stall}.stalled").exists(), 120, what="the stall")
    state = table_state(config, "c")
    app.kill()
    app = stream_app(config)
    app.wait_streaming(dsn)
    execute(dsn, "INSERT INTO a VALUES (9999, 'after', 1)")
    wait_for(
        lambda: any(
            r["idempotency_key"] and r["record"] and '"after"' in r["record"] for r in iceberg_rows(config, "a")
        ),
        120,
        what="a's next row",
    )
    assert table_state(config, "c") == state, app.log_tail()  # the replayed batch committed nothing to c

    # a SIGKILL mid-run: nothing lost, no position twice
    thread = threading.Thread(target=workload, args=(dsn, random.Random(8), 60))
    thread.start()
    time.sleep(2)
    app.kill()
    thread.join()
    app = stream_app(config)
    app.wait_streaming(dsn)
    settle(2)
    ref_keys = [_changelog_key(m) for m in sink_messages(dsn, "ref") if m["action"] != "read"]
    rows = [r for t in "abc" for r in iceberg_rows(config, t)]
    positions = [(r["commit_lsn"], r["commit_idx"]) for r in rows]
    assert len(positions) == len(set(positions))  # no position twice
    changes = sorted((r for r in rows if r["action"] != "read"), key=lambda r: (r["commit_lsn"], r["commit_idx"]))
    assert [
        (r["commit_lsn"], r["commit_idx"], r["action"], r["idempotency_key"], r["table_name"]) for r in changes
    ] == ref_keys
    by_key = {(m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]): m for m in sink_messages(dsn, "ref")}
    for r in changes:  # the record exactly (numeric digits too)
        m = by_key[(r["commit_lsn"], r["commit_idx"])]
        assert json.loads(r["record"], parse_float=Decimal) == m["record"], r
    reads = [json.loads(r["record"], parse_float=Decimal) for r in rows if r["action"] == "read"]
    assert sorted(x["id"] for x in reads) == present and len(present) >= 300  # every row present then, once
    assert all(r["idempotency_key"].startswith("backfill:") for r in rows if r["action"] == "read")


def _changelog_count(config: Path) -> int:
    return sum(len(iceberg_rows(config, t)) for t in "abc")


def _reads(config: Path) -> int:
    return sum(1 for r in iceberg_rows(config, "a") if r["action"] == "read")


def cli_args(config: Path, *args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), *args]


def test_mirror_of_three_tables_equals_the_source_through_a_backfill_a_truncate_and_a_kill(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    for sql in TABLES:
        execute(dsn, sql)
    execute(dsn, "INSERT INTO a SELECT g, 'pre' || g, g / 7.0 FROM generate_series(100, 399) g")
    # a filter makes the batches payload=full (the changelog test covers payload=spool)
    config = make_config(tmp_path, dsn, dbname, "mirror", reference="", filter=FULL_PAYLOAD_FILTER)
    app = stream_app(config)
    app.wait_streaming(dsn)
    rng = random.Random(11)
    workload(dsn, rng, 30)
    out = subprocess.run(
        cli_args(config, "backfill", "start", "lake", "a"), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    thread = threading.Thread(target=workload, args=(dsn, random.Random(12), 80, True))
    thread.start()
    time.sleep(3)
    app.kill()
    thread.join()
    app = stream_app(config)
    app.wait_streaming(dsn)
    workload(dsn, rng, 30)
    for table in "abc":
        wait_for(lambda t=table: mirrored(config, dsn, t), 240, what=f"the mirror of {table} equal to the source")
    assert any(r["id"] >= 100 for r in iceberg_rows(config, "a"))
    with psycopg.connect(dsn) as conn:  # nothing parked: every value fit its column
        assert conn.execute("SELECT count(*) FROM sequin.buffered_messages").fetchone()[0] == 0


def test_a_replay_from_the_iceberg_changelog_into_a_sequin_stream_is_exact_and_marked(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    """Change retention in Iceberg (with a retention period, which keeps these recent rows) read back by
    ``sequin replay`` with a condition run by the store's Postgres (docs/replays.md)."""
    for sql in TABLES:
        execute(dsn, sql)
    config = make_config(tmp_path, dsn, dbname, "changelog", commit_timeout="30s\n      retention: 30d")
    app = stream_app(config)
    app.wait_streaming(dsn)
    workload(dsn, random.Random(21), 40)
    execute(dsn, "INSERT INTO b (id) VALUES (-1)")
    wait_for(
        lambda: (
            any(r["record_pks"] == ["-1"] for r in iceberg_rows(config, "b"))
            and _changelog_count(config) == len(sink_messages(dsn, "ref"))
        ),
        240,
        what="the changelog holding every change",
    )
    rows = sorted(iceberg_rows(config, "a"), key=lambda r: (r["commit_lsn"], r["commit_idx"]))
    expected = [r for r in rows if r["action"] == "update"]
    assert expected
    out = subprocess.run(
        cli_args(config, "replay", "lake", "ref", "--table", "a", "--where", "action = 'update'"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert f"{len(expected)} changes from lake queued for sink ref; ref: delivered {len(expected)}" in out.stdout
    execute(dsn, "INSERT INTO b (id) VALUES (-2)")  # a live change: the stream passes the replay's mark
    replayed = wait_for(  # visible to consumers once the stream has passed the replay's position
        lambda: (lambda ms: ms if len(ms) >= len(expected) else None)(
            [m for m in sink_messages(dsn, "ref") if "replay_id" in m["metadata"]]
        ),
        120,
        what="the replayed messages visible",
    )
    assert [(m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]) for m in replayed] == [
        (r["commit_lsn"], r["commit_idx"]) for r in expected
    ]
    for m, r in zip(replayed, expected):
        assert m["action"] == "update" and m["record"] == json.loads(r["record"], parse_float=Decimal)
        assert (
            m["metadata"]["idempotency_key"]
            == f"replay:{m['metadata']['replay_id']}:{r['commit_lsn']}:{r['commit_idx']}"
        )
    assert len(rows) == len(iceberg_rows(config, "a"))  # the retention period kept every recent row
    bad = subprocess.run(
        cli_args(config, "replay", "lake", "ref", "--table", "a", "--where", "no_such_column = 1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode != 0 and "error: reading changelog of sink 'lake'" in bad.stderr, bad.stdout + bad.stderr
    assert "no_such_column" in bad.stderr
    assert len([m for m in sink_messages(dsn, "ref") if "replay_id" in m["metadata"]]) == len(expected)
