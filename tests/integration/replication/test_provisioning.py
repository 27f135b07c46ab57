"""``sequin init``: prerequisites are checked first; failures leave nothing half-created."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from sequin_provider import store
from sequin_provider.cli import main as cli_main
from sequin_provider.config import load_config
from sequin_provider.provisioning import initialize
from sequin_provider.replication import ChangeReader, ReplicationError
from tests.support.config import write_config
from tests.support.postgres import execute


def config_for(tmp_path: Path, dsn: str, tables: str, slot: str) -> Path:
    return write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases:
          - name: app
            dsn: {dsn}
            slot: {{name: {slot}}}
            publication: {{name: pub_{slot}}}
        sinks:
          - name: s
            tables: {tables}
            destination: {{type: sequin_stream}}
        """,
    )


def created_objects(dsn: str, slot: str) -> tuple[bool, bool, bool]:
    """(publication exists, slot exists, store schema exists)."""
    with psycopg.connect(dsn) as conn:
        pub = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (f"pub_{slot}",)).fetchone()
        sl = conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        sch = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'sequin'").fetchone()
    return bool(pub), bool(sl), bool(sch)


def test_init_creates_everything_once(
    tmp_path: Path, dsn: str, dbname: str, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(
        dsn,
        "CREATE TABLE a (id int PRIMARY KEY)",
        "CREATE TABLE b (id int PRIMARY KEY)",
        "ALTER TABLE b REPLICA IDENTITY FULL",
    )
    path = config_for(tmp_path, dsn, "[a, b]", f"s_{dbname}")
    assert cli_main(["--config", str(path), "init"]) == 0
    out = capsys.readouterr()
    assert "publication" in out.out and "replication slot" in out.out and "store schema" in out.out
    assert "public.a has REPLICA IDENTITY DEFAULT" in out.err and "public.b" not in out.err
    assert created_objects(dsn, f"s_{dbname}") == (True, True, True)
    assert cli_main(["--config", str(path), "init"]) == 0
    assert "nothing to create" in capsys.readouterr().out
    with psycopg.connect(dsn) as conn:
        assert store.schema_version(conn) == store.SCHEMA_VERSION
        assert store.migrate(conn) == []


def test_init_adds_new_tables_to_the_publication(tmp_path: Path, dsn: str, dbname: str) -> None:
    execute(dsn, "CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)")
    initialize(load_config(config_for(tmp_path, dsn, "[a]", f"s_{dbname}")))
    initialize(load_config(config_for(tmp_path, dsn, "[a, b]", f"s_{dbname}")))
    with psycopg.connect(dsn) as conn:
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_publication_tables WHERE pubname = %s", (f"pub_s_{dbname}",)
            )
        }
    assert tables == {"a", "b"}


@pytest.mark.parametrize(
    ("setup", "tables", "message"),
    [
        ("CREATE TABLE a (id int PRIMARY KEY)", "[a, missing]", "table public.missing does not exist"),
        ("CREATE TABLE a (id int)", "[a]", "table public.a has no primary key"),
        (
            "CREATE TABLE a (id int PRIMARY KEY); ALTER TABLE a REPLICA IDENTITY NOTHING",
            "[a]",
            "REPLICA IDENTITY NOTHING",
        ),
        ("CREATE TABLE a (id int PRIMARY KEY)", "[{name: a, group_column_names: [nope]}]", "has no column 'nope'"),
        ("CREATE VIEW a AS SELECT 1 AS id", "[a]", "table public.a does not exist (or is not a table)"),
    ],
)
def test_bad_tables_fail_and_create_nothing(
    tmp_path: Path, dsn: str, dbname: str, setup: str, tables: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(dsn, setup)
    path = config_for(tmp_path, dsn, tables, f"s_{dbname}")
    assert cli_main(["--config", str(path), "init"]) == 2
    assert message in capsys.readouterr().err
    assert created_objects(dsn, f"s_{dbname}") == (False, False, False)


def test_slot_used_by_another_consumer(tmp_path: Path, dsn: str, dbname: str) -> None:
    execute(dsn, "CREATE TABLE a (id int PRIMARY KEY)")
    config = load_config(config_for(tmp_path, dsn, "[a]", f"s_{dbname}"))
    initialize(config)
    other = ChangeReader(dsn, f"s_{dbname}", f"pub_s_{dbname}")
    other.open(0)
    try:
        with pytest.raises(ReplicationError, match=r"slot 's_\w+' is in use by another consumer \(walsender pid \d+\)"):
            initialize(config)
        intruder = ChangeReader(dsn, f"s_{dbname}", f"pub_s_{dbname}")
        with pytest.raises(ReplicationError, match="stays in use by another consumer"):
            intruder.open(0, attempts=2)
    finally:
        other.close()


def test_wal_level_not_logical(tmp_path: Path) -> None:
    with EmbeddedPostgres(wal_level="replica", use_env_dsn=False) as plain:
        dsn = plain.create_database("app")
        execute(dsn, "CREATE TABLE a (id int PRIMARY KEY)")
        with pytest.raises(ReplicationError, match="wal_level is 'replica', must be 'logical'"):
            initialize(load_config(config_for(tmp_path, dsn, "[a]", "s_replica")))
        assert created_objects(dsn, "s_replica") == (False, False, False)


def test_unreachable_database_is_a_clear_cli_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_for(tmp_path, "postgresql://postgres@127.0.0.1:1/none", "[a]", "s")
    assert cli_main(["--config", str(path), "init"]) == 2
    assert "cannot connect" in capsys.readouterr().err


def test_initial_backfill_is_created_once_when_the_sink_is_first_set_up(tmp_path: Path, dsn: str, dbname: str) -> None:
    execute(
        dsn,
        "CREATE TABLE a (id int PRIMARY KEY, at timestamptz)",
        "CREATE TABLE b (id int PRIMARY KEY)",
        "INSERT INTO a SELECT g, now() FROM generate_series(1, 10) g",
    )
    path = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases:
          - {{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}}}}
        sinks:
          - {{name: whole, tables: [a, b], initial_backfill: true, destination: {{type: sequin_stream}}}}
          - name: recent
            tables: [a]
            initial_backfill: {{table: a, sort_column: at, start_position: "2020-01-01"}}
            destination: {{type: sequin_stream}}
          - {{name: none, tables: [b], destination: {{type: sequin_stream}}}}
        """,
    )
    report = initialize(load_config(path))
    assert sum("initial backfill" in line for line in report.created) == 3
    with psycopg.connect(dsn) as conn:
        got = sorted(
            (b.sink, b.table_name, b.kind, b.sort_column, b.start_position, b.state)
            for b in store.list_backfills(conn, "sequin")
        )
    assert got == [
        ("recent", "a", "partial", "at", "2020-01-01", "pending"),
        ("whole", "a", "full", None, None, "pending"),
        ("whole", "b", "full", None, None, "pending"),
    ]
    assert not any("initial backfill" in line for line in initialize(load_config(path)).created)  # once
    with psycopg.connect(dsn) as conn:
        assert len(store.list_backfills(conn, "sequin")) == 3


def test_a_bad_initial_backfill_fails_init_and_records_nothing(tmp_path: Path, dsn: str, dbname: str) -> None:
    execute(dsn, "CREATE TABLE a (id int PRIMARY KEY, at timestamptz)")
    path = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases:
          - {{name: app, dsn: "{dsn}", slot: {{name: slot_{dbname}}}, publication: {{name: pub_{dbname}}}}}
        sinks:
          - name: s
            tables: [a]
            initial_backfill: {{table: a, sort_column: at, start_position: "not a time"}}
            destination: {{type: sequin_stream}}
        """,
    )
    with pytest.raises(ReplicationError, match="initial backfill: start position 'not a time' is not a valid"):
        initialize(load_config(path))
    with psycopg.connect(dsn) as conn:
        assert store.list_backfills(conn, "sequin") == []
        assert store.new_sinks(conn, "sequin", ["s"]) == ["s"]  # tried again next time
