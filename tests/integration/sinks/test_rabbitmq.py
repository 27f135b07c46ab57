"""RabbitMQ sink against the machine's RabbitMQ (127.0.0.1:5672, guest/guest): each test declares
its own exchange and a queue bound to it (unique names, deleted afterwards) and reads back with
``basic_get`` exactly what the sink published. "The broker is down" is a ``TcpProxy`` in front of
it, never the machine's server stopped.

The publisher alone: confirmed messages with their properties, a returned (unroutable) or refused
(nack) message is a ``DeliveryError``, a connection cut is found and replaced (one cut while idle
without failing a request). Through the stream
app: three tables and a backfill in per-group order, an unroutable table parked and retried, a
SIGKILL mid-run (duplicates only of the same ``message_id``), the broker away and back (parked,
retried, in order). ``sequin init``: wrong credentials, a missing exchange, no server ->
``DestinationError`` naming the sink.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.buffer import DeliveryError
from sequin_provider.cli import main as cli_main
from sequin_provider.config import ConfigError, SinkConfig, load_config, parse_config
from sequin_provider.exceptions import DestinationError
from sequin_provider.provisioning import initialize
from sequin_provider.sinks.rabbitmq import RabbitMQOptions
from tests.support.config import write_config
from tests.support.key_workload import KeyWorkload
from tests.support.postgres import execute
from tests.support.rabbitmq import PORT, URL, QueueReader, Received, rabbitmq_running, unique_name
from tests.support.stream_app import cli
from tests.support.tcp_proxy import TcpProxy

pika = pytest.importorskip("pika", reason="needs pika: pip install 'sequin-provider[rabbitmq]'")

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: rabbit
    tables: [{tables}]
    destination: {{type: rabbitmq, url: "{url}", exchange: {exchange}, exchange_type: topic, declare_exchange: true,
                   routing_key: "cdc.{{table_name}}", batch_size: 10, timeout: 5s}}
stream:
  checkpoint_location: {ckpt}
"""


@pytest.fixture(scope="module", autouse=True)
def rabbitmq() -> None:
    if not rabbitmq_running():
        pytest.skip(f"needs RabbitMQ on 127.0.0.1:{PORT}")


@pytest.fixture()
def reader() -> Iterator[QueueReader]:
    """A fresh topic exchange and a queue bound to ``cdc.kv``, ``cdc.orders`` and ``cdc.items``."""
    queue = QueueReader(unique_name(), ("cdc.kv", "cdc.orders", "cdc.items"))
    yield queue
    queue.close()


def _sink(destination: dict[str, Any], dsn: str = "postgresql:///x") -> SinkConfig:
    config = parse_config(
        {
            "databases": [{"name": "app", "dsn": dsn}],
            "sinks": [{"name": "rabbit", "tables": ["kv"], "destination": {"type": "rabbitmq", **destination}}],
        },
        "sequin.yaml",
    )
    return config.sinks[0]


def _message(table: str, n: int) -> str:
    return json.dumps({"record": {"id": n}, "action": "insert", "metadata": {"table_name": table}})


# --- options ------------------------------------------------------------------------------------


def test_options_are_parsed_with_their_defaults() -> None:
    options: RabbitMQOptions = _sink({"routing_key": "cdc.{table_name}"}).destination.options
    assert (options.url, options.exchange, options.exchange_type, options.declare_exchange) == (
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        "",
        "direct",
        False,
    )
    assert (options.batch_size, options.timeout, options.persistent) == (100, 10.0, True)
    assert options.routing_key.target(_message("kv", 1)) == "cdc.kv"
    assert "guest" not in repr(options)  # the URL's password stays out of logs


@pytest.mark.parametrize(
    ("destination", "path", "reason"),
    [
        ({}, "routing_key", "is required"),
        ({"routing_key": "k", "url": "http://h/"}, "url", "expected an amqp:// or amqps:// URL with a host"),
        ({"routing_key": "k", "exchange_type": "round"}, "exchange_type", "expected one of direct, fanout"),
        ({"routing_key": "k", "declare_exchange": True}, "declare_exchange", "default exchange"),
        ({"routing_key": "k", "batch_size": 0}, "batch_size", "must be between 1 and 10000, got 0"),
        ({"routing_key": "{nope}"}, "routing_key", "unknown placeholder {nope}"),
        ({"routing_key": "k", "persistent": "yes"}, "persistent", ""),
        ({"routing_key": "k", "queue": "q"}, "queue", "unknown key"),
    ],
)
def test_bad_options_name_the_key_path(destination: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        _sink(destination)
    assert err.value.path == f"sinks[0].destination.{path}" and reason in err.value.reason


# --- the publisher alone ------------------------------------------------------------------------


def test_published_messages_are_confirmed_with_their_properties_in_order(reader: QueueReader) -> None:
    sink = _sink({"exchange": reader.exchange, "routing_key": "cdc.{table_name}", "batch_size": 5})
    pusher = sink.destination.kind.pusher(sink)
    try:
        messages = [_message("kv" if n % 3 else "orders", n) for n in range(12)]
        keys = [f"{n}:0" for n in range(12)]
        for start in (0, 5, 10):  # requests of a mix of routing keys: a run each
            pusher.send(messages[start : start + 5], keys[start : start + 5])
    finally:
        pusher.close()
    got = reader.drain()
    assert [(r.message_id, r.body) for r in got] == list(zip(keys, messages))
    assert {(r.content_type, r.delivery_mode) for r in got} == {("application/json", 2)}
    assert [r.routing_key for r in got] == [f"cdc.{json.loads(m)['metadata']['table_name']}" for m in messages]


def test_unroutable_and_refused_messages_are_delivery_errors(reader: QueueReader) -> None:
    sink = _sink({"exchange": reader.exchange, "routing_key": "cdc.{table_name}", "persistent": False})
    pusher = sink.destination.kind.pusher(sink)
    try:
        with pytest.raises(DeliveryError, match=r"rabbitmq rabbit: 1 messages returned unroutable: 312 NO_ROUTE"):
            pusher.send([_message("kv", 1), _message("lost", 2), _message("kv", 3)], ["1:0", "2:0", "3:0"])
        # nothing behind the returned message was published: its run is confirmed before the next
        assert [r.message_id for r in reader.drain()] == ["1:0"]
        with pytest.raises(DeliveryError, match="is null in the message"):
            pusher.send(['{"metadata": {}}'], ["x"])  # no route: refused before publishing
        # a full queue that rejects publishes: the broker nacks
        reader.channel.queue_declare(
            f"{reader.queue}.full", arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
        )
        reader.channel.queue_bind(f"{reader.queue}.full", reader.exchange, "cdc.full")
        try:
            pusher.send([_message("full", 1)], ["f1"])
            with pytest.raises(DeliveryError, match=r"refused \(nack\) 1 of 1"):
                pusher.send([_message("full", 2)], ["f2"])
        finally:
            reader.channel.queue_delete(f"{reader.queue}.full")
        pusher.send([_message("kv", 4)], ["4:0"])  # the channel is still good
    finally:
        pusher.close()
    assert [(r.message_id, r.delivery_mode) for r in reader.drain()] == [("1:0", 1), ("4:0", 1)]


@contextmanager
def _proxied_pusher(reader: QueueReader) -> Iterator[tuple[TcpProxy, Any]]:
    """A publisher to ``reader``'s exchange through a ``TcpProxy`` (2 s timeout), closed after."""
    with TcpProxy(PORT) as proxy:
        url = URL.replace(f":{PORT}/", f":{proxy.port}/")
        sink = _sink({"url": url, "exchange": reader.exchange, "routing_key": "cdc.kv", "timeout": "2s"})
        pusher = sink.destination.kind.pusher(sink)
        try:
            yield proxy, pusher
        finally:
            pusher.close()


def test_a_cut_connection_is_a_delivery_error_then_replaced(reader: QueueReader) -> None:
    with _proxied_pusher(reader) as (proxy, pusher):
        pusher.send([_message("kv", 1)], ["1:0"])
        proxy.down()
        started = time.monotonic()
        with pytest.raises(DeliveryError, match="rabbitmq rabbit: "):
            pusher.send([_message("kv", 2)], ["2:0"])
        assert time.monotonic() - started < 5  # bounded by the timeout
        proxy.up()
        pusher.send([_message("kv", 3)], ["3:0"])  # the dead connection was dropped, a new one opened
    assert [r.message_id for r in reader.drain()] == ["1:0", "3:0"]


def test_a_connection_cut_while_idle_is_replaced_without_failing_a_request(reader: QueueReader) -> None:
    """The pool checks an idle channel when it is taken (``sinks.idle_pool``): one whose connection
    was cut between two requests is closed and a new one opened, and the request goes through."""
    with _proxied_pusher(reader) as (proxy, pusher):
        pusher.send([_message("kv", 1)], ["1:0"])
        proxy.down()  # cuts the idle connection
        proxy.up()
        time.sleep(0.5)  # the cut reaches the client's socket (loopback: at once)
        pusher.send([_message("kv", 2)], ["2:0"])  # no DeliveryError: a new connection
    assert [r.message_id for r in reader.drain()] == ["1:0", "2:0"]


def test_the_exchange_deleted_under_the_publisher(reader: QueueReader) -> None:
    sink = _sink({"exchange": reader.exchange, "routing_key": "cdc.kv"})
    pusher = sink.destination.kind.pusher(sink)
    try:
        pusher.send([_message("kv", 1)], ["1:0"])
        reader.channel.exchange_delete(reader.exchange)
        with pytest.raises(DeliveryError, match="404"):
            pusher.send([_message("kv", 2)], ["2:0"])
        reader.channel.exchange_declare(reader.exchange, "topic", durable=True)
        reader.bind("cdc.kv")
        pusher.send([_message("kv", 3)], ["3:0"])
    finally:
        pusher.close()
    assert [r.message_id for r in reader.drain()] == ["1:0", "3:0"]


# --- sequin init and status ---------------------------------------------------------------------


def _init_config(tmp_path: Path, dsn: str, dbname: str, destination: str) -> Path:
    return write_config(
        tmp_path / "sequin.yaml",
        f"""
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{dbname}}}
    publication: {{name: pub_{dbname}}}
sinks:
  - name: rabbit
    tables: [kv]
    destination: {{type: rabbitmq, routing_key: "cdc.kv", timeout: 3s, {destination}}}
""",
    )


def test_init_checks_the_broker_and_the_exchange(
    dsn: str, dbname: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    exchange = unique_name()
    cases = {
        "wrong password": (
            f'url: "amqp://guest:wrong@127.0.0.1:{PORT}/%2F", exchange: {exchange}',
            "refused the credentials",
        ),
        "no exchange": (f"exchange: {exchange}", f"exchange '{exchange}' does not exist at 127.0.0.1:{PORT}"),
        "no server": ('url: "amqp://guest:guest@127.0.0.1:1/%2F"', "cannot connect to RabbitMQ at 127.0.0.1:1"),
    }
    for case, (destination, reason) in cases.items():
        config = load_config(_init_config(tmp_path, dsn, dbname, destination))
        with pytest.raises(DestinationError) as err:
            initialize(config)
        assert err.value.sink == "rabbit" and reason in err.value.reason, case
        assert "wrong" not in str(err.value)  # no password in the message
        with psycopg.connect(dsn) as conn:  # nothing made before the destinations were checked
            slots = "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
            assert conn.execute(slots).fetchone() == (0,)
    # declared when asked: `sequin init` creates it, and `sequin status` finds it
    path = _init_config(tmp_path, dsn, dbname, f"exchange: {exchange}, exchange_type: topic, declare_exchange: true")
    try:
        assert cli_main(["--config", str(path), "init"]) == 0
        assert f"RabbitMQ topic exchange '{exchange}'" in capsys.readouterr().out
        sink = load_config(path).sinks[0]
        assert sink.destination.kind.health(sink) == "ok"
        assert cli_main(["--config", str(path), "status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["health"] == {"rabbit": "ok"}
    finally:
        reader = QueueReader(exchange, ())  # the same declaration: deletes it
        reader.close()
    assert sink.destination.kind.health(sink) == f"exchange '{exchange}' does not exist"


# --- through the stream app ---------------------------------------------------------------------


def _first_seen(got: list[Received]) -> tuple[list[dict[str, Any]], int]:
    """The messages in arrival order with repeats of a ``message_id`` left out, and how many
    repeats there were; a repeat must be the same message."""
    seen: dict[str, str] = {}
    first: list[dict[str, Any]] = []
    for r in got:
        assert r.message_id == json.loads(r.body)["metadata"]["idempotency_key"]
        if r.message_id in seen:
            assert seen[r.message_id] == r.body, f"{r.message_id} redelivered with another body"
            continue
        seen[r.message_id] = r.body
        first.append(r.data)
    return first, len(got) - len(first)


def _changes_by_key(messages: list[dict[str, Any]], table: str) -> dict[int, list[tuple[str, int | None]]]:
    got: dict[int, list[tuple[str, int | None]]] = {}
    for m in messages:
        if m["metadata"]["table_name"] == table and m["action"] != "read":
            got.setdefault(m["record"]["id"], []).append((m["action"], m["record"].get("v")))
    return got


def _parked(dsn: str) -> list[Any]:
    with psycopg.connect(dsn) as conn:
        return store.list_buffered(conn, "sequin", "rabbit", "parked")


def _stream_config(tmp_path: Path, dsn: str, dbname: str, exchange: str, tables: str, url: str = URL) -> Path:
    return write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(dsn=dsn, db=dbname, url=url, exchange=exchange, tables=tables, ckpt=tmp_path / "ckpt"),
    )


def test_three_tables_and_a_backfill_in_group_order_and_an_unroutable_table_parked(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any, reader: QueueReader
) -> None:
    tables = ("kv", "orders", "items")
    execute(
        dsn,
        *(f"CREATE TABLE {t} (id int PRIMARY KEY, v int)" for t in (*tables, "lost")),
        "INSERT INTO items SELECT g, -g FROM generate_series(1000, 1039) g",  # before capture: only a backfill sends them
    )
    config = _stream_config(tmp_path, dsn, dbname, reader.exchange, "kv, orders, items, lost")
    app = stream_app(config)
    app.wait_streaming(dsn)
    # the table nothing is bound for: returned by the broker, parked with its groups (before the
    # workloads, so that no request holds both its messages and others)
    execute(dsn, "INSERT INTO lost VALUES (1, 1)", "UPDATE lost SET v = 2", "INSERT INTO lost VALUES (2, 1)")
    parked = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(_parked(dsn)), 60, what="lost's 3 changes parked")
    assert "NO_ROUTE" in parked[0].last_error and "cdc.lost" in parked[0].last_error
    workloads = [KeyWorkload(dsn, keys=40, seed=n, table=t).start() for n, t in enumerate(tables)]
    time.sleep(4)
    for w in workloads:
        w.stop()
    total = sum(w.committed for w in workloads)
    wait_for(lambda: len(reader.drain()) >= total, 180, what=f"{total} changes in the queue")
    # a backfill of items: a read of every row it has now, after the changes of its group
    done = cli(config, "backfill", "start", "rabbit", "items")
    assert done.returncode == 0, done.stdout + done.stderr
    with psycopg.connect(dsn) as conn:
        rows = dict(conn.execute("SELECT id, v FROM items").fetchall())
    wait_for(lambda: len(reader.drain()) >= total + len(rows), 180, what="the backfill's reads in the queue")
    time.sleep(2)  # anything extra would show up now
    got = reader.drain()
    messages, repeats = _first_seen(got)
    assert repeats == 0 and len(got) == total + len(rows)
    for table, workload in zip(tables, workloads):
        assert _changes_by_key(messages, table) == workload.expected, table
    reads = [m for m in messages if m["action"] == "read"]
    assert {m["record"]["id"]: m["record"]["v"] for m in reads} == rows and len(reads) == len(rows)
    for n, m in enumerate(messages):  # each read after its row's changes
        if m["action"] == "read":
            assert not [
                x
                for x in messages[n:]
                if x["metadata"]["table_name"] == "items"
                and x["action"] != "read"
                and x["record"]["id"] == m["record"]["id"]
            ]
    assert {r.routing_key for r in got} == {"cdc.kv", "cdc.orders", "cdc.items"}

    # bound now: the retry delivers the parked changes in order
    assert len(_parked(dsn)) == 3
    reader.bind("cdc.lost")
    retried = wait_for(
        lambda: (lambda r: r if "still parked 0" in r.stdout else time.sleep(1))(
            cli(config, "buffer", "retry", "--sink", "rabbit")
        ),
        90,
        what="retry delivering lost's changes",
    )
    assert "delivered 3" in retried.stdout
    lost = [r.data for r in reader.drain() if r.routing_key == "cdc.lost"]
    assert _changes_by_key(lost, "lost") == {1: [("insert", 1), ("update", 2)], 2: [("insert", 1)]}  # per group


def test_sigkill_mid_run_loses_nothing_and_repeats_only_the_same_messages(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any, reader: QueueReader
) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    config = _stream_config(tmp_path, dsn, dbname, reader.exchange, "kv")
    app = stream_app(config)
    app.wait_streaming(dsn)
    workload = KeyWorkload(dsn, keys=100).start()
    wait_for(lambda: len(reader.drain()) > workload.committed // 2, 120, what="progress before the kill")
    time.sleep(1.5)
    app.kill()  # mid-run: the requests in flight are published again by the restarted app
    time.sleep(1.0)
    app = stream_app(config)
    app.wait_streaming(dsn)
    workload.stop()
    wait_for(
        lambda: len({r.message_id for r in reader.drain()}) >= workload.committed, 240, what="every change delivered"
    )
    time.sleep(2)
    messages, repeats = _first_seen(reader.drain())
    assert _changes_by_key(messages, "kv") == workload.expected  # nothing lost, in order per key
    assert len(messages) == workload.committed > 300
    assert _parked(dsn) == []
    print(f"rabbitmq sigkill: {workload.committed} changes, {repeats} redelivered")


def test_the_broker_away_and_back_parks_then_retries_in_order(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any, reader: QueueReader
) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v int)")
    with TcpProxy(PORT) as proxy:
        url = URL.replace(f":{PORT}/", f":{proxy.port}/")
        config = _stream_config(tmp_path, dsn, dbname, reader.exchange, "kv", url=url)
        app = stream_app(config)
        app.wait_streaming(dsn)
        workload = KeyWorkload(dsn, keys=60).start()
        wait_for(lambda: len(reader.drain()) > 50, 120, what="changes flowing")
        proxy.down()
        wait_for(lambda: len(_parked(dsn)) > 20, 120, what="changes parked while the broker is away")
        time.sleep(2)
        proxy.up()
        stop = threading.Event()

        def retry_loop() -> None:
            from sequin_provider.sinks.retry import retry_sinks

            loaded = load_config(config)
            while not stop.is_set():
                retry_sinks(loaded, "rabbit")
                stop.wait(0.5)

        retrier = threading.Thread(target=retry_loop, daemon=True)
        retrier.start()
        try:
            time.sleep(3)
            workload.stop()
            wait_for(
                lambda: len({r.message_id for r in reader.drain()}) >= workload.committed,
                240,
                what="every change delivered",
            )
            wait_for(lambda: not _parked(dsn), 120, what="the buffer drained")
        finally:
            stop.set()
            retrier.join(timeout=60)
        app.check_alive()
    time.sleep(1)
    messages, repeats = _first_seen(reader.drain())
    assert _changes_by_key(messages, "kv") == workload.expected  # nothing lost, in order per key
    assert len(messages) == workload.committed
    print(f"rabbitmq away and back: {workload.committed} changes, {repeats} redelivered")
