"""Backfills end to end: real Postgres, the stream app (a subprocess), the backfill Spark app in local mode.

The backfill app runs in this test process (one SparkSession for the module); the stream app
that places the reads at the high watermarks runs as in production, as its own process: one for
the module, each test with its own tables and sinks (the test that kills it starts it again).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.config import load_config
from sequin_provider.store import Backfill
from tests.support.backfills import backfill, ranges_moved
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

SCHEMA = [
    "CREATE TABLE big (id bigint PRIMARY KEY, name text NOT NULL, n numeric)",
    "INSERT INTO big SELECT g, 'row ' || g, g * 1.5 FROM generate_series(1, 100000) g",
    "CREATE TABLE busy (id int PRIMARY KEY, n int NOT NULL, s text)",
    "INSERT INTO busy SELECT g, 0, 'v' || g FROM generate_series(1, 200000) g",
    "CREATE TABLE events (id int PRIMARY KEY, kind text, updated_at timestamptz)",
    "INSERT INTO events SELECT g, 'e', CASE WHEN g % 10 = 0 THEN NULL"
    " ELSE timestamptz '2025-01-01 00:00:00+00' + g * interval '1 hour' END FROM generate_series(1, 1000) g",
    "CREATE INDEX ON events (updated_at)",
    "CREATE TABLE lines (order_id int, line int, sku text, PRIMARY KEY (order_id, line))",
    "INSERT INTO lines SELECT o, l, 'sku-' || o || '-' || l FROM generate_series(1, 300) o, generate_series(1, 7) l",
    "CREATE TABLE docs (id uuid PRIMARY KEY, title text)",
    "INSERT INTO docs SELECT md5(g::text)::uuid, 'doc ' || g FROM generate_series(1, 3000) g",
    "CREATE TABLE nothing (id int PRIMARY KEY)",
    "CREATE TABLE tagged (id int PRIMARY KEY, tags text[])",  # an array column: rendered by the decoder (Python)
    "INSERT INTO tagged SELECT g, ARRAY['t' || g, NULL, 'a,b'] FROM generate_series(1, 1500) g",
    "CREATE TABLE adapt (id int PRIMARY KEY, pad text)",
    "INSERT INTO adapt SELECT g, repeat('x', 100) FROM generate_series(1, 60000) g",
    "CREATE TABLE killed (id bigint PRIMARY KEY, name text NOT NULL, n numeric)",
    "INSERT INTO killed SELECT g, 'row ' || g, g FROM generate_series(1, 150000) g",
    "CREATE TABLE resumed (id bigint PRIMARY KEY, name text NOT NULL)",
    "INSERT INTO resumed SELECT g, 'row ' || g FROM generate_series(1, 120000) g",
    "CREATE TABLE retried (id int PRIMARY KEY, v int NOT NULL)",
    "INSERT INTO retried SELECT g, 0 FROM generate_series(1, 3000) g",
    "CREATE TABLE paid (id int PRIMARY KEY, status text, region text)",
    "INSERT INTO paid SELECT g, CASE WHEN g % 3 = 0 THEN 'paid' ELSE 'open' END,"
    " CASE WHEN g % 4 = 0 THEN 'eu' ELSE 'us' END FROM generate_series(1, 20000) g",
    "ANALYZE",
]

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - {{name: big_sink, tables: [big], destination: {{type: sequin_stream}}}}
  - {{name: busy_sink, tables: [busy], destination: {{type: sequin_stream}}}}
  - {{name: events_sink, tables: [events], destination: {{type: sequin_stream}}}}
  - {{name: lines_sink, tables: [lines], destination: {{type: sequin_stream}}}}
  - {{name: docs_sink, tables: [docs], destination: {{type: sequin_stream}}}}
  - {{name: nothing_sink, tables: [nothing], destination: {{type: sequin_stream}}}}
  - {{name: tagged_sink, tables: [tagged], destination: {{type: sequin_stream}}}}
  - {{name: adapt_sink, tables: [adapt], destination: {{type: sequin_stream}}}}
  - {{name: killed_sink, tables: [killed], destination: {{type: sequin_stream}}}}
  - {{name: resumed_sink, tables: [resumed], destination: {{type: sequin_stream}}}}
  - {{name: paid_sink, tables: [paid], destination: {{type: sequin_stream}}}}
  - {{name: retried_sink, tables: [retried], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {checkpoint}
"""


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """The backfill app's Spark (local mode, two cores as on CI)."""
    from sequin_provider.spark.app import spark_session

    session = spark_session("sequin-backfill-tests", "local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def app_db(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, StreamApp, Path]]:
    """A database with the tables above and a running stream app."""
    db = "backfill_app"
    dsn = pg.create_database(db)
    execute(dsn, *SCHEMA)
    tmp = tmp_path_factory.mktemp("backfill")
    config = write_config(tmp / "sequin.yaml", CONFIG.format(dsn=dsn, db=db, checkpoint=tmp / "ckpt"))
    app = StreamApp(config, tmp / "app.log").start()
    try:
        app.wait_streaming(dsn)
        yield dsn, app, config
    finally:
        app.stop()


def run(spark: Any, config_path: Path, backfill_id: int, **kwargs: Any) -> Backfill:
    from sequin_provider.spark.backfill_app import run_backfill

    return run_backfill(spark, str(config_path), backfill_id, **kwargs)


def reads_of(dsn: str, sink: str) -> list[dict[str, Any]]:
    return [m for m in sink_messages(dsn, sink) if m["action"] == "read"]


def test_full_backfill_delivers_every_row_once_in_key_order_per_range(
    app_db: tuple[str, StreamApp, Path], spark: Any
) -> None:
    dsn, app, config = app_db
    created = backfill(dsn, config, "big_sink", "big")
    assert created.state == "pending" and 90_000 <= (created.rows_initial or 0) <= 110_000  # planner estimate
    final = run(spark, config, created.id)
    assert final.state == "completed", final.error
    assert (final.rows_processed, final.rows_emitted) == (100_000, 100_000)
    reads = reads_of(dsn, "big_sink")
    assert len(reads) == 100_000
    assert sorted(m["record"]["id"] for m in reads) == list(range(1, 100_001))  # each row once
    first = reads[0]
    assert first["changes"] is None and first["record"]["name"] == f"row {first['record']['id']}"
    assert first["metadata"]["idempotency_key"] == f'backfill:{created.id}:["{first["record"]["id"]}"]'
    assert first["metadata"]["record_pks"] == [str(first["record"]["id"])]
    with psycopg.connect(dsn) as conn:
        ranges = store.backfill_ranges(conn, "sequin", created.id)
    assert len(ranges) == 2 and all(r.done for r in ranges)
    # the stream app's source runs in a Python worker of its own; its lines reach the app's log
    assert re.search(
        f"backfill {created.id} page [0-9]+: [0-9]+ reads released \\(written by the task\\)",
        app.log_path.read_text(errors="replace"),
    ), app.log_tail()
    assert sum(r.rows_processed for r in ranges) == 100_000
    # in key order within each range: position order == key order
    bound = int(ranges[0].upper_key[0])  # type: ignore[index]
    for in_range in ([m for m in reads if m["record"]["id"] <= bound], [m for m in reads if m["record"]["id"] > bound]):
        assert in_range, "both ranges got rows"
        ids = [m["record"]["id"] for m in in_range]
        assert ids == sorted(ids)
    # the pages were staged and emitted: nothing left in staging
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM sequin.backfill_rows").fetchone()[0] == 0
        states = dict(
            conn.execute(
                "SELECT state, count(*) FROM sequin.backfill_pages WHERE backfill_id = %s GROUP BY state", (created.id,)
            ).fetchall()
        )
    assert set(states) <= {"emitted", "stale"} and states["emitted"] >= 2


def _workload(dsn: str, stop: threading.Event, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    next_id = 200_001 + seed * 1_000_000
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            with conn.transaction():
                for _ in range(rng.randint(1, 5)):
                    roll = rng.random()
                    key = rng.randint(2, 200_000)
                    if roll < 0.6:
                        conn.execute("UPDATE busy SET n = n + 1, s = %s WHERE id = %s", (f"u{rng.random()}", key))
                        counts["update"] += 1
                    elif roll < 0.8:
                        conn.execute("DELETE FROM busy WHERE id = %s", (key,))
                        counts["delete"] += 1
                    else:
                        conn.execute("INSERT INTO busy VALUES (%s, 0, 'new')", (next_id,))
                        next_id += 1
                        counts["insert"] += 1
            time.sleep(0.001)


def test_backfill_racing_a_random_workload_replays_to_the_final_state(
    app_db: tuple[str, StreamApp, Path], spark: Any
) -> None:
    dsn, app, config = app_db
    with psycopg.connect(dsn) as conn:
        initial = {r[0] for r in conn.execute("SELECT id FROM busy").fetchall()}
    created = backfill(dsn, config, "busy_sink", "busy")
    stop = threading.Event()
    counts = {"update": 0, "delete": 0, "insert": 0}
    workers = [threading.Thread(target=_workload, args=(dsn, stop, seed, counts)) for seed in (1, 2)]
    for w in workers:
        w.start()
    try:
        final = run(spark, config, created.id)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert final.state == "completed", final.error
    assert counts["update"] > 100 and counts["delete"] > 20, counts  # the race really happened
    execute(dsn, "UPDATE busy SET s = 'the end' WHERE id = 1")  # a last change, to know the stream caught up
    wait_for(
        lambda: any(m["record"].get("s") == "the end" for m in sink_messages(dsn, "busy_sink")[-50:]),
        180,
        what="the final marker change",
    )
    messages = sink_messages(dsn, "busy_sink")
    with psycopg.connect(dsn) as conn:
        final_rows = {r[0]: {"id": r[0], "n": r[1], "s": r[2]} for r in conn.execute("SELECT id, n, s FROM busy")}
    state: dict[int, dict[str, Any] | None] = {}
    changed: set[int] = set()
    stale_reads = []
    for m in messages:  # position order
        key = m["record"]["id"]
        if m["action"] == "read":
            if key in changed and state.get(key) != m["record"]:
                stale_reads.append((key, state.get(key), m["record"]))  # a read older than a change before it
            state[key] = m["record"]
        elif m["action"] == "delete":
            changed.add(key)
            state[key] = None
        else:
            changed.add(key)
            state[key] = m["record"]
    assert stale_reads == []
    replayed = {k: v for k, v in state.items() if v is not None}
    assert replayed == final_rows  # every key: replay == final table state
    assert initial <= set(state)  # every row present at the start is represented by a read or a change
    reads = [m for m in messages if m["action"] == "read"]
    assert len(reads) == len({m["record"]["id"] for m in reads})  # no row read twice
    assert final.rows_processed >= len(reads) and final.rows_emitted == len(reads)
    dropped = final.rows_processed - final.rows_emitted
    logging.getLogger(__name__).info(
        "race: %s, %d reads, %d dropped as changed in their window", counts, len(reads), dropped
    )


def test_partial_backfill_from_a_timestamp_skips_older_rows_and_nulls(
    app_db: tuple[str, StreamApp, Path], spark: Any, tmp_path: Path
) -> None:
    dsn, app, config = app_db
    # through the CLI, as a user would: record, run, status
    cli = [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), "backfill"]
    started = subprocess.run(
        [
            *cli,
            "start",
            "events_sink",
            "events",
            "--sort-column",
            "updated_at",
            "--start-position",
            "2025-01-30 00:00:00+00",
            "--no-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    backfill_id = int(started.stdout.split()[1].rstrip(":"))
    final = run(spark, config, backfill_id)
    assert final.state == "completed" and final.kind == "partial"
    reads = reads_of(dsn, "events_sink")
    # hour g after 2025-01-01 >= 2025-01-30 00:00  <=>  g >= 696; NULL sort values (g % 10 = 0) are not included
    expected = [g for g in range(696, 1001) if g % 10]
    assert [m["record"]["id"] for m in reads] == expected  # in (updated_at, id) order
    status = subprocess.run([*cli, "status", str(backfill_id)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"backfill {backfill_id} [events_sink public.events partial from updated_at >= " in status.stdout
    assert f"completed, {len(expected):,}" in status.stdout and "rows/s" in status.stdout


def test_a_backfill_with_a_condition_sends_exactly_the_matching_rows(
    app_db: tuple[str, StreamApp, Path], spark: Any
) -> None:
    dsn, app, config = app_db
    cli = [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), "backfill"]
    where = "status = 'paid' AND region = 'eu'"
    started = subprocess.run(
        [*cli, "start", "paid_sink", "paid", "--where", where, "--no-run"], capture_output=True, text=True, timeout=120
    )
    assert started.returncode == 0, started.stderr
    backfill_id = int(started.stdout.split()[1].rstrip(":"))
    final = run(spark, config, backfill_id)
    assert (final.state, final.where) == ("completed", where), final.error
    expected = [g for g in range(1, 20001) if g % 12 == 0]
    assert final.rows_processed == len(expected)
    reads = reads_of(dsn, "paid_sink")
    assert sorted(m["record"]["id"] for m in reads) == expected  # exactly the matching rows, each once
    assert all(m["record"]["status"] == "paid" and m["record"]["region"] == "eu" for m in reads)
    with psycopg.connect(dsn) as conn:
        assert len(store.backfill_ranges(conn, "sequin", backfill_id)) == 2  # the keyset ranges as without one
    status = subprocess.run([*cli, "status", str(backfill_id)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"backfill {backfill_id} [paid_sink public.paid full where {where}]: completed" in status.stdout


def test_composite_uuid_and_empty_tables(app_db: tuple[str, StreamApp, Path], spark: Any) -> None:
    dsn, app, config = app_db
    for sink, table, rows in (
        ("lines_sink", "lines", 2100),
        ("docs_sink", "docs", 3000),
        ("nothing_sink", "nothing", 0),
        ("tagged_sink", "tagged", 1500),
    ):
        created = backfill(dsn, config, sink, table)
        final = run(spark, config, created.id, ranges=3)
        assert final.state == "completed", final.error
        assert final.rows_processed == rows
        assert len(reads_of(dsn, sink)) == rows
    lines = reads_of(dsn, "lines_sink")
    assert sorted((m["record"]["order_id"], m["record"]["line"]) for m in lines) == [
        (o, ln) for o in range(1, 301) for ln in range(1, 8)
    ]
    assert lines[0]["metadata"]["record_pks"] == [str(lines[0]["record"]["order_id"]), str(lines[0]["record"]["line"])]
    with psycopg.connect(dsn) as conn:
        uuids = {str(r[0]) for r in conn.execute("SELECT id FROM docs")}
    assert {m["record"]["id"] for m in reads_of(dsn, "docs_sink")} == uuids
    tagged = sorted((m["record"]["id"], m["record"]["tags"]) for m in reads_of(dsn, "tagged_sink"))
    assert tagged == [(g, [f"t{g}", None, "a,b"]) for g in range(1, 1501)]  # the Python rendering path


def test_page_size_adapts_to_a_small_budget_and_to_timeouts(app_db: tuple[str, StreamApp, Path], spark: Any) -> None:
    """A real table, a 300 ms budget, and a lock that makes page queries time out for a while."""
    dsn, app, config = app_db
    created = backfill(dsn, config, "adapt_sink", "adapt", max_query_ms=300)
    locker = psycopg.connect(dsn)
    locker.execute("LOCK TABLE adapt IN ACCESS EXCLUSIVE MODE")  # page queries wait, then hit the budget
    result: dict[str, Backfill] = {}
    runner = threading.Thread(target=lambda: result.update(final=run(spark, config, created.id, ranges=1)))
    runner.start()
    try:
        wait_for(lambda: len(_stale_pages(dsn, created.id)) >= 2, 180, what="pages timing out on the locked table")
    finally:
        locker.rollback()
        locker.close()
    runner.join(timeout=600)
    final = result["final"]
    assert final.state == "completed", final.error
    assert len(reads_of(dsn, "adapt_sink")) == 60_000
    with psycopg.connect(dsn) as conn:
        sizes = [
            r[0]
            for r in conn.execute(
                "SELECT rows_staged FROM sequin.backfill_pages WHERE backfill_id = %s"
                " AND state = 'emitted' ORDER BY id",
                (created.id,),
            )
        ]
    assert len(sizes) >= 3 and sizes[0] < max(sizes), sizes  # pages grew while queries finished inside the budget
    # the pages that hit the budget were given up (no rows staged) and read again smaller
    assert _stale_pages(dsn, created.id), "the locked table made at least one page time out"


def _stale_pages(dsn: str, backfill_id: int) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT id FROM sequin.backfill_pages WHERE backfill_id = %s AND state = 'stale' AND rows_staged = 0",
                (backfill_id,),
            )
        ]


def test_stream_app_killed_mid_backfill_then_restarted_completes_with_nothing_missing(
    app_db: tuple[str, StreamApp, Path], spark: Any
) -> None:
    """SIGKILL the module's stream app twice while pages are in flight (it is started again each time).

    A restarted app releases every page waiting for it at once, so the backfill may end before a
    second kill: the loop stops killing then (a kill after the end tests nothing), but the first kill
    must land while the backfill runs."""
    dsn, app, config = app_db
    created = backfill(dsn, config, "killed_sink", "killed")
    result: dict[str, Backfill] = {}
    runner = threading.Thread(target=lambda: result.update(final=run(spark, config, created.id, max_page_rows=10_000)))
    runner.start()
    seen = 0
    kills_mid_backfill = 0
    try:
        for _ in range(2):  # kill it twice while pages are in flight
            wait_for(
                lambda at_least=seen + 5_000: count_messages(dsn, "killed_sink") > at_least or not runner.is_alive(),
                240,
                what="backfill progress",
            )
            if not runner.is_alive():
                break
            app.kill()
            kills_mid_backfill += 1
            time.sleep(1.0)
            app.start()
            app.wait_streaming(dsn)
            seen = count_messages(dsn, "killed_sink")
        runner.join(timeout=600)
    finally:
        if app.proc is None:  # killed and not started again: the module's next tests need it
            app.start()
    assert kills_mid_backfill >= 1
    assert result["final"].state == "completed", result["final"].error
    ids = [m["record"]["id"] for m in reads_of(dsn, "killed_sink")]
    assert set(ids) == set(range(1, 150_001))  # nothing missing
    # and nothing twice: a page whose window a restart broke is read again alone, since the pages
    # after it in flight are not released either (a consumer may have acked their reads already)
    assert len(ids) == 150_000, f"{len(ids) - 150_000} reads of rows already read"
    with psycopg.connect(dsn) as conn:
        stale = conn.execute(
            "SELECT count(*) FROM sequin.backfill_pages WHERE backfill_id = %s AND state = 'stale'", (created.id,)
        ).fetchone()[0]
    logging.getLogger(__name__).info(
        "kill test: %d kills mid-backfill, %d reads for 150000 rows, %d stale pages",
        kills_mid_backfill,
        len(ids),
        stale,
    )


def test_backfill_app_killed_mid_run_resumes_from_its_cursors_with_nothing_missing(
    app_db: tuple[str, StreamApp, Path], tmp_path: Path
) -> None:
    """SIGKILL the backfill app itself (driver and JVM) mid-run; ``sequin backfill run ID`` finishes it."""
    dsn, app, config = app_db
    created = backfill(dsn, config, "resumed_sink", "resumed")
    root = Path(__file__).resolve().parents[3]
    with open(tmp_path / "backfill1.log", "wb") as log_file:
        first = subprocess.Popen(
            [
                sys.executable,
                str(root / "spark_apps" / "backfill.py"),
                "--config",
                str(config),
                "--backfill-id",
                str(created.id),
                "--master",
                "local[2]",
                "--ranges",
                "2",
                "--max-page-rows",
                "5000",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            # both ranges' cursors moved (counting messages is not enough: a page's reads are in the
            # stream table, hidden, before its window closes and its range's cursor moves)
            wait_for(
                lambda: ranges_moved(dsn, created.id) or first.poll() is not None,
                300,
                what="backfill progress before the kill",
            )
            assert first.poll() is None, (tmp_path / "backfill1.log").read_text()[-3000:]
        finally:
            os.killpg(first.pid, signal.SIGKILL)  # the driver and its JVM, mid-page
            first.wait(timeout=60)
    with psycopg.connect(dsn) as conn:
        killed = store.get_backfill(conn, "sequin", created.id)
        cursors = [r.cursor for r in store.backfill_ranges(conn, "sequin", created.id)]
    assert killed.state == "running" and 0 < killed.rows_emitted < 120_000
    assert all(c is not None for c in cursors)  # both ranges had made progress to resume from
    resumed = subprocess.run(
        [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), "backfill", "run", str(created.id)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    app.check_alive()
    with psycopg.connect(dsn) as conn:
        final = store.get_backfill(conn, "sequin", created.id)
    assert final.state == "completed", final.error
    ids = [m["record"]["id"] for m in reads_of(dsn, "resumed_sink")]
    assert set(ids) == set(range(1, 120_001))  # nothing missing
    # resumed after the last page each range released, not from its recorded cursor: the pages in
    # flight at the kill whose reads were served (and maybe acked) are not read again
    assert len(ids) == 120_000, f"{len(ids) - 120_000} reads of rows already read"


def test_a_retried_range_task_takes_back_the_page_its_earlier_attempt_left_staged(
    app_db: tuple[str, StreamApp, Path],
) -> None:
    """A range's task that dies after staging a page (its executor lost before the high watermark)
    leaves that page's hidden reads in the stream table, first in their groups. The retried task
    (Spark's ``spark.task.maxFailures``; no new app, so ``start_backfill`` does not run) makes them
    stale before it reads the range again: each row is served once, and a later change of a row of
    the dead page is not held back behind a read that will never be released."""
    from sequin_provider.backfill.reader import RangeReader
    from sequin_provider.backfill.watermarks import page_reads

    dsn, _, config_path = app_db
    config = load_config(config_path)
    created = backfill(dsn, config_path, "retried_sink", "retried")
    with psycopg.connect(dsn) as conn:
        store.transition_backfill(conn, "sequin", created.id, "running")
        store.ensure_backfill_ranges(conn, "sequin", created.id, [(None, None)])
        # the earlier attempt: a page of rows 1-10 staged as hidden reads, its window never closed
        lsn = int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()[0])
        reads = page_reads(
            config.sink("retried_sink"), "app", created.id, "public", "retried", "2026-11-26T00:00:00Z", lsn
        )
        dead = stage(conn, created.id, [([str(i)], json.dumps({"id": i, "v": 0})) for i in range(1, 11)], reads)
        conn.commit()
    result = RangeReader(config, "app", created.id, 0, max_page_rows=1000).run()
    assert result.done and result.rows_processed == 3000
    execute(dsn, "UPDATE retried SET v = 1 WHERE id = 5")  # a row the dead page had read
    served: list[tuple[str, int]] = []

    def consumed() -> bool:
        with psycopg.connect(dsn) as conn:
            served.extend(receive(conn, "retried_sink", "id", 1000))
        return ("update", 5) in served

    wait_for(consumed, 120, what="the change of row 5, after its read")
    with psycopg.connect(dsn) as conn:
        assert store.get_backfill_page(conn, "sequin", dead).state == "stale"
    reads_served = sorted(i for action, i in served if action == "read")
    assert reads_served == list(range(1, 3001))  # each row once: the dead page's reads were taken back
    assert served.index(("read", 5)) < served.index(("update", 5))


def count_messages(dsn: str, sink: str) -> int:
    """Messages of the sink in the stream table (hidden reads included)."""
    with psycopg.connect(dsn) as conn:
        return int(conn.execute("SELECT count(*) FROM sequin.stream_messages WHERE sink = %s", (sink,)).fetchone()[0])


def test_a_second_app_for_a_backfill_that_is_being_run_is_refused_and_changes_nothing(
    app_db: tuple[str, StreamApp, Path], spark: Any
) -> None:
    from sequin_provider.backfill import BackfillBusy, run_lock

    dsn, app, config = app_db
    created = backfill(dsn, config, "nothing_sink", "nothing")
    holder = run_lock(dsn, "sequin", created.id, "the first app")
    assert holder.acquire()
    try:
        with pytest.raises(BackfillBusy, match=f"backfill {created.id} is being run by another app .*'the first app'"):
            run(spark, config, created.id, lock_wait=0.5)
    finally:
        holder.release()
    with psycopg.connect(dsn) as conn:
        assert store.get_backfill(conn, "sequin", created.id).state == "pending"
        assert store.backfill_ranges(conn, "sequin", created.id) == []
    # the app's supervisor goes while the app waits for the lock: once it has the lock, it starts nothing
    stopping, outcome = threading.Event(), []
    assert holder.acquire()
    try:
        waiting = threading.Thread(
            target=lambda: outcome.append(run(spark, config, created.id, lock_wait=60, stopping=stopping))
        )
        waiting.start()
        time.sleep(1.0)
        stopping.set()
    finally:
        holder.release()
    waiting.join(timeout=120)
    assert [b.state for b in outcome] == ["pending"]
    with psycopg.connect(dsn) as conn:
        assert store.get_backfill(conn, "sequin", created.id).state == "pending"
        assert store.backfill_ranges(conn, "sequin", created.id) == []
    assert run(spark, config, created.id).state == "completed"  # once the lock is free


def test_backfill_app_stops_when_its_supervisor_is_gone_and_leaves_the_backfill_to_resume(
    dsn: str, dbname: str, tmp_path: Path
) -> None:
    """An Airflow worker lost mid-backfill: the app (started in a session of its own, so it outlives the
    worker) stops by itself, the backfill stays running with its cursors, and the lock is free for the
    retry. No stream app runs here, so the app's first page waits for its window when the worker goes."""
    from sequin_provider.backfill import run_lock

    execute(dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 5000)")
    config = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}}}}]
        sinks: [{{name: t_sink, tables: [t], destination: {{type: sequin_stream}}}}]
        stream: {{checkpoint_location: {tmp_path / "ckpt"}}}
        """,
    )
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
    created = backfill(dsn, config, "t_sink", "t")
    worker = subprocess.Popen(["sleep", "600"])
    root = Path(__file__).resolve().parents[3]
    with open(tmp_path / "backfill.log", "wb") as log_file:
        app = subprocess.Popen(
            [
                sys.executable,
                str(root / "spark_apps" / "backfill.py"),
                "--config",
                str(config),
                "--backfill-id",
                str(created.id),
                "--master",
                "local[1]",
                "--window-timeout",
                "600",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "SEQUIN_SUPERVISOR_PID": str(worker.pid)},
        )
        try:
            wait_for(lambda: open_pages(dsn, created.id) or app.poll() is not None, 300, what="the app's first page")
            assert app.poll() is None, (tmp_path / "backfill.log").read_text()[-3000:]
            worker.kill()
            worker.wait()
            code = app.wait(timeout=180)
        finally:
            if app.poll() is None:
                os.killpg(app.pid, signal.SIGKILL)
    out = (tmp_path / "backfill.log").read_text()
    assert code == 1, out[-3000:]
    assert "the supervisor (pid" in out and "stays running" in out, out[-3000:]
    with psycopg.connect(dsn) as conn:
        after = store.get_backfill(conn, "sequin", created.id)
    assert after.state == "running" and after.error is None
    lock = run_lock(dsn, "sequin", created.id)
    assert lock.acquire(), "the stopped app released the backfill's run lock"
    lock.release()


def open_pages(dsn: str, backfill_id: int) -> bool:
    """Whether the backfill has a page in its window (staged, waiting for the stream app)."""
    with psycopg.connect(dsn) as conn:
        return bool(
            conn.execute(
                "SELECT count(*) FROM sequin.backfill_pages WHERE backfill_id = %s AND state IN ('open', 'staged')",
                (backfill_id,),
            ).fetchone()[0]
        )


def test_bad_backfill_requests_fail_clearly_through_the_cli(app_db: tuple[str, StreamApp, Path]) -> None:
    dsn, app, config = app_db
    cli = [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), "backfill"]
    cases = [
        (["start", "big_sink", "nope", "--no-run"], "does not capture public.nope"),
        (["start", "no_sink", "big", "--no-run"], "unknown sink 'no_sink'"),
        (
            ["start", "events_sink", "events", "--sort-column", "missing", "--start-position", "1", "--no-run"],
            "sort column 'missing' is not a column",
        ),
        (
            [
                "start",
                "events_sink",
                "events",
                "--sort-column",
                "updated_at",
                "--start-position",
                "yesterday-ish",
                "--no-run",
            ],
            "is not a valid timestamp with time zone",
        ),
        (["start", "big_sink", "big", "--max-query-ms", "0", "--no-run"], "max_query_ms must be an integer between 1"),
        (
            ["start", "big_sink", "big", "--where", "colour = 'red'", "--no-run"],
            'backfill condition "colour = \'red\'" is not valid on the source: column "colour" does not exist',
        ),
        (["start", "big_sink", "big", "--where", "n > 1; DROP TABLE big", "--no-run"], "';' is not allowed"),
        (["status", "999999"], "no backfill with id 999999"),
        (["cancel", "999999"], "no backfill with id 999999"),
    ]
    for args, message in cases:
        out = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (args, out.stdout, out.stderr)
    with psycopg.connect(dsn) as conn:  # a refused condition recorded nothing
        assert all(b.where is None for b in store.list_backfills(conn, "sequin", "big_sink"))
    first = subprocess.run(
        [*cli, "start", "docs_sink", "docs", "--no-run"], capture_output=True, text=True, timeout=120
    )
    assert first.returncode == 0, first.stderr
    second = subprocess.run(
        [*cli, "start", "docs_sink", "docs", "--no-run"], capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 2 and "already has an active backfill" in second.stderr
    backfill_id = int(first.stdout.split()[1].rstrip(":"))
    cancelled = subprocess.run([*cli, "cancel", str(backfill_id)], capture_output=True, text=True, timeout=60)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    with psycopg.connect(dsn) as conn:
        assert store.get_backfill(conn, "sequin", backfill_id).state == "cancelled"
    assert (
        json.loads(
            subprocess.run(
                [*cli, "status", "--sink", "docs_sink", "--json"], capture_output=True, text=True, timeout=60
            ).stdout
        )[0]["state"]
        == "cancelled"
    )


STORE_RENDERED_SINKS = {
    "change": "{name: s, tables: [tricky], destination: {type: sequin_stream}}",
    "record": "{name: s, tables: [tricky], message_kind: record, destination: {type: sequin_stream}}",
    "record_only": "{name: s, tables: [tricky], transform: record_only, destination: {type: sequin_stream}}",
    "ungrouped": "{name: s, tables: [tricky], message_grouping: false, destination: {type: sequin_stream}}",
}
TRICKY_KEYS = [
    "plain",
    'quote " and \\ backslash',
    "tab\tnew\nline\rcr\bbs\fff",
    "ünïcødé ✓ 😀",
    "it's",
    '["x"]',
    "unit\x1fsep\x0bvt\x01",
]


def tricky_backfill(dsn: str, tmp_path: Path, sink_yaml: str) -> tuple[Any, int]:
    """A ``tricky`` table and a running backfill of it for the sink ``s``: (sink config, backfill id)."""
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            f"""
databases: [{{name: app, dsn: "{dsn}"}}]
sinks: [{sink_yaml}]
""",
        )
    )
    execute(dsn, "CREATE TABLE tricky (k text, n int, PRIMARY KEY (k, n))")
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        created = store.create_backfill(conn, "sequin", "s", "public", "tricky")
        store.transition_backfill(conn, "sequin", created.id, "running")
    return config.sinks[0], created.id


def stage(
    conn: psycopg.Connection,
    backfill_id: int,
    rows: list[tuple[list[str], str]],
    reads: Any = None,
    after: int | None = None,
) -> int:
    """One page of ``rows`` staged (with ``reads``: written as the sink's hidden reads; ``after``:
    the page it follows); its id. Its cursor is its last row's key."""
    page = store.open_backfill_page(conn, "sequin", backfill_id, 0, after)
    assert store.stage_backfill_page(conn, "sequin", page, rows, rows[-1][0] if rows else None, reads)
    return page


@pytest.mark.parametrize("kind", sorted(STORE_RENDERED_SINKS))
def test_reads_the_task_writes_equal_the_pipelines_byte_for_byte(
    kind: str, dsn: str, tmp_path: Path, spark: Any
) -> None:
    """A page's reads written by the backfill task (plain Sequin Stream sinks), from staged rows,
    rendered by the source's SQL or rendered in the task with Arrow, must be exactly what the Spark pipeline writes for the same reads at
    the same position: data, group, idempotency key.
    Keys include control characters that JSON escapes as ``\\u00xx`` (Spark's own JSON would write
    ``\\u001F``). (The task numbers a page's reads before the close drops any, so dropping is
    tested on its own below.)"""
    import pyarrow as pa
    from psycopg import sql

    from sequin_provider import stream_queue
    from sequin_provider.backfill.reader import copy_out
    from sequin_provider.backfill.watermarks import page_reads, read_rows
    from sequin_provider.message_render import COPY_BINARY_HEADER, COPY_BINARY_TRAILER, read_rows_copy_binary
    from sequin_provider.messages import CHANGE_SCHEMA_DDL, json_text
    from sequin_provider.spark.pipeline import StreamWriter, project_batch

    staged = [
        (
            [k, str(n)],
            json.dumps({"k": k, "n": n, "amount": 1.50, "nested": {"a": [1, None]}}, ensure_ascii=n % 2 == 0).replace(
                "1.5,", "1.50,"
            ),
        )
        for n, k in enumerate(TRICKY_KEYS)
    ]
    sink, backfill_id = tricky_backfill(dsn, tmp_path, STORE_RENDERED_SINKS[kind])
    at = (987_654_321, 3, "2026-11-22T08:00:00.123456Z", 4242)  # the reads' position, time, xid
    with psycopg.connect(dsn) as conn:

        def written(stored: list[str] | None = None) -> list[tuple]:
            """The messages as the store serves them (then deleted); ``stored``: their data as stored."""
            rows = [
                (m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key, m.data)
                for m in store.stream_messages(conn, "sequin")
            ]
            if stored is not None:
                stored += [r[0] for r in conn.execute("SELECT data FROM sequin.stream_messages ORDER BY commit_idx")]
            conn.execute("DELETE FROM sequin.stream_messages")
            conn.commit()
            return rows

        # through Spark, as the stream app does for sinks with a filter or a transform
        page = stage(conn, backfill_id, staged)
        closed = store.close_backfill_window(conn, "sequin", page, True, set(), at[0])
        assert closed is not None and closed.in_store == 0 and len(closed.rows) == len(TRICKY_KEYS)
        reads = read_rows(at, "public", "tricky", backfill_id, "s", closed.rows)
        projected = project_batch(spark.createDataFrame(reads, CHANGE_SCHEMA_DDL), (sink,)).toArrow()
        result = next(StreamWriter(str(tmp_path / "sequin.yaml"), "app").write(iter(projected.to_batches())))
        assert result.column("written").to_pylist() == [len(TRICKY_KEYS)]
        through_spark = written()

        # written by the task as it stages the page, then closed by the stream app (and closed again: a replay)
        page = stage(
            conn, backfill_id, staged, page_reads(sink, "app", backfill_id, "public", "tricky", at[2], at[0], at[1])
        )
        assert conn.execute("SELECT count(*) FROM sequin.backfill_rows WHERE page_id = %s", (page,)).fetchone()[0] == 0
        closed = store.close_backfill_window(conn, "sequin", page, True, set(), at[0] + 10)
        assert closed is not None and closed.rows == [] and closed.in_store == len(TRICKY_KEYS)
        assert store.close_backfill_window(conn, "sequin", page, True, {(TRICKY_KEYS[2], "2")}, at[0] + 10) == closed
        assert store.close_backfill_window(conn, "sequin", page, False, set(), at[0] + 10) == closed  # decided once
        by_task = written()

        # rendered by the source's SQL and copied straight into the stream table (the path of tables
        # ``backfill_sql`` renders), through COPY's text escaping both ways
        page = store.open_backfill_page(conn, "sequin", backfill_id, 0)
        reads = page_reads(sink, "app", backfill_id, "public", "tricky", at[2], at[0], at[1])
        rows = sql.SQL("(VALUES {}) AS r (ordinal, record_pks, record)").format(
            sql.SQL(", ").join(
                sql.SQL("({}, {}::text[], {})").format(n, pks, record) for n, (pks, record) in enumerate(staged)
            )
        )
        data = copy_out(conn, sql.SQL("COPY ({}) TO STDOUT").format(store.read_messages_sql(reads, page, rows)))
        conn.commit()
        assert store.stage_page_reads_copy(conn, "sequin", page, (data,), len(staged), None, at[0])
        assert store.close_backfill_window(conn, "sequin", page, True, set(), at[0] + 10).in_store == len(TRICKY_KEYS)
        by_source = written()

        def staged_by_arrow(compact: bool) -> None:
            """The page rendered in the task from the records and keys (the compiled page path: COPY
            binary), staged and closed; ``compact`` as the backfill task writes it."""
            page = store.open_backfill_page(conn, "sequin", backfill_id, 0)
            conn.commit()
            body = read_rows_copy_binary(
                reads,
                page,
                pa.array([record for _, record in staged], pa.string()),
                pa.array([json_text(pks) for pks, _ in staged], pa.string()),
                compact=compact,
            )
            assert store.stage_page_reads_copy(
                conn,
                "sequin",
                page,
                (COPY_BINARY_HEADER, memoryview(body), COPY_BINARY_TRAILER),
                len(staged),
                None,
                at[0],
                binary=True,
                template=reads.template if compact else None,
            )
            closed = store.close_backfill_window(conn, "sequin", page, True, set(), at[0] + 10)
            assert closed is not None and closed.in_store == len(TRICKY_KEYS)

        staged_by_arrow(compact=False)
        by_arrow = written()

        # compact, as the backfill task writes them: each read stores its record alone, the page
        # the template, and the store serves the whole message (read back, and received)
        staged_by_arrow(compact=True)
        store.advance_visible_lsn(conn, "sequin", [sink.name], at[0] + 10)
        conn.commit()
        served = [d.data for d in stream_queue.receive(conn, "sequin", sink.name, 100, 30.0, 1000)]
        stored: list[str] = []
        compact = written(stored)

    assert len(through_spark) == len(TRICKY_KEYS)
    assert by_task == through_spark
    assert by_source == through_spark
    assert by_arrow == through_spark
    assert compact == through_spark
    assert served == [r[4] for r in through_spark]
    assert stored == ([record for _, record in staged] if kind != "record_only" else [r[4] for r in through_spark])
    if kind != "record_only":
        assert [json.loads(r[4])["metadata"]["record_pks"][0] for r in by_task] == TRICKY_KEYS


def tricky_reads(sink: Any, backfill_id: int, lsn: int) -> Any:
    """The ``StoreReads`` of a page of ``tricky`` read at position ``lsn``."""
    from sequin_provider.backfill.watermarks import page_reads

    return page_reads(sink, "app", backfill_id, "public", "tricky", "2026-11-22T08:00:00.000000Z", lsn)


def change(lsn: int, key: str) -> tuple:
    """A change of the ``tricky`` row ``(key, "1")`` at ``lsn``, as the stream app writes it for sink ``s``."""
    return ("s", lsn, 0, f'public.tricky:["{key}","1"]', f"{lsn}:0", json.dumps({"record": {"k": key, "n": 1}}))


def receive(conn: psycopg.Connection, sink: str = "s", key: str = "k", count: int = 10) -> list[tuple[str, Any]]:
    """What a consumer of ``sink`` is served now (then acked): (action, the record's ``key``) in order."""
    from sequin_provider import stream_queue

    got = stream_queue.receive(conn, "sequin", sink, count, 30.0, 1000)
    stream_queue.ack(conn, "sequin", sink, [d.ack_id for d in got])
    return [(json.loads(d.data).get("action", "change"), json.loads(d.data)["record"][key]) for d in got]


def test_task_written_reads_wait_for_their_window_and_go_with_a_page_that_is_not_emitted(
    dsn: str, tmp_path: Path
) -> None:
    """Reads the task wrote are served only once the stream app closed their window, and hold back
    their groups' later changes until then; a window not seen, or a backfill that stops, takes its
    pages' hidden reads back; a page taken back is not staged."""
    sink, backfill_id = tricky_backfill(dsn, tmp_path, STORE_RENDERED_SINKS["change"])

    def reads(lsn: int) -> Any:
        return tricky_reads(sink, backfill_id, lsn)

    with psycopg.connect(dsn) as conn:

        def hidden() -> int:
            return int(
                conn.execute("SELECT count(*) FROM sequin.stream_messages WHERE backfill_page IS NOT NULL").fetchone()[
                    0
                ]
            )

        page = stage(conn, backfill_id, [(["a", "1"], '{"k":"a","n":1}'), (["b", "1"], '{"k":"b","n":1}')], reads(1000))
        store.insert_stream_messages(conn, "sequin", [change(2000, "a"), change(2000 + 1, "z")])
        conn.commit()
        store.advance_visible_lsn(conn, "sequin", ["s"], 5000)
        assert receive(conn) == [("change", "z")]  # the reads are hidden, and a's change waits behind a's read
        assert hidden() == 2
        closed = store.close_backfill_window(conn, "sequin", page, True, {("b", "1")}, 1500)
        assert closed is not None and closed.in_store == 1
        assert receive(conn) == [("read", "a")]  # b changed inside the window: its read is gone
        assert receive(conn) == [("change", "a")]  # then a's change, in position order

        stale = stage(conn, backfill_id, [(["c", "1"], '{"k":"c","n":1}')], reads(3000))
        assert store.close_backfill_window(conn, "sequin", stale, False, set(), 3500) is None  # window not seen
        assert store.get_backfill_page(conn, "sequin", stale).state == "stale" and hidden() == 0

        stopped = stage(conn, backfill_id, [(["d", "1"], '{"k":"d","n":1}')], reads(4000))
        late = store.open_backfill_page(conn, "sequin", backfill_id, 0)
        assert hidden() == 1
        store.transition_backfill(conn, "sequin", backfill_id, "cancelled")
        assert store.get_backfill_page(conn, "sequin", stopped).state == "stale" and hidden() == 0
        assert not store.stage_backfill_page(conn, "sequin", late, [(["e", "1"], '{"k":"e","n":1}')], None, reads(4500))
        assert hidden() == 0 and receive(conn) == []


def test_a_page_after_one_not_released_is_not_released_and_a_resumed_range_counts_what_was(
    dsn: str, tmp_path: Path
) -> None:
    """A stream app restart breaks the window of the page in flight (stale), while the pages the job
    read after it are seen whole: they are not released either, so the job reads all of them again
    from the stale page's start and no row's read is served twice (a consumer may have acked the
    first). A job that stops with released pages it has not counted resumes after them."""
    sink, backfill_id = tricky_backfill(dsn, tmp_path, STORE_RENDERED_SINKS["change"])

    def rows(*keys: str) -> list[tuple[list[str], str]]:
        return [([k, "1"], json.dumps({"k": k, "n": 1})) for k in keys]

    with psycopg.connect(dsn) as conn:
        store.ensure_backfill_ranges(conn, "sequin", backfill_id, [(None, None)])
        store.advance_visible_lsn(conn, "sequin", ["s"], 10_000)
        broken = stage(conn, backfill_id, rows("a", "b"), tricky_reads(sink, backfill_id, 1000))
        second = stage(conn, backfill_id, rows("c", "d"), tricky_reads(sink, backfill_id, 2000), after=broken)
        third = stage(conn, backfill_id, rows("e"), tricky_reads(sink, backfill_id, 3000), after=second)
        assert store.close_backfill_window(conn, "sequin", broken, False, set(), 1500) is None  # not seen
        assert store.close_backfill_window(conn, "sequin", second, True, set(), 2500) is None  # seen, follows it
        assert store.close_backfill_window(conn, "sequin", third, True, set(), 3500) is None
        assert [store.get_backfill_page(conn, "sequin", p).state for p in (broken, second, third)] == ["stale"] * 3
        assert receive(conn) == []  # none of their reads is served

        # read again from the broken page's start; two pages released, then the job stops
        again = stage(conn, backfill_id, rows("a", "b"), tricky_reads(sink, backfill_id, 4000))
        then = stage(conn, backfill_id, rows("c", "d"), tricky_reads(sink, backfill_id, 5000), after=again)
        for page, high in ((again, 4500), (then, 5500)):
            closed = store.close_backfill_window(conn, "sequin", page, True, set(), high)
            assert closed is not None and closed.in_store == 2
        assert receive(conn) == [("read", k) for k in "abcd"]  # served and acked

        released = store.released_pages_after(conn, "sequin", backfill_id, 0, None)
        assert [(p.id, p.rows_staged, p.cursor_after, p.reads_written) for p in released] == [
            (again, 2, ["b", "1"], True),
            (then, 2, ["d", "1"], True),
        ]
        store.advance_backfill_range(conn, "sequin", backfill_id, 0, ["b", "1"], 2, 2, False, again)
        (rng,) = store.backfill_ranges(conn, "sequin", backfill_id)
        assert rng.last_page == again and rng.cursor == ["b", "1"]
        assert [p.id for p in store.released_pages_after(conn, "sequin", backfill_id, 0, again)] == [then]
        assert store.released_pages_after(conn, "sequin", backfill_id, 0, then) == []


def test_a_released_read_waits_for_the_batch_that_closed_its_window(dsn: str, tmp_path: Path) -> None:
    """A page's reads sit just after its low watermark, so they lie inside the micro-batch that the
    stream app is still writing when it meets the page's high watermark and releases them. The sink's
    visibility watermark keeps them back until that batch is in the store: a change of the same row
    earlier in that batch is served first."""
    sink, backfill_id = tricky_backfill(dsn, tmp_path, STORE_RENDERED_SINKS["change"])
    with psycopg.connect(dsn) as conn:
        store.advance_visible_lsn(conn, "sequin", ["s"], 5000)  # the last batch in the store ended at 5000
        page = stage(conn, backfill_id, [(["g", "1"], '{"k":"g","n":2}')], tricky_reads(sink, backfill_id, 6000))
        # the next batch (5000, 7000] holds a change of g at 5500, the page's window and its high mark at 6500
        assert store.close_backfill_window(conn, "sequin", page, True, set(), 6500) is not None
        assert store.get_backfill_page(conn, "sequin", page).state == "closing"
        assert receive(conn) == []  # released, but above the visible position: the batch is not in yet
        store.insert_stream_messages(conn, "sequin", [change(5500, "g")])
        conn.commit()
        store.advance_visible_lsn(conn, "sequin", ["s"], 7000)  # the batch is in the store
        assert receive(conn) == [("change", "g")]
        assert receive(conn) == [("read", "g")]


def test_a_windows_close_keeps_a_custom_plan_however_many_pages_it_closes(dsn: str, tmp_path: Path) -> None:
    """The stream app closes every page on one store connection. The close deletes the reads whose
    key changed inside the window, matched against thousands of keys under concurrent writes; a
    prepared (generic) plan compares each read with every key (seconds per page, measured in
    ``bench/backfill_throughput.py`` (c)), so the delete must never be prepared. Each close still
    takes back exactly the changed keys' reads."""
    sink, backfill_id = tricky_backfill(dsn, tmp_path, STORE_RENDERED_SINKS["change"])
    with psycopg.connect(dsn) as conn:
        for n in range(12):  # psycopg prepares a statement on its 6th execution
            keys = [f"p{n}k{i}" for i in range(30)]
            page = stage(
                conn,
                backfill_id,
                [([k, "1"], json.dumps({"k": k, "n": 1})) for k in keys],
                tricky_reads(sink, backfill_id, 1000 * (n + 1)),
            )
            changed = {(k, "1") for k in keys[::3]} | {(f"elsewhere{i}", "1") for i in range(50)}
            closed = store.close_backfill_window(conn, "sequin", page, True, changed, 1000 * (n + 1) + 500)
            assert closed is not None and closed.in_store == 20
            left = [
                r[0]
                for r in conn.execute(
                    "SELECT data::json #>> '{record,k}' FROM sequin.stream_messages"
                    " WHERE backfill_page = %s ORDER BY commit_idx",
                    (page,),
                )
            ]
            assert left == [k for i, k in enumerate(keys) if i % 3]
        prepared = [r[0] for r in conn.execute("SELECT statement FROM pg_prepared_statements")]
        assert not [s for s in prepared if "DELETE FROM" in s and "idempotency_key" in s], prepared
