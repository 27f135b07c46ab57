"""A libpq DSN as a SQLAlchemy URL, for the tools that take one: Airflow's metadata database
(``devtools.airflow_standalone``) and the Iceberg sink's SQL catalog (its tests and benchmark)."""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy.engine import URL


def sqlalchemy_url(dsn: str, **overrides: Any) -> str:
    """The psycopg2 SQLAlchemy URL of a libpq ``dsn`` (URL or key=value), ``overrides`` being libpq
    parameters that replace the DSN's (``port=...``). Every part is escaped as a URL needs (a password
    with reserved characters), and a socket directory as host goes in the query, where libpq takes it:
    in the URL's host, SQLAlchemy would read it as part of the database name."""
    params = psycopg.conninfo.conninfo_to_dict(dsn, **overrides)
    host = params.get("host")
    socket_dir = bool(host) and str(host).startswith("/")
    return URL.create(
        "postgresql+psycopg2",
        username=params.get("user"),
        password=params.get("password"),
        host=None if socket_dir else host,
        port=int(params["port"]) if params.get("port") else None,
        database=params.get("dbname"),
        query={"host": str(host)} if socket_dir else {},
    ).render_as_string(hide_password=False)
