"""``devtools.sqlalchemy_url`` and ``devtools.airflow_standalone``: the metadata database's URL from a
libpq DSN (what the end-to-end test and the demo hand Airflow; the Iceberg tests' catalog URL too)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy

from devtools.airflow_standalone import airflow_env
from devtools.sqlalchemy_url import sqlalchemy_url


def test_a_tcp_dsn_becomes_a_psycopg2_url_with_every_part() -> None:
    url = sqlalchemy.engine.make_url(sqlalchemy_url("postgresql://postgres:s%40cret@127.0.0.1:5544/airflow_meta"))
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg2",
        "postgres",
        "s@cret",
        "127.0.0.1",
        5544,
        "airflow_meta",
    )


def test_a_socket_directory_goes_in_the_query() -> None:
    url = sqlalchemy.engine.make_url(sqlalchemy_url("host=/var/run/postgresql port=5432 dbname=meta user=me"))
    assert (url.host, url.query, url.port, url.database, url.username) == (
        None,
        {"host": "/var/run/postgresql"},
        5432,
        "meta",
        "me",
    )


def test_without_a_metadata_dsn_airflow_keeps_its_sqlite(tmp_path: Path) -> None:
    dsn = "postgresql://postgres@127.0.0.1:5432/app"
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in airflow_env(
        tmp_path, dsn, tmp_path / "s.yaml", metadata_dsn=None
    )
    env = airflow_env(tmp_path, dsn, tmp_path / "s.yaml", metadata_dsn="postgresql://postgres@127.0.0.1:5432/meta")
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == "postgresql+psycopg2://postgres@127.0.0.1:5432/meta"


def test_overrides_replace_the_dsns_parameters() -> None:
    url = sqlalchemy.engine.make_url(sqlalchemy_url("postgresql://postgres@127.0.0.1:5544/app", port=9))
    assert (url.host, url.port, url.database) == ("127.0.0.1", 9, "app")
