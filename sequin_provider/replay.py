"""Replays of retained changes: the changes a changelog sink kept, for a time or position range and an
optional SQL condition, delivered again to any sink (``sequin replay``, the ``sequin_replay`` DAG's
changes mode; docs/replays.md).

A changelog (``sinks.changelog``: a ``postgres_table`` or ``iceberg`` sink in ``mode: changelog``) holds
every message of its sink with its position. A replay reads the rows in range from it, ordered by
position, keeps those matching its condition (SQL over the changelog's columns, run by Postgres: the
changelog's own database, or for an Iceberg changelog the store's, into which the rows in range are
copied first), renders each for the target sink (its message kind, consumer and tables; its transform)
and queues them in the target's buffer, where they are delivered as parked messages are: in position
order within each group, parallel across groups, with the retry's backoff and ``max_retry_count``, by
``sequin buffer retry`` (which the replay runs once at the end) and the ``sequin_retry`` DAG.

Where it sits in the sink's order: the replay writes a logical message (``sequin:replay``) into the WAL
of the target's database and its messages take that position (``commit_lsn`` of the mark, indexes 1…n
in the changelog's order) in the buffer. A change of the same group committed before the mark is
delivered before them; one committed after waits behind them, as behind any parked message. So the
per-group order of what a consumer receives is the order of these positions.

How a consumer tells a replayed message apart: its metadata has ``"replay_id": <id>`` and its
idempotency key is ``replay:<id>:<lsn>:<idx>``; ``commit_lsn``, ``commit_idx`` and ``commit_timestamp``
stay the original change's. A sink that dedupes (Redis, JetStream, RabbitMQ ids) takes each replay
once; a Postgres mirror applies nothing older than what it holds. An Iceberg mirror is refused: its
retry applies a message whatever the table holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import psycopg

from sequin_provider import store
from sequin_provider.backfill.row_filter import normalize_row_filter
from sequin_provider.buffer import RetryReport
from sequin_provider.config import SequinConfig, SinkConfig
from sequin_provider.exceptions import BackfillError, ReplayError
from sequin_provider.sinks.changelog import ChangelogSelection, parse_bound

log = logging.getLogger(__name__)

REPLAY_PREFIX = "sequin:replay"
"""The prefix of the logical message that marks a replay's position in its sink's order."""
QUEUE_CHUNK = 5_000


@dataclass(frozen=True)
class ReplayRequest:
    """What to replay: from changelog sink ``source`` into sink ``sink``, the changes of ``tables``
    (``schema.table``; empty: every table both sinks have) committed in [``since``, ``until``)
    (either may be open) that match ``where``."""

    source: str
    sink: str
    tables: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    where: str | None = None


@dataclass(frozen=True)
class ReplayPlan:
    """A checked request: the changelog sink, the sink to replay into, and what to read."""

    source: SinkConfig
    sink: SinkConfig
    selection: ChangelogSelection


@dataclass
class ReplayResult:
    """What a replay did: its record, how many messages it queued, and the delivery run's report."""

    replay: store.Replay
    queued: int
    delivery: RetryReport | None = None

    def line(self) -> str:
        """One line for the CLI and the Airflow log."""
        text = f"replay {self.replay.id}: {self.queued} changes from {self.replay.source_sink} queued for sink {self.replay.sink}"
        if self.delivery is not None:
            text += f"; {self.delivery.line()}"
        return text


def plan_replay(config: SequinConfig, request: ReplayRequest) -> ReplayPlan:
    """Check a request against the config: ``ReplayError`` naming what is wrong."""
    for name in (request.source, request.sink):
        if not config.has_sink(name):
            raise ReplayError(f"no sink named {name!r}")
    source, sink = config.sink(request.source), config.sink(request.sink)
    if not source.destination.kind.keeps_changelog(source):
        raise ReplayError(
            f"sink {source.name!r} keeps no changelog (a postgres_table or iceberg sink in mode: changelog)"
        )
    if sink.name == source.name:
        raise ReplayError(f"sink {sink.name!r} cannot replay into itself")
    refusal = sink.destination.kind.replay_refusal(sink)
    if refusal is not None:
        raise ReplayError(f"sink {sink.name!r} cannot take a replay: {refusal}")
    kept = {(t.schema, t.name) for t in source.tables}
    served = {(t.schema, t.name): t for t in sink.tables}
    if request.tables:
        tables = []
        for name in request.tables:
            schema, dot, table = name.partition(".")
            key = (schema, table) if dot else ("public", schema)
            for sinks, which in ((kept, source.name), (served, sink.name)):
                if key not in sinks:
                    raise ReplayError(f"table {key[0]}.{key[1]} is not one of sink {which!r}'s tables")
            tables.append(key)
    else:
        tables = sorted(kept & set(served))
        if not tables:
            raise ReplayError(f"sinks {source.name!r} and {sink.name!r} have no table in common")
    for key in tables:
        if sink.message_grouping and served[key].group_column_names:
            raise ReplayError(
                f"sink {sink.name!r} groups {key[0]}.{key[1]} by group_column_names: replays group by primary key only"
            )
    try:
        where = normalize_row_filter(request.where, "replay condition")
    except BackfillError as exc:
        raise ReplayError(str(exc)) from None
    since = parse_bound(request.since, "since") if request.since else None
    until = parse_bound(request.until, "until") if request.until else None
    return ReplayPlan(source, sink, ChangelogSelection(source.name, tuple(tables), since, until, where))


# ---------------------------------------------------------------------------------------------
# Reading the changelog


def changelog_rows(config: SequinConfig, plan: ReplayPlan) -> list[tuple[Any, ...]]:
    """The plan's changes from its changelog, in position order (the changelog's kind reads them)."""
    return plan.source.destination.kind.changelog_rows(config, plan.source, plan.selection)


# ---------------------------------------------------------------------------------------------
# Queueing and delivering


def replay_mark(config: SequinConfig, sink: SinkConfig, replay_id: int) -> int:
    """Write the replay's mark into the WAL of ``sink``'s database; returns its position (the position
    of the replay's messages in the sink's order): the mark's last byte, which no change has, as a
    backfill page's read position (``backfill.watermarks.read_position``). Its end would be where the next
    record starts, maybe a commit whose changes would then share the replay's positions."""
    from sequin_provider.backfill.watermarks import read_position

    try:
        with psycopg.connect(config.database(sink.database).dsn, autocommit=True, connect_timeout=10) as conn:
            return read_position(conn, REPLAY_PREFIX, str(replay_id))[0]
    except psycopg.Error as exc:
        raise ReplayError(f"cannot mark the replay in database {sink.database!r}: {exc}") from None


def park_rows(
    plan: ReplayPlan, replay_id: int, mark: int, rows: Sequence[tuple[Any, ...]], first: int = 1
) -> list[store.ParkRow]:
    """The replay's messages for its sink, as buffer rows at ``(mark, first…)``: rendered with the
    sink's message kind and consumer, marked (``replay_id``, ``replay:`` keys), then transformed (a
    failed transform keeps the message untransformed with its error, as the stream parks one)."""
    from sequin_provider import message_render
    from sequin_provider.change_arrow import rows_to_arrow
    from sequin_provider.delivery import TransformError, apply_transform, load_transform

    changes = [(r[0], r[1], r[2], 0, r[3], r[4], r[5], r[6], r[7], list(r[8] or []), [], None, None) for r in rows]
    rendering = message_render.SinkRendering.of(plan.sink, plan.source.database)
    rendered = message_render.render(rows_to_arrow(changes), rendering, replay_id=replay_id)
    transform = load_transform(plan.sink.transform)
    groups, keys = rendered.group_id.to_pylist(), rendered.idempotency_key.to_pylist()
    barriers = rendered.barrier.to_pylist() if rendered.barrier is not None else [None] * len(rows)
    out = []
    for n, message in enumerate(rendered.data.to_pylist()):
        data, source, error = message, None, f"replay {replay_id}: queued for delivery"
        if transform is not None:
            try:
                data = apply_transform(plan.sink, transform, message)
            except TransformError as exc:
                data, source, error = None, message, f"replay {replay_id}: {exc}"
        out.append(
            store.ParkRow(plan.sink.name, mark, first + n, groups[n], keys[n], data, source, 0, error, 0.0, barriers[n])
        )
    return out


def queue_replay(config: SequinConfig, request: ReplayRequest) -> ReplayResult:
    """Check, record and queue a replay (its messages in its sink's buffer, in one transaction);
    returns its result without delivering (``replay_changes`` delivers)."""
    plan = plan_replay(config, request)
    rows = changelog_rows(config, plan)
    schema = config.store.schema
    with psycopg.connect(config.store_dsn(plan.sink.database), connect_timeout=10) as conn:
        store.migrate(conn, schema)
        replay = store.create_replay(
            conn,
            schema,
            plan.source.name,
            plan.sink.name,
            [f"{s}.{t}" for s, t in plan.selection.tables],
            plan.selection.since.text if plan.selection.since else None,
            plan.selection.until.text if plan.selection.until else None,
            plan.selection.where,
        )
        conn.commit()
        mark = replay_mark(config, plan.sink, replay.id)
        with conn.transaction():
            for start in range(0, len(rows), QUEUE_CHUNK):
                parked = park_rows(plan, replay.id, mark, rows[start : start + QUEUE_CHUNK], start + 1)
                store.park_messages(conn, schema, parked)
            replay = store.record_replay_queued(conn, schema, replay.id, mark, len(rows))
    log.info(
        "replay %d: %d changes of %s queued for sink %s at %d",
        replay.id,
        len(rows),
        plan.source.name,
        plan.sink.name,
        mark,
    )
    return ReplayResult(replay, len(rows))


def replay_changes(
    config: SequinConfig, request: ReplayRequest, deliver: bool = True, workers: int = 8
) -> ReplayResult:
    """Queue a replay and, with ``deliver``, run its sink's retry once (what fails stays parked, for the
    next ``sequin buffer retry`` or ``sequin_retry`` run)."""
    result = queue_replay(config, request)
    if deliver and result.queued:
        from sequin_provider.sinks.retry import retry_sinks

        (result.delivery,) = retry_sinks(config, result.replay.sink, workers)
    return result
