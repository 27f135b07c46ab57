"""The pull API's tokens (``api_tokens``): stored as SHA-256 hashes only, which the caller computes
(``stream_queue.hash_token``); a token is active until revoked, and a revoked token's name may be
reused."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.store.connection import ident


def add_api_token(conn: psycopg.Connection[Any], schema: str, name: str, token_hash: str) -> bool:
    """Store a token's hash under ``name``, replacing a revoked token of that name; False (nothing
    stored) when an active token has that name."""
    with conn.transaction():
        row = conn.execute(
            sql.SQL(
                "INSERT INTO {0}.api_tokens (name, token_hash) VALUES (%s, %s) ON CONFLICT (name) DO UPDATE"
                " SET token_hash = EXCLUDED.token_hash, created_at = now(), revoked_at = NULL"
                " WHERE {0}.api_tokens.revoked_at IS NOT NULL RETURNING name"
            ).format(ident(schema)),
            (name, token_hash),
        ).fetchone()
    return row is not None


def revoke_api_token(conn: psycopg.Connection[Any], schema: str, name: str) -> int:
    """Revoke the active token called ``name``; returns how many were (0: none is active by that name)."""
    with conn.transaction():
        cur = conn.execute(
            sql.SQL("UPDATE {}.api_tokens SET revoked_at = now() WHERE name = %s AND revoked_at IS NULL").format(
                ident(schema)
            ),
            (name,),
        )
    return cur.rowcount


def list_api_tokens(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, datetime, datetime | None]]:
    """(name, created_at, revoked_at) of every token."""
    return [
        tuple(r)
        for r in conn.execute(
            sql.SQL(  # type: ignore[misc]
                "SELECT name, created_at, revoked_at FROM {}.api_tokens ORDER BY name"
            ).format(ident(schema))
        ).fetchall()
    ]


def api_token_active(conn: psycopg.Connection[Any], schema: str, token_hash: str) -> bool | None:
    """Whether the token with hash ``token_hash`` is active (False: revoked); None when no token has it."""
    row = conn.execute(
        sql.SQL("SELECT revoked_at IS NULL FROM {}.api_tokens WHERE token_hash = %s").format(ident(schema)),
        (token_hash,),
    ).fetchone()
    return None if row is None else bool(row[0])
