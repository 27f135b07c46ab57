"""What a receive + ack costs the store with messages as a row each (today) or in blocks of many.

    .venv/bin/python bench/store_receive_layout.py [--messages 300000] [--seconds 5] [--rounds 4]
        [--consumers 4] [--batch 100] [--block 100] [--no-http]

A design measurement, not a feature's benchmark, and the second half of ``store_reads_layout.py``:
blocks of 100 messages cost the store a quarter of a row per message to write, but only pay if
consumers are served from the blocks themselves (docs/architecture.md, "Where the design would
change next"). This measures that serving. On a fresh embedded cluster, ``--messages`` insert
messages of one plain Sequin Stream sink over 50,000 groups are written as the stream app writes
them (``delivery_throughput.fill``), then received and acked for ``--seconds`` by 4 processes at
batch 100, straight against the store (no HTTP), in two layouts, interleaved for ``--rounds``:

  - ``rows``: a row of ``stream_messages`` per message, received and acked by the product's own
    ``stream_queue.receive`` and ``stream_queue.ack`` (the reference);
  - ``blocks of 100``: a prototype. The same messages, 100 to an immutable row of ``bench_blocks``
    (positions, group ids, keys, timestamps, templates and compact data as arrays), and a small
    mutable row of ``bench_block_state`` per block holding each message's delivery state as arrays
    (nonce: 0 available, -1 acked; visibility deadline; delivery count). A receive
    (``bench_block_receive``, one PL/pgSQL call) locks the sink's pending counter row, so receives
    and acks of a sink run one at a time and each sees the last one's claims; reads the first
    blocks of the head (as many as the pending messages and 4 times the batch fill), takes each
    group's first unacked message and claims those available, oldest first, setting their states
    element by element in PL/pgSQL variables and writing each of their blocks' state rows once (one
    or two per receive, where the rows layout updates 100 rows); and serves their data put together
    by the same ``READ_DATA`` as the rows layout. An ack (``bench_block_ack``) marks its messages
    acked in their blocks' state rows the same way, writes one ledger row, takes them off the
    pending counter and deletes the blocks it completed.
    Not modelled, each a per-block check at most: truncate barriers, backfill reads' windows.

Then the same over HTTP, as ``make bench`` measures the pull API (``compare.pull_api_section``: 4
``http.client`` consumers at batch 100): one ``sequin api`` process as shipped, and one whose
``stream_queue.receive`` and ``ack`` are the prototype's (``blocks_receive``, ``blocks_ack``: an ack
id carries its block's position, the ordinal and the nonce), each run on its layout's messages.

Reported per layout: messages/s received and acked (wall), the store backends' CPU per message
(the four consumers' sessions, or over HTTP the API's pool; autovacuum and the background writers
are not counted), over HTTP the API process's CPU per message too. Every run's deliveries are
checked: no message received twice, and none received before the ack of its group's previous
message was sent; over HTTP, the messages the store settled must be the ones the consumers counted.
Before the rounds, each layout runs on 20,000 messages over 100 groups, so that a head holds several
messages of a group and a receive that handed out a later one would fail that check (the benchmark's
50,000 groups never put two of a group in one head). Prints a Markdown table and writes
bench/results/store_receive_layout.json (another ``--consumers``/``--batch``/``--block``:
store_receive_layout_<consumers>x<batch>[_block<n>].json). Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.compare import config_text  # noqa: E402
from bench.delivery_throughput import answers, fill, http_consumer, run_consumers  # noqa: E402 - as make bench
from bench.store_reads_layout import backend_cpu  # noqa: E402
from bench.stream_throughput import add_pg_setting_argument  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres, free_port  # noqa: E402
from devtools.stream_process import wait_for  # noqa: E402
from sequin_provider import ack_ids as ack_id_codec  # noqa: E402
from sequin_provider import stream_queue  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.store.connection import DURABLE_COMMIT, int_array  # noqa: E402
from sequin_provider.store.migrations import migrate  # noqa: E402
from sequin_provider.store.stream import READ_DATA  # noqa: E402

SCHEMA = "sequin"
SINK = "bench"
GROUPS = 50_000
"""Distinct groups of the filled messages: message ``i`` is in group ``i % GROUPS``."""
CONSUMERS, BATCH = 4, 100
"""The load ``make bench`` measures the pull API with (``--consumers``, ``--batch``)."""
BLOCK = 100
"""Messages per block."""
VISIBILITY_TIMEOUT, MAX_ACK_PENDING = 30.0, 1_000_000
NONCES = 1 << 28

_TABLES = """
CREATE TABLE {s}.bench_blocks (
    sink text NOT NULL, first_lsn bigint NOT NULL, first_idx integer NOT NULL, n integer NOT NULL,
    lsns bigint[] NOT NULL, idxs integer[] NOT NULL, group_ids text[] NOT NULL, keys text[] NOT NULL,
    commit_timestamps text[], templates integer[], data text[] NOT NULL,
    PRIMARY KEY (sink, first_lsn, first_idx));
CREATE TABLE {s}.bench_block_state (
    sink text NOT NULL, first_lsn bigint NOT NULL, first_idx integer NOT NULL, n integer NOT NULL,
    acked integer NOT NULL DEFAULT 0,
    nonces integer[] NOT NULL,          -- per message: 0 available, -1 acked, else its delivery's nonce
    deadlines timestamptz[] NOT NULL,   -- per message: when its delivery's visibility times out
    deliver_counts integer[] NOT NULL,
    PRIMARY KEY (sink, first_lsn, first_idx)) WITH (fillfactor = 50);
CREATE TABLE {s}.bench_block_acked (
    sink text NOT NULL, block_lsns bigint[] NOT NULL, block_idxs integer[] NOT NULL, ordinals integer[] NOT NULL);
"""

_RECEIVE = """
CREATE FUNCTION {s}.bench_block_receive(p_sink text, p_batch integer, p_max_pending integer, p_timeout float8,
                                        p_nonces integer)
RETURNS TABLE (block_lsn bigint, block_idx integer, ordinal integer, nonce integer, commit_lsn bigint,
               commit_idx integer, data text)
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_pending bigint;
    v_visible bigint;
    v_claim integer;
    v_blocks integer;
    v_bl bigint[];          -- the picks, in position order: block, ordinal, nonce before and after
    v_bi integer[];
    v_o integer[];
    v_was integer[];
    v_new integer[];
    v_n integer;
    v_newly integer;
    v_l bigint;             -- the block whose state is in v_nonces, v_deadlines, v_counts
    v_i integer;
    v_nonces integer[];
    v_deadlines timestamptz[];
    v_counts integer[];
    v_deadline timestamptz;
BEGIN
    SELECT p.pending INTO v_pending FROM {s}.stream_pending p WHERE p.sink = p_sink FOR UPDATE;
    SELECT v.visible_lsn INTO v_visible FROM {s}.stream_visibility v WHERE v.sink = p_sink;
    v_claim := least(p_batch, p_max_pending - v_pending);
    IF v_visible IS NULL OR v_claim <= 0 THEN
        RETURN;
    END IF;
    v_blocks := (v_pending + {growth} * v_claim) / {block} + 1;
    LOOP
        WITH hb AS (
            SELECT s.first_lsn, s.first_idx, s.nonces, s.deadlines FROM {s}.bench_block_state s
            WHERE s.sink = p_sink AND s.first_lsn <= v_visible
            ORDER BY s.first_lsn, s.first_idx LIMIT v_blocks),
        head AS (
            SELECT hb.first_lsn AS bl, hb.first_idx AS bi, u.o::integer AS o, u.lsn, u.idx, u.g,
                   hb.nonces[u.o] AS nonce, hb.deadlines[u.o] AS deadline
            FROM hb JOIN {s}.bench_blocks b
              ON b.sink = p_sink AND b.first_lsn = hb.first_lsn AND b.first_idx = hb.first_idx
            CROSS JOIN LATERAL unnest(b.lsns, b.idxs, b.group_ids) WITH ORDINALITY AS u(lsn, idx, g, o)
            WHERE hb.nonces[u.o] <> -1),
        firsts AS (
            SELECT DISTINCT ON (h.g COLLATE "C") h.* FROM head h ORDER BY h.g COLLATE "C", h.lsn, h.idx),
        picked AS (
            SELECT f.* FROM firsts f WHERE f.nonce = 0 OR f.deadline <= now() ORDER BY f.lsn, f.idx LIMIT v_claim)
        SELECT array_agg(p.bl ORDER BY p.lsn, p.idx), array_agg(p.bi ORDER BY p.lsn, p.idx),
               array_agg(p.o ORDER BY p.lsn, p.idx), array_agg(p.nonce ORDER BY p.lsn, p.idx)
          INTO v_bl, v_bi, v_o, v_was
          FROM picked p;
        v_n := coalesce(array_length(v_o, 1), 0);
        IF v_n > 0 THEN
            -- Each pick's state set element by element in the block's arrays, then each block's
            -- state row written once (a block's picks are consecutive: blocks are position ranges).
            v_new := array_fill(0, ARRAY[v_n]);
            v_newly := 0;
            v_l := NULL;
            v_deadline := clock_timestamp() + p_timeout * interval '1 second';
            FOR k IN 1 .. v_n + 1 LOOP
                IF k > v_n OR v_l IS NULL OR v_l <> v_bl[k] OR v_i <> v_bi[k] THEN
                    IF v_l IS NOT NULL THEN
                        UPDATE {s}.bench_block_state t SET nonces = v_nonces, deadlines = v_deadlines,
                               deliver_counts = v_counts
                         WHERE t.sink = p_sink AND t.first_lsn = v_l AND t.first_idx = v_i;
                    END IF;
                    EXIT WHEN k > v_n;
                    v_l := v_bl[k];
                    v_i := v_bi[k];
                    SELECT t.nonces, t.deadlines, t.deliver_counts INTO v_nonces, v_deadlines, v_counts
                      FROM {s}.bench_block_state t WHERE t.sink = p_sink AND t.first_lsn = v_l AND t.first_idx = v_i;
                END IF;
                v_nonces[v_o[k]] := 1 + floor(random() * (p_nonces - 1))::integer;
                v_deadlines[v_o[k]] := v_deadline;
                v_counts[v_o[k]] := v_counts[v_o[k]] + 1;
                v_new[k] := v_nonces[v_o[k]];
                v_newly := v_newly + (v_was[k] = 0)::integer;
            END LOOP;
            UPDATE {s}.stream_pending p SET pending = p.pending + v_newly WHERE p.sink = p_sink;
            RETURN QUERY
            SELECT pb.bl, pb.bi, m.o::integer, pb.nonces[array_position(pb.os, m.o::integer)], m.commit_lsn,
                   m.commit_idx, {data}
            FROM (SELECT u.bl, u.bi, array_agg(u.o) AS os, array_agg(u.nonce) AS nonces
                    FROM unnest(v_bl, v_bi, v_o, v_new) AS u(bl, bi, o, nonce) GROUP BY u.bl, u.bi) pb
            JOIN {s}.bench_blocks b ON b.sink = p_sink AND b.first_lsn = pb.bl AND b.first_idx = pb.bi
            CROSS JOIN LATERAL (
                SELECT x.*, NULL::bigint AS backfill_page
                FROM unnest(b.lsns, b.idxs, b.group_ids, b.keys, b.commit_timestamps, b.templates, b.data) WITH ORDINALITY
                     AS x(commit_lsn, commit_idx, group_id, idempotency_key, commit_timestamp, template, data, o)) m
            LEFT JOIN {s}.message_templates tpl ON tpl.id = m.template
            WHERE m.o = ANY(pb.os);
        END IF;
        v_claim := v_claim - v_n;
        EXIT WHEN v_claim <= 0 OR NOT EXISTS (
            SELECT 1 FROM {s}.bench_block_state s WHERE s.sink = p_sink AND s.first_lsn <= v_visible
            ORDER BY s.first_lsn, s.first_idx OFFSET v_blocks);
        v_blocks := v_blocks * {growth};
    END LOOP;
END
$fn$ SET plan_cache_mode = force_generic_plan;
"""
"""A receive on the blocks. The head is read in one statement; the picks' delivery states are set
element by element in PL/pgSQL variables and each block's state row written once (an aggregate
rebuilding the three arrays in SQL cost a small receive as much as a large one). Its statements run
on generic plans: on the plan cache's own choice they were planned anew on every call (1.8-2.4 ms
against 1.2 ms per receive of 100)."""

_ACK = """
CREATE FUNCTION {s}.bench_block_ack(p_sink text, p_bl bigint[], p_bi integer[], p_o integer[], p_nonce integer[])
RETURNS integer
LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_bl bigint[];          -- the ack ids in position order
    v_bi integer[];
    v_o integer[];
    v_nonce integer[];
    v_l bigint;             -- the block whose state is in v_nonces and v_acked
    v_i integer;
    v_n integer;
    v_nonces integer[];
    v_acked integer;
    v_count integer;
    m_bl bigint[] := '{{}}';  -- the messages settled
    m_bi integer[] := '{{}}';
    m_o integer[] := '{{}}';
BEGIN
    PERFORM 1 FROM {s}.stream_pending p WHERE p.sink = p_sink FOR UPDATE;
    PERFORM {durable};
    SELECT array_agg(a.bl ORDER BY a.bl, a.bi, a.o), array_agg(a.bi ORDER BY a.bl, a.bi, a.o),
           array_agg(a.o ORDER BY a.bl, a.bi, a.o), array_agg(a.nonce ORDER BY a.bl, a.bi, a.o)
      INTO v_bl, v_bi, v_o, v_nonce
      FROM unnest(p_bl, p_bi, p_o, p_nonce) AS a(bl, bi, o, nonce);
    v_count := coalesce(array_length(v_o, 1), 0);
    FOR k IN 1 .. v_count + 1 LOOP
        IF k > v_count OR v_l IS NULL OR v_l <> v_bl[k] OR v_i <> v_bi[k] THEN
            IF v_nonces IS NOT NULL AND v_acked < v_n THEN
                UPDATE {s}.bench_block_state t SET nonces = v_nonces, acked = v_acked
                 WHERE t.sink = p_sink AND t.first_lsn = v_l AND t.first_idx = v_i;
            ELSIF v_nonces IS NOT NULL THEN  -- every message of the block acked: it goes
                DELETE FROM {s}.bench_block_state t WHERE t.sink = p_sink AND t.first_lsn = v_l AND t.first_idx = v_i;
                DELETE FROM {s}.bench_blocks b WHERE b.sink = p_sink AND b.first_lsn = v_l AND b.first_idx = v_i;
            END IF;
            EXIT WHEN k > v_count;
            v_l := v_bl[k];
            v_i := v_bi[k];
            SELECT t.n, t.nonces, t.acked INTO v_n, v_nonces, v_acked
              FROM {s}.bench_block_state t WHERE t.sink = p_sink AND t.first_lsn = v_l AND t.first_idx = v_i;
        END IF;
        IF v_nonces IS NOT NULL AND v_nonce[k] > 0 AND v_nonces[v_o[k]] = v_nonce[k] THEN
            v_nonces[v_o[k]] := -1;
            v_acked := v_acked + 1;
            m_bl := m_bl || v_l;
            m_bi := m_bi || v_i;
            m_o := m_o || v_o[k];
        END IF;
    END LOOP;
    IF cardinality(m_o) > 0 THEN
        INSERT INTO {s}.bench_block_acked (sink, block_lsns, block_idxs, ordinals) VALUES (p_sink, m_bl, m_bi, m_o);
        UPDATE {s}.stream_pending p SET pending = greatest(p.pending - cardinality(m_o), 0) WHERE p.sink = p_sink;
    END IF;
    RETURN cardinality(m_o);
END
$fn$ SET plan_cache_mode = force_generic_plan;
"""
"""An ack on the blocks: the acked messages' states set element by element, each block's state row
written once (or the block deleted once all its messages are acked), one ledger row, the pending
counter taken down."""

_BLOCKS_FROM_ROWS = """
WITH numbered AS (
    SELECT m.*, (row_number() OVER (ORDER BY commit_lsn, commit_idx) - 1) / {block} AS block
    FROM {s}.stream_messages m WHERE m.sink = %(sink)s),
blocks AS (
    INSERT INTO {s}.bench_blocks
    SELECT %(sink)s, min(commit_lsn), (array_agg(commit_idx ORDER BY commit_lsn, commit_idx))[1], count(*),
           array_agg(commit_lsn ORDER BY commit_lsn, commit_idx), array_agg(commit_idx ORDER BY commit_lsn, commit_idx),
           array_agg(group_id ORDER BY commit_lsn, commit_idx), array_agg(idempotency_key ORDER BY commit_lsn, commit_idx),
           array_agg(commit_timestamp ORDER BY commit_lsn, commit_idx), array_agg(template ORDER BY commit_lsn, commit_idx),
           array_agg(data ORDER BY commit_lsn, commit_idx)
    FROM numbered GROUP BY block
    RETURNING sink, first_lsn, first_idx, n)
INSERT INTO {s}.bench_block_state (sink, first_lsn, first_idx, n, nonces, deadlines, deliver_counts)
SELECT sink, first_lsn, first_idx, n, array_fill(0, ARRAY[n]), array_fill('-infinity'::timestamptz, ARRAY[n]),
       array_fill(0, ARRAY[n])
FROM blocks
"""
"""The filled rows of ``stream_messages`` as blocks of ``{block}``, in position order, each with its
state (every message available)."""


def _sql(template: str, block: int = BLOCK) -> str:
    """``template`` with the store's schema, the block size, the head growth and the pieces of the
    product it shares (``READ_DATA``, ``DURABLE_COMMIT``) filled in."""
    s = sql.Identifier(SCHEMA)
    data = sql.SQL(READ_DATA).format(m=sql.Identifier("m"), s=s, t=sql.Identifier("tpl")).as_string(None)
    return template.format(
        s=s.as_string(None), block=block, growth=stream_queue.HEAD_GROWTH, data=data, durable=DURABLE_COMMIT
    )


ORDINAL_BITS = 8
"""An ack id's commit index holds its block's first index and the message's ordinal in the block."""
RECEIVE_CALL = f"SELECT * FROM {SCHEMA}.bench_block_receive(%s, %s, %s, %s, %s)"
ACK_CALL = f"SELECT {SCHEMA}.bench_block_ack(%s, %s::bigint[], %s::integer[], %s::integer[], %s::integer[])"


def blocks_receive(
    conn: psycopg.Connection[Any],
    schema: str,
    sink: str,
    batch_size: int,
    visibility_timeout: float,
    max_ack_pending: int,
) -> list[stream_queue.Delivery]:
    """``stream_queue.receive`` on the blocks: messages in position order, each with an ack id of its
    block's position, its ordinal and its nonce."""
    rows = conn.execute(
        RECEIVE_CALL.replace(SCHEMA, schema, 1), (sink, batch_size, max_ack_pending, visibility_timeout, NONCES)
    ).fetchall()
    rows.sort(key=lambda r: (r[4], r[5]))
    ids = ack_id_codec.ack_ids([(bl, bi << ORDINAL_BITS | o, nonce) for bl, bi, o, nonce, _, _, _ in rows])
    return [stream_queue.Delivery(ack_id, row[6]) for ack_id, row in zip(ids, rows)]


def blocks_ack(conn: psycopg.Connection[Any], schema: str, sink: str, ack_ids: list[str | uuid.UUID]) -> int:
    """``stream_queue.ack`` on the blocks."""
    blocks, positions, nonces = ack_id_codec.positions(ack_ids)
    return int(
        conn.execute(
            ACK_CALL.replace(SCHEMA, schema, 1),
            (
                sink,
                int_array(blocks),
                int_array(p >> ORDINAL_BITS for p in positions),
                int_array(p & ((1 << ORDINAL_BITS) - 1) for p in positions),
                int_array(nonces),
            ),
        ).fetchone()[0]
    )


def serve_blocks_api(config: str, port: int) -> int:
    """``sequin api`` with the prototype's receive and ack in place of ``stream_queue``'s."""
    from sequin_provider.cli import main as sequin

    stream_queue.receive = blocks_receive  # type: ignore[assignment]
    stream_queue.ack = blocks_ack  # type: ignore[assignment]
    return sequin(["--config", config, "api", "--port", str(port)])


Position = tuple[int, int]
"""A message's (commit_lsn, commit_idx)."""


@dataclass
class Consumed:
    """What one consumer process did: each receive's positions with the time it returned, each ack's
    positions with the time it was sent (``time.monotonic``, one clock for all processes), and its
    session's backend CPU seconds."""

    received: list[tuple[float, list[Position]]] = field(default_factory=list)
    acked: list[tuple[float, list[Position]]] = field(default_factory=list)
    cpu: float = 0.0


Claim = tuple[list[Position], Callable[[], int]]
"""A receive's messages (their positions; none: nothing deliverable) and the call that acks them,
returning how many it settled."""


def rows_claim(conn: psycopg.Connection[Any], batch: int) -> Claim:
    """A receive with the product's ``stream_queue``, and its ack."""
    got = stream_queue.receive(conn, SCHEMA, SINK, batch, VISIBILITY_TIMEOUT, MAX_ACK_PENDING)
    positions = [ack_id_codec.parse_ack_id(d.ack_id)[:2] for d in got]  # type: ignore[index]
    return positions, lambda: stream_queue.ack(conn, SCHEMA, SINK, [d.ack_id for d in got])


def blocks_claim(conn: psycopg.Connection[Any], batch: int) -> Claim:
    """A receive on the blocks prototype, and its ack: one function call each."""
    got = conn.execute(RECEIVE_CALL, (SINK, batch, MAX_ACK_PENDING, VISIBILITY_TIMEOUT, NONCES)).fetchall()
    ack = (SINK, *(int_array(r[i] for r in got) for i in range(4)))  # block lsn, idx, ordinal, nonce
    return [(r[4], r[5]) for r in got], lambda: int(conn.execute(ACK_CALL, ack).fetchone()[0])


CLAIMS = {"rows": rows_claim, "blocks": blocks_claim}


def consumer(args: tuple[str, str, float, Any, int]) -> Consumed:
    """Receive + ack ``layout``'s messages ``batch`` at a time on a session set up as the API's, until
    the deadline (a consumer process of ``consume``)."""
    layout, dsn, seconds, barrier, batch = args
    claim, done = CLAIMS[layout], Consumed()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET jit = off")
        pid = conn.info.backend_pid
        barrier.wait()
        started, deadline = backend_cpu(pid), time.monotonic() + seconds
        while time.monotonic() < deadline:
            positions, ack = claim(conn, batch)
            if not positions:
                continue
            done.received.append((time.monotonic(), positions))
            done.acked.append((time.monotonic(), positions))
            settled = ack()
            if settled != len(positions):
                raise RuntimeError(f"an ack settled {settled} of {len(positions)} messages")
        done.cpu = backend_cpu(pid) - started
    return done


def checked(consumed: list[Consumed], messages: int, groups: int) -> int:
    """How many messages were acked; raises unless none was received twice and no message of a group
    was received before the ack of the group's previous message was sent (message ``i``, at position
    (1000 + i // 10, i % 10), is in group ``i % groups``)."""
    received: dict[int, float] = {}
    ack_sent: dict[int, float] = {}
    for done in consumed:
        for at, positions in done.received:
            for lsn, idx in positions:
                i = (lsn - 1000) * 10 + idx
                if i in received or not 0 <= i < messages:
                    raise SystemExit(f"message {i} was received twice, or was never written")
                received[i] = at
        for at, positions in done.acked:
            ack_sent.update(((lsn - 1000) * 10 + idx, at) for lsn, idx in positions)
    early = [i for i, at in received.items() if i >= groups and not ack_sent.get(i - groups, at) < at]
    if early:
        raise SystemExit(f"{len(early)} messages were received before their group's previous one was acked")
    return len(ack_sent)


def prepare(layout: str, store: str, messages: int, block: int, groups: int = GROUPS) -> None:
    """``messages`` over ``groups`` filled anew in ``layout``, every one available, the pending
    counter at 0."""
    fill(store, messages, groups)
    with psycopg.connect(store, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {SCHEMA}.bench_blocks, {SCHEMA}.bench_block_state, {SCHEMA}.bench_block_acked")
        conn.execute(f"UPDATE {SCHEMA}.stream_pending SET pending = 0")
        if layout == "blocks":
            conn.execute(_sql(_BLOCKS_FROM_ROWS, block), {"sink": SINK})
            conn.execute(f"TRUNCATE {SCHEMA}.stream_messages")
            conn.execute(f"VACUUM ANALYZE {SCHEMA}.bench_blocks, {SCHEMA}.bench_block_state")
        conn.execute("CHECKPOINT")


def settled(layout: str, store: str, messages: int) -> int:
    """How many messages the store settled in the run just done: raises if one was settled twice."""
    with psycopg.connect(store, autocommit=True) as conn:
        if layout == "rows":
            return messages - int(conn.execute(f"SELECT count(*) FROM {SCHEMA}.stream_messages").fetchone()[0])
        total, distinct = conn.execute(
            f"SELECT count(*), count(DISTINCT (l, i, o)) FROM {SCHEMA}.bench_block_acked a,"
            " unnest(a.block_lsns, a.block_idxs, a.ordinals) AS u(l, i, o)"
        ).fetchone()
    if total != distinct:
        raise SystemExit(f"{total - distinct} messages were acked twice")
    return int(total)


@dataclass(frozen=True)
class Load:
    """How many consumer processes receive and ack at once, their batch size, and the messages per
    block of the blocks layout."""

    consumers: int = CONSUMERS
    batch: int = BATCH
    block: int = BLOCK


def consume(layout: str, store: str, seconds: float, load: Load) -> tuple[list[Consumed], float]:
    """``load.consumers`` processes receiving and acking ``layout`` for ``seconds``; what each did
    and the seconds to count a rate over."""
    with mp.Manager() as manager:
        barrier = manager.Barrier(load.consumers)
        with mp.get_context("spawn").Pool(load.consumers) as pool:
            started = time.monotonic()
            consumed = pool.map(consumer, [(layout, store, seconds, barrier, load.batch)] * load.consumers)
            elapsed = max(min(time.monotonic() - started, seconds + 0.5), seconds)
    return consumed, elapsed


def run(layout: str, store: str, messages: int, seconds: float, load: Load) -> dict[str, float]:
    """One run of ``layout`` straight against the store: the messages filled anew, then received and
    acked under ``load`` for ``seconds``."""
    prepare(layout, store, messages, load.block)
    consumed, elapsed = consume(layout, store, seconds, load)
    acked = checked(consumed, messages, GROUPS)
    cpu = sum(done.cpu for done in consumed)
    return {"messages_per_s": acked / elapsed, "cpu_us_per_message": cpu / acked * 1e6, "acked": acked}


ORDER_MESSAGES, ORDER_GROUPS = 20_000, 100
"""The ordering check's shape: a group's messages 100 apart, so the head a receive reads holds
several of each group and only the group's first may go out."""


def check_order(layout: str, store: str, load: Load) -> int:
    """``layout`` received and acked for 3 s on a stream whose head holds several messages of each
    group (``ORDER_GROUPS``), every delivery checked (``checked``); returns how many were acked. With
    the benchmark's 50,000 groups a head never holds two of a group, so its runs cannot catch a
    receive that hands out a group's later message: this can (its prototype without ``DISTINCT ON``
    fails it)."""
    prepare(layout, store, ORDER_MESSAGES, load.block, ORDER_GROUPS)
    consumed, _ = consume(layout, store, 3.0, load)
    return checked(consumed, ORDER_MESSAGES, ORDER_GROUPS)


def store_backends_cpu(store: str) -> dict[int, float]:
    """CPU seconds so far of every other backend connected to the store's database (the API's pool)."""
    with psycopg.connect(store, autocommit=True) as conn:
        pids = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return {pid: backend_cpu(pid) for (pid,) in pids if psutil.pid_exists(pid)}


def run_http(
    layout: str, url: str, token: str, api_pid: int, store: str, messages: int, seconds: float, load: Load
) -> dict[str, float]:
    """One run of ``layout`` over HTTP: ``load`` in ``http.client`` consumers against the API serving
    it (process ``api_pid``), as ``make bench``'s pull API section."""
    prepare(layout, store, messages, load.block)
    api = psutil.Process(api_pid)
    api_from, store_from = sum(api.cpu_times()[:2]), store_backends_cpu(store)
    rate = run_consumers(http_consumer, url, token, load.consumers, load.batch, seconds)
    api_cpu, store_to = sum(api.cpu_times()[:2]) - api_from, store_backends_cpu(store)
    store_cpu = sum(cpu - store_from.get(pid, 0.0) for pid, cpu in store_to.items())
    done = settled(layout, store, messages)
    if not rate * seconds - 1 <= done <= rate * (seconds + 0.5) + 1:  # the rate's divisor: seconds to seconds + 0.5
        raise SystemExit(f"over HTTP the store settled {done} messages, the consumers counted {rate * seconds:.0f}")
    return {
        "messages_per_s": rate,
        "settled": done,
        "api_cpu_us_per_message": api_cpu / done * 1e6,
        "store_cpu_us_per_message": store_cpu / done * 1e6,
    }


def http_rounds(
    pg: EmbeddedPostgres, store: str, args: argparse.Namespace, load: Load
) -> dict[str, list[dict[str, float]]]:
    """``--rounds`` interleaved rounds over HTTP: an API process as shipped for the rows, one with
    the prototype's receive and ack for the blocks, both on the store's sink ``SINK``."""
    source = pg.create_database("bench")
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE events (id bigint PRIMARY KEY)")
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-"))
    config = work / "api.yaml"
    config.write_text(
        config_text(
            source, store, "api_slot", f"{{type: sequin_stream, max_ack_pending: {MAX_ACK_PENDING}}}", work
        ).replace("name: events\n", f"name: {SINK}\n")
    )
    initialize(load_config(config))
    with psycopg.connect(store) as conn:
        token = stream_queue.create_token(conn, SCHEMA, "bench")
        conn.commit()
    ports = {"rows": free_port(), "blocks": free_port()}
    commands = {
        "rows": [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), "api"],
        "blocks": [sys.executable, __file__, "--serve-blocks-api", str(config)],
    }
    apis = {
        layout: subprocess.Popen([*commands[layout], "--port", str(ports[layout])], stderr=subprocess.DEVNULL)
        for layout in ports
    }
    results: dict[str, list[dict[str, float]]] = {"rows": [], "blocks": []}
    try:
        for layout, port in ports.items():
            wait_for(lambda: answers(f"http://127.0.0.1:{port}/health"), 60, what=f"the {layout} API")
        for round_ in range(args.rounds):
            for layout in ("rows", "blocks") if round_ % 2 == 0 else ("blocks", "rows"):
                url = f"http://127.0.0.1:{ports[layout]}"
                result = run_http(layout, url, token, apis[layout].pid, store, args.messages, args.seconds, load)
                results[layout].append(result)
                print(
                    f"bench: over HTTP, round {round_ + 1}, {layout}: {result['messages_per_s']:,.0f} messages/s,"
                    f" the API {result['api_cpu_us_per_message']:.1f} and the store"
                    f" {result['store_cpu_us_per_message']:.1f} µs per message",
                    flush=True,
                )
    finally:
        for api in apis.values():
            api.terminate()
            api.wait(timeout=30)
    return results


def table(
    title: str, layouts: dict[str, list[dict[str, float]]], keys: tuple[tuple[str, str, str], ...], block: int
) -> dict[str, Any]:
    """Print ``layouts``' runs as a Markdown table of ``keys`` (key, column, format): median (min–max)."""
    names = {"rows": "a row per message (today)", "blocks": f"blocks of {block} (prototype)"}
    print(f"\n{title}\n")
    print("| layout | " + " | ".join(column for _, column, _ in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    summary: dict[str, dict[str, float]] = {}
    for layout, results in layouts.items():
        cells = []
        for key, _, fmt in keys:
            values = [r[key] for r in results]
            summary.setdefault(layout, {})[key] = statistics.median(values)
            cells.append(
                f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"
            )
        print(f"| {names[layout]} | " + " | ".join(cells) + " |")
    return summary


def main() -> int:
    if sys.argv[1:2] == ["--serve-blocks-api"]:
        return serve_blocks_api(sys.argv[2], int(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=CONSUMERS, help="consumer processes at once")
    parser.add_argument("--batch", type=int, default=BATCH, help="each receive's batch_size")
    parser.add_argument("--block", type=int, default=BLOCK, help="messages per block (at most 255)")
    parser.add_argument("--no-http", dest="http", action="store_false", help="only the store, no HTTP rounds")
    add_pg_setting_argument(parser)
    args = parser.parse_args()
    if not 0 < args.block < 1 << ORDINAL_BITS:
        parser.error(f"--block: 1 to {(1 << ORDINAL_BITS) - 1} (an ack id's ordinal)")
    load = Load(args.consumers, args.batch, args.block)
    layouts: dict[str, list[dict[str, float]]] = {"rows": [], "blocks": []}
    over_http: dict[str, list[dict[str, float]]] = {}
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        store = pg.create_database("bench_store")
        with psycopg.connect(store, autocommit=True) as conn:
            migrate(conn, SCHEMA)
            for statement in (_TABLES, _RECEIVE, _ACK):
                conn.execute(_sql(statement, load.block))
            conn.execute(f"INSERT INTO {SCHEMA}.stream_pending (sink, pending) VALUES (%s, 0)", (SINK,))
        for layout in layouts:
            print(f"bench: {layout}: group order held for {check_order(layout, store, load):,} messages", flush=True)
        for round_ in range(args.rounds):
            for layout in ("rows", "blocks") if round_ % 2 == 0 else ("blocks", "rows"):
                result = run(layout, store, args.messages, args.seconds, load)
                layouts[layout].append(result)
                print(
                    f"bench: round {round_ + 1}, {layout}: {result['messages_per_s']:,.0f} messages/s,"
                    f" {result['cpu_us_per_message']:.1f} µs of the store per message",
                    flush=True,
                )
        if args.http:
            over_http = http_rounds(pg, store, args, load)
    shape = (
        f"{load.consumers} processes at batch {load.batch}, {args.seconds:g} s each, {args.messages:,} messages over"
        f" {GROUPS:,} groups; median of {args.rounds} (min–max)"
    )
    summary = {
        "store": table(
            f"receive + ack straight against the store, {shape}:",
            layouts,
            (
                ("messages_per_s", "messages/s", "{:,.0f}"),
                ("cpu_us_per_message", "store backends, µs of CPU per message", "{:.1f}"),
            ),
            load.block,
        )
    }
    if over_http:
        summary["http"] = table(
            f"receive + ack over HTTP (one `sequin api` process per layout), {shape}:",
            over_http,
            (
                ("messages_per_s", "messages/s", "{:,.0f}"),
                ("api_cpu_us_per_message", "the API process, µs of CPU per message", "{:.1f}"),
                ("store_cpu_us_per_message", "store backends, µs of CPU per message", "{:.1f}"),
            ),
            load.block,
        )
    shaped = (
        ""
        if load == Load()
        else f"_{load.consumers}x{load.batch}" + (f"_block{load.block}" if load.block != BLOCK else "")
    )
    out = ROOT / "bench" / "results" / f"store_receive_layout{shaped}.json"
    out.write_text(
        json.dumps(
            {
                "messages": args.messages,
                "seconds": args.seconds,
                "rounds": args.rounds,
                "consumers": load.consumers,
                "batch": load.batch,
                "block": load.block,
                "pg_settings": dict(args.pg_setting),
                "run_at": time.strftime("%Y-%m-%d %H:%M"),
                "median": summary,
                "runs_by_layout": layouts,
                "http_runs_by_layout": over_http,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
