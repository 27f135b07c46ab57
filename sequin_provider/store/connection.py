"""Store connections: durable commits, one-statement transactions, integer array parameters, and
``ident``, the store schema's SQL identifier."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Iterable

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

DURABLE_COMMIT = "set_config('synchronous_commit', 'on', true)"
"""SQL that makes the transaction it runs in durable when it commits, whatever the session's and the
server's ``synchronous_commit`` (``durable_commit``). As an expression it also goes inside the one
statement of an autocommit transaction (``own_transaction``), whose commit then waits for the WAL
flush too: the setting is the transaction's until it ends."""


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
    conn.execute("SELECT " + DURABLE_COMMIT)


def own_transaction(conn: psycopg.Connection[Any]) -> AbstractContextManager[Any]:
    """What makes one statement on ``conn`` a transaction of its own: nothing on an autocommit
    connection outside a transaction block (the statement is one, and its commit comes back with its
    answer: one round trip instead of three for BEGIN, the statement and COMMIT), else a
    transaction block (committed at its end, or a savepoint inside the caller's block)."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        return nullcontext()
    return conn.transaction()


def int_array(values: Iterable[int]) -> str:
    """``values`` as a Postgres array literal, for a parameter cast to ``bigint[]`` or ``integer[]``
    in the query. psycopg dumps a list element by element in Python: three lists of 100 ints took
    0.41 ms per query, their literals 0.05 ms."""
    return "{" + ",".join(map(str, values)) + "}"
