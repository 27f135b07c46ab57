"""The store: Sequin's internal Postgres schema (migrations) and the queries on it (DESIGN §8).

One module per concern, every public name re-exported here (``store.migrate``, ``store.Backfill``):

- ``connection``: ``connect_durable``, ``durable_commit`` and ``ident`` (the schema's SQL identifier,
  which every module composing store SQL uses);
- ``migrations``: the versioned, idempotent migrations, applied under an advisory lock by ``migrate``;
- ``stream``: the stream table (writing a micro-batch's messages, the acked ledger, visibility);
- ``backfills``: the backfills table and sink setups;
- ``backfill_pages``: backfill ranges and pages (the watermark window protocol, DESIGN §7);
- ``status``: the stream status table;
- ``stream_queue``: the pull API's consumer-group queue on the stream table (claiming a receive's
  messages, ``FOR UPDATE SKIP LOCKED``; the pending counter; ack, nack, release; a sink's counts);
- ``tokens``: the pull API's tokens (their hashes);
- ``buffer``: the buffer of parked messages (parking, parked heads and barriers, due groups,
  attempts, listing, counts, discarding and requeueing);
- ``replays``: the replays of retained changes (``sequin_provider.replay``).

Every query on the store's tables is here. ``sequin_provider.stream_queue`` (how much a receive
reads and claims, ack ids, token rules) and ``sequin_provider.buffer`` (the retry: backoff, giving
up, delivery) keep their rules and call these functions.
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
from sequin_provider.store.buffer import (
    PARKED_COLUMNS,
    Parked,
    ParkRow,
    behind_barrier,
    buffer_counts,
    count_parked,
    due_parked_groups,
    list_buffered,
    make_parked_due,
    park_messages,
    parked_barriers,
    parked_group_messages,
    parked_heads,
    record_parked_failure,
    remove_parked,
    set_buffered_state,
    sinks_with_parked,
)
from sequin_provider.store.connection import connect_durable, durable_commit, ident
from sequin_provider.store.migrations import (
    MIGRATIONS,
    SCHEMA_VERSION,
    migrate,
    schema_version,
)
from sequin_provider.store.replays import Replay, create_replay, list_replays, record_replay_queued
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
from sequin_provider.store.stream_queue import (
    Claimed,
    Deliveries,
    ack_messages,
    claim_from_head,
    nack_messages,
    receive_start,
    recount_pending,
    release_messages,
    stream_counts,
)
from sequin_provider.store.tokens import add_api_token, api_token_active, list_api_tokens, revoke_api_token

__all__ = [
    "Replay",
    "create_replay",
    "list_replays",
    "record_replay_queued",
    "ACTIVE_BACKFILL_STATES",
    "BACKFILL_CHANNEL",
    "BACKFILL_TRANSITIONS",
    "COPY_TEXT_ESCAPES",
    "MAX_QUERY_MS_LIMIT",
    "MIGRATIONS",
    "PARKED_COLUMNS",
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
    "Claimed",
    "ClosedWindow",
    "CopyChunk",
    "Deliveries",
    "ParkRow",
    "Parked",
    "Span",
    "StoreReads",
    "StoredMessage",
    "StreamRow",
    "abandon_backfill_pages",
    "ack_messages",
    "acked_positions",
    "add_api_token",
    "advance_backfill_range",
    "advance_visible_lsn",
    "api_token_active",
    "backfill_ranges",
    "behind_barrier",
    "buffer_counts",
    "check_max_query_ms",
    "claim_from_head",
    "close_backfill_window",
    "closing_windows",
    "connect_durable",
    "copy_line",
    "copy_text",
    "count_parked",
    "create_backfill",
    "discard_backfill_page",
    "drop_acked",
    "due_parked_groups",
    "durable_commit",
    "ensure_backfill_ranges",
    "finish_emitted_pages",
    "get_backfill",
    "get_backfill_page",
    "ident",
    "insert_stream_copy",
    "insert_stream_messages",
    "list_api_tokens",
    "list_backfills",
    "list_buffered",
    "make_parked_due",
    "migrate",
    "nack_messages",
    "new_sinks",
    "open_backfill_page",
    "park_messages",
    "parked_barriers",
    "parked_group_messages",
    "parked_heads",
    "prune_acked",
    "read_messages_sql",
    "read_status",
    "receive_start",
    "record_backfill_progress",
    "record_parked_failure",
    "record_sink_setup",
    "recount_pending",
    "release_messages",
    "remove_parked",
    "revoke_api_token",
    "schema_version",
    "set_buffered_state",
    "sinks_with_parked",
    "stage_backfill_copy",
    "stage_backfill_page",
    "stage_page_reads_copy",
    "stale_backfill_pages",
    "stream_counts",
    "stream_messages",
    "transition_backfill",
    "update_status",
    "visible_lsn",
    "write_page_reads",
]
