"""The watermark window protocol between backfill pages and the change stream (DESIGN §7).

A backfill page is bracketed by two transactional logical messages in the source's WAL:
``sequin:backfill:low`` before its SELECT and ``sequin:backfill:high`` after its rows are staged.
The stream side sees them in commit order among the changes. ``WindowTracker`` follows the open
windows: every change to a windowed table between the two marks adds its key (and, for an update
that moved the key, the old key) to the window, and at the high mark the page's staged rows whose
key is in that set are dropped: the change events carry a newer state than the read could. A
high mark whose low mark this process did not see (it restarted in between) means the window is
unknown, so the page is stale and read again; so does a TRUNCATE of the table inside the window.
No Spark here; the only I/O is a page's two statements on the source just after its low watermark
(``wait_for_snapshot_horizon``, ``read_position``), here because they are the protocol's too.
A page's reads are rows for the Spark pipeline (``read_rows``), or, for sinks that need no
Spark, written by the backfill task as it stages the page, hidden until the window closes
(``page_reads``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import psycopg

from sequin_provider.config import SinkConfig
from sequin_provider.delivery import message_kind, reads_render_in_store
from sequin_provider.messages import metadata_tail, read_message_template
from sequin_provider.pgoutput import lsn_to_int
from sequin_provider.store import StoreReads

log = logging.getLogger(__name__)

LOW_PREFIX = "sequin:backfill:low"
HIGH_PREFIX = "sequin:backfill:high"
MAX_WINDOW_KEYS = 2_000_000
"""A window that collects more keys than this is given up (its page is read again)."""

Key = tuple[str, ...]


@dataclass(frozen=True)
class Watermark:
    """The content of a low or high watermark message."""

    backfill_id: int
    page_id: int
    range_idx: int
    table_schema: str
    table_name: str
    primary_key: tuple[str, ...]
    last: bool = False  # a high watermark that ends its range: the stream app does not hold its batch


def watermark_content(mark: Watermark) -> str:
    """The JSON payload of a watermark message."""
    content = {
        "backfill": mark.backfill_id,
        "page": mark.page_id,
        "range": mark.range_idx,
        "schema": mark.table_schema,
        "table": mark.table_name,
        "pk": list(mark.primary_key),
    }
    return json.dumps({**content, "last": True} if mark.last else content, separators=(",", ":"))


def parse_watermark(content: str) -> Watermark | None:
    """A watermark from its payload; None (logged) for a payload that is not one of ours."""
    try:
        data = json.loads(content)
        return Watermark(
            int(data["backfill"]),
            int(data["page"]),
            int(data.get("range", 0)),
            str(data["schema"]),
            str(data["table"]),
            tuple(str(c) for c in data["pk"]),
            bool(data.get("last", False)),
        )
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring a malformed backfill watermark %r: %s", content[:200], exc)
        return None


def _text(value: Any) -> str:
    """A JSON value of a record back in Postgres text form (as ``record_pks`` holds keys)."""
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def holdable(row: Sequence[Any]) -> bool:
    """Whether a change row may wait for a later micro-batch: a logical message that is not the
    high watermark ending a backfill range (its range's job waits for that batch)."""
    if row[6] != "message":
        return False
    if row[5] != HIGH_PREFIX:
        return True
    mark = parse_watermark(row[7])
    return mark is None or not mark.last


def old_key(row: Sequence[Any], primary_key: Sequence[str]) -> Key | None:
    """For an update that changed key columns, the row's previous key (from ``changes``).

    Numbers are compared as the text they were rendered from; values whose JSON rendering is not
    their Postgres text (timestamps, bytea) may not match, which only matters for an update of
    such a key while its page is in flight (docs/backfills.md, "Guarantees and limits")."""
    if row[6] != "update" or not row[8] or row[8] == "{}":
        return None
    try:
        old = json.loads(row[8], parse_float=str, parse_int=str)
    except ValueError:
        return None
    if not any(c in old for c in primary_key):
        return None
    record = json.loads(row[7], parse_float=str, parse_int=str)
    return tuple(_text(old[c] if c in old else record.get(c)) for c in primary_key)


@dataclass
class Window:
    """An open window: the page it belongs to and the keys changed since its low watermark."""

    mark: Watermark
    changed: set[Key] = field(default_factory=set)
    overflow: bool = False

    def add(self, row: Sequence[Any]) -> None:
        """Record the key(s) a change row touches. A truncate touches every row the page may have
        read, so its window is given up like one that overflows: the page is read again after it."""
        if self.overflow:
            return
        if row[6] == "truncate":
            log.info(
                "backfill %d page %d: its table was truncated inside its window; the page will be read again",
                self.mark.backfill_id,
                self.mark.page_id,
            )
            self.overflow, self.changed = True, set()
            return
        self.changed.add(tuple(row[9]))
        moved = old_key(row, self.mark.primary_key)
        if moved is not None:
            self.changed.add(moved)
        if len(self.changed) > MAX_WINDOW_KEYS:
            log.warning(
                "backfill %d page %d: more than %d keys changed inside its window; the page will be read again",
                self.mark.backfill_id,
                self.mark.page_id,
                MAX_WINDOW_KEYS,
            )
            self.overflow, self.changed = True, set()


@dataclass(frozen=True)
class WindowClosed:
    """A high watermark met in the stream: its row (the position), whether its window was seen
    whole by this process, and the keys changed inside it."""

    mark: Watermark
    row: tuple
    seen: bool
    changed: frozenset[Key]


class WindowTracker:
    """Follows backfill windows over change rows taken in commit order (one per stream reader)."""

    def __init__(self) -> None:
        self._windows: dict[int, Window] = {}
        self._by_table: dict[tuple[str, str], list[Window]] = {}

    @property
    def open_pages(self) -> list[int]:
        """Pages whose window is open."""
        return sorted(self._windows)

    def scan(self, rows: Iterable[tuple]) -> list[WindowClosed]:
        """Take rows in order; return the windows closed among them (in order)."""
        closed: list[WindowClosed] = []
        by_table = self._by_table
        for row in rows:
            if row[6] == "message":
                if row[5] == LOW_PREFIX:
                    mark = parse_watermark(row[7])
                    if mark is not None:
                        self._open(mark)
                elif row[5] == HIGH_PREFIX:
                    mark = parse_watermark(row[7])
                    if mark is not None:
                        closed.append(self._close(mark, row))
            elif by_table:
                windows = by_table.get((row[4], row[5]))
                if windows:
                    for window in windows:
                        window.add(row)
        return closed

    def _open(self, mark: Watermark) -> None:
        # a new page of the same range supersedes any window its job left behind
        for page, window in list(self._windows.items()):
            if (window.mark.backfill_id, window.mark.range_idx) == (mark.backfill_id, mark.range_idx):
                self._drop(page)
        window = Window(mark)
        self._windows[mark.page_id] = window
        self._by_table.setdefault((mark.table_schema, mark.table_name), []).append(window)

    def _close(self, mark: Watermark, row: tuple) -> WindowClosed:
        window = self._drop(mark.page_id)
        if window is None or window.overflow:
            return WindowClosed(mark, row, False, frozenset())
        return WindowClosed(mark, row, True, frozenset(window.changed))

    def _drop(self, page_id: int) -> Window | None:
        window = self._windows.pop(page_id, None)
        if window is not None:
            key = (window.mark.table_schema, window.mark.table_name)
            remaining = [w for w in self._by_table.get(key, []) if w is not window]
            if remaining:
                self._by_table[key] = remaining
            else:
                self._by_table.pop(key, None)
        return window

    def reset(self) -> None:
        """Forget every window (the stream was reopened elsewhere: they can no longer be trusted)."""
        self._windows.clear()
        self._by_table.clear()


def read_rows(
    closed_row: tuple,
    table_schema: str,
    table_name: str,
    backfill_id: int,
    sink: str,
    staged: Sequence[tuple[int, Sequence[str], str]],
) -> list[tuple]:
    """Change rows with action ``read`` for the staged rows kept, at the high watermark's position.

    Positions are the watermark's commit LSN with consecutive indexes after it (its transaction
    holds nothing else), so a batch rebuilt after a crash gives each read the same position.
    """
    lsn, idx, ts, xid = closed_row[0], closed_row[1], closed_row[2], closed_row[3]
    return [
        (lsn, idx + 1 + n, ts, xid, table_schema, table_name, "read", record, None, list(pks), [], backfill_id, sink)
        for n, (_ordinal, pks, record) in enumerate(staged)
    ]


def page_reads(
    sink: SinkConfig | None,
    database_name: str,
    backfill_id: int,
    table_schema: str,
    table_name: str,
    commit_timestamp: str,
    commit_lsn: int,
    commit_idx: int = 0,
) -> StoreReads | None:
    """For sinks that need no Spark (``delivery.reads_render_in_store``): how the store writes a
    page's reads itself, at ``(commit_lsn, commit_idx + 1…)``, or None."""
    if sink is None or not reads_render_in_store(sink, table_schema, table_name):
        return None
    template = read_message_template(
        message_kind(sink),
        table_schema,
        table_name,
        commit_timestamp,
        commit_lsn,
        metadata_tail(sink.consumer_id, sink.name, database_name),
    )
    group = f"{table_schema}.{table_name}:" if sink.message_grouping else None
    return StoreReads(sink.name, backfill_id, template, group, commit_lsn, commit_idx)


SNAPSHOT_WAIT = 2.0
"""Seconds a page waits at most for the transactions in progress at its low watermark (``wait_for_snapshot_horizon``)."""


def wait_for_snapshot_horizon(conn: psycopg.Connection[Any], timeout: float = SNAPSHOT_WAIT) -> None:
    """Wait until transactions still in progress now have finished (briefly).

    A transaction whose commit record precedes the low watermark can still look in progress to a
    snapshot taken just after it (Postgres writes the commit record, then publishes the commit).
    Its change is not inside the window, so the page's SELECT must see it: waiting for the
    transactions in progress at this moment closes that gap. Transactions still running after
    ``timeout`` had not written their commit record yet, so they fall inside the window.
    """
    snapshot = conn.execute("SELECT txid_current_snapshot()::text").fetchone()[0]  # type: ignore[index]
    in_progress = [int(x) for x in str(snapshot).split(":")[2].split(",") if x]
    deadline = time.monotonic() + timeout
    while in_progress:
        rows = conn.execute(
            "SELECT x FROM unnest(%s::bigint[]) AS x WHERE txid_status(x) = 'in progress'", (in_progress,)
        ).fetchall()
        in_progress = [int(r[0]) for r in rows]
        if not in_progress or time.monotonic() > deadline:
            return
        time.sleep(0.002)


READ_POSITION_PREFIX = "sequin:backfill:position"


def read_position(
    conn: psycopg.Connection[Any], prefix: str = READ_POSITION_PREFIX, content: str = ""
) -> tuple[int, str]:
    """A position for a page's reads and their commit timestamp, taken just after the page's low
    watermark committed: the last byte of a fresh non-transactional logical message (``prefix``,
    ``content``; the stream app ignores those), and the source's clock (UTC, as changes render it).
    A replay's mark is one too (``replay.replay_mark``).

    No commit record starts inside a WAL record, so the position is unique and no change has it;
    every commit before the low watermark lies below it, and the high watermark above it: a read
    there follows every change its SELECT saw that the window does not cover, and precedes every
    change after the window."""
    row = conn.execute(
        "SELECT pg_logical_emit_message(false, %s, %s), to_char(clock_timestamp() AT TIME ZONE 'UTC',"
        ' \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\')',
        (prefix, content),
    ).fetchone()
    return lsn_to_int(str(row[0])) - 1, str(row[1])  # type: ignore[index]
