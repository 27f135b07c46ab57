"""The store: Sequin's internal Postgres schema (migrations) and the queries on it (DESIGN §8).

Migrations are versioned and idempotent; ``migrate`` applies the missing ones under an advisory
lock, so ``sequin init`` and every app start may call it concurrently. All SQL that touches the
store lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from sequin_provider.exceptions import BackfillError
from sequin_provider.messages import ReadMessageTemplate, idempotency_key

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "stream messages and stream status", """
CREATE TABLE IF NOT EXISTS {schema}.stream_messages (
    sink              text        NOT NULL,
    commit_lsn        bigint      NOT NULL,
    commit_idx        integer     NOT NULL,
    group_id          text        NOT NULL,
    idempotency_key   text        NOT NULL,
    ack_id            uuid,                    -- replaced by ack_nonce in migration 7
    state             text        NOT NULL DEFAULT 'available',
    deliver_count     integer     NOT NULL DEFAULT 0,
    not_visible_until timestamptz,
    last_delivered_at timestamptz,
    inserted_at       timestamptz NOT NULL DEFAULT now(),
    data              json        NOT NULL,
    -- A message's position is unique per sink and identical when a batch is replayed, so it is
    -- the idempotency constraint (for changes the idempotency key is the position itself).
    PRIMARY KEY (sink, commit_lsn, commit_idx)
);
CREATE INDEX IF NOT EXISTS stream_messages_group ON {schema}.stream_messages (sink, group_id, commit_lsn, commit_idx);
CREATE UNIQUE INDEX IF NOT EXISTS stream_messages_ack_id ON {schema}.stream_messages (ack_id);
CREATE TABLE IF NOT EXISTS {schema}.stream_status (
    database          text PRIMARY KEY,
    slot              text,
    app_started_at    timestamptz,
    heartbeat_at      timestamptz,
    last_batch_id     bigint,
    last_batch_at     timestamptz,
    last_commit_lsn   bigint,
    batch_rows        integer,
    batch_latency_ms  double precision,
    rows_per_sec      double precision,
    total_rows        bigint NOT NULL DEFAULT 0,
    last_error        text
);
"""),
    (2, "backfills", """
CREATE TABLE IF NOT EXISTS {schema}.backfills (
    id              bigserial PRIMARY KEY,
    sink            text        NOT NULL,
    table_schema    text        NOT NULL,
    table_name      text        NOT NULL,
    kind            text        NOT NULL CHECK (kind IN ('full', 'partial')),
    sort_column     text,
    start_position  text,
    max_query_ms    integer     NOT NULL DEFAULT 5000 CHECK (max_query_ms BETWEEN 1 AND 600000),
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'running', 'completed', 'failed', 'cancelled')),
    cursor          jsonb,
    rows_initial    bigint,
    rows_processed  bigint      NOT NULL DEFAULT 0,
    rows_emitted    bigint      NOT NULL DEFAULT 0,
    error           text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    started_at      timestamptz,
    finished_at     timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'partial') = (sort_column IS NOT NULL))
);
CREATE UNIQUE INDEX IF NOT EXISTS backfills_one_active ON {schema}.backfills (sink, table_schema, table_name)
    WHERE state IN ('pending', 'running');
"""),
    (3, "stream visibility", """
CREATE TABLE IF NOT EXISTS {schema}.stream_visibility (
    sink        text PRIMARY KEY,
    visible_lsn bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
"""),
    (4, "backfill ranges, pages and staged rows", """
CREATE TABLE IF NOT EXISTS {schema}.backfill_ranges (
    backfill_id     bigint  NOT NULL REFERENCES {schema}.backfills (id) ON DELETE CASCADE,
    range_idx       integer NOT NULL,
    lower_key       jsonb,                 -- exclusive; null: from the first key
    upper_key       jsonb,                 -- inclusive; null: to the last key
    cursor          jsonb,                 -- the last key whose page was emitted
    done            boolean NOT NULL DEFAULT false,
    rows_processed  bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (backfill_id, range_idx)
);
CREATE TABLE IF NOT EXISTS {schema}.backfill_pages (
    id              bigserial PRIMARY KEY,
    backfill_id     bigint  NOT NULL REFERENCES {schema}.backfills (id) ON DELETE CASCADE,
    range_idx       integer NOT NULL,
    state           text    NOT NULL DEFAULT 'open'
                            CHECK (state IN ('open', 'staged', 'closing', 'emitted', 'stale')),
    cursor_after    jsonb,
    rows_staged     integer NOT NULL DEFAULT 0,
    rows_emitted    integer,
    dropped         integer[],             -- ordinals whose key changed inside the window
    high_lsn        bigint,                -- commit LSN of the high watermark that closed the window
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS backfill_pages_closing ON {schema}.backfill_pages (high_lsn) WHERE state = 'closing';
CREATE TABLE IF NOT EXISTS {schema}.backfill_rows (
    page_id         bigint  NOT NULL,
    ordinal         integer NOT NULL,
    record_pks      text[]  NOT NULL,
    record          text    NOT NULL,
    PRIMARY KEY (page_id, ordinal)
);
"""),
    (5, "sink setups", """
CREATE TABLE IF NOT EXISTS {schema}.sink_setups (
    sink        text PRIMARY KEY,
    created_at  timestamptz NOT NULL DEFAULT now()
);
"""),
    (6, "api tokens, consumer visibility index, buffer of parked messages", """
CREATE TABLE IF NOT EXISTS {schema}.api_tokens (
    name        text PRIMARY KEY,
    token_hash  text        NOT NULL UNIQUE,   -- sha256 hex of the token; the token itself is never stored
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX IF NOT EXISTS stream_messages_outstanding ON {schema}.stream_messages (sink)
    WHERE state = 'delivered';
CREATE TABLE IF NOT EXISTS {schema}.buffered_messages (
    sink              text        NOT NULL,
    commit_lsn        bigint      NOT NULL,
    commit_idx        integer     NOT NULL,
    group_id          text        NOT NULL,
    idempotency_key   text        NOT NULL,
    data              text,                    -- the rendered message; null when its transform failed
    source            text,                    -- the message before its transform, to transform again
    state             text        NOT NULL DEFAULT 'parked' CHECK (state IN ('parked', 'discarded')),
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    parked_at         timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sink, commit_lsn, commit_idx)
);
CREATE INDEX IF NOT EXISTS buffered_messages_group ON {schema}.buffered_messages (sink, group_id, commit_lsn, commit_idx)
    WHERE state = 'parked';
"""),
    # Receiving a message updates no indexed column, so the update is HOT (no index entries, the
    # new version on the same page, which the fillfactor leaves room for):
    # - an ack id encodes its message's position and a random nonce (stream_queue.ack_id), so an ack
    #   finds its message by primary key: no ack-id index;
    # - the count of pending messages (max_ack_pending) is kept in stream_pending by every receive,
    #   ack and nack: no index on state.
    # Messages received before this migration have no nonce: their old ack ids match nothing, and
    # they come back after their visibility timeout (at least once).
    (7, "HOT receives: ack ids derived from the position, a pending counter", """
DROP INDEX IF EXISTS {schema}.stream_messages_ack_id;
DROP INDEX IF EXISTS {schema}.stream_messages_outstanding;
ALTER TABLE {schema}.stream_messages DROP COLUMN IF EXISTS ack_id;
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS ack_nonce integer;
ALTER TABLE {schema}.stream_messages SET (fillfactor = 50);
CREATE TABLE IF NOT EXISTS {schema}.stream_pending (
    sink        text PRIMARY KEY,
    pending     bigint      NOT NULL DEFAULT 0,   -- messages received and neither acked nor nacked
    checked_at  timestamptz NOT NULL DEFAULT now()  -- last exact recount (stream_queue.receive)
);
INSERT INTO {schema}.stream_pending (sink, pending)
    SELECT sink, count(*) FROM {schema}.stream_messages WHERE state = 'delivered' GROUP BY sink
    ON CONFLICT (sink) DO NOTHING;
"""),
    # A page rendered by the source's SQL arrives as COPY bytes (backfill_sql); its last row carries
    # the page's order key, the range's next cursor, so the bytes need not be parsed.
    (8, "backfill rows carry the order key of a page's last row", """
ALTER TABLE {schema}.backfill_rows ADD COLUMN IF NOT EXISTS order_key text[];
"""),
    # A plain Sequin Stream sink's reads are written by the backfill task as it stages the page, at
    # the page's read position (just after its low watermark), hidden until the stream app closes
    # the page's window (DESIGN §7, docs/backfills.md): the close then takes back only the reads
    # whose key changed inside the window, instead of writing every read on the stream's path.
    (9, "backfill reads written by the task, hidden until their window closes", """
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS backfill_page bigint;
ALTER TABLE {schema}.backfill_pages ADD COLUMN IF NOT EXISTS read_lsn bigint;
"""),
    # Who asked for a backfill (an Airflow task instance: dag/task/run[map index]): a retry of that
    # task finds the backfill its earlier try started and resumes it instead of being refused.
    (10, "backfills record who requested them", """
ALTER TABLE {schema}.backfills ADD COLUMN IF NOT EXISTS requested_by text;
"""),
    # The cheapest message row: every change of a Sequin Stream sink is one, and its write is the
    # largest cost of the stream and of a backfill (docs/performance.md). A receive finds each
    # group's first message in the stream's head (stream_queue.receive), so no index on groups is
    # written per message; and the data is stored as the text it is rendered to, unparsed: it is
    # JSON by construction (the compiled renderer, held equal to its Python reference, or
    # json.dumps of a transform's result), and the pull API splices it into its answers as it is.
    # Changing the column's type rewrites the table once (ACCESS EXCLUSIVE while it runs).
    (11, "stream messages without a group index, data as text", """
DROP INDEX IF EXISTS {schema}.stream_messages_group;
ALTER TABLE {schema}.stream_messages ALTER COLUMN data TYPE text;
"""),
    # A truncate message is a barrier for its table (docs/stream-behaviour.md: TRUNCATE). Its
    # ``barrier`` is the group-id prefix of its table's messages for its sink ("schema.table:",
    # or "" when the sink does not group: then the whole sink), null for every other message, so
    # a receive (stream_queue) and a push or retry (delivery, buffer) can tell which earlier and
    # later messages it separates without storing the table of every message.
    (12, "truncate messages are barriers for their table", """
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS barrier text;
ALTER TABLE {schema}.buffered_messages ADD COLUMN IF NOT EXISTS barrier text;
CREATE INDEX IF NOT EXISTS buffered_messages_barrier ON {schema}.buffered_messages (sink)
    WHERE barrier IS NOT NULL AND state = 'parked';
"""),
    # An acked message never comes back (docs/stream-behaviour.md: "Acked messages never come
    # back"). An ack deletes its messages, so a micro-batch replayed after a crash between its store
    # commit and Spark's offset commit would write them again; the ack also records their positions
    # here, and a write of the stream takes out again the positions found here (``insert_stream_copy``).
    # A position is needed only until the slot has passed it (no replay can bring it back then):
    # the stream app records that position per sink (``passed_lsn``) and drops the entries below
    # it (``prune_acked``), and an ack of messages below it records nothing. One entry per ack
    # (its positions as two arrays, their LSN range indexed): an ack of 100 messages writes one
    # row and one index entry, not 100 (the ack's median time: +10 %, against +55 % for a row per
    # message, measured). A write looks up the entries whose range meets its own: none for a batch
    # that is not a replay, which lies above every acked position.
    (13, "the acked ledger: positions acked and not yet passed by the slot", """
CREATE TABLE IF NOT EXISTS {schema}.stream_acked (
    sink        text      NOT NULL,
    min_lsn     bigint    NOT NULL,
    max_lsn     bigint    NOT NULL,
    lsns        bigint[]  NOT NULL,   -- the positions (lsns[i], idxs[i]) acked together
    idxs        integer[] NOT NULL
);
CREATE INDEX IF NOT EXISTS stream_acked_range ON {schema}.stream_acked (max_lsn, min_lsn);
ALTER TABLE {schema}.stream_visibility ADD COLUMN IF NOT EXISTS passed_lsn bigint NOT NULL DEFAULT 0;
"""),
)

READS_RELEASED = """(m.backfill_page IS NULL OR EXISTS (SELECT 1 FROM {s}.backfill_pages p
                   WHERE p.id = m.backfill_page AND p.state IN ('closing', 'emitted')))"""
"""SQL condition on a message ``m`` of ``stream_messages``: not a backfill read still waiting for its
page's window to close (``{s}``: the store's schema identifier)."""

SCHEMA_VERSION = MIGRATIONS[-1][0]

BACKFILL_TRANSITIONS: dict[str, tuple[str, ...]] = {
    "running": ("pending",),
    "completed": ("running",),
    "failed": ("pending", "running"),
    "cancelled": ("pending", "running"),
}
"""Target state -> the states it may be reached from; completed, failed and cancelled are final."""
ACTIVE_BACKFILL_STATES = ("pending", "running")


# ``BackfillError`` (``exceptions``): the backfill functions below commit what they change, so they
# compose with a caller's connection whatever its transaction state.


@dataclass(frozen=True)
class Backfill:
    """A row of the backfills table."""

    id: int
    sink: str
    table_schema: str
    table_name: str
    kind: str
    sort_column: str | None
    start_position: str | None
    max_query_ms: int
    state: str
    cursor: Any
    rows_initial: int | None
    rows_processed: int
    rows_emitted: int
    error: str | None
    created_at: Any
    started_at: Any
    finished_at: Any
    updated_at: Any
    requested_by: str | None = None


class BackfillConflict(BackfillError):
    """The sink already has an active backfill of the table (``active``, when it could be read)."""

    def __init__(self, message: str, active: Backfill | None) -> None:
        super().__init__(message)
        self.active = active


MAX_QUERY_MS_LIMIT = 600_000


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


def check_max_query_ms(value: object) -> int:
    """A backfill's per-page query budget: an integer from 1 to 600000 ms."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUERY_MS_LIMIT:
        raise BackfillError(f"max_query_ms must be an integer between 1 and {MAX_QUERY_MS_LIMIT}, got {value!r}")
    return value


def _backfill_query(schema: str, where: str) -> sql.Composed:
    return sql.SQL("SELECT id, sink, table_schema, table_name, kind, sort_column, start_position, max_query_ms, state,"
                   " cursor, rows_initial, rows_processed, rows_emitted, error, created_at, started_at, finished_at,"
                   " updated_at, requested_by FROM {}.backfills " + where).format(_ident(schema))


BACKFILL_CHANNEL = "sequin_backfill"
"""The store's ``NOTIFY`` channel of new backfills (the payload: the store schema), which a backfill
server (``spark.backfill_app.serve_backfills``) listens on rather than waiting out its poll interval."""


def create_backfill(conn: psycopg.Connection[Any], schema: str, sink: str, table_schema: str, table_name: str,
                    kind: str = "full", sort_column: str | None = None, start_position: str | None = None,
                    max_query_ms: int = 5000, rows_initial: int | None = None,
                    requested_by: str | None = None) -> Backfill:
    """Record a pending backfill; at most one is active per (sink, table): ``BackfillConflict``."""
    if kind not in ("full", "partial"):
        raise BackfillError(f"kind must be 'full' or 'partial', got {kind!r}")
    if (kind == "partial") != (sort_column is not None):
        raise BackfillError("a partial backfill needs a sort column; a full one takes none")
    check_max_query_ms(max_query_ms)
    try:
        with conn.transaction():
            durable_commit(conn)
            row = conn.execute(sql.SQL(
                "INSERT INTO {}.backfills (sink, table_schema, table_name, kind, sort_column, start_position,"
                " max_query_ms, rows_initial, requested_by) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id"
            ).format(_ident(schema)), (sink, table_schema, table_name, kind, sort_column, start_position, max_query_ms,
                                       rows_initial, requested_by)).fetchone()
            conn.execute("SELECT pg_notify(%s, %s)", (BACKFILL_CHANNEL, schema))  # a backfill server wakes on commit
        conn.commit()  # a caller's open transaction made the block above a savepoint
    except psycopg.errors.UniqueViolation:
        active = conn.execute(_backfill_query(schema, "WHERE sink = %s AND table_schema = %s AND table_name = %s"
                                              " AND state IN ('pending', 'running')"),
                              (sink, table_schema, table_name)).fetchone()
        conn.commit()
        found = Backfill(*active) if active else None
        which = (f"backfill {found.id} ({found.state}{', requested by ' + found.requested_by if found.requested_by else ''})"
                 if found else "another backfill")
        raise BackfillConflict(f"sink {sink!r} already has an active backfill of {table_schema}.{table_name}: {which};"
                               " cancel it or wait for it to finish", found) from None
    return get_backfill(conn, schema, int(row[0]))  # type: ignore[index]


def get_backfill(conn: psycopg.Connection[Any], schema: str, backfill_id: int) -> Backfill:
    """One backfill by id."""
    row = conn.execute(_backfill_query(schema, "WHERE id = %s"), (backfill_id,)).fetchone()
    if row is None:
        raise BackfillError(f"no backfill with id {backfill_id}")
    return Backfill(*row)


def list_backfills(conn: psycopg.Connection[Any], schema: str, sink: str | None = None) -> list[Backfill]:
    """Backfills, newest first (optionally of one sink)."""
    where = "WHERE sink = %s ORDER BY id DESC" if sink else "ORDER BY id DESC"
    return [Backfill(*r) for r in conn.execute(_backfill_query(schema, where), (sink,) if sink else ()).fetchall()]


def transition_backfill(conn: psycopg.Connection[Any], schema: str, backfill_id: int, state: str,
                        error: str | None = None) -> Backfill:
    """Move a backfill to ``state`` if its current state allows it (``BACKFILL_TRANSITIONS``)."""
    allowed = BACKFILL_TRANSITIONS.get(state)
    if allowed is None:
        raise BackfillError(f"unknown target state {state!r} (running | completed | failed | cancelled)")
    stamps = {"running": "started_at = now(), ", "completed": "finished_at = now(), ", "failed": "finished_at = now(), ",
              "cancelled": "finished_at = now(), "}[state]
    with conn.transaction():
        durable_commit(conn)
        row = conn.execute(sql.SQL(
            "UPDATE {}.backfills SET state = %s, " + stamps + "error = coalesce(%s, error), updated_at = now()"
            " WHERE id = %s AND state = ANY(%s) RETURNING id").format(_ident(schema)),
            (state, error, backfill_id, list(allowed))).fetchone()
        if row is not None and state in ("failed", "cancelled"):
            # its pages in flight will not be emitted: hidden reads must not hold back their groups
            _stale_backfill_pages(conn, _ident(schema), backfill_id)
    conn.commit()
    if row is None:
        current = get_backfill(conn, schema, backfill_id)
        raise BackfillError(f"backfill {backfill_id} is {current.state}: it cannot become {state}")
    return get_backfill(conn, schema, backfill_id)


def record_backfill_progress(conn: psycopg.Connection[Any], schema: str, backfill_id: int, cursor: Any,
                             processed: int, emitted: int) -> None:
    """Advance a running backfill's cursor and add to its row counts."""
    with conn.transaction():
        done = conn.execute(sql.SQL(
            "UPDATE {}.backfills SET cursor = %s, rows_processed = rows_processed + %s, rows_emitted = rows_emitted + %s,"
            " updated_at = now() WHERE id = %s AND state = 'running' RETURNING id").format(_ident(schema)),
            (Jsonb(cursor), processed, emitted, backfill_id)).fetchone()
    conn.commit()
    if done is None:
        raise BackfillError(f"backfill {backfill_id} is not running: progress not recorded")


def _ident(schema: str) -> sql.Identifier:
    return sql.Identifier(schema)


def new_sinks(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str]) -> list[str]:
    """Which of ``sinks`` were never set up before (without recording them: ``record_sink_setup``)."""
    known = {r[0] for r in conn.execute(sql.SQL("SELECT sink FROM {}.sink_setups WHERE sink = ANY(%s)").format(
        _ident(schema)), (list(sinks),)).fetchall()}
    conn.commit()
    return [s for s in sinks if s not in known]


def record_sink_setup(conn: psycopg.Connection[Any], schema: str, sink: str) -> None:
    """Remember that a sink has been set up (its initial backfills are created once)."""
    conn.execute(sql.SQL("INSERT INTO {}.sink_setups (sink) VALUES (%s) ON CONFLICT DO NOTHING").format(_ident(schema)),
                 (sink,))
    conn.commit()


# -- backfill ranges and pages (the watermark window protocol, DESIGN §7) ----------------------

@dataclass(frozen=True)
class BackfillRange:
    """One task's slice of a backfill's key space and how far it got."""

    backfill_id: int
    range_idx: int
    lower_key: list[str] | None
    upper_key: list[str] | None
    cursor: list[str] | None
    done: bool
    rows_processed: int


def ensure_backfill_ranges(conn: psycopg.Connection[Any], schema: str, backfill_id: int,
                           bounds: Sequence[tuple[list[str] | None, list[str] | None]]) -> list[BackfillRange]:
    """Record a backfill's ranges once; a resumed backfill keeps the ranges (and cursors) it has."""
    with conn.transaction():
        conn.execute(sql.SQL("SELECT 1 FROM {}.backfills WHERE id = %s FOR UPDATE").format(_ident(schema)),
                     (backfill_id,))
        if not backfill_ranges(conn, schema, backfill_id):
            with conn.cursor() as cur:
                cur.executemany(sql.SQL("INSERT INTO {}.backfill_ranges (backfill_id, range_idx, lower_key, upper_key)"
                                        " VALUES (%s, %s, %s, %s)").format(_ident(schema)),
                                [(backfill_id, i, Jsonb(lo) if lo is not None else None,
                                  Jsonb(hi) if hi is not None else None) for i, (lo, hi) in enumerate(bounds)])
    conn.commit()
    return backfill_ranges(conn, schema, backfill_id)


def backfill_ranges(conn: psycopg.Connection[Any], schema: str, backfill_id: int) -> list[BackfillRange]:
    """A backfill's ranges in key order."""
    rows = conn.execute(sql.SQL("SELECT backfill_id, range_idx, lower_key, upper_key, cursor, done, rows_processed"
                                " FROM {}.backfill_ranges WHERE backfill_id = %s ORDER BY range_idx").format(
        _ident(schema)), (backfill_id,)).fetchall()
    return [BackfillRange(*r) for r in rows]


def open_backfill_page(conn: psycopg.Connection[Any], schema: str, backfill_id: int, range_idx: int) -> int:
    """A new page of a range (before its low watermark); returns the page id."""
    row = conn.execute(sql.SQL("INSERT INTO {}.backfill_pages (backfill_id, range_idx) VALUES (%s, %s)"
                               " RETURNING id").format(_ident(schema)), (backfill_id, range_idx)).fetchone()
    conn.commit()
    return int(row[0])  # type: ignore[index]


def stage_backfill_page(conn: psycopg.Connection[Any], schema: str, page_id: int,
                        rows: Sequence[tuple[list[str], str]], cursor_after: list[str] | None,
                        reads: StoreReads | None = None) -> bool:
    """Stage a page's rows ``(record_pks, record JSON)`` before its high watermark is emitted; with
    ``reads``, write them as the sink's hidden reads instead (``write_page_reads``). False when the
    page is no longer open (taken back: the backfill stopped), and then nothing is written."""
    s = _ident(schema)
    with conn.transaction(), conn.cursor() as cur:
        if not _lock_open_page(cur, schema, page_id):
            return False
        with cur.copy(sql.SQL("COPY {}.backfill_rows (page_id, ordinal, record_pks, record) FROM STDIN").format(s)) as copy:
            for ordinal, (pks, record) in enumerate(rows):
                copy.write_row((page_id, ordinal, pks, record))
        if reads is not None:
            write_page_reads(conn, s, page_id, reads)
            cur.execute(sql.SQL("DELETE FROM {}.backfill_rows WHERE page_id = %s").format(s), (page_id,))
        _mark_staged(cur, s, page_id, len(rows), cursor_after, reads.commit_lsn if reads is not None else None)
    conn.commit()
    return True


def stage_backfill_copy(conn: psycopg.Connection[Any], schema: str, page_id: int, data: bytes, rows: int,
                        cursor_after: list[str] | None) -> bool:
    """``stage_backfill_page`` for a page already in COPY text form (``backfill_reader.PageQuery.staging_sql``)."""
    s = _ident(schema)
    with conn.transaction(), conn.cursor() as cur:
        if not _lock_open_page(cur, schema, page_id):
            return False
        with cur.copy(sql.SQL("COPY {}.backfill_rows (page_id, ordinal, record_pks, record, order_key) FROM STDIN"
                              ).format(s)) as copy:
            copy.write(data)
        _mark_staged(cur, s, page_id, rows, cursor_after, None)
    conn.commit()
    return True


def _lock_open_page(cur: psycopg.Cursor[Any], schema: str, page_id: int) -> bool:
    row = cur.execute(sql.SQL("SELECT state FROM {}.backfill_pages WHERE id = %s FOR UPDATE").format(_ident(schema)),
                      (page_id,)).fetchone()
    return row is not None and row[0] == "open"


def _mark_staged(cur: psycopg.Cursor[Any], s: sql.Identifier, page_id: int, rows: int, cursor_after: list[str] | None,
                 read_lsn: int | None) -> None:
    cur.execute(sql.SQL("UPDATE {}.backfill_pages SET state = 'staged', rows_staged = %s, cursor_after = %s,"
                        " read_lsn = %s, updated_at = now() WHERE id = %s AND state = 'open'").format(s),
                (rows, Jsonb(cursor_after) if cursor_after is not None else None, read_lsn, page_id))


@dataclass(frozen=True)
class BackfillPage:
    """A page's state as the backfill job sees it."""

    id: int
    backfill_id: int
    range_idx: int
    state: str
    rows_staged: int
    rows_emitted: int | None


def get_backfill_page(conn: psycopg.Connection[Any], schema: str, page_id: int) -> BackfillPage:
    """One page by id."""
    row = conn.execute(sql.SQL("SELECT id, backfill_id, range_idx, state, rows_staged, rows_emitted"
                               " FROM {}.backfill_pages WHERE id = %s").format(_ident(schema)), (page_id,)).fetchone()
    conn.commit()
    if row is None:
        raise BackfillError(f"no backfill page {page_id}")
    return BackfillPage(*row)


@dataclass(frozen=True)
class ClosedWindow:
    """What the stream app emits for a page whose window it saw: the staged rows still valid, or
    (``in_store``) how many of them the store has already written as messages."""

    page_id: int
    backfill_id: int
    sink: str
    rows: list[tuple[int, list[str], str]]  # (ordinal, record_pks, record JSON)
    in_store: int = 0


@dataclass(frozen=True)
class StoreReads:
    """How a page's reads are written as a plain Sequin Stream sink's messages by the store itself:
    the sink, the message template, the group (``group_prefix`` + the key's JSON; None: the
    position) and the position (``commit_lsn``, indexes from ``commit_idx + 1``)."""

    sink: str
    backfill_id: int
    template: ReadMessageTemplate
    group_prefix: str | None
    commit_lsn: int
    commit_idx: int


def close_backfill_window(conn: psycopg.Connection[Any], schema: str, page_id: int, seen: bool,
                          changed: set[tuple[str, ...]], high_lsn: int) -> ClosedWindow | None:
    """Stream side, at a page's high watermark (DESIGN §7).

    A window this process saw becomes ``closing``: the rows whose key changed inside it are
    dropped, and ``finish_emitted_pages`` marks the page ``emitted`` once the batch is delivered.
    A page staged as rows returns the others, to be emitted at the high watermark's position. A
    page whose reads the task already wrote, hidden (``read_lsn``), has its dropped reads deleted
    and the rest released: ``in_store`` counts them. A window not seen (the app restarted in
    between), or of a backfill no longer running, makes a staged page ``stale`` (its rows and
    hidden reads go) and the job reads the page again. A closing page closed again (a replayed
    batch) gives the same answer as the first close; other states are left alone.
    """
    s = _ident(schema)
    with conn.transaction():
        row = conn.execute(sql.SQL("SELECT p.state, p.backfill_id, b.sink, b.state, p.rows_emitted, p.read_lsn"
                                   " FROM {0}.backfill_pages p JOIN {0}.backfills b ON b.id = p.backfill_id"
                                   " WHERE p.id = %s FOR UPDATE OF p").format(s), (page_id,)).fetchone()
        if row is None or row[0] not in ("staged", "closing"):
            result = None
        elif row[0] == "closing":
            result = ClosedWindow(page_id, int(row[1]), str(row[2]), [] if row[5] is not None else _kept_rows(
                conn, s, page_id), in_store=int(row[4] or 0) if row[5] is not None else 0)
        elif not seen or row[3] != "running":
            _stale_pages(conn, s, [page_id])
            result = None
        elif row[5] is not None:
            keys = [idempotency_key(0, 0, int(row[1]), k) for k in changed]
            # Never prepared: a generic plan tests each of the page's reads against the keys one
            # by one (thousands under concurrent writes: seconds per page, in the stream app's
            # reader); a custom plan sees the array and hashes it.
            dropped = [r[0] for r in conn.execute(sql.SQL(
                "DELETE FROM {}.stream_messages WHERE sink = %s AND commit_lsn = %s AND idempotency_key = ANY(%s)"
                " RETURNING commit_idx").format(s), (row[2], row[5], keys), prepare=False).fetchall()] if keys else []
            kept = _close_page(conn, s, page_id, high_lsn, sorted(dropped), None)
            result = ClosedWindow(page_id, int(row[1]), str(row[2]), [], in_store=kept)
        else:
            staged = conn.execute(sql.SQL("SELECT ordinal, record_pks, record FROM {}.backfill_rows WHERE page_id = %s"
                                          " ORDER BY ordinal").format(s), (page_id,)).fetchall()
            kept = [r for r in staged if tuple(r[1]) not in changed]
            _close_page(conn, s, page_id, high_lsn, [r[0] for r in staged if tuple(r[1]) in changed], len(kept))
            result = ClosedWindow(page_id, int(row[1]), str(row[2]), kept)
    conn.commit()
    return result


def _close_page(conn: psycopg.Connection[Any], s: sql.Identifier, page_id: int, high_lsn: int, dropped: list[int],
                kept: int | None) -> int:
    """Mark a page ``closing`` at ``high_lsn``; ``kept`` None: its staged rows less the dropped ones."""
    row = conn.execute(sql.SQL("UPDATE {}.backfill_pages SET state = 'closing', rows_emitted = coalesce(%s, rows_staged"
                               " - %s), dropped = %s, high_lsn = %s, updated_at = now() WHERE id = %s RETURNING"
                               " rows_emitted").format(s), (kept, len(dropped), dropped, high_lsn, page_id)).fetchone()
    return int(row[0])  # type: ignore[index]


def _kept_rows(conn: psycopg.Connection[Any], s: sql.Identifier, page_id: int) -> list[tuple[int, list[str], str]]:
    """A closing page's staged rows that were not dropped, in order."""
    return [tuple(r) for r in conn.execute(sql.SQL(  # type: ignore[misc]
        "SELECT r.ordinal, r.record_pks, r.record FROM {0}.backfill_rows r JOIN {0}.backfill_pages p ON p.id = r.page_id"
        " WHERE r.page_id = %s AND NOT r.ordinal = ANY(coalesce(p.dropped, '{{}}')) ORDER BY r.ordinal").format(s),
        (page_id,)).fetchall()]


def _stale_pages(conn: psycopg.Connection[Any], s: sql.Identifier, page_ids: Sequence[int]) -> list[int]:
    """Make pages that are not closing or emitted ``stale``: their staged rows and their hidden
    reads go (they are read again); returns the ids that changed."""
    rows = conn.execute(sql.SQL(
        "UPDATE {0}.backfill_pages p SET state = 'stale', updated_at = now() FROM {0}.backfills b"
        " WHERE p.id = ANY(%s) AND b.id = p.backfill_id AND p.state IN ('open', 'staged')"
        " RETURNING p.id, b.sink, p.read_lsn").format(s), (list(page_ids),)).fetchall()
    ids = _drop_staged_rows(conn, s, rows)
    for _id, sink, read_lsn in rows:
        if read_lsn is not None:
            conn.execute(sql.SQL("DELETE FROM {}.stream_messages WHERE sink = %s AND commit_lsn = %s").format(s),
                         (sink, read_lsn))
    return ids


READ_MESSAGE_COLUMNS = ("sink", "commit_lsn", "commit_idx", "group_id", "idempotency_key", "data", "backfill_page")


def read_messages_sql(reads: StoreReads, page_id: int, rows: sql.Composable,
                      extra: sql.Composable | None = None) -> sql.Composed:
    """``SELECT`` of a page's read messages as ``READ_MESSAGE_COLUMNS`` (``watermarks.read_rows``
    positions, ``messages.idempotency_key`` keys, ``delivery`` groups, the template's JSON) from
    ``rows``, a relation ``r`` of ``(ordinal from 0, record_pks text[], record JSON text)``, in
    ordinal order; ``extra`` adds a column. Runs in the store, or in the source when the task
    copies the rendered page straight into the stream table."""
    t, lit = reads.template, sql.Literal
    pks = sql.SQL("r.pks_json")  # computed once per row (below): it appears in the group, the key and the data
    idx = sql.SQL("({} + r.ordinal + 1)").format(lit(reads.commit_idx))
    key = sql.SQL("({} || {})").format(lit(f"backfill:{reads.backfill_id}:"), pks)
    group = (sql.SQL("{} || {}").format(lit(reads.group_prefix), pks) if reads.group_prefix is not None
             else sql.SQL("{} || {}::text").format(lit(f"{reads.commit_lsn}:"), idx))
    data = (sql.SQL("r.record") if t.record_only else sql.SQL(
        "{} || r.record || {} || {}::text || ',\"idempotency_key\":' || to_json({})::text || ',\"record_pks\":' || {} || {}"
        ).format(lit(t.before_record), lit(t.before_idx), idx, key, pks, lit(t.after_pks)))
    return sql.SQL("SELECT {sink}, {lsn}::bigint, {idx}, {group}, {key}, {data}, {page}::bigint{extra}"
                   " FROM (SELECT r.*, to_json(r.record_pks)::text AS pks_json FROM {rows}) r ORDER BY r.ordinal").format(
        sink=lit(reads.sink), lsn=lit(reads.commit_lsn), idx=idx, group=group, key=key, data=data,
        page=lit(page_id), rows=rows,
        extra=sql.SQL(", {}").format(extra) if extra is not None else sql.SQL(""))


def write_page_reads(conn: psycopg.Connection[Any], s: sql.Identifier, page_id: int, reads: StoreReads) -> None:
    """Insert a staged page's rows as the sink's read messages, hidden until the page's window
    closes (``READS_RELEASED``)."""
    conn.execute(sql.SQL("INSERT INTO {s}.stream_messages ({columns}) {select}").format(
        s=s, columns=sql.SQL(", ").join(map(sql.Identifier, READ_MESSAGE_COLUMNS)),
        select=read_messages_sql(reads, page_id, sql.SQL("{}.backfill_rows r WHERE r.page_id = {}").format(
            s, sql.Literal(page_id)))))


def stage_page_reads_copy(conn: psycopg.Connection[Any], schema: str, page_id: int, data: Iterable[CopyChunk],
                          rows: int, cursor_after: list[str] | None, read_lsn: int, binary: bool = False) -> bool:
    """Job side: a page's read messages as COPY text (rendered by the source, ``read_messages_sql``)
    or, with ``binary``, as COPY binary from header to trailer (``message_render.read_rows_copy_binary``),
    in chunks, written straight into the stream table, hidden until the page's window closes; the
    page is then staged. False when the page is no longer open (nothing is written)."""
    s = _ident(schema)
    with conn.transaction(), conn.cursor() as cur:
        if not _lock_open_page(cur, schema, page_id):
            return False
        with cur.copy(sql.SQL("COPY {}.stream_messages ({}) FROM STDIN{}").format(
                s, sql.SQL(", ").join(map(sql.Identifier, READ_MESSAGE_COLUMNS)),
                sql.SQL(" (FORMAT binary)" if binary else ""))) as copy:
            for chunk in data:
                copy.write(chunk)
        _mark_staged(cur, s, page_id, rows, cursor_after, read_lsn)
    conn.commit()
    return True


def closing_windows(conn: psycopg.Connection[Any], schema: str, high_lsns: Sequence[int]) -> dict[int, ClosedWindow]:
    """Pages closed at these high watermark LSNs, rebuilt from the store (a batch re-read from the slot)."""
    s = _ident(schema)
    out: dict[int, ClosedWindow] = {}
    pages = conn.execute(sql.SQL("SELECT p.id, p.backfill_id, b.sink"
                                 " FROM {0}.backfill_pages p JOIN {0}.backfills b ON b.id = p.backfill_id"
                                 " WHERE p.state = 'closing' AND p.high_lsn = ANY(%s)").format(s),
                         (list(high_lsns),)).fetchall()
    for page_id, backfill_id, sink in pages:
        out[int(page_id)] = ClosedWindow(int(page_id), int(backfill_id), str(sink), _kept_rows(conn, s, int(page_id)))
    conn.commit()
    return out


def finish_emitted_pages(conn: psycopg.Connection[Any], schema: str, end_lsn: int) -> int:
    """Stream side, after a batch ending at ``end_lsn`` is delivered: its closing pages are emitted."""
    s = _ident(schema)
    with conn.transaction():
        ids = _drop_staged_rows(conn, s, conn.execute(sql.SQL(
            "UPDATE {}.backfill_pages SET state = 'emitted', updated_at = now() WHERE state = 'closing'"
            " AND high_lsn < %s RETURNING id").format(s), (end_lsn,)).fetchall())
    conn.commit()
    return len(ids)


def _drop_staged_rows(conn: psycopg.Connection[Any], s: sql.Identifier, pages: Sequence[Sequence[Any]]) -> list[int]:
    """Delete the staged rows of the pages ``(id, …)`` just finished; returns their ids."""
    ids = [int(r[0]) for r in pages]
    if ids:
        conn.execute(sql.SQL("DELETE FROM {}.backfill_rows WHERE page_id = ANY(%s)").format(s), (ids,))
    return ids


def discard_backfill_page(conn: psycopg.Connection[Any], schema: str, page_id: int) -> None:
    """Job side: give up a page that is not emitted (stale, or the job stops); its rows and hidden reads go."""
    with conn.transaction():
        _stale_pages(conn, _ident(schema), [page_id])
    conn.commit()


def abandon_backfill_pages(conn: psycopg.Connection[Any], schema: str, backfill_id: int) -> int:
    """Pages of a backfill left open or staged will never be waited for (the job restarts, or the
    backfill ended): they become stale, and their rows and hidden reads go."""
    s = _ident(schema)
    with conn.transaction():
        ids = _stale_backfill_pages(conn, s, backfill_id)
    conn.commit()
    return len(ids)


def _stale_backfill_pages(conn: psycopg.Connection[Any], s: sql.Identifier, backfill_id: int) -> list[int]:
    return _stale_pages(conn, s, [r[0] for r in conn.execute(sql.SQL(
        "SELECT id FROM {}.backfill_pages WHERE backfill_id = %s AND state IN ('open', 'staged')").format(s),
        (backfill_id,)).fetchall()])


def advance_backfill_range(conn: psycopg.Connection[Any], schema: str, backfill_id: int, range_idx: int,
                           cursor: list[str] | None, processed: int, emitted: int, done: bool) -> None:
    """Job side, after a page is emitted: move the range's cursor and add to the backfill's counts."""
    s = _ident(schema)
    with conn.transaction():
        conn.execute(sql.SQL("UPDATE {}.backfill_ranges SET cursor = coalesce(%s, cursor), done = %s,"
                             " rows_processed = rows_processed + %s WHERE backfill_id = %s AND range_idx = %s"
                             ).format(s),
                     (Jsonb(cursor) if cursor is not None else None, done, processed, backfill_id, range_idx))
        done_row = conn.execute(sql.SQL(
            "UPDATE {0}.backfills SET cursor = (SELECT jsonb_agg(jsonb_build_object('range', range_idx, 'cursor', cursor,"
            " 'done', done) ORDER BY range_idx) FROM {0}.backfill_ranges WHERE backfill_id = %s),"
            " rows_processed = rows_processed + %s, rows_emitted = rows_emitted + %s, updated_at = now()"
            " WHERE id = %s AND state = 'running' RETURNING id").format(s),
            (backfill_id, processed, emitted, backfill_id)).fetchone()
        if done_row is None:
            raise BackfillError(f"backfill {backfill_id} is not running: progress not recorded")
    conn.commit()


def migrate(conn: psycopg.Connection[Any], schema: str = "sequin") -> list[int]:
    """Create the schema and apply missing migrations; return the versions applied now."""
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('sequin-migrate:' || %s))", (schema,))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_ident(schema)))
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())").format(_ident(schema)))
        done = {v for (v,) in conn.execute(sql.SQL("SELECT version FROM {}.schema_migrations").format(_ident(schema)))}
        for version, name, body in MIGRATIONS:
            if version in done:
                continue
            conn.execute(sql.SQL(body).format(schema=_ident(schema)))  # type: ignore[arg-type]
            conn.execute(sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)").format(
                _ident(schema)), (version, name))
            applied.append(version)
    return applied


def schema_version(conn: psycopg.Connection[Any], schema: str = "sequin") -> int:
    """The highest applied migration, 0 when the store is not initialised."""
    exists = conn.execute("SELECT to_regclass(%s)", (f"{schema}.schema_migrations",)).fetchone()
    if not exists or exists[0] is None:
        return 0
    row = conn.execute(sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(_ident(schema))).fetchone()
    return int(row[0]) if row else 0


StreamRow = tuple
"""(sink, commit_lsn, commit_idx, group_id, idempotency_key, data JSON[, barrier]): a truncate
message's barrier (migration 12); without it, null."""

STREAM_COLUMNS = ("sink", "commit_lsn", "commit_idx", "group_id", "idempotency_key", "data", "barrier")
COPY_TEXT_ESCAPES: tuple[tuple[str, str], ...] = (("\\", "\\\\"), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"))
"""Replacements that make a value safe as a field of COPY's text format (backslash first)."""


def copy_text(value: object) -> str:
    """One field in COPY text format."""
    text = str(value)
    for raw, escaped in COPY_TEXT_ESCAPES:
        text = text.replace(raw, escaped)
    return text


def copy_line(row: StreamRow) -> str:
    """A stream row as one line of COPY text (``STREAM_COLUMNS`` order, no trailing newline)."""
    fields = [copy_text(v) for v in row[:6]]
    fields.append(copy_text(row[6]) if len(row) > 6 and row[6] is not None else "\\N")
    return "\t".join(fields)


def insert_stream_messages(conn: psycopg.Connection[Any], schema: str, rows: Sequence[StreamRow]) -> int:
    """Durably add messages to the stream; a replayed batch adds nothing, and no message whose
    position its sink acked (``stream_acked``). Returns the new count."""
    lsns = [int(r[1]) for r in rows]
    span = (min(lsns), max(lsns)) if lsns else None
    return insert_stream_copy(conn, schema, ["".join(copy_line(r) + "\n" for r in rows)], span=lambda: span)


CopyChunk = Union[str, bytes, memoryview]
Span = Callable[[], tuple[int, int] | None]
"""The lowest and highest commit LSN of the rows a write took, asked once its chunks are consumed
(None: it took none)."""
_ANY_POSITION = (0, (1 << 63) - 1)


def insert_stream_copy(conn: psycopg.Connection[Any], schema: str, chunks: Iterable[CopyChunk],
                       consumed: list[CopyChunk] | None = None, binary: bool = False, span: Span | None = None) -> int:
    """Like ``insert_stream_messages`` for rows already in COPY format, streamed chunk by chunk.

    Chunks are whole lines (``copy_line`` + newline), or with ``binary`` the pieces of one COPY
    binary stream (header, tuples, trailer: ``message_render``), and are sent as they come, so the server
    works while the producer renders the next chunk. Fast path: COPY straight into the table.
    When a row is already there (the batch is a replay after a crash), the COPY fails on the
    primary key (the position) and the rows go through a temporary table with
    ``ON CONFLICT DO NOTHING`` instead. Every chunk taken is appended to ``consumed`` (so a
    caller can retry after a connection failure). Returns the number of new rows; commits.

    Rows at positions their sink acked (``stream_acked``: a replay of a batch consumers took part
    of) are taken out again before the commit, by a statement of their own (``drop_acked``).
    ``span`` bounds the positions to look up; without it every ledger entry is. A batch that is not
    a replay lies above every acked position, so for it the look-up finds nothing in the index.
    """
    seen: list[CopyChunk] = consumed if consumed is not None else []
    pending = iter(chunks)  # one pass: after a failure, only what was not taken remains
    copy_format = sql.SQL("(FORMAT binary)" if binary else "")
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in STREAM_COLUMNS)
    target = sql.SQL("{}.stream_messages").format(_ident(schema))
    try:
        with conn.transaction(), conn.cursor() as cur:
            with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN {}").format(target, columns, copy_format)) as copy:
                for chunk in pending:
                    seen.append(chunk)
                    copy.write(chunk)
            copied = max(cur.rowcount, 0)
            bounds = span() if span is not None else _ANY_POSITION
            return copied - drop_acked(cur, schema, *bounds) if copied and bounds is not None else copied
    except psycopg.errors.UniqueViolation:
        seen.extend(pending)  # whatever the failed COPY did not take yet
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE IF NOT EXISTS sequin_incoming (sink text, commit_lsn bigint, commit_idx integer,"
                    " group_id text, idempotency_key text, data text, barrier text) ON COMMIT DELETE ROWS")
        with cur.copy(sql.SQL("COPY sequin_incoming ({}) FROM STDIN {}").format(columns, copy_format)) as copy:
            for chunk in seen:
                copy.write(chunk)
        cur.execute(sql.SQL(
            "INSERT INTO {} ({}) SELECT sink, commit_lsn, commit_idx, group_id, idempotency_key, data, barrier"
            " FROM sequin_incoming ORDER BY commit_lsn, commit_idx ON CONFLICT DO NOTHING").format(target, columns))
        inserted = max(cur.rowcount, 0)
        lowest, highest = cur.execute("SELECT min(commit_lsn), max(commit_lsn) FROM sequin_incoming").fetchone() \
            or (None, None)
        return inserted - drop_acked(cur, schema, lowest, highest) if inserted else 0


def drop_acked(cur: psycopg.Cursor[Any], schema: str, lowest: int, highest: int) -> int:
    """Delete the stream rows at positions their sink acked (``stream_acked``) among the ledger
    entries whose LSN range meets ``lowest``..``highest``; returns how many.

    For a write, in the write's transaction but in statements of their own after it: an ack that
    deleted a row the write then waited for (its key) has committed by then, and these statements'
    snapshots see its ledger entry (the write's did not), so the row written again goes. The
    positions are read first (none for a batch that is not a replay: one index look-up), then
    deleted by key: one statement joining the ledger to the stream table may be planned as a hash
    join over the whole table (measured before the ledger was analyzed: 385 ms for a 1,000,000-row
    table, against 4 ms by key)."""
    s = _ident(schema)
    found = cur.execute(sql.SQL(
        "SELECT a.sink, p.lsn, p.idx FROM {}.stream_acked a, unnest(a.lsns, a.idxs) p(lsn, idx)"
        " WHERE a.max_lsn >= %s AND a.min_lsn <= %s").format(s), (lowest, highest)).fetchall()
    if not found:
        return 0
    sinks, lsns, idxs = (list(column) for column in zip(*found))
    cur.execute(sql.SQL(
        "DELETE FROM {}.stream_messages m USING unnest(%s::text[], %s::bigint[], %s::integer[]) x(sink, lsn, idx)"
        " WHERE m.sink = x.sink AND m.commit_lsn = x.lsn AND m.commit_idx = x.idx").format(s), (sinks, lsns, idxs))
    return max(cur.rowcount, 0)


def prune_acked(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str], lsn: int) -> int:
    """The slot has passed ``lsn`` (the stream app acknowledged it, after Spark committed the batch
    that ends there): no replay can bring back a message of ``sinks`` committed below it, so the
    ledger entries whose positions all lie below it go, and later acks of such messages record
    nothing (``passed_lsn``, never moves back). Returns how many positions were forgotten; commits."""
    s = _ident(schema)
    with conn.transaction():
        conn.execute(sql.SQL("UPDATE {}.stream_visibility SET passed_lsn = %s WHERE sink = ANY(%s) AND passed_lsn < %s"
                             ).format(s), (lsn, list(sinks), lsn))
        dropped = conn.execute(sql.SQL("WITH gone AS (DELETE FROM {}.stream_acked WHERE max_lsn < %s AND sink = ANY(%s)"
                                       " RETURNING cardinality(lsns) AS n) SELECT coalesce(sum(n), 0) FROM gone").format(s),
                               (lsn, list(sinks))).fetchone()
    conn.commit()
    return int(dropped[0]) if dropped else 0


def acked_positions(conn: psycopg.Connection[Any], schema: str, sink: str) -> list[tuple[int, int]]:
    """The positions of ``sink`` in the acked ledger (acked, not yet passed by the slot), in order."""
    return [(int(lsn), int(idx)) for lsn, idx in conn.execute(sql.SQL(
        "SELECT p.lsn, p.idx FROM {}.stream_acked a, unnest(a.lsns, a.idxs) p(lsn, idx) WHERE a.sink = %s"
        " ORDER BY p.lsn, p.idx").format(_ident(schema)), (sink,)).fetchall()]


def advance_visible_lsn(conn: psycopg.Connection[Any], schema: str, sinks: Sequence[str], lsn: int) -> None:
    """Make the sinks' messages up to commit LSN ``lsn`` visible to readers (never moves back).

    Called once every partition of a micro-batch has committed: a batch written in several
    transactions, or interrupted by a crash, stays invisible until it is whole, so a reader never
    sees a later message of a group without the earlier ones. Readers serve only messages with
    ``commit_lsn <= visible_lsn``.
    """
    with conn.transaction():
        conn.execute(sql.SQL(
            "INSERT INTO {0}.stream_visibility (sink, visible_lsn) SELECT unnest(%s::text[]), %s"
            " ON CONFLICT (sink) DO UPDATE SET visible_lsn = greatest({0}.stream_visibility.visible_lsn,"
            " EXCLUDED.visible_lsn), updated_at = now()").format(_ident(schema)), (list(sinks), lsn))
        # wake long-polling receivers of these sinks (delivered at commit; payload: schema/sink)
        conn.execute("SELECT pg_notify(%s, %s || '/' || s) FROM unnest(%s::text[]) s",
                     (VISIBLE_CHANNEL, schema, list(sinks)))
    conn.commit()


VISIBLE_CHANNEL = "sequin_visible"
"""NOTIFY channel announcing that a sink has new visible messages (payload ``schema/sink``)."""


def visible_lsn(conn: psycopg.Connection[Any], schema: str, sink: str) -> int | None:
    """Up to which commit LSN a sink's messages are complete and may be served."""
    row = conn.execute(sql.SQL("SELECT visible_lsn FROM {}.stream_visibility WHERE sink = %s").format(_ident(schema)),
                       (sink,)).fetchone()
    return None if row is None else int(row[0])


@dataclass(frozen=True)
class StoredMessage:
    """A message as it sits in the stream table."""

    sink: str
    commit_lsn: int
    commit_idx: int
    group_id: str
    idempotency_key: str
    data: str


def stream_messages(conn: psycopg.Connection[Any], schema: str, sink: str | None = None,
                    visible_only: bool = False) -> list[StoredMessage]:
    """All messages of a sink (or all sinks), in position order.

    ``visible_only`` returns what a consumer may be served: messages at or below their sink's
    visibility watermark (a batch still being written is left out), without the backfill reads
    whose window is still open.
    """
    conditions = [sql.SQL("m.sink = %s")] if sink else []
    if visible_only:
        conditions.append(sql.SQL("m.commit_lsn <= (SELECT v.visible_lsn FROM {}.stream_visibility v"
                                  " WHERE v.sink = m.sink)").format(_ident(schema)))
        conditions.append(sql.SQL(READS_RELEASED).format(s=_ident(schema)))
    where = sql.SQL("WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    query = sql.SQL("SELECT m.sink, m.commit_lsn, m.commit_idx, m.group_id, m.idempotency_key, m.data::text"
                    " FROM {}.stream_messages m {} ORDER BY m.sink, m.commit_lsn, m.commit_idx").format(
        _ident(schema), where)
    return [StoredMessage(*r) for r in conn.execute(query, (sink,) if sink else ()).fetchall()]


def count_stream_messages(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """Messages per sink."""
    rows = conn.execute(sql.SQL("SELECT sink, count(*) FROM {}.stream_messages GROUP BY sink").format(_ident(schema)))
    return {sink: int(n) for sink, n in rows.fetchall()}


STATUS_FIELDS = ("slot", "app_started_at", "heartbeat_at", "last_batch_id", "last_batch_at", "last_commit_lsn",
                 "batch_rows", "batch_latency_ms", "rows_per_sec", "last_error")


def update_status(conn: psycopg.Connection[Any], schema: str, database: str, add_rows: int = 0,
                  **fields: Any) -> None:
    """Upsert the stream status row of ``database`` (only the given fields change)."""
    unknown = set(fields) - set(STATUS_FIELDS)
    if unknown:
        raise ValueError(f"unknown status fields: {sorted(unknown)}")
    names = list(fields)
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in ["database", *names])
    vals = sql.SQL(", ").join(sql.Placeholder() for _ in range(len(names) + 1))
    sets = [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names]
    sets.append(sql.SQL("total_rows = {}.stream_status.total_rows + %s").format(_ident(schema)))
    conn.execute(sql.SQL("INSERT INTO {}.stream_status ({}, total_rows) VALUES ({}, %s) ON CONFLICT (database) DO UPDATE SET {}").format(
        _ident(schema), cols, vals, sql.SQL(", ").join(sets)),
        (database, *fields.values(), add_rows, add_rows))
    conn.commit()


def read_status(conn: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    """Every stream status row as a dict."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(sql.SQL("SELECT * FROM {}.stream_status ORDER BY database").format(_ident(schema)))
        return list(cur.fetchall())
