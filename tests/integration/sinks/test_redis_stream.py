"""The redis_stream sink against the machine's Redis (127.0.0.1:6379): config errors, the sender's
idempotent adds, ``sequin init``'s checks, and the stream app delivering three tables and a backfill
through a SIGKILL, and through Redis "down" (a ``TcpProxy`` in front of it cut) and back.

Every test uses its own key prefix and deletes what it created. Without a Redis on 6379 the tests
that need one skip.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.config import ConfigError, SinkConfig, parse_config
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.provisioning import initialize
from sequin_provider.sinks import kind
from tests.support.backfills import backfill
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.stream_app import cli
from tests.support.tcp_proxy import TcpProxy

REDIS_PORT = 6379


def _redis_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", REDIS_PORT), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture()
def redis_client() -> Any:
    """A client of the machine's Redis, or the test skips."""
    if not _redis_up():
        pytest.skip(f"needs Redis on 127.0.0.1:{REDIS_PORT}")
    import redis

    client = redis.Redis(port=REDIS_PORT, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture()
def prefix(redis_client: Any) -> Iterator[str]:
    """A key prefix of this test; its keys are deleted afterwards."""
    name = f"sequin-test-{uuid.uuid4().hex[:10]}"
    yield name
    keys = list(redis_client.scan_iter(match=f"{name}*", count=1000))
    for start in range(0, len(keys), 500):
        redis_client.delete(*keys[start : start + 500])


def _sink(destination: dict[str, Any], dsn: str = "postgresql:///x", tables: list[str] | None = None) -> SinkConfig:
    config = parse_config(
        {
            "databases": [{"name": "app", "dsn": dsn}],
            "sinks": [{"name": "events", "tables": tables or ["kv"], "destination": destination}],
        },
        "sequin.yaml",
    )
    return config.sinks[0]


def _message(table: str, k: int, v: int) -> str:
    return json.dumps({"record": {"k": k, "v": v}, "action": "update", "metadata": {"table_name": table}})


def entries(client: Any, key: str) -> list[tuple[str, dict[str, Any]]]:
    """A stream's entries as (idempotency key, message), in stream order."""
    return [(f[b"key"].decode(), json.loads(f[b"data"])) for _, f in client.xrange(key)]


# --- options ---------------------------------------------------------------------------------------


def test_options_are_typed_with_defaults() -> None:
    options = _sink({"type": "redis_stream", "stream_key": "cdc.{table_name}"}).destination.options
    assert (options.url, options.stream_key.spec, options.maxlen, options.batch_size) == (
        "redis://127.0.0.1:6379/0",
        "cdc.{table_name}",
        None,
        100,
    )
    assert (options.timeout, options.dedupe_window, options.create, options.concurrency) == (10.0, 86400.0, True, 4)
    assert "secret" not in repr(_sink({"type": "redis_stream", "stream_key": "s", "url": "redis://:secret@h"}))


@pytest.mark.parametrize(
    ("extra", "path", "reason"),
    [
        ({"stream_key": None}, "stream_key", "is required"),
        ({"url": "http://h:6379"}, "url", "expected redis://"),
        ({"url": "redis://h:99999"}, "url", "expected redis://"),
        ({"url": "redis://h/db"}, "url", "expected redis://"),
        ({"stream_key": "cdc.{table}"}, "stream_key", "unknown placeholder {table}"),
        ({"maxlen": 0}, "maxlen", "must be >= 1, got 0"),
        ({"batch_size": 1001}, "batch_size", "must be between 1 and 1000"),
        ({"dedupe_window": "500ms"}, "dedupe_window", "must be at least 1s"),
        ({"timeout": 0}, "timeout", "must be more than 0"),
        ({"create": "yes"}, "create", ""),
        ({"stream": "x"}, "stream", "unknown key (allowed: batch_size, concurrency, create, dedupe_window, maxlen,"),
    ],
)
def test_bad_options_name_the_key_path(extra: dict[str, Any], path: str, reason: str) -> None:
    destination = {"type": "redis_stream", "stream_key": "s", **extra}
    if extra.get("stream_key", "") is None:
        del destination["stream_key"]
    with pytest.raises(ConfigError) as err:
        _sink(destination)
    assert err.value.path == f"sinks[0].destination.{path}" and reason in err.value.reason


# --- the sender against Redis ------------------------------------------------------------------


def test_a_replayed_request_adds_nothing_twice_and_a_request_cut_short_loses_nothing(
    redis_client: Any, prefix: str
) -> None:
    sink = _sink({"type": "redis_stream", "stream_key": prefix + ".{table_name}", "batch_size": 10})
    sender = kind("redis_stream").pusher(sink)
    try:
        batch = [_message("a", 1, 0), _message("a", 1, 1), _message("b", 2, 0)]
        keys = ["10:0", "10:1", "11:0"]
        redis_client.set(f"{prefix}.b", "not a stream")  # the third message's stream is refused
        with pytest.raises(DeliveryError, match="WRONGTYPE"):
            sender.send(batch, keys)
        assert [k for k, _ in entries(redis_client, f"{prefix}.a")] == ["10:0", "10:1"]  # added before the refusal
        redis_client.delete(f"{prefix}.b")
        sender.send(batch, keys)  # the whole request again (a parked retry, a replayed batch)
        sender.send(batch, keys)
        assert entries(redis_client, f"{prefix}.a") == [("10:0", json.loads(batch[0])), ("10:1", json.loads(batch[1]))]
        assert entries(redis_client, f"{prefix}.b") == [("11:0", json.loads(batch[2]))]
        # a later position first, an earlier one of another group after (two lanes): both are added
        sender.send([_message("a", 3, 0)], ["20:0"])
        sender.send([_message("a", 4, 0)], ["15:0"])
        assert [k for k, _ in entries(redis_client, f"{prefix}.a")] == ["10:0", "10:1", "20:0", "15:0"]
        assert 86_000_000 < redis_client.pttl(f"{prefix}.a:seen:10:0") <= 86_400_000
    finally:
        sender.close()


def test_the_dedupe_window_and_approximate_trimming(redis_client: Any, prefix: str) -> None:
    sink = _sink({"type": "redis_stream", "stream_key": prefix, "dedupe_window": "1s", "maxlen": 10})
    sender = kind("redis_stream").pusher(sink)
    try:
        sender.send([_message("t", 1, 0)], ["1:0"])
        time.sleep(1.2)
        sender.send([_message("t", 1, 0)], ["1:0"])  # remembered for 1 s only: added again
        assert [k for k, _ in entries(redis_client, prefix)] == ["1:0", "1:0"]
        for start in range(0, 1000, 100):
            sender.send(
                [_message("t", n, 0) for n in range(start, start + 100)], [f"2:{n}" for n in range(start, start + 100)]
            )
        assert 10 <= redis_client.xlen(prefix) < 300  # MAXLEN ~ trims whole nodes, not exactly 10
        assert entries(redis_client, prefix)[-1][0] == "2:999"
    finally:
        sender.close()


def test_create_false_refuses_a_missing_stream_and_adds_nothing(redis_client: Any, prefix: str) -> None:
    sink = _sink({"type": "redis_stream", "stream_key": prefix + ".{table_name}", "create": False})
    sender = kind("redis_stream").pusher(sink)
    try:
        redis_client.xadd(f"{prefix}.a", {"init": "1"})
        with pytest.raises(DeliveryError, match=f"stream {prefix}.b does not exist"):
            sender.send([_message("a", 1, 0), _message("b", 1, 0)], ["1:0", "1:1"])
        assert redis_client.xlen(f"{prefix}.a") == 1 and not redis_client.exists(f"{prefix}.a:seen:1:0")
        sender.send([_message("a", 1, 0)], ["1:0"])
        assert redis_client.xlen(f"{prefix}.a") == 2
    finally:
        sender.close()


def test_down_then_back_fails_within_the_timeout_then_delivers(redis_client: Any, prefix: str) -> None:
    with TcpProxy(REDIS_PORT) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        sink = _sink({"type": "redis_stream", "url": url, "stream_key": prefix, "timeout": "2s"})
        redis_kind = kind("redis_stream")
        sender = redis_kind.pusher(sink)
        try:
            sender.send([_message("t", 1, 0)], ["1:0"])
            proxy.down()
            started = time.monotonic()
            with pytest.raises(DeliveryError, match="redis_stream events: "):
                sender.send([_message("t", 1, 1)], ["1:1"])
            assert redis_kind.health(sink).startswith(f"Redis at redis://127.0.0.1:{proxy.port}/0: ")
            assert time.monotonic() - started < 6
            proxy.up()
            sender.send([_message("t", 1, 1)], ["1:1"])
            assert redis_kind.health(sink) == "ok"
        finally:
            sender.close()
    assert [k for k, _ in entries(redis_client, prefix)] == ["1:0", "1:1"]


# --- sequin init ---------------------------------------------------------------------------------


def _init_config(dsn: str, dbname: str, destination: dict[str, Any]) -> Any:
    return parse_config(
        {
            "databases": [
                {
                    "name": "app",
                    "dsn": dsn,
                    "slot": {"name": f"slot_{dbname}"},
                    "publication": {"name": f"pub_{dbname}"},
                }
            ],
            "sinks": [{"name": "events", "tables": ["kv"], "destination": destination}],
        },
        "sequin.yaml",
    )


def test_init_checks_the_destination_and_names_the_sink(redis_client: Any, prefix: str, dsn: str, dbname: str) -> None:
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    redis_client.set(f"{prefix}.string", "x")
    cases = [
        ({"url": f"redis://127.0.0.1:{dead_port}/0", "timeout": "2s"}, "ConnectionError"),
        ({"url": "redis://nobody:pw@127.0.0.1:6379/0"}, "AuthenticationError"),
        ({"stream_key": f"{prefix}.missing", "create": False}, f"stream '{prefix}.missing' does not exist"),
        ({"stream_key": f"{prefix}.string"}, f"key '{prefix}.string' holds a string, not a stream"),
    ]
    for extra, reason in cases:
        destination = {"type": "redis_stream", "stream_key": prefix, **extra}
        with pytest.raises(DestinationError) as err:
            initialize(_init_config(dsn, dbname, destination))
        assert err.value.sink == "events" and reason in err.value.reason, err.value
        assert str(err.value).startswith("sink 'events': Redis at redis://127.0.0.1:")
        assert "pw" not in str(err.value)
    with psycopg.connect(dsn) as conn:  # nothing was created
        assert (
            conn.execute(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (f"slot_{dbname}",)
            ).fetchone()[0]
            == 0
        )
    redis_client.xadd(f"{prefix}.present", {"init": "1"})
    for destination in (
        {"type": "redis_stream", "stream_key": f"{prefix}.{{table_name}}"},
        {"type": "redis_stream", "stream_key": f"{prefix}.present", "create": False},
    ):
        report = initialize(_init_config(dsn, dbname, destination))
        assert not any("stream" in c and prefix in c for c in report.created)


# --- through the stream app ----------------------------------------------------------------------

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: events
    tables: [{tables}]
    destination: {{type: redis_stream, url: "{url}", stream_key: "{prefix}.{{table_name}}", batch_size: 7,
                   timeout: 2s}}
stream:
  checkpoint_location: {ckpt}
  max_batch_wait: 200ms
"""


def _rounds(dsn: str, tables: list[str], keys: int, rounds: range, pause: float = 0.0) -> int:
    """Upserts ``v = round`` of rows 1..keys of each table, a transaction per table and round;
    returns the change count."""
    changes = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        for r in rounds:
            for table in tables:
                with conn.transaction():
                    for k in range(1, keys + 1):
                        conn.execute(
                            f"INSERT INTO {table} VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (k, r)
                        )
                        changes += 1
                time.sleep(pause)
    return changes


def _changes_by_group(client: Any, key: str) -> dict[int, list[int]]:
    """The ``v`` of each row's change entries, in stream order."""
    groups: dict[int, list[int]] = {}
    for _, m in entries(client, key):
        if m["action"] != "read":
            groups.setdefault(m["record"]["k"], []).append(m["record"]["v"])
    return groups


def _assert_exact(client: Any, prefix: str, tables: list[str], keys: int, rounds: int) -> None:
    """Each table's stream holds each change once, each row's in commit order, nothing else but reads."""
    for table in tables:
        found = entries(client, f"{prefix}.{table}")
        assert len({k for k, _ in found}) == len(found), f"{table}: a duplicate entry"
        assert _changes_by_group(client, f"{prefix}.{table}") == {k: list(range(rounds)) for k in range(1, keys + 1)}
        positions: dict[int, list[tuple[int, int]]] = {}
        for _, m in found:
            if m["action"] != "read":
                positions.setdefault(m["record"]["k"], []).append(
                    (m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"])
                )
        assert all(p == sorted(p) for p in positions.values())


def _delivered(client: Any, prefix: str, tables: list[str], count: int) -> bool:
    return sum(client.xlen(f"{prefix}.{t}") for t in tables) >= count


def test_three_tables_and_a_backfill_through_a_sigkill_are_delivered_exactly_in_group_order(
    redis_client: Any, prefix: str, dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    tables = ["alpha", "beta", "gamma"]
    execute(dsn, *(f"CREATE TABLE {t} (k int PRIMARY KEY, v int)" for t in tables))
    config = write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(
            dsn=dsn,
            db=dbname,
            tables=", ".join(tables),
            url="redis://127.0.0.1:6379/0",
            prefix=prefix,
            ckpt=tmp_path / "ckpt",
        ),
    )
    assert cli(config, "init").returncode == 0
    app = stream_app(config)
    app.wait_streaming(dsn)
    keys, rounds = 30, 8
    done: list[int] = []
    writer = threading.Thread(target=lambda: done.append(_rounds(dsn, tables, keys, range(rounds), pause=0.3)))
    writer.start()
    wait_for(lambda: _delivered(redis_client, prefix, tables, keys * len(tables)), 120, what="the first changes")
    app.kill()  # mid-run: the batch in flight is replayed after the restart
    time.sleep(1.0)
    app = stream_app(config)
    app.wait_streaming(dsn)
    writer.join(timeout=300)
    total = done[0]
    wait_for(lambda: _delivered(redis_client, prefix, tables, total), 180, what=f"{total} changes in Redis")
    created = backfill(dsn, config, "events", "beta")
    ran = cli(config, "backfill", "run", str(created.id))
    assert ran.returncode == 0, ran.stderr[-3000:]
    wait_for(lambda: _delivered(redis_client, prefix, tables, total + keys), 120, what="the backfill's reads")
    time.sleep(2.0)  # anything extra (a duplicate) would show up now
    _assert_exact(redis_client, prefix, tables, keys, rounds)
    reads = [m for _, m in entries(redis_client, f"{prefix}.beta") if m["action"] == "read"]
    assert sorted(m["record"]["k"] for m in reads) == list(range(1, keys + 1))
    assert all(m["record"]["v"] == rounds - 1 for m in reads)
    assert sum(redis_client.xlen(f"{prefix}.{t}") for t in tables) == total + keys
    with psycopg.connect(dsn) as conn:
        assert store.list_buffered(conn, "sequin", "events") == []


def test_redis_down_parks_then_retry_delivers_in_order(
    redis_client: Any, prefix: str, dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    with TcpProxy(REDIS_PORT) as proxy:
        config = write_config(
            tmp_path / "sequin.yaml",
            CONFIG.format(
                dsn=dsn,
                db=dbname,
                tables="kv",
                url=f"redis://127.0.0.1:{proxy.port}/0",
                prefix=prefix,
                ckpt=tmp_path / "ckpt",
            ),
        )
        app = stream_app(config)
        app.wait_streaming(dsn)
        keys = 20
        first = _rounds(dsn, ["kv"], keys, range(2))
        wait_for(lambda: redis_client.xlen(f"{prefix}.kv") >= first, 120, what="the first rounds delivered")
        proxy.down()
        _rounds(dsn, ["kv"], keys, range(2, 4))

        def parked() -> list[Any] | None:
            with psycopg.connect(dsn) as conn:
                found = store.list_buffered(conn, "sequin", "events")
            return found if len(found) >= 2 * keys else None

        held = wait_for(parked, 120, what="the rounds while down parked")
        assert "redis_stream events: " in held[0].last_error
        assert redis_client.xlen(f"{prefix}.kv") == first
        proxy.up()
        _rounds(dsn, ["kv"], keys, range(4, 5))  # behind the parked groups: parked too, not sent ahead
        wait_for(lambda: (lambda m: m if len(m) >= 3 * keys else None)(parked()), 120, what="the next round parked")
        assert redis_client.xlen(f"{prefix}.kv") == first
        retried = wait_for(
            lambda: (lambda r: r if "still parked 0" in r.stdout else time.sleep(0.5))(
                cli(config, "buffer", "retry", "--sink", "events")
            ),
            120,
            what="retry delivering the parked groups",
        )
        assert retried.returncode == 0, retried.stdout + retried.stderr
        _assert_exact(redis_client, prefix, ["kv"], keys, 5)
        _rounds(dsn, ["kv"], keys, range(5, 6))  # and the stream goes on
        wait_for(lambda: redis_client.xlen(f"{prefix}.kv") >= 6 * keys, 120, what="the last round")
        _assert_exact(redis_client, prefix, ["kv"], keys, 6)
        app.check_alive()
