"""The backfill server (``spark_apps/backfill.py --serve``, ``sequin backfill serve``): real Postgres, the
stream app and the server as subprocesses, ``sequin backfill start`` as a user runs it. Nothing is mocked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import BackfillServerProcess, wait_for
from sequin_provider import store
from sequin_provider.backfill.control import DEFAULT_PAGES_IN_FLIGHT
from tests.support.backfills import backfill, ranges_moved
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - {{name: orders_sink, tables: [orders], destination: {{type: sequin_stream}}}}
  - {{name: lines_sink, tables: [lines], destination: {{type: sequin_stream}}}}
  - {{name: gone_sink, tables: [gone], destination: {{type: sequin_stream}}}}
  - {{name: big_sink, tables: [big], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {checkpoint}
"""
SCHEMA = [
    "CREATE TABLE orders (id bigint PRIMARY KEY, note text)",
    "INSERT INTO orders SELECT g, 'order ' || g FROM generate_series(1, 20000) g",
    "CREATE TABLE lines (order_id int, line int, sku text, PRIMARY KEY (order_id, line))",
    "INSERT INTO lines SELECT o, l, 'sku-' || l FROM generate_series(1, 500) o, generate_series(1, 4) l",
    "CREATE TABLE gone (id int PRIMARY KEY)",
    "CREATE TABLE big (id bigint PRIMARY KEY, name text NOT NULL)",
    "INSERT INTO big SELECT g, 'row ' || g FROM generate_series(1, 400000) g",
    "ANALYZE",
]
PAGE_ROWS = 2000


def cli(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), *args]


@pytest.fixture(scope="module")
def served(
    pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, Path, StreamApp]]:
    """A database with the tables above and the stream app, past provisioning (store, publication, slot)
    but maybe still starting Spark (no server yet): each test starts its server meanwhile, then waits
    for both."""
    db = "backfill_server"
    dsn = pg.create_database(db)
    execute(dsn, *SCHEMA)
    tmp = tmp_path_factory.mktemp("backfill_server")
    config = write_config(tmp / "sequin.yaml", CONFIG.format(dsn=dsn, db=db, checkpoint=tmp / "ckpt"))
    app = StreamApp(config, tmp / "app.log").start()
    try:

        def provisioned() -> bool:
            app.check_alive()
            return "created replication slot" in app.log_tail(1_000_000)  # logged once provisioning is done

        wait_for(provisioned, 180, what="the stream app to provision the database")
        yield dsn, config, tmp, app
    finally:
        app.stop()


def read_keys(dsn: str, sink: str, key: tuple[str, ...]) -> list[tuple[object, ...]]:
    return [tuple(m["record"][k] for k in key) for m in sink_messages(dsn, sink) if m["action"] == "read"]


def final_state(dsn: str, backfill_id: int) -> store.Backfill:
    with psycopg.connect(dsn) as conn:
        return store.get_backfill(conn, "sequin", backfill_id)


def test_server_runs_each_backfill_as_it_is_recorded_and_refuses_a_second_server(
    served: tuple[str, Path, Path, StreamApp],
) -> None:
    dsn, config, tmp, app = served
    # recorded while no server is up, then its table dropped: the server cannot start it
    doomed = backfill(dsn, config, "gone_sink", "gone")
    execute(dsn, "DROP TABLE gone")
    with psycopg.connect(dsn) as conn:  # recorded for a sink since taken out of the config
        retired = store.create_backfill(conn, "sequin", "retired_sink", "public", "orders")
    server = BackfillServerProcess(config, tmp / "server.log", "--master", "local[2]").start()
    try:
        app.wait_streaming(dsn)
        server.wait_up()
        wait_for(lambda: final_state(dsn, doomed.id).state == "failed", 120, what="the doomed backfill marked failed")
        assert "gone" in (final_state(dsn, doomed.id).error or "")
        wait_for(lambda: final_state(dsn, retired.id).state == "failed", 120, what="the retired sink's backfill")
        assert "no longer in the config" in (final_state(dsn, retired.id).error or "")

        # `sequin backfill start` hands the backfill to the server and follows it to its end
        out = subprocess.run(
            cli(config, "backfill", "start", "orders_sink", "orders"), capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert "the backfill server" in out.stdout and "runs it" in out.stdout, out.stdout
        assert "completed, 20,000/20,000 rows" in out.stdout, out.stdout
        keys = read_keys(dsn, "orders_sink", ("id",))
        assert sorted(keys) == [(i,) for i in range(1, 20001)]  # every row once

        # a backfill recorded as the operator does (no CLI) is taken too, in the same app
        lines = backfill(dsn, config, "lines_sink", "lines")
        wait_for(lambda: final_state(dsn, lines.id).state == "completed", 300, what="the lines backfill")
        assert sorted(read_keys(dsn, "lines_sink", ("order_id", "line"))) == [
            (o, n) for o in range(1, 501) for n in range(1, 5)
        ]

        second = subprocess.run(cli(config, "backfill", "serve"), capture_output=True, text=True, timeout=300)
        assert second.returncode == 3, second.stderr[-3000:]
        assert "already has a backfill server" in second.stderr
        server.check_alive()  # the first one is untouched
    finally:
        code = server.stop(120)
    log = server.log_tail(1_000_000)
    assert code == 0, log[-3000:]
    assert log.count("backfill server up") == 1
    assert "backfill server stopped" in log


def test_a_backfill_whose_server_is_killed_is_finished_by_the_cli_that_followed_it(
    served: tuple[str, Path, Path, StreamApp],
) -> None:
    """SIGKILL the server mid-backfill: the `sequin backfill start` that followed it runs the rest itself,
    resuming from the ranges' cursors, and nothing is missing."""
    dsn, config, tmp, app = served
    server = BackfillServerProcess(
        config, tmp / "server-killed.log", "--master", "local[2]", "--max-page-rows", str(PAGE_ROWS)
    ).start()  # small pages: a run long enough to kill it in
    try:
        app.wait_streaming(dsn)
        server.wait_up()
        with open(tmp / "start.log", "wb") as out:
            start = subprocess.Popen(
                cli(
                    config,
                    "backfill",
                    "start",
                    "big_sink",
                    "big",
                    "--ranges",
                    "2",
                    "--max-page-rows",
                    str(PAGE_ROWS),
                    "--master",
                    "local[2]",
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                wait_for(
                    lambda: _big_backfill_moved(dsn) or start.poll() is not None,
                    300,
                    what="the big backfill's progress",
                )
                assert start.poll() is None, (tmp / "start.log").read_text()[-3000:]
                server.kill()
                assert start.wait(timeout=600) == 0, (tmp / "start.log").read_text()[-3000:]
            finally:
                if start.poll() is None:
                    start.kill()
    finally:
        server.kill()
    text = (tmp / "start.log").read_text()
    assert "runs it" in text and "went away before the backfill ended; running it here" in text, text[-3000:]
    ids = [k[0] for k in read_keys(dsn, "big_sink", ("id",))]
    assert set(ids) == set(range(1, 400001))  # nothing missing
    # resumed from the cursors: at most the pages in flight at the kill are read again
    assert len(ids) - 400000 <= 2 * DEFAULT_PAGES_IN_FLIGHT * PAGE_ROWS, len(ids)


def _big_backfill_moved(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        found = [b for b in store.list_backfills(conn, "sequin", "big_sink")]
    return bool(found) and ranges_moved(dsn, found[0].id)  # newest first
