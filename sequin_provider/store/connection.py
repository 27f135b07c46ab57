"""Store connections: durable commits, and ``ident``, the store schema's SQL identifier."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql


def ident(schema: str) -> sql.Identifier:
    """The store schema ``schema`` as a SQL identifier, for queries composed with ``psycopg.sql``."""
    return sql.Identifier(schema)


def connect_durable(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A store connection whose commits are durable when they return (``synchronous_commit = on``
    whatever the server's default). The data path acknowledges the slot once its store writes have
    committed; with ``off`` a crash of the store loses its last few hundred milliseconds of commits,
    and with them messages the slot has already moved past."""
    conn = psycopg.connect(dsn, **kwargs)
    conn.execute("SET synchronous_commit = on")
    conn.commit()
    return conn


def durable_commit(conn: psycopg.Connection[Any]) -> None:
    """Make the transaction in progress durable when it commits, whatever the session's and the
    server's ``synchronous_commit``: a backfill created, cancelled or finished must not vanish in a
    crash of the store after its caller was told so (a chaos round's immediate restart, 1 s after
    ``create_backfill`` returned id 2, left the backfill app with "no backfill with id 2")."""
    conn.execute("SET LOCAL synchronous_commit = on")
