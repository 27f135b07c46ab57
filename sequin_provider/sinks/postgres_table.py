"""Postgres table sink: apply each change to a table of another Postgres database (docs/postgres_table.md).

An insert, update or backfill ``read`` is an upsert by the target's primary key, a delete a delete, a
TRUNCATE a TRUNCATE of the target; each ``send`` is one transaction. Nothing older ever lands over
something newer: every target row keeps the position of the change it holds (``_sequin_lsn``,
``_sequin_idx``) and an upsert only replaces an older row; a delete leaves a *tombstone* (its key and
position in ``<schema>._sequin_tombstones``) so a replayed older insert cannot bring the row back, and
a truncate leaves its position in ``<schema>._sequin_truncates`` so nothing from before it can. Replays
(a restarted app, a retried batch) are therefore harmless, and the message keys are not needed.

Within one request the changes of a row are collapsed to its last one (the earlier ones are overwritten
anyway), so a request costs one set-based statement per target table and action: the rows go to the
server as the records' own JSON text (``sinks.change_message``) beside arrays of their positions, and
Postgres converts each value with the target column's type (``json_to_recordset``: a json column keeps
its text), never through Python floats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import psycopg

from sequin_provider.config import SinkConfig
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.change_message import parse_change
from sequin_provider.sinks.changelog import ChangelogSelection, Retention, parse_retention
from sequin_provider.sinks.idle_pool import IdlePool, readable
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register
from sequin_provider.sinks.routing import Route, parse_route

POSITION_COLUMNS = ("_sequin_lsn", "_sequin_idx")
"""The hidden columns of a target row: the position of the change it holds."""
TOMBSTONES = "_sequin_tombstones"
"""Per target schema: (table_name, key, lsn, idx) of deleted rows, so an older insert stays deleted."""
TRUNCATES = "_sequin_truncates"
"""Per target schema: (table_name, lsn, idx) of the last truncate of each target table."""
UPSERT_ACTIONS = ("insert", "update", "read")
APPLIED_ACTIONS = frozenset((*UPSERT_ACTIONS, "delete"))
"""The actions a mirror applies to rows (a truncate empties the table)."""
MODES = ("mirror", "changelog")
Step = tuple[Callable[..., None], tuple[Any, ...]]
"""A statement of a request: a ``postgres_table_schema`` function and its arguments after the connection."""


@dataclass(frozen=True)
class PostgresTableOptions:
    """A postgres_table destination's settings (docs/postgres_table.md)."""

    dsn: str = field(repr=False)
    table: Route
    conn_id: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)
    create_table: bool = False
    batch_size: int = 500
    timeout: float = 30.0
    concurrency: int = 2
    mode: str = "mirror"
    """``mirror`` (apply each change to its row) or ``changelog`` (append each message: change retention)."""
    retention: float | None = None
    """A changelog's retention period in seconds (``sinks.changelog.Retention``); None keeps every row."""


class PostgresTableKind(DestinationKind):
    """``type: postgres_table``: pushed, each request one transaction of upserts and deletes."""

    name = "postgres_table"
    stored = False

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> PostgresTableOptions:
        """``dsn`` or ``conn_id``, ``table`` (a route), ``mode``, ``columns``, ``create_table``,
        ``batch_size``, ``timeout``, ``concurrency``, ``retention`` (a changelog's)."""
        allowed = {"dsn", "conn_id", "table", "mode", "columns", "create_table", "batch_size", "timeout", "concurrency"}
        item = self.option_keys(reader, value, path, allowed | {"retention"}, {"table"})
        mode = reader.string(item.get("mode", "mirror"), f"{path}.mode")
        if mode not in MODES:
            raise reader.fail(f"{path}.mode", f"expected {' or '.join(MODES)}, got {mode!r}")
        retention = parse_retention(reader, item.get("retention"), f"{path}.retention", mode)
        dsn, conn_id = reader.connection(item, path)
        if dsn is None:
            raise reader.fail(f"{path}.dsn", "is required (or conn_id)")
        columns = item.get("columns") or {}
        if not isinstance(columns, dict):
            raise reader.fail(f"{path}.columns", "expected a mapping of source column to target column")
        mapped = {
            reader.string(k, f"{path}.columns"): reader.string(v, f"{path}.columns.{k}") for k, v in columns.items()
        }
        if len(set(mapped.values())) != len(mapped):
            raise reader.fail(f"{path}.columns", "two source columns map onto the same target column")
        if set(mapped.values()) & set(POSITION_COLUMNS) or set(mapped) & set(POSITION_COLUMNS):
            raise reader.fail(f"{path}.columns", f"{', '.join(POSITION_COLUMNS)} are the sink's own columns")
        if mapped and mode == "changelog":
            raise reader.fail(f"{path}.columns", "a changelog keeps whole records (columns maps a mirror's)")
        return PostgresTableOptions(
            dsn=dsn,
            conn_id=conn_id,
            table=parse_route(reader, item["table"], f"{path}.table"),
            columns=mapped,
            create_table=reader.boolean(item.get("create_table", False), f"{path}.create_table"),
            batch_size=reader.integer(item.get("batch_size", 500), f"{path}.batch_size", 1, 10000),
            timeout=reader.duration(item.get("timeout", 30), f"{path}.timeout"),
            concurrency=reader.integer(item.get("concurrency", 2), f"{path}.concurrency", 1, 32),
            mode=mode,
            retention=retention,
        )

    def pusher(self, sink: SinkConfig) -> PostgresTableSink:
        """A writer into the sink's target database."""
        return PostgresTableSink(sink)

    def prepare(self, sink: SinkConfig) -> list[str]:
        """Connect, check (or create) the targets the route names for the sink's tables (without the
        source's catalog: a missing target is an error)."""
        return self._prepare(sink, None)

    def prepare_from_source(self, sink: SinkConfig, source: psycopg.Connection[Any]) -> list[str]:
        """``prepare`` with the source's catalog: ``create_table`` creates a missing target from the
        source table's columns and key, and the target is checked to hold every source column."""
        return self._prepare(sink, source)

    def _prepare(self, sink: SinkConfig, source: psycopg.Connection[Any] | None) -> list[str]:
        from sequin_provider.sinks import postgres_table_schema as schema

        options: PostgresTableOptions = sink.destination.options
        try:
            with connect(options, sink.name, autocommit=True) as conn:
                if options.mode == "changelog":
                    return _prepare_changelogs(conn, sink, options)
                return schema.prepare_targets(conn, source, sink, options)
        except (DeliveryError, schema.TargetError) as exc:
            raise DestinationError(sink.name, str(exc)) from None
        except psycopg.Error as exc:
            raise DestinationError(sink.name, f"postgres_table: {_reason(exc)}") from None

    def keeps_changelog(self, sink: SinkConfig) -> bool:
        """A sink in ``mode: changelog``."""
        return sink.destination.options.mode == "changelog"  # type: ignore[no-any-return]

    def changelog_rows(self, config: Any, sink: SinkConfig, selection: ChangelogSelection) -> list[tuple[Any, ...]]:
        """Read by the changelog's own database (``sinks.postgres_changelog.changelog_rows``)."""
        from sequin_provider.sinks.postgres_changelog import changelog_rows

        return changelog_rows(sink, selection)

    def health(self, sink: SinkConfig) -> str | None:
        """``ok`` when the target database answers and the targets the route names exist."""
        from sequin_provider.sinks import postgres_table_schema as schema

        options: PostgresTableOptions = sink.destination.options
        try:
            with connect(options, sink.name, autocommit=True, timeout=2.0) as conn:
                targets = schema.fixed_targets(sink, options).values()
                missing = [t for t in targets if schema.target_columns(conn, t) is None]
        except DeliveryError as exc:
            return str(exc)
        except psycopg.Error as exc:
            return f"postgres_table: {_reason(exc)}"
        return f"missing table {', '.join(missing)}" if missing else "ok"


def _prepare_changelogs(conn: psycopg.Connection[Any], sink: SinkConfig, options: PostgresTableOptions) -> list[str]:
    """Each changelog table the route names for the sink's tables there with the changelog's columns,
    or created with ``create_table``; returns what was created."""
    from sequin_provider.sinks import postgres_changelog as changelog
    from sequin_provider.sinks.postgres_table_schema import TargetError, fixed_targets

    created = []
    for name in sorted(set(fixed_targets(sink, options).values())):
        found = changelog.is_changelog(conn, name)
        if found is None and options.create_table:
            changelog.create_changelog(conn, name)
            created.append(f"changelog table {name}")
        elif found is None:
            raise TargetError(f"changelog table {name} does not exist (create_table is off)")
        elif not found:
            raise TargetError(f"table {name} is not a changelog (it lacks the changelog's columns)")
    return created


def connect(
    options: PostgresTableOptions, sink: str, autocommit: bool = False, timeout: float | None = None
) -> psycopg.Connection[Any]:
    """A connection to the target database, every wait bounded: the connect by ``timeout``, a
    statement by the server's ``statement_timeout``, a dead peer by TCP keepalives and
    ``tcp_user_timeout``. ``DeliveryError`` naming the sink when it cannot be had."""
    seconds = options.timeout if timeout is None else timeout
    millis = max(int(seconds * 1000), 1000)
    try:
        return psycopg.connect(
            options.dsn,
            autocommit=autocommit,
            connect_timeout=max(int(seconds), 1),
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
            tcp_user_timeout=millis,
            options=f"-c statement_timeout={millis} -c lock_timeout={millis}",
            application_name=f"sequin postgres_table {sink}",
        )
    except psycopg.Error as exc:
        raise DeliveryError(f"postgres_table {sink}: cannot connect: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """A one-line reason of a psycopg error."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]


@dataclass(slots=True)
class _Change:
    """One message of a request, parsed."""

    index: int
    action: str
    target: str
    position: tuple[int, int]
    columns: frozenset[str] = frozenset()
    key: tuple[str, ...] = ()
    partial: bool = False
    """An update that left unchanged TOAST columns out of its record (it sets only the others)."""
    record_text: str = "null"
    """The record's JSON text as the message holds it (what the server parses)."""


def idle_connection_usable(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection of the pool may serve the next request: open, outside a
    transaction, and its server sent nothing while it sat idle. A server that ends a session (a
    restart, ``pg_terminate_backend``, ``idle_session_timeout``) sends its FATAL and closes the
    socket; without this the next request failed on it, and was parked and retried."""
    return not conn.closed and conn.info.transaction_status == 0 and not readable(conn.fileno())


class PostgresTableSink(PushSink):
    """Applies one postgres_table sink's messages to its target tables; a connection per lane (pool)."""

    def __init__(self, sink: SinkConfig) -> None:
        from sequin_provider.sinks.postgres_table_schema import TargetCache

        self.options: PostgresTableOptions = sink.destination.options
        self.sink = sink.name
        self.batch_size = self.options.batch_size
        self.lanes = self.options.concurrency
        self.targets = TargetCache(self.options.columns)
        self.retention = Retention(self.options.retention)
        self._idle: IdlePool[psycopg.Connection[Any]] = IdlePool(idle_connection_usable)

    def send(self, messages: list[str], keys: list[str] | None = None) -> None:
        """Apply ``messages`` (in order) in one transaction; ``DeliveryError`` unless all committed.
        (Replays are harmless by position: ``keys`` are unused.) A request of one statement runs
        as a transaction of its own (the connections are in autocommit), without the round trips of
        ``BEGIN`` and ``COMMIT``."""
        from sequin_provider.sinks import postgres_table_schema as schema

        conn = self._take()
        ok = False
        try:
            if self.options.mode == "changelog":
                with conn.transaction():
                    self._append(conn, messages)
            else:
                steps = self._plan(conn, messages)  # every message read before anything is written
                if len(steps) == 1 and steps[0][0] is not schema.truncate:  # a truncate is several statements
                    step, args = steps[0]
                    step(conn, *args)  # one statement: a transaction of its own (autocommit), no BEGIN/COMMIT
                else:
                    with conn.transaction():
                        for step, args in steps:
                            step(conn, *args)
        except DeliveryError:
            self._give_back(conn)
            raise
        except psycopg.OperationalError as exc:  # the connection is gone or unusable
            conn.close()
            raise DeliveryError(f"postgres_table {self.sink}: {_reason(exc)}") from None
        except psycopg.Error as exc:
            self._give_back(conn)
            raise DeliveryError(f"postgres_table {self.sink}: {_reason(exc)}") from None
        except BaseException:
            conn.close()
            raise
        else:
            ok = True
        finally:
            if not ok:
                self.targets.forget()  # the target may have been altered, or its creation rolled back
        self._give_back(conn)

    def _append(self, conn: psycopg.Connection[Any], messages: list[str]) -> None:
        """A changelog's request: each message a row of the table its route names (created with
        ``create_table``), and the rows past the retention period pruned when a prune is due."""
        from sequin_provider.sinks import postgres_changelog as changelog

        by_table: dict[str, list[str]] = {}
        for text in messages:
            by_table.setdefault(self.options.table.target(text), []).append(text)
        for name, texts in by_table.items():
            if name not in self.targets.changelogs:
                found = changelog.is_changelog(conn, name)
                if found is None and self.options.create_table:
                    changelog.create_changelog(conn, name)
                elif not found:
                    what = "does not exist (create_table is off)" if found is None else "is not a changelog table"
                    raise DeliveryError(f"postgres_table {self.sink}: changelog {name} {what}")
                self.targets.changelogs.add(name)
            changelog.append_messages(conn, name, texts)
        if self.retention.seconds is not None and self.retention.due():
            for name in self.targets.changelogs:
                changelog.prune(conn, name, self.retention.seconds)

    def _take(self) -> psycopg.Connection[Any]:
        conn = self._idle.take()
        return conn if conn is not None else connect(self.options, self.sink, autocommit=True)

    def _give_back(self, conn: psycopg.Connection[Any]) -> None:
        if conn.closed or conn.info.transaction_status != 0:  # not idle: do not reuse
            conn.close()
        else:
            self._idle.give(conn)

    def _segments(self, conn: psycopg.Connection[Any], messages: list[str]) -> Iterator[list[_Change]]:
        """The messages as runs of changes that may be applied as sets (each row once, its last
        change), split at each truncate and where a partial update (unchanged TOAST columns left out)
        follows an earlier change of its row."""
        current: dict[tuple[str, tuple[str, ...]], _Change] = {}
        for i, text in enumerate(messages):
            change = self._parse(conn, i, text)
            if change.action == "truncate":
                if current:
                    yield list(current.values())
                    current = {}
                yield [change]
                continue
            slot = (change.target, change.key)
            if slot in current and change.partial:
                yield list(current.values())
                current = {}
            current.pop(slot, None)
            current[slot] = change
        if current:
            yield list(current.values())

    def _parse(self, conn: psycopg.Connection[Any], i: int, text: str) -> _Change:
        try:
            message = parse_change(text)
        except ValueError as exc:
            raise DeliveryError(
                f"postgres_table {self.sink}: not a change message (needs action, record, metadata): {exc}"
            ) from None
        route = self.options.table
        if route.function is not None:  # a function reads the whole message
            target = route.target_of(json.loads(text))
        else:
            target = route.target_of_fields(message.action, message.table_schema, message.table_name, message.record)
        action, record, position = message.action, message.record, message.position
        if action == "truncate":
            self.targets.get(conn, target, self.sink)
            return _Change(i, action, target, position)
        if action not in APPLIED_ACTIONS or not isinstance(record, dict):
            raise DeliveryError(f"postgres_table {self.sink}: cannot apply action {action!r}")
        table = self.targets.get(conn, target, self.sink)
        key = table.key_of(record, self.sink)
        partial = bool(message.unchanged_toast_columns)
        return _Change(i, action, target, position, frozenset(record), key, partial, message.record_text)

    def _plan(self, conn: psycopg.Connection[Any], messages: list[str]) -> list[Step]:
        """The request's statements, in order, as (function, its arguments after the connection):
        one per target table and action of each segment, and a truncate's own."""
        from sequin_provider.sinks import postgres_table_schema as schema

        steps: list[Step] = []
        for changes in self._segments(conn, messages):
            if changes[0].action == "truncate":
                (change,) = changes
                steps.append((schema.truncate, (self.targets.get(conn, change.target, self.sink), change.position)))
                continue
            groups: dict[tuple[str, bool, frozenset[str]], schema.Rows] = {}
            for c in changes:
                delete = c.action == "delete"
                key = (c.target, delete, frozenset() if delete else c.columns)
                rows = groups.get(key)
                if rows is None:
                    rows = groups[key] = schema.Rows([], [], [])
                rows.records.append(c.record_text)
                rows.lsns.append(c.position[0])
                rows.idxs.append(c.position[1])
            for (target, delete, columns), rows in groups.items():
                table = self.targets.get(conn, target, self.sink)
                if delete:
                    steps.append((schema.delete_rows, (table, rows, self.sink)))
                else:
                    steps.append((schema.upsert_rows, (table, columns, rows, self.sink)))
        return steps

    def close(self) -> None:
        """Close the idle connections."""
        self._idle.close()


KIND = register(PostgresTableKind())
