"""Config parsing: typed values, defaults, and errors naming file, key path and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from sequin_provider.config import (
    ConfigError,
    dsn_from_airflow_conn,
    dsn_uri,
    load_config,
    parse_config,
    parse_duration,
)
from sequin_provider.sinks.sequin_stream import SequinStreamOptions
from sequin_provider.sinks.webhook import WebhookOptions
from tests.support.config import builtin_kind_names

GOOD = """
databases:
  - name: app
    dsn: ${SRC_DSN:-postgresql://postgres@127.0.0.1:5432/app}
    slot: {name: my_slot}
    heartbeat_interval: 500ms
sinks:
  - name: orders
    tables: [{name: public.orders, group_column_names: [account_id]}, users]
    actions: [insert, update]
    filter: "record.status <> 'draft'"
    destination: {type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sequin.yaml"
    path.write_text(text)
    return path


def test_good_config_is_typed(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), environ={})
    db = config.database()
    assert db.dsn == "postgresql://postgres@127.0.0.1:5432/app"
    assert db.slot.name == "my_slot" and db.publication.name == "sequin_pub"
    assert db.heartbeat_interval == 0.5
    sink = config.sinks[0]
    assert [t.qualified for t in sink.tables] == ["public.orders", "public.users"]
    assert sink.tables[0].group_column_names == ("account_id",)
    assert sink.actions == ("insert", "update")
    assert sink.destination.options == SequinStreamOptions(visibility_timeout=60.0, max_ack_pending=5, max_waiting=20)
    assert sink.destination.kind.stored and not sink.destination.kind.pushed
    assert sink.database == "app" and sink.message_grouping and sink.message_kind == "change"
    assert config.store_dsn() == db.dsn and config.store.schema == "sequin"
    assert sink.consumer_id == load_config(write(tmp_path, GOOD), environ={}).sinks[0].consumer_id


def test_env_substitution_and_conn_id(tmp_path: Path) -> None:
    env = {"SRC_DSN": "postgresql://u@h:1/x"}
    assert load_config(write(tmp_path, GOOD), environ=env).database().dsn == "postgresql://u@h:1/x"
    text = GOOD.replace("dsn: ${SRC_DSN:-postgresql://postgres@127.0.0.1:5432/app}", "conn_id: sequin_source")
    env = {"AIRFLOW_CONN_SEQUIN_SOURCE": "postgres://bob:p%40ss@db:6543/shop"}
    assert load_config(write(tmp_path, text), environ=env).database().dsn == "postgresql://bob:p%40ss@db:6543/shop"
    assert (
        dsn_from_airflow_conn(
            "x",
            {
                "AIRFLOW_CONN_X": '{"conn_type": "postgres", "host": "h", "login": "u",'
                ' "password": "p w", "port": 5, "schema": "d"}'
            },
        )
        == "postgresql://u:p%20w@h:5/d"
    )


def test_conn_ids_go_through_the_resolver_given_and_are_recorded(tmp_path: Path) -> None:
    """Inside Airflow the hook passes a resolver backed by Airflow; the config remembers which
    connections it named, so the operators can hand them to the Spark apps."""
    text = (
        GOOD.replace("dsn: ${SRC_DSN:-postgresql://postgres@127.0.0.1:5432/app}", "conn_id: src")
        + "store:\n  conn_id: st\n"
    )
    known = {"src": "host=db port=6543 user=bob password=p@ss:w dbname=shop", "st": "postgresql://s@store/st"}
    asked: list[str] = []

    def resolve(conn_id: str) -> str:
        asked.append(conn_id)
        if conn_id not in known:
            raise LookupError("Airflow has no such connection")
        return known[conn_id]

    config = load_config(write(tmp_path, text), environ={}, resolve_conn_id=resolve)
    assert asked == ["src", "st"]
    assert (config.database().dsn, config.database().conn_id) == (known["src"], "src")
    assert (config.store_dsn(), config.store.conn_id) == (known["st"], "st")
    assert config.connections() == known
    assert load_config(write(tmp_path, GOOD), environ={}).connections() == {}
    with pytest.raises(ConfigError, match=r"databases\[0\]\.conn_id: connection 'src' not found: Airflow has no"):
        load_config(write(tmp_path, text), environ={}, resolve_conn_id=lambda conn_id: resolve("x"))


def test_dsn_uri_is_the_airflow_conn_form_and_resolves_back_to_the_same_connection() -> None:
    from psycopg.conninfo import conninfo_to_dict

    for dsn in (
        "host=db port=6543 user=bob password='p@ss:/w x' dbname=shop sslmode=require connect_timeout=10",
        "postgresql://u@h:1/d?application_name=a",
        "host=/tmp/pg dbname=x",
    ):
        uri = dsn_uri(dsn)
        assert uri.startswith("postgresql://")
        assert conninfo_to_dict(dsn_from_airflow_conn("c", {"AIRFLOW_CONN_C": uri})) == conninfo_to_dict(dsn)


@pytest.mark.parametrize(
    ("text", "path", "reason"),
    [
        ("databases: [ {name: app", "", "malformed YAML at line"),
        ("", "", "the file is empty"),
        (
            GOOD.replace("    slot: {name: my_slot}", "    slot: {name: my_slot, colour: red}"),
            "databases[0].slot.colour",
            "unknown key",
        ),
        (GOOD + "extra: 1\n", "extra", "unknown key"),
        (
            GOOD.replace("actions: [insert, update]", "actions: [insert, upsert]"),
            "sinks[0].actions[1]",
            "unknown action 'upsert'",
        ),
        (
            GOOD.replace("type: sequin_stream", "type: kafka"),
            "sinks[0].destination.type",
            f"unknown destination type 'kafka' ({' | '.join(builtin_kind_names())})",
        ),
        (
            GOOD.replace("heartbeat_interval: 500ms", "heartbeat_interval: soon"),
            "databases[0].heartbeat_interval",
            "not a duration",
        ),
        (GOOD.replace("max_ack_pending: 5", "max_ack_pending: 0"), "sinks[0].destination.max_ack_pending", "must be"),
        (
            GOOD.replace("max_ack_pending: 5", "max_ack_pending: true"),
            "sinks[0].destination.max_ack_pending",
            "expected an integer",
        ),
        (GOOD.replace("name: public.orders", "name: a.b.c"), "sinks[0].tables[0].name", "is not a table name"),
        (
            GOOD.replace("name: my_slot", "name: 'bad slot'"),
            "databases[0].slot.name",
            "not a valid Postgres identifier",
        ),
        (
            GOOD.replace("dsn: ${SRC_DSN:-postgresql://postgres@127.0.0.1:5432/app}", "dsn: ${NOPE}"),
            "databases[0].dsn",
            "NOPE is not set",
        ),
        (
            GOOD.replace("dsn: ${SRC_DSN:-postgresql://postgres@127.0.0.1:5432/app}", "conn_id: missing"),
            "databases[0].conn_id",
            "AIRFLOW_CONN_MISSING",
        ),
        (
            GOOD.replace("    tables:", "    database: other\n    tables:"),
            "sinks[0].database",
            "no database named 'other'",
        ),
        (
            GOOD.replace("message_grouping", "x") + "    message_kind: rows\n",
            "sinks[0].message_kind",
            "expected change or record",
        ),
        (GOOD + "    transform: 'not a spec'\n", "sinks[0].transform", "module:function"),
        (
            GOOD + "    initial_backfill: {table: nope}\n",
            "sinks[0].initial_backfill.table",
            "not one of this sink's tables",
        ),
        (
            GOOD + "    initial_backfill: [{table: public.orders, sort_column: at}]\n",
            "sinks[0].initial_backfill[0]",
            "needs both sort_column and start_position",
        ),
        (GOOD + "    initial_backfill: yes please\n", "sinks[0].initial_backfill", "expected true"),
        (
            GOOD + "    initial_backfill: {table: public.orders, max_query_ms: 0}\n",
            "sinks[0].initial_backfill.max_query_ms",
            "must be",
        ),
        (
            GOOD.replace("{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}", "{type: webhook}"),
            "sinks[0].destination.url",
            "is required",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}", "{type: webhook, url: 'ftp://x'}"
            ),
            "sinks[0].destination.url",
            "http:// or https://",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', batch_size: 0}",
            ),
            "sinks[0].destination.batch_size",
            "must be",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', headers: [a]}",
            ),
            "sinks[0].destination.headers",
            "mapping",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', timeout: never}",
            ),
            "sinks[0].destination.timeout",
            "duration",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x:99999/hook'}",
            ),
            "sinks[0].destination.url",
            "http:// or https://",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                '{type: webhook, url: "http://x/a\\r\\nX-Evil: 1"}',
            ),
            "sinks[0].destination.url",
            "http:// or https://",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', headers: {X-A: \"v\\r\\nX-Evil: 1\"}}",
            ),
            "sinks[0].destination.headers",
            "not a valid HTTP header",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', headers: {'Bad Name': v}}",
            ),
            "sinks[0].destination.headers",
            "not a valid HTTP header",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://hooks..example/x'}",
            ),
            "sinks[0].destination.url",
            "not a valid domain name",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x/caf\u00e9'}",
            ),
            "sinks[0].destination.url",
            "must be percent-encoded",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', headers: {X-Who: \"\u2603\"}}",
            ),
            "sinks[0].destination.headers",
            "ISO-8859-1",
        ),
        (
            GOOD.replace(
                "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
                "{type: webhook, url: 'http://x', headers: {content-length: 3}}",
            ),
            "sinks[0].destination.headers",
            "set by the client",
        ),
        ("databases: []\n", "databases", "non-empty list"),
        ("- a\n- b\n", "", "expected a mapping"),
    ],
)
def test_bad_config_names_file_path_and_reason(tmp_path: Path, text: str, path: str, reason: str) -> None:
    file = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(file, environ={})
    assert err.value.source == str(file)
    assert err.value.path == path
    assert reason in err.value.reason
    assert str(err.value).startswith(f"{file}: ")


def test_webhook_destination_defaults(tmp_path: Path) -> None:
    text = GOOD.replace(
        "{type: sequin_stream, visibility_timeout: 1m, max_ack_pending: 5}",
        "{type: webhook, url: 'https://h.example/x', headers: {X-A: 1}}",
    )
    options = load_config(write(tmp_path, text), environ={}).sinks[0].destination.options
    assert options == WebhookOptions(
        url="https://h.example/x",
        headers={"X-A": "1"},
        batch=True,
        batch_size=10,
        timeout=30.0,
        secret=None,
        concurrency=8,
    )


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_duplicate_sink_names() -> None:
    data = {
        "databases": [{"name": "a", "dsn": "postgresql://x/y"}],
        "sinks": [{"name": "s", "tables": ["t"], "destination": {"type": "sequin_stream"}}] * 2,
    }
    with pytest.raises(ConfigError, match="sink names must be unique"):
        parse_config(data)


@pytest.mark.parametrize(
    ("value", "seconds"), [(15, 15.0), ("15s", 15.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0)]
)
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


def test_the_trigger_interval_is_a_duration_and_50ms_by_default() -> None:
    """``stream.trigger_interval``: unset, micro-batches start at most every 50 ms; 0 starts each when
    the one before it ends; a duration sets the least time between starts; a negative one is refused
    with its path."""
    base = {
        "databases": [{"name": "a", "dsn": "postgresql://x/y"}],
        "sinks": [{"name": "s", "tables": ["t"], "destination": {"type": "sequin_stream"}}],
    }
    assert parse_config(base).stream.trigger_interval == 0.05
    assert parse_config({**base, "stream": {"trigger_interval": 0}}).stream.trigger_interval == 0.0
    assert parse_config({**base, "stream": {"trigger_interval": "250ms"}}).stream.trigger_interval == 0.25
    with pytest.raises(ConfigError, match=r"stream\.trigger_interval.*negative"):
        parse_config({**base, "stream": {"trigger_interval": -1}})
