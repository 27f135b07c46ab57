"""The store: Sequin's internal Postgres schema (migrations) and the queries on it (DESIGN §8).

One module per concern, every public name re-exported here (``store.migrate``, ``store.Backfill``):

- ``connection``: ``connect_durable``, ``durable_commit`` and ``ident`` (the schema's SQL identifier,
  which every module composing store SQL uses);
- ``migrations``: the versioned, idempotent migrations, applied under an advisory lock by ``migrate``;
- ``stream``: the stream table (writing a micro-batch's messages, the acked ledger, visibility);
- ``backfills``: the backfills table and sink setups;
- ``backfill_pages``: backfill ranges and pages (the watermark window protocol, DESIGN §7);
- ``status``: the stream status table.

The consumer-group queries and API tokens (``stream_queue``) and the buffer of parked messages
(``buffer``) run their own SQL on the tables these migrations create, through ``ident``.
"""

from __future__ import annotations

from sequin_provider.exceptions import (
    BackfillError,  # raised by the backfill functions; importable from here
)
from sequin_provider.store.backfill_pages import (
    READ_MESSAGE_COLUMNS,
    BackfillPage,
    BackfillRange,
    ClosedWindow,
    StoreReads,
    abandon_backfill_pages,
    advance_backfill_range,
    backfill_ranges,
    close_backfill_window,
    closing_windows,
    discard_backfill_page,
    ensure_backfill_ranges,
    finish_emitted_pages,
    get_backfill_page,
    open_backfill_page,
    read_messages_sql,
    stage_backfill_copy,
    stage_backfill_page,
    stage_page_reads_copy,
    stale_backfill_pages,
    write_page_reads,
)
from sequin_provider.store.backfills import (
    ACTIVE_BACKFILL_STATES,
    BACKFILL_CHANNEL,
    BACKFILL_TRANSITIONS,
    MAX_QUERY_MS_LIMIT,
    Backfill,
    BackfillConflict,
    check_max_query_ms,
    create_backfill,
    get_backfill,
    list_backfills,
    new_sinks,
    record_backfill_progress,
    record_sink_setup,
    transition_backfill,
)
from sequin_provider.store.connection import connect_durable, durable_commit, ident
from sequin_provider.store.migrations import (
    MIGRATIONS,
    SCHEMA_VERSION,
    migrate,
    schema_version,
)
from sequin_provider.store.status import STATUS_FIELDS, read_status, update_status
from sequin_provider.store.stream import (
    COPY_TEXT_ESCAPES,
    READS_RELEASED,
    STREAM_COLUMNS,
    VISIBLE_CHANNEL,
    CopyChunk,
    Span,
    StoredMessage,
    StreamRow,
    acked_positions,
    advance_visible_lsn,
    copy_line,
    copy_text,
    drop_acked,
    insert_stream_copy,
    insert_stream_messages,
    prune_acked,
    stream_messages,
    visible_lsn,
)

__all__ = [
    "ACTIVE_BACKFILL_STATES",
    "BACKFILL_CHANNEL",
    "BACKFILL_TRANSITIONS",
    "COPY_TEXT_ESCAPES",
    "MAX_QUERY_MS_LIMIT",
    "MIGRATIONS",
    "READS_RELEASED",
    "READ_MESSAGE_COLUMNS",
    "SCHEMA_VERSION",
    "STATUS_FIELDS",
    "STREAM_COLUMNS",
    "VISIBLE_CHANNEL",
    "Backfill",
    "BackfillConflict",
    "BackfillError",
    "BackfillPage",
    "BackfillRange",
    "ClosedWindow",
    "CopyChunk",
    "Span",
    "StoreReads",
    "StoredMessage",
    "StreamRow",
    "abandon_backfill_pages",
    "acked_positions",
    "advance_backfill_range",
    "advance_visible_lsn",
    "backfill_ranges",
    "check_max_query_ms",
    "close_backfill_window",
    "closing_windows",
    "connect_durable",
    "copy_line",
    "copy_text",
    "create_backfill",
    "discard_backfill_page",
    "drop_acked",
    "durable_commit",
    "ensure_backfill_ranges",
    "finish_emitted_pages",
    "get_backfill",
    "get_backfill_page",
    "ident",
    "insert_stream_copy",
    "insert_stream_messages",
    "list_backfills",
    "migrate",
    "new_sinks",
    "open_backfill_page",
    "prune_acked",
    "read_messages_sql",
    "read_status",
    "record_backfill_progress",
    "record_sink_setup",
    "schema_version",
    "stage_backfill_copy",
    "stage_backfill_page",
    "stage_page_reads_copy",
    "stale_backfill_pages",
    "stream_messages",
    "transition_backfill",
    "update_status",
    "visible_lsn",
    "write_page_reads",
]
