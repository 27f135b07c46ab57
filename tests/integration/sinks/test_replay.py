"""Change retention and replays (docs/replays.md) against real servers: a Postgres changelog kept by the
stream app, pruned by its retention period, replayed into a webhook endpoint on loopback, ordered against
live changes of the same rows, marked, and selected by a range and a SQL condition."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.config import ConfigError, load_config, parse_config
from sequin_provider.exceptions import ReplayError
from sequin_provider.provisioning import initialize
from sequin_provider.replay import ReplayRequest, plan_replay
from sequin_provider.sinks.changelog import parse_bound
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.receiver import Receiver
from tests.support.stream_app import cli

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: log
    tables: [orders, notes]
    destination: {{type: postgres_table, mode: changelog, dsn: "{target}", table: cdc.changes, create_table: true,
                   retention: {retention}}}
  - name: hook
    tables: [orders]
    destination: {{type: webhook, url: "{url}", batch: false, timeout: 5s}}
stream:
  checkpoint_location: {ckpt}
"""


@pytest.fixture
def target(pg: EmbeddedPostgres, dbname: str) -> str:
    """A second database of the test cluster: where the changelog is kept."""
    return pg.create_database(f"{dbname[:40]}_log")


def write(tmp_path: Path, dsn: str, db: str, target: str, url: str, retention: str = "30d") -> Path:
    text = CONFIG.format(dsn=dsn, db=db, target=target, url=url, retention=retention, ckpt=tmp_path / "ckpt")
    return write_config(tmp_path / "sequin.yaml", text)


def changelog(target: str) -> list[tuple[Any, ...]]:
    """The changelog's rows in position order: (lsn, idx, action, table, record as dict)."""
    with psycopg.connect(target) as conn:
        return conn.execute(
            "SELECT commit_lsn, commit_idx, action, table_name, record FROM cdc.changes ORDER BY 1, 2"
        ).fetchall()


# --- options and requests, no server ---------------------------------------------------------------


def config_of(sinks: list[dict[str, Any]]) -> Any:
    data = {"databases": [{"name": "app", "dsn": "postgresql://127.0.0.1/app"}], "sinks": sinks}
    return parse_config(data, "sequin.yaml", environ={})


LOG = {
    "name": "log",
    "tables": ["a", "b"],
    "destination": {"type": "postgres_table", "dsn": "x", "table": "c.l", "mode": "changelog"},
}
HOOK = {"name": "hook", "tables": ["a"], "destination": {"type": "webhook", "url": "http://h/"}}


@pytest.mark.parametrize(
    ("destination", "path", "reason"),
    [
        ({"mode": "log"}, "sinks[0].destination.mode", "expected mirror or changelog"),
        ({"retention": "7d"}, "sinks[0].destination.retention", "only a changelog"),
        ({"mode": "changelog", "retention": "soon"}, "sinks[0].destination.retention", "not a duration"),
        ({"mode": "changelog", "retention": 0}, "sinks[0].destination.retention", "longer than 0s"),
        ({"mode": "changelog", "columns": {"a": "b"}}, "sinks[0].destination.columns", "whole records"),
    ],
)
def test_bad_changelog_options_name_the_key(destination: dict[str, Any], path: str, reason: str) -> None:
    sink = {
        "name": "log",
        "tables": ["a"],
        "destination": {"type": "postgres_table", "dsn": "x", "table": "t", **destination},
    }
    with pytest.raises(ConfigError, match=re.escape(path) + ": .*" + reason):
        config_of([sink])


def test_a_retention_in_days_and_the_iceberg_changelog_takes_one_too() -> None:
    config = config_of([{**LOG, "destination": {**LOG["destination"], "retention": "7d"}}])
    assert config.sink("log").destination.options.retention == 7 * 86400
    iceberg = {"type": "iceberg", "catalog": {"uri": "sqlite:///x.db", "warehouse": "/tmp/w"}}
    config = config_of([{"name": "lake", "tables": ["a"], "destination": {**iceberg, "retention": "36h"}}])
    assert config.sink("lake").destination.options.retention == 36 * 3600
    with pytest.raises(ConfigError, match="only a changelog"):
        config_of([{"name": "lake", "tables": ["a"], "destination": {**iceberg, "mode": "mirror", "retention": "1d"}}])


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (ReplayRequest("nope", "hook"), "no sink named 'nope'"),
        (ReplayRequest("hook", "log"), "sink 'hook' keeps no changelog"),
        (ReplayRequest("log", "log"), "cannot replay into itself"),
        (ReplayRequest("log", "hook", ("public.b",)), "table public.b is not one of sink 'hook'"),
        (ReplayRequest("log", "hook", ("c",)), "table public.c is not one of sink 'log'"),
        (ReplayRequest("log", "hook", where="a = 1; DROP TABLE x"), "replay condition .*';' is not allowed"),
        (ReplayRequest("log", "hook", since="yesterday"), "since 'yesterday': expected a time"),
        (ReplayRequest("log", "lake"), "sink 'lake' cannot take a replay: it is an Iceberg mirror"),
    ],
)
def test_a_replay_that_cannot_be_made_says_why(request_: ReplayRequest, reason: str) -> None:
    lake = {
        "name": "lake",
        "tables": ["a"],
        "destination": {
            "type": "iceberg",
            "mode": "mirror",
            "catalog": {"uri": "sqlite:///x.db", "warehouse": "/tmp/w"},
        },
    }
    with pytest.raises(ReplayError, match=reason):
        plan_replay(config_of([LOG, HOOK, lake]), request_)


def test_range_ends_are_times_or_positions() -> None:
    assert parse_bound("2026-11-26T10:00:00Z", "since").timestamp == datetime(2026, 11, 26, 10, tzinfo=timezone.utc)
    assert parse_bound("2026-11-26 10:00", "since").timestamp == datetime(2026, 11, 26, 10, tzinfo=timezone.utc)
    assert parse_bound("123:4", "since").position == (123, 4)
    assert parse_bound("123", "since").position == (123, 0)
    assert parse_bound("1/0000000A", "since").position == ((1 << 32) + 10, 0)


# --- through the stream app ------------------------------------------------------------------------


def test_the_changelog_keeps_every_change_and_prunes_past_its_retention(
    dsn: str, dbname: str, target: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(
        dsn,
        "CREATE TABLE orders (id int PRIMARY KEY, status text, v numeric)",
        "CREATE TABLE notes (id int PRIMARY KEY, t text)",
    )
    receiver = Receiver().start()
    try:
        config = write(tmp_path, dsn, dbname, target, receiver.url, retention="3s")
        report = initialize(load_config(config))
        assert "changelog table cdc.changes" in report.created
        app = stream_app(config)
        app.wait_streaming(dsn)
        execute(
            dsn,
            "INSERT INTO orders VALUES (1, 'new', 12345678901234567890.123456789)",
            "UPDATE orders SET status = 'paid' WHERE id = 1",
            "INSERT INTO notes VALUES (1, 'x')",
            "DELETE FROM notes WHERE id = 1",
        )
        first = wait_for(
            lambda: (lambda r: r if len(r) == 4 else None)(changelog(target)), 120, what="4 changelog rows"
        )
        assert [(r[2], r[3]) for r in first] == [
            ("insert", "orders"),
            ("update", "orders"),
            ("insert", "notes"),
            ("delete", "notes"),
        ]
        with psycopg.connect(target) as conn:  # every digit of the numeric, as the message had it
            assert conn.execute("SELECT record->>'v' FROM cdc.changes ORDER BY 1 LIMIT 1").fetchone() == (
                "12345678901234567890.123456789",
            )
        time.sleep(4)  # past the retention period: the next request prunes the first four
        execute(dsn, "INSERT INTO notes VALUES (2, 'y')")
        later = wait_for(
            lambda: (lambda r: r if len(r) == 1 else None)(changelog(target)), 120, what="the old rows pruned"
        )
        assert [(r[2], r[3]) for r in later] == [("insert", "notes")]
    finally:
        receiver.stop()


def test_a_replay_delivers_the_matching_changes_again_marked_and_in_order_with_live_ones(
    dsn: str, dbname: str, target: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(
        dsn,
        "CREATE TABLE orders (id int PRIMARY KEY, status text, v int)",
        "CREATE TABLE notes (id int PRIMARY KEY, t text)",
    )
    receiver = Receiver().start()
    try:
        config = write(tmp_path, dsn, dbname, target, receiver.url)
        initialize(load_config(config))
        app = stream_app(config)
        app.wait_streaming(dsn)
        execute(dsn, "INSERT INTO orders SELECT g, 'new', 0 FROM generate_series(1, 20) g")
        wait_for(lambda: len(changelog(target)) == 20 or None, 120, what="the inserts in the changelog")
        since = datetime.now(timezone.utc).isoformat()
        for n in range(1, 4):  # three rounds: some orders paid, every order's v moves
            execute(
                dsn,
                "UPDATE orders SET v = v + 1, status = CASE WHEN id % 3 = 0 THEN 'paid' ELSE status END",
                f"DELETE FROM orders WHERE id = {n}",
                "INSERT INTO notes VALUES (%d, 'n')" % n,
            )
        total = 20 + 3 * 20 - 0 - (0 + 1 + 2) + 3  # inserts, updates (fewer as rows go), deletes
        rows = wait_for(
            lambda: (lambda r: r if len(r) >= total else None)(changelog(target)), 120, what="the changelog"
        )
        wait_for(lambda: len(receiver.messages()) >= 20 + 57 + 3 or None, 120, what="the live messages")
        live_before = len(receiver.messages())

        # --where over the changelog's columns, --since a time: the paid orders' changes since then
        expected = [
            r
            for r in rows
            if r[3] == "orders" and r[2] != "insert" and r[4] is not None and r[4].get("status") == "paid"
        ]
        queued = cli(
            config, "replay", "log", "hook", "--since", since, "--where", "record->>'status' = 'paid'", "--no-deliver"
        )
        assert queued.returncode == 0, queued.stderr
        assert f"{len(expected)} changes from log queued for sink hook" in queued.stdout
        replay_id = int(queued.stdout.split()[1].rstrip(":"))
        # Live changes of the same rows after the replay was queued wait behind its messages.
        execute(dsn, "UPDATE orders SET v = 100 WHERE id % 3 = 0")
        with psycopg.connect(dsn) as conn:
            wait_for(
                lambda: (
                    len([m for m in store.list_buffered(conn, "sequin", "hook") if "behind" in (m.last_error or "")])
                    >= 5
                    or None
                ),
                120,
                what="the live changes parked behind the replay",
            )
        assert len(receiver.messages()) == live_before  # nothing of those rows went ahead
        retried = cli(config, "buffer", "retry", "--sink", "hook")
        assert retried.returncode == 0, retried.stdout + retried.stderr
        after = receiver.messages()[live_before:]
        replayed = [m for m in after if m["metadata"].get("replay_id") == replay_id]
        # exactly the matching changes, each once, with its original position and a replay key
        assert sorted((m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]) for m in replayed) == [
            (r[0], r[1]) for r in expected
        ]
        for m, r in zip(
            sorted(replayed, key=lambda m: (m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"])), expected
        ):
            assert (m["action"], m["record"]) == (r[2], r[4])
            assert m["metadata"]["idempotency_key"] == f"replay:{replay_id}:{r[0]}:{r[1]}"
            assert m["metadata"]["consumer"]["name"] == "hook"
        # per row: the replayed changes in their order, then the live update that waited
        by_row: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for m in after:
            by_row[m["record"]["id"]].append(m)
        for key, messages in by_row.items():
            replays = [m for m in messages if "replay_id" in m["metadata"]]
            positions = [(m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]) for m in replays]
            assert positions == sorted(positions), key
            assert messages[: len(replays)] == replays, key
            if key > 3:  # not deleted: its live update came after the replayed changes, and last
                assert messages[len(replays) :] == [messages[-1]], key
                assert messages[-1]["record"]["v"] == 100 and "replay_id" not in messages[-1]["metadata"], key
        assert sorted(k for k in by_row if k > 3) == [6, 9, 12, 15, 18]
        with psycopg.connect(dsn) as conn:
            assert store.list_buffered(conn, "sequin", "hook") == []
            (recorded,) = [r for r in store.list_replays(conn, "sequin") if r.id == replay_id]
        assert (recorded.source_sink, recorded.sink, recorded.messages) == ("log", "hook", len(expected))
        assert recorded.row_filter == "record->>'status' = 'paid'" and recorded.since == since

        # a position range, delivered at once: the first 20 inserts again
        first, last = rows[0], rows[19]
        again = cli(config, "replay", "log", "hook", "--until", f"{last[0]}:{last[1] + 1}", "--table", "orders")
        assert again.returncode == 0, again.stderr
        assert "20 changes from log queued for sink hook; hook: delivered 20" in again.stdout
        second = [m for m in receiver.messages() if m["metadata"].get("replay_id") == replay_id + 1]
        assert sorted(m["record"]["id"] for m in second) == list(range(1, 21))
        assert {m["action"] for m in second} == {"insert"}
        assert {m["metadata"]["commit_lsn"] for m in second} == {r[0] for r in rows[:20]}
        assert first[0] == rows[0][0]
    finally:
        receiver.stop()


def test_a_replay_from_a_missing_changelog_or_with_a_bad_condition_is_refused_with_the_reason(
    dsn: str, dbname: str, target: str, tmp_path: Path
) -> None:
    execute(
        dsn, "CREATE TABLE orders (id int PRIMARY KEY, status text)", "CREATE TABLE notes (id int PRIMARY KEY, t text)"
    )
    config = write(tmp_path, dsn, dbname, target, "http://127.0.0.1:9/hook")
    missing = cli(config, "replay", "log", "hook")
    assert missing.returncode == 2
    assert "error: reading changelog of sink 'log'" in missing.stderr and "cdc.changes" in missing.stderr
    initialize(load_config(config))
    bad = cli(config, "replay", "log", "hook", "--where", "nosuch = 1")
    assert bad.returncode == 2
    assert 'column "nosuch" does not exist' in bad.stderr
