"""The store's schema: versioned, idempotent migrations (DESIGN §8).

``migrate`` applies the missing ones under an advisory lock, so ``sequin init`` and every app start
may call it concurrently.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from sequin_provider.exceptions import StoreError
from sequin_provider.store.connection import ident

MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (
        1,
        "stream messages and stream status",
        """
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
""",
    ),
    (
        2,
        "backfills",
        """
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
""",
    ),
    (
        3,
        "stream visibility",
        """
CREATE TABLE IF NOT EXISTS {schema}.stream_visibility (
    sink        text PRIMARY KEY,
    visible_lsn bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
""",
    ),
    (
        4,
        "backfill ranges, pages and staged rows",
        """
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
""",
    ),
    (
        5,
        "sink setups",
        """
CREATE TABLE IF NOT EXISTS {schema}.sink_setups (
    sink        text PRIMARY KEY,
    created_at  timestamptz NOT NULL DEFAULT now()
);
""",
    ),
    (
        6,
        "api tokens, consumer visibility index, buffer of parked messages",
        """
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
""",
    ),
    # Receiving a message updates no indexed column, so the update is HOT (no index entries, the
    # new version on the same page, which the fillfactor leaves room for):
    # - an ack id encodes its message's position and a random nonce (ack_ids.format_ack_id), so an ack
    #   finds its message by primary key: no ack-id index;
    # - the count of pending messages (max_ack_pending) is kept in stream_pending by every receive,
    #   ack and nack: no index on state.
    # Messages received before this migration have no nonce: their old ack ids match nothing, and
    # they come back after their visibility timeout (at least once).
    (
        7,
        "HOT receives: ack ids derived from the position, a pending counter",
        """
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
""",
    ),
    # A page rendered by the source's SQL arrives as COPY bytes (backfill.source_sql); its last row carries
    # the page's order key, the range's next cursor, so the bytes need not be parsed.
    (
        8,
        "backfill rows carry the order key of a page's last row",
        """
ALTER TABLE {schema}.backfill_rows ADD COLUMN IF NOT EXISTS order_key text[];
""",
    ),
    # A plain Sequin Stream sink's reads are written by the backfill task as it stages the page, at
    # the page's read position (just after its low watermark), hidden until the stream app closes
    # the page's window (DESIGN §7, docs/backfills.md): the close then takes back only the reads
    # whose key changed inside the window, instead of writing every read on the stream's path.
    (
        9,
        "backfill reads written by the task, hidden until their window closes",
        """
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS backfill_page bigint;
ALTER TABLE {schema}.backfill_pages ADD COLUMN IF NOT EXISTS read_lsn bigint;
""",
    ),
    # Who asked for a backfill (an Airflow task instance: dag/task/run[map index]): a retry of that
    # task finds the backfill its earlier try started and resumes it instead of being refused.
    (
        10,
        "backfills record who requested them",
        """
ALTER TABLE {schema}.backfills ADD COLUMN IF NOT EXISTS requested_by text;
""",
    ),
    # The cheapest message row: every change of a Sequin Stream sink is one, and its write is the
    # largest cost of the stream and of a backfill (docs/performance.md). A receive finds each
    # group's first message in the stream's head (stream_queue.receive), so no index on groups is
    # written per message; and the data is stored as the text it is rendered to, unparsed: it is
    # JSON by construction (the compiled renderer, held equal to its Python reference, or
    # json.dumps of a transform's result), and the pull API splices it into its answers as it is.
    # Changing the column's type rewrites the table once (ACCESS EXCLUSIVE while it runs).
    (
        11,
        "stream messages without a group index, data as text",
        """
DROP INDEX IF EXISTS {schema}.stream_messages_group;
ALTER TABLE {schema}.stream_messages ALTER COLUMN data TYPE text;
""",
    ),
    # A truncate message is a barrier for its table (docs/stream-behaviour.md: TRUNCATE). Its
    # ``barrier`` is the group-id prefix of its table's messages for its sink ("schema.table:",
    # or "" when the sink does not group: then the whole sink), null for every other message, so
    # a receive (stream_queue) and a push or retry (delivery, buffer) can tell which earlier and
    # later messages it separates without storing the table of every message.
    (
        12,
        "truncate messages are barriers for their table",
        """
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS barrier text;
ALTER TABLE {schema}.buffered_messages ADD COLUMN IF NOT EXISTS barrier text;
CREATE INDEX IF NOT EXISTS buffered_messages_barrier ON {schema}.buffered_messages (sink)
    WHERE barrier IS NOT NULL AND state = 'parked';
""",
    ),
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
    (
        13,
        "the acked ledger: positions acked and not yet passed by the slot",
        """
CREATE TABLE IF NOT EXISTS {schema}.stream_acked (
    sink        text      NOT NULL,
    min_lsn     bigint    NOT NULL,
    max_lsn     bigint    NOT NULL,
    lsns        bigint[]  NOT NULL,   -- the positions (lsns[i], idxs[i]) acked together
    idxs        integer[] NOT NULL
);
CREATE INDEX IF NOT EXISTS stream_acked_range ON {schema}.stream_acked (max_lsn, min_lsn);
ALTER TABLE {schema}.stream_visibility ADD COLUMN IF NOT EXISTS passed_lsn bigint NOT NULL DEFAULT 0;
""",
    ),
    # A backfill may carry an SQL condition over its table's columns (docs/backfills.md: "Only the
    # rows that match"): every page reads only the rows matching it. Null: every row.
    (
        14,
        "backfills may carry a row condition",
        """
ALTER TABLE {schema}.backfills ADD COLUMN IF NOT EXISTS row_filter text;
""",
    ),
    # A replay of retained changes into a sink (docs/replays.md): its id marks its messages
    # (``replay_id``, ``replay:<id>:…`` keys); ``position`` is where it sits in the target's order.
    (
        15,
        "replays of retained changes",
        """
CREATE TABLE IF NOT EXISTS {schema}.replays (
    id          bigserial   PRIMARY KEY,
    source_sink text        NOT NULL,
    sink        text        NOT NULL,
    tables      text[]      NOT NULL,
    since       text,
    until       text,
    row_filter  text,
    position    bigint,
    messages    integer,
    created_at  timestamptz NOT NULL DEFAULT now(),
    queued_at   timestamptz
);
""",
    ),
    # A range's pages form a chain: each page names the page it follows (``after_page``: the one
    # whose last key is its first cursor; null: the range's start), and the stream app releases a
    # page only when the page it follows was released, so what a range released is always a prefix
    # of its keys. ``last_page`` is the last page the job counted; a resumed job takes the released
    # pages after it as its own instead of reading their keys again (their reads may be acked).
    # A range that had released pages before this migration starts from its last one (its recorded
    # cursor, as before: such a page may be read again once).
    (
        16,
        "backfill pages follow one another; ranges know the last page they counted",
        """
ALTER TABLE {schema}.backfill_pages ADD COLUMN IF NOT EXISTS after_page bigint;
ALTER TABLE {schema}.backfill_ranges ADD COLUMN IF NOT EXISTS last_page bigint;
UPDATE {schema}.backfill_ranges r SET last_page = (SELECT max(p.id) FROM {schema}.backfill_pages p
    WHERE p.backfill_id = r.backfill_id AND p.range_idx = r.range_idx AND p.state IN ('closing', 'emitted'))
    WHERE r.last_page IS NULL;
""",
    ),
    # A plain Sequin Stream sink's reads rendered by the backfill task are stored compact: a read's
    # data is its record alone, and its page keeps the template around it (the same for all of the
    # page's reads); the store serves the whole message (``stream.READ_DATA``). A read stored whole
    # was three times the bytes of its record (1,000,000 reads of the benchmark's table: 1.4 kB of
    # heap and 0.7 kB of WAL each), and the store's writing of them bounded a backfill. Reads written
    # before this migration hold their whole message (a null template).
    (
        17,
        "backfill reads store their record; their page keeps the message around it",
        """
ALTER TABLE {schema}.backfill_pages ADD COLUMN IF NOT EXISTS read_template text[];
""",
    ),
    # A plain Sequin Stream sink's changes are stored compact too: a change's data is its own part
    # of the message (record, changes, action), ``commit_timestamp`` its commit's, and ``template``
    # names the row of ``message_templates`` holding what its sink and table share (the metadata
    # before the timestamp, and after the keys); its position, key and group id give the rest. The store
    # serves the whole message (``stream.READ_DATA``). Two thirds of a change stored whole was that
    # shared metadata. Templates are content-addressed and never change: a message keeps the one it
    # was written with. Changes written before this migration hold their whole message.
    (
        18,
        "changes store their own part; message_templates keep what their sink and table share",
        """
CREATE TABLE IF NOT EXISTS {schema}.message_templates (
    id         integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    before_ts  text    NOT NULL,  -- after the message's own part, up to the commit timestamp
    after_pks  text    NOT NULL,  -- after record_pks, to the end
    pks_from   integer NOT NULL,  -- where record_pks starts in the group id (1-based, characters)
    UNIQUE (before_ts, after_pks, pks_from)
);
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS template integer;
ALTER TABLE {schema}.stream_messages ADD COLUMN IF NOT EXISTS commit_timestamp text;
""",
    ),
    # A message's data over about 2 kB (the TOAST threshold; e.g. an update of a 1.6 kB row under
    # REPLICA IDENTITY FULL, 3.3 kB) is compressed when stored; pglz, the default, cost its backend
    # 28-34 us per such message, lz4 15-17 (reading back costs the same either way; docs/performance.md,
    # "A slow hour, and messages over the TOAST threshold"). lz4 came with
    # PostgreSQL 14 and needs a server built with it (every PGDG and Debian build is): elsewhere the
    # columns keep pglz. Only values written afterwards are compressed with lz4; older ones stay
    # readable as they are.
    (
        19,
        "message data is compressed with lz4 where the server has it",
        """
DO $$
BEGIN
    IF current_setting('server_version_num')::integer >= 140000 THEN
        EXECUTE 'ALTER TABLE {schema}.stream_messages ALTER COLUMN data SET COMPRESSION lz4';
        EXECUTE 'ALTER TABLE {schema}.buffered_messages ALTER COLUMN data SET COMPRESSION lz4,'
            ' ALTER COLUMN source SET COMPRESSION lz4';
        EXECUTE 'ALTER TABLE {schema}.backfill_rows ALTER COLUMN record SET COMPRESSION lz4';
    END IF;
EXCEPTION WHEN feature_not_supported THEN
    NULL;  -- a server built without lz4: pglz, as before
END
$$;
""",
    ),
    # The queue tables keep their pages when emptied. A burst (a backfill's reads, a stalled
    # destination's buffer) grows them; consumers then delete every row, and a VACUUM would cut the
    # empty pages off the end of the file, under an ACCESS EXCLUSIVE lock that stops every receive
    # and write of the table while it holds it. The next burst then extends the file again one page
    # at a time (a page of zeros written, a lock for each extension on PostgreSQL 15 and older):
    # 0.6 us of CPU per read of a served backfill, whose rate rose 16 % without it (docs/performance.md,
    # "Backfills"). Kept, the pages are reused through the free space map. ``VACUUM (TRUNCATE)``
    # still gives the space back on demand.
    (
        20,
        "queue tables keep their pages when emptied (vacuum_truncate off)",
        """
ALTER TABLE {schema}.stream_messages SET (vacuum_truncate = false);
ALTER TABLE {schema}.buffered_messages SET (vacuum_truncate = false);
ALTER TABLE {schema}.backfill_rows SET (vacuum_truncate = false);
""",
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(conn: psycopg.Connection[Any], schema: str = "sequin") -> list[int]:
    """Create the schema and apply missing migrations; return the versions applied now. Raises
    ``StoreError`` when a newer install has migrated the store further than this one knows."""
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('sequin-migrate:' || %s))", (schema,))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident(schema))
        )
        done = {v for (v,) in conn.execute(sql.SQL("SELECT version FROM {}.schema_migrations").format(ident(schema)))}
        if max(done, default=0) > SCHEMA_VERSION:
            # a newer install migrated this store: this one would misread what it wrote (e.g. the
            # compact backfill reads of migration 17 served without their message)
            raise StoreError(
                f"the store's schema {schema!r} is at version {max(done)}, newer than this install knows"
                f" ({SCHEMA_VERSION}): a newer sequin_provider migrated it; upgrade this install"
            )
        for version, name, body in MIGRATIONS:
            if version in done:
                continue
            conn.execute(sql.SQL(body).format(schema=ident(schema)))  # type: ignore[arg-type]
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)").format(ident(schema)),
                (version, name),
            )
            applied.append(version)
    return applied


def schema_version(conn: psycopg.Connection[Any], schema: str = "sequin") -> int:
    """The highest applied migration, 0 when the store is not initialised."""
    exists = conn.execute("SELECT to_regclass(%s)", (f"{schema}.schema_migrations",)).fetchone()
    if not exists or exists[0] is None:
        return 0
    row = conn.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(ident(schema))
    ).fetchone()
    return int(row[0]) if row else 0
