"""The NATS JetStream sink against the machine's NATS server with JetStream (127.0.0.1:4222): the
stream app publishes three tables' changes and a backfill, killed mid-run, with the server taken
away for a while (a TCP proxy in front of it goes down and up: the machine's server keeps running);
what the stream holds is read back message by message and compared with what the workload wrote.

Every test uses its own subject prefix and stream (a uuid) and deletes its streams afterwards.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest

from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.config import ConfigError, parse_config
from sequin_provider.delivery import Outgoing
from sequin_provider.exceptions import DestinationError
from sequin_provider.provisioning import initialize
from sequin_provider.sinks.nats_jetstream import derived_subjects, subject_matches, valid_subject
from sequin_provider.sinks.retry import retry_sinks
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.stream_app import cli
from tests.support.tcp_proxy import TcpProxy

NATS_PORT = 4222
NATS_URL = f"nats://127.0.0.1:{NATS_PORT}"

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: jets
    tables: [a, b, c]
    destination: {{type: nats_jetstream, servers: "{server}", subject: "{prefix}.{{table_schema}}.{{table_name}}",
                   stream: {stream}, create_stream: true, duplicate_window: 10m, batch_size: 10, timeout: 2s}}
stream:
  checkpoint_location: {ckpt}
"""

TABLES = ["CREATE TABLE a (id int PRIMARY KEY, v int)", "CREATE TABLE b (id int PRIMARY KEY, v int)"]
Expected = dict[tuple[str, int], list[tuple[str, Any]]]
"""Per group (table, id): the (action, v) of each message in commit order (v None for a delete)."""


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module", autouse=True)
def nats_server() -> None:
    """Skip the module unless the machine's NATS server listens."""
    if not _listening(NATS_PORT):
        pytest.skip(f"needs a NATS server with JetStream on 127.0.0.1:{NATS_PORT}")


def _run(work: Callable[[Any], Any]) -> Any:
    """``work(client)`` on a fresh connection to the machine's server."""
    import nats

    async def main() -> Any:
        client = await nats.connect(NATS_URL, connect_timeout=5, allow_reconnect=False)
        try:
            return await asyncio.wait_for(work(client), 60)
        finally:
            await client.close()

    return asyncio.run(main())


@pytest.fixture()
def names() -> Iterator[tuple[str, str]]:
    """A unique (subject prefix, stream name); the stream is deleted afterwards."""
    tag = uuid.uuid4().hex[:10]
    prefix, stream = f"sqt{tag}", f"SQT{tag}"
    yield prefix, stream

    async def delete(client: Any) -> None:
        jsm = client.jsm()
        for name in await jsm.streams_info():
            if name.config.name.startswith(stream):
                await jsm.delete_stream(name.config.name)

    _run(delete)


def read_stream(stream: str) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """Every message of ``stream`` in sequence order: (subject, headers, JSON)."""

    async def read(client: Any) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
        jsm = client.jsm()
        state = (await jsm.stream_info(stream)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            msg = await jsm.get_msg(stream, seq)
            out.append((msg.subject, dict(msg.headers or {}), json.loads(msg.data)))
        return out

    return _run(read)


def stream_count(stream: str) -> int:
    async def count(client: Any) -> int:
        return (await client.jsm().stream_info(stream)).state.messages

    return _run(count)


def assert_stream_holds(stream: str, prefix: str, expected: Expected) -> None:
    """The stream holds exactly the expected messages, each once, each group in commit order, each
    on its table's subject with ``Nats-Msg-Id`` = its idempotency key."""
    got: Expected = {}
    keys = []
    for subject, headers, m in read_stream(stream):
        table = m["metadata"]["table_name"]
        assert subject == f"{prefix}.public.{table}"
        assert headers["Nats-Msg-Id"] == m["metadata"]["idempotency_key"]
        keys.append(m["metadata"]["idempotency_key"])
        got.setdefault((table, m["record"]["id"]), []).append((m["action"], m["record"].get("v")))
    assert len(keys) == len(set(keys)), "a message is in the stream twice"
    assert got == expected


def _wait_for_count(stream: str, total: int, timeout: float = 240) -> None:
    wait_for(lambda: stream_count(stream) >= total, timeout, what=f"{total} messages in {stream}")
    time.sleep(2)  # nothing more comes
    assert stream_count(stream) == total


class Workload:
    """Inserts, updates and deletes on ``a`` and ``b`` in transactions touching both; remembers each
    message the sink should get, per group, in commit order."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.expected: Expected = {}
        self.rows: dict[tuple[str, int], int] = {}
        self.total = 0

    def expect(self, table: str, key: int, action: str, v: Any) -> None:
        self.expected.setdefault((table, key), []).append((action, v))
        self.total += 1

    def run(self, rounds: int, keys: int = 12, pause: float = 0.0) -> None:
        """``rounds`` rounds over ``keys`` ids of each table: insert, update, and every third round a delete."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for _ in range(rounds):
                for k in range(1, keys + 1):
                    with conn.transaction():
                        for table in ("a", "b"):
                            v = self.rows.get((table, k))
                            if v is None:
                                conn.execute(f"INSERT INTO {table} VALUES (%s, 0)", (k,))
                                self.rows[(table, k)] = 0
                                self.expect(table, k, "insert", 0)
                            elif (v + k) % 3 == 2:
                                conn.execute(f"DELETE FROM {table} WHERE id = %s", (k,))
                                del self.rows[(table, k)]
                                self.expect(table, k, "delete", None)
                            else:
                                conn.execute(f"UPDATE {table} SET v = %s WHERE id = %s", (v + 1, k))
                                self.rows[(table, k)] = v + 1
                                self.expect(table, k, "update", v + 1)
                    if pause:
                        time.sleep(pause)


def _setup(dsn: str, dbname: str, tmp_path: Path, prefix: str, stream: str, server: str = NATS_URL) -> Path:
    execute(dsn, *TABLES, "CREATE TABLE c (id int PRIMARY KEY, v int)")
    execute(dsn, "INSERT INTO c SELECT g, 0 FROM generate_series(1, 40) g")  # before the slot: only a backfill has them
    config = write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(dsn=dsn, db=dbname, server=server, prefix=prefix, stream=stream, ckpt=tmp_path / "ckpt"),
    )
    done = cli(config, "init")
    assert done.returncode == 0, done.stderr
    assert f"JetStream stream '{stream}' (subjects {prefix}.*.*) for sink 'jets'" in done.stdout
    return config


# --- parsing and the subject helpers --------------------------------------------------------------


def _sink(destination: dict[str, Any]) -> Any:
    return parse_config(
        {
            "databases": [{"name": "app", "dsn": "postgresql:///x"}],
            "sinks": [{"name": "n", "tables": ["kv"], "destination": {"type": "nats_jetstream", **destination}}],
        },
        "sequin.yaml",
    ).sinks[0]


@pytest.mark.parametrize(
    ("destination", "key", "reason"),
    [
        ({"stream": "S"}, "subject", "is required"),
        ({"subject": "a.b"}, "stream", "is required"),
        ({"subject": "a b", "stream": "S"}, "subject", "not a NATS subject"),
        ({"subject": "a.*", "stream": "S"}, "subject", "not a NATS subject"),
        ({"subject": "a..{table_name}", "stream": "S"}, "subject", "not a NATS subject"),
        ({"subject": "a.{nope}", "stream": "S"}, "subject", "unknown placeholder {nope}"),
        ({"subject": "a", "stream": "S.1"}, "stream", "not a JetStream stream name"),
        ({"subject": "a", "stream": "S", "servers": "http://h:4222"}, "servers", "expected a nats://host:port URL"),
        ({"subject": "a", "stream": "S", "servers": ["nats://h:0"]}, "servers", "expected a nats://host:port URL"),
        ({"subject": "a", "stream": "S", "servers": "ws://h:8080"}, "servers", "websockets are not supported"),
        ({"subject": "a", "stream": "S", "stream_subjects": ["a.>.b"]}, "stream_subjects", "not NATS subject filters"),
        (
            {"subject": "tests.support.transforms:route", "stream": "S", "create_stream": True},
            "stream_subjects",
            "required with create_stream when the subject is a function route",
        ),
        ({"subject": "a", "stream": "S", "batch_size": 0}, "batch_size", "must be between 1 and 1000, got 0"),
        ({"subject": "a", "stream": "S", "timeout": "soon"}, "timeout", "not a duration"),
        ({"subject": "a", "stream": "S", "colour": "red"}, "colour", "unknown key"),
    ],
)
def test_bad_options_name_the_key_path(destination: dict[str, Any], key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        _sink(destination)
    assert err.value.path == f"sinks[0].destination.{key}"
    assert reason in err.value.reason


def test_options_parse_with_defaults_and_credentials_stay_out_of_sight() -> None:
    options = _sink(
        {"subject": "cdc.{table_schema}.{table_name}", "stream": "CDC", "servers": "nats://me:pw@127.0.0.1:4222"}
    ).destination.options
    assert (options.stream, options.batch_size, options.timeout, options.create_stream) == ("CDC", 100, 10.0, False)
    assert options.duplicate_window == 120.0 and options.capture == ("cdc.*.*",)
    assert options.where == "nats://***@127.0.0.1:4222" and "pw" not in repr(options.password)
    listed = _sink({"subject": "x", "stream": "S", "servers": ["nats://h1:1", "tls://h2:2"], "stream_subjects": "x.>"})
    assert listed.destination.options.servers == ("nats://h1:1", "tls://h2:2")
    assert listed.destination.options.capture == ("x.>",)


def test_subject_helpers() -> None:
    assert valid_subject("a.b_c.d-1") and not valid_subject("a..b") and not valid_subject("a.>")
    assert valid_subject("a.*.>", wildcards=True) and not valid_subject("a.>.b", wildcards=True)
    assert subject_matches("a.*.*", "a.public.t") and not subject_matches("a.*", "a.public.t")
    assert subject_matches("a.>", "a.public.t") and not subject_matches("a.>", "a")
    assert subject_matches("a.b", "a.b") and not subject_matches("a.b", "a.c")
    route = _sink({"subject": "x.{table_name}-v1.{record.k}", "stream": "S"}).destination.options.subject
    assert derived_subjects(route) == ("x.*.*",)


# --- against the server ---------------------------------------------------------------------------


def test_pusher_parks_while_the_server_is_away_and_retry_delivers_each_group_in_order(
    dsn: str, names: tuple[str, str]
) -> None:
    """The shared push path without Spark: deliver through the proxy, down -> every message parked
    (the connection lost, then refused); up -> ``sequin buffer retry``'s entry point delivers them in
    order; the same batch delivered again adds nothing (``Nats-Msg-Id``)."""
    prefix, stream = names
    execute(dsn, *TABLES)
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    with TcpProxy(NATS_PORT) as proxy:
        config = parse_config(
            {
                "databases": [{"name": "app", "dsn": dsn}],
                "sinks": [
                    {
                        "name": "jets",
                        "tables": ["a"],
                        "destination": {
                            "type": "nats_jetstream",
                            "servers": f"nats://127.0.0.1:{proxy.port}",
                            "subject": f"{prefix}.{{record.id}}",
                            "stream": stream,
                            "create_stream": True,
                            "batch_size": 3,
                            "timeout": "2s",
                        },
                    }
                ],
            },
            "sequin.yaml",
        )
        sink = config.sinks[0]
        assert sink.destination.kind.prepare(sink) == [
            f"JetStream stream '{stream}' (subjects {prefix}.*) for sink 'jets'"
        ]

        def batch(first: int) -> Outgoing:
            out = Outgoing()
            for n in range(first, first + 12):
                message = json.dumps({"record": {"id": n % 3}, "metadata": {"idempotency_key": f"{n}:0"}, "n": n})
                out.extend(Outgoing([n], [0], [f"g{n % 3}"], [f"{n}:0"], [message]))
            return out

        pusher = sink.destination.kind.pusher(sink)
        keeper = SequinStreamSink(dsn, "sequin")
        try:
            assert pusher.deliver(batch(1), keeper, "sequin") == (12, 0)
            proxy.down()
            assert pusher.deliver(batch(13), keeper, "sequin") == (0, 12)
            assert pusher.deliver(batch(25), keeper, "sequin") == (0, 12)  # behind the parked groups
            with psycopg.connect(dsn) as conn:
                parked = store.list_buffered(conn, "sequin", "jets")
            assert len(parked) == 24 and all("nats_jetstream jets" in m.last_error for m in parked if m.attempts)
            proxy.up()
            with psycopg.connect(dsn) as conn:  # due now
                store.set_buffered_state(conn, "sequin", "jets", "discarded")
                store.set_buffered_state(conn, "sequin", "jets", "parked")
                conn.commit()
            (report,) = retry_sinks(config, "jets")
            assert (report.delivered, report.still_parked) == (24, 0)
            assert pusher.deliver(batch(1), keeper, "sequin") == (12, 0)  # a replay: dropped as duplicates
            assert pusher.duplicates == 12
        finally:
            keeper.close()
            pusher.close()
    got = read_stream(stream)
    assert sorted(m["n"] for _, _, m in got) == list(range(1, 37))  # each once
    for g in range(3):  # one group per subject, each in order
        assert [m["n"] for subject, _, m in got if subject == f"{prefix}.{g}"] == list(range(3 if g == 0 else g, 37, 3))


def test_three_tables_and_a_backfill_land_exactly_once_in_group_order(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any, names: tuple[str, str]
) -> None:
    prefix, stream = names
    config = _setup(dsn, dbname, tmp_path, prefix, stream)
    work = Workload(dsn)
    app = stream_app(config)
    app.wait_streaming(dsn)
    work.run(rounds=6)
    started = cli(config, "backfill", "start", "jets", "c")
    assert started.returncode == 0, started.stdout + started.stderr
    for k in range(1, 41):
        work.expect("c", k, "read", 0)
    _wait_for_count(stream, work.total)
    execute(dsn, "UPDATE c SET v = 1 WHERE id <= 10")  # after the reads, in the same groups
    for k in range(1, 11):
        work.expect("c", k, "update", 1)
    _wait_for_count(stream, work.total)
    assert_stream_holds(stream, prefix, work.expected)
    status = cli(config, "status", "--json")
    assert json.loads(status.stdout)[0]["health"] == {"jets": "ok"}


def test_killed_stream_app_loses_nothing_and_adds_no_duplicate(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any, names: tuple[str, str]
) -> None:
    prefix, stream = names
    config = _setup(dsn, dbname, tmp_path, prefix, stream)
    work = Workload(dsn)
    app = stream_app(config)
    app.wait_streaming(dsn)
    writer = threading.Thread(target=work.run, kwargs={"rounds": 30, "pause": 0.01})
    writer.start()
    try:
        wait_for(lambda: stream_count(stream) >= 100, 120, what="the first messages published")
        app.kill()  # mid-run: the batch in flight is replayed after the restart
    finally:
        writer.join()
    assert stream_count(stream) < work.total
    stream_app(config).wait_streaming(dsn)
    _wait_for_count(stream, work.total)
    assert_stream_holds(stream, prefix, work.expected)


def test_server_away_for_a_while_parks_then_retry_delivers_in_order(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any, names: tuple[str, str]
) -> None:
    prefix, stream = names
    with TcpProxy(NATS_PORT) as proxy:
        config = _setup(dsn, dbname, tmp_path, prefix, stream, server=f"nats://127.0.0.1:{proxy.port}")
        work = Workload(dsn)
        app = stream_app(config)
        app.wait_streaming(dsn)
        work.run(rounds=2)
        _wait_for_count(stream, work.total)
        proxy.down()
        work.run(rounds=2)

        def parked() -> list[Any] | None:
            with psycopg.connect(dsn) as conn:
                found = store.list_buffered(conn, "sequin", "jets")
            return found if len(found) >= 24 else None

        held = wait_for(parked, 120, what="messages parked while NATS is away")
        assert "nats_jetstream jets" in held[0].last_error
        health = json.loads(cli(config, "status", "--json").stdout)[0]["health"]["jets"]
        assert "cannot connect" in health and f"127.0.0.1:{proxy.port}" in health
        proxy.up()
        work.run(rounds=2)  # behind the parked groups: parked too, then retried in order

        def retried() -> bool:
            cli(config, "buffer", "retry", "--sink", "jets")
            with psycopg.connect(dsn) as conn:
                return not store.list_buffered(conn, "sequin", "jets") and stream_count(stream) >= work.total

        wait_for(retried, 240, what="the retry delivering every parked message")
        _wait_for_count(stream, work.total)
    assert_stream_holds(stream, prefix, work.expected)


def test_init_refuses_an_unusable_destination_naming_the_sink(
    dsn: str, dbname: str, tmp_path: Path, names: tuple[str, str]
) -> None:
    prefix, stream = names
    execute(dsn, *TABLES)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()[1]  # bound, not listening: connections are refused
    try:

        def config(**destination: Any) -> Any:
            return parse_config(
                {
                    "databases": [{"name": "app", "dsn": dsn, "slot": {"name": f"slot_{dbname}"}}],
                    "sinks": [
                        {
                            "name": "jets",
                            "tables": ["a", "b"],
                            "destination": {"type": "nats_jetstream", "stream": stream, **destination},
                        }
                    ],
                },
                "sequin.yaml",
            )

        cases = [
            (config(subject=f"{prefix}.x", servers=f"nats://u:secret@127.0.0.1:{dead}"), "cannot connect"),
            (config(subject=f"{prefix}.x"), f"JetStream stream '{stream}' does not exist"),
        ]
        for bad, reason in cases:
            with pytest.raises(DestinationError) as err:
                initialize(bad)
            assert err.value.sink == "jets" and reason in str(err.value) and "secret" not in str(err.value)
        # created for one subject, then asked to carry another that it does not capture
        initialize(config(subject=f"{prefix}.x", create_stream=True))
        with pytest.raises(DestinationError, match=f"sink 'jets': JetStream stream '{stream}' .* does not capture"):
            initialize(config(subject=f"{prefix}.y"))
        with pytest.raises(DestinationError, match=f"does not capture subject '{prefix}.public.a'"):
            initialize(config(subject=f"{prefix}.{{table_schema}}.{{table_name}}"))
        # the CLI says it in one line
        path = write_config(
            tmp_path / "sequin.yaml",
            f"""
            databases: [{{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}}}]
            sinks:
              - {{name: jets, tables: [a], destination: {{type: nats_jetstream, subject: "{prefix}.y", stream: {stream}}}}}
            """,
        )
        refused = cli(path, "init")
        assert refused.returncode == 2 and refused.stderr.startswith("error: sink 'jets': JetStream stream")
        assert "Traceback" not in refused.stderr
    finally:
        closed.close()
