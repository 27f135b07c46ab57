"""A changelog: a table that keeps every message of a sink as a row (change retention, docs/replays.md).

Two sinks keep one: ``postgres_table`` with ``mode: changelog`` and ``iceberg`` with ``mode: changelog``.
Both have the same columns (``CHANGELOG_COLUMNS``): the message's position (``commit_lsn``,
``commit_idx``, unique per message, so a replayed batch adds nothing), what happened (``action``,
``table_schema``, ``table_name``, ``commit_timestamp``, ``record_pks``, ``idempotency_key``) and the
message's ``record`` and ``changes`` as its own JSON text. A ``retention`` period drops the rows whose
commit is older (``Retention``). ``replay`` reads a changelog back into any sink.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from sequin_provider.backfill.row_filter import row_filter_sql
from sequin_provider.exceptions import ReplayError

if TYPE_CHECKING:
    from sequin_provider.sinks.base import OptionReader

CHANGELOG_COLUMNS = (
    "commit_lsn",
    "commit_idx",
    "action",
    "idempotency_key",
    "table_schema",
    "table_name",
    "commit_timestamp",
    "record_pks",
    "record",
    "changes",
)
"""A changelog table's columns: the position, what happened, and ``record``/``changes`` as JSON text."""

_LSN = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_POSITION = re.compile(r"^(\d+)(?::(\d+))?$")
PRUNE_EVERY = 60.0
"""Seconds between two prunes of one changelog by one process (a prune is one indexed delete)."""


def parse_retention(reader: OptionReader, value: Any, path: str, mode: str) -> float | None:
    """A sink's ``retention`` option (``path``) in seconds: only a changelog's (``mode``), longer than
    0; None when it is not set (keep every row)."""
    if value is None:
        return None
    if mode != "changelog":
        raise reader.fail(path, "only a changelog keeps changes for a period (mode: changelog)")
    seconds = reader.duration(value, path)
    if seconds <= 0:
        raise reader.fail(path, "must be longer than 0s")
    return seconds


@dataclass
class Retention:
    """When a changelog's writer prunes it: rows whose ``commit_timestamp`` is older than ``seconds``
    go, at most once every ``PRUNE_EVERY`` seconds (or a tenth of the period, if shorter) per writer.
    ``seconds`` None keeps everything."""

    seconds: float | None
    _last: float = field(default=float("-inf"), repr=False)

    def due(self) -> bool:
        """Whether a prune is due now (and, if so, the clock restarts)."""
        if self.seconds is None:
            return False
        now = time.monotonic()
        if now - self._last < min(PRUNE_EVERY, self.seconds / 10):
            return False
        self._last = now
        return True


@dataclass(frozen=True)
class Bound:
    """One end of a range of a changelog (a replay's): a commit time, or a position (``commit_lsn``, ``commit_idx``)."""

    text: str
    timestamp: datetime | None = None
    position: tuple[int, int] | None = None


def parse_bound(text: str, what: str) -> Bound:
    """A range end from ``2026-11-26T10:00:00Z`` (ISO 8601; without a zone, UTC), ``<lsn>:<idx>``
    or ``<lsn>`` (integers, as messages carry them) or ``16/B374D848`` (Postgres' LSN notation)."""
    value = text.strip()
    lsn = _LSN.match(value)
    if lsn:
        return Bound(value, position=((int(lsn.group(1), 16) << 32) + int(lsn.group(2), 16), 0))
    position = _POSITION.match(value)
    if position:
        return Bound(value, position=(int(position.group(1)), int(position.group(2) or 0)))
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ReplayError(
            f"{what} {text!r}: expected a time (2026-11-26T10:00:00Z) or a position (<lsn>:<idx> or 16/B374D848)"
        ) from None
    return Bound(value, timestamp=moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc))


@dataclass(frozen=True)
class ChangelogSelection:
    """What a replay reads from a changelog sink (``sink``, for errors): the changes of ``tables``
    committed in [``since``, ``until``) that match ``where`` (SQL over the changelog's columns)."""

    sink: str
    tables: tuple[tuple[str, str], ...]
    since: Bound | None = None
    until: Bound | None = None
    where: str | None = None


def select_changes(table: sql.Composable, selection: ChangelogSelection) -> tuple[sql.Composed, list[Any]]:
    """The query of a changelog table's rows of the selection, in position order: (commit_lsn,
    commit_idx, commit_timestamp as the message's text, table_schema, table_name, action, record,
    changes, record_pks)."""
    terms = [
        sql.SQL("(table_schema, table_name) IN ({})").format(
            sql.SQL(", ").join(sql.SQL("(%s, %s)") for _ in selection.tables)
        )
    ]
    params: list[Any] = [v for key in selection.tables for v in key]
    for bound, op in ((selection.since, ">="), (selection.until, "<")):
        if bound is None:
            continue
        if bound.position is not None:
            terms.append(sql.SQL("(commit_lsn, commit_idx) " + op + " (%s, %s)"))
            params += list(bound.position)
        else:
            terms.append(sql.SQL("commit_timestamp " + op + " %s"))
            params.append(bound.timestamp)
    if selection.where:
        terms.append(row_filter_sql(selection.where))
    query = sql.SQL(
        "SELECT commit_lsn, commit_idx,"
        " to_char(commit_timestamp AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),"
        " table_schema, table_name, action, record::text, changes::text, record_pks"
        " FROM {} WHERE {} ORDER BY commit_lsn, commit_idx"
    ).format(table, sql.SQL(" AND ").join(terms))
    return query, params


def read_changes(
    conn: psycopg.Connection[Any], table: sql.Composable, selection: ChangelogSelection
) -> list[tuple[Any, ...]]:
    """The selection's rows of one changelog table (``select_changes``), read only; ``ReplayError``
    with Postgres' reason (an unknown column of the condition, say)."""
    query, params = select_changes(table, selection)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL transaction_read_only = on")
            return conn.execute(query, params).fetchall()
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReplayError(f"reading changelog of sink {selection.sink!r}: {reason}") from None
