"""Iceberg tables of an ``iceberg`` sink: the SQL catalog, creating a table, and one commit of a
micro-batch's rows per table that records its position (``sinks.iceberg``).

A commit is one Iceberg transaction (one new metadata file, swapped in the catalog in one row
update): the batch's data files, the mirror's deletes, and the table property
``sequin.position`` = ``"<commit_lsn>:<commit_idx>"`` of the last message it applied (also in the
snapshot summary). Rows at or before a table's recorded position are dropped before the commit,
so a replayed batch commits nothing, and a batch is in the table whole or not at all.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from sequin_provider.exceptions import DeliveryError
from sequin_provider.sinks.changelog import Retention
from sequin_provider.sinks.iceberg_rows import (
    Message,
    Position,
    RowShape,
    changelog_schema,
    changelog_table,
    mirror_schema,
    source_columns,
)

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import Schema
    from pyiceberg.table import Table

    from sequin_provider.sinks.iceberg import IcebergOptions

log = logging.getLogger(__name__)
T = TypeVar("T")

OWN_COMMIT_RETRY = {"commit.retry.num-retries": "0"}
"""Each table's property that turns pyiceberg's own retry of a commit that lost a race off: it re-applies
the same updates, so the position this commit computed before the other landed would be written over a
later one. ``retrying`` makes the commit again from a fresh read of the table instead."""
POSITION_PROPERTY = "sequin.position"
"""The table property (and snapshot summary key) holding the last applied message's position."""
SINK_PROPERTY = "sequin.sink"
INSTALL_HINT = "pip install 'sequin-provider[iceberg]'"


def require_pyiceberg() -> None:
    """Import check: a clear error naming the extra when pyiceberg is missing."""
    try:
        import pyiceberg.catalog.sql  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the iceberg destination needs pyiceberg: {INSTALL_HINT} ({exc})") from None


def catalog_uri(uri: str, timeout: float) -> str:
    """``uri`` with a connect timeout for a Postgres catalog (libpq's ``connect_timeout``)."""
    if uri.startswith("postgresql") and "connect_timeout=" not in uri:
        return f"{uri}{'&' if '?' in uri else '?'}connect_timeout={max(1, int(timeout))}"
    return uri


def open_catalog(options: IcebergOptions, timeout: float = 10.0) -> Catalog:
    """The SQL catalog of ``options`` (its tables created in the catalog database if missing)."""
    require_pyiceberg()
    from pyiceberg.catalog.sql import SqlCatalog

    return SqlCatalog(
        options.catalog_name,
        uri=catalog_uri(options.catalog_uri, timeout),
        warehouse=options.warehouse,
        pool_pre_ping="true",
    )


def parse_position(text: str | None) -> Position | None:
    """A recorded ``"lsn:idx"``."""
    if not text:
        return None
    lsn, _, idx = text.partition(":")
    return int(lsn), int(idx)


def recorded_position(table: Table) -> Position | None:
    """The position of the last message committed to ``table`` (None: none yet)."""
    return parse_position(table.properties.get(POSITION_PROPERTY))


def partition_spec(options: IcebergOptions, schema: Schema) -> Any:
    """The partition spec of ``options.partition_by`` over ``schema``; ``ValueError`` naming a
    column the table lacks."""
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import (
        BucketTransform,
        DayTransform,
        HourTransform,
        IdentityTransform,
        MonthTransform,
        TruncateTransform,
        YearTransform,
    )

    made = {
        "identity": lambda _: IdentityTransform(),
        "year": lambda _: YearTransform(),
        "month": lambda _: MonthTransform(),
        "day": lambda _: DayTransform(),
        "hour": lambda _: HourTransform(),
        "bucket": BucketTransform,
        "truncate": TruncateTransform,
    }
    fields = []
    for n, (transform, column, width) in enumerate(options.partition_by):
        found = schema.find_field(column, case_sensitive=True) if column in schema.column_names else None
        if found is None:
            raise ValueError(f"partition_by: the table has no column {column!r}")
        name = column if transform == "identity" else f"{column}_{transform}"
        fields.append(PartitionField(found.field_id, 1000 + n, made[transform](width), name))
    return PartitionSpec(*fields)


@dataclass
class TableBatch:
    """A micro-batch's messages for one Iceberg table, in position order."""

    identifier: tuple[str, str]
    source: tuple[str, str]
    messages: list[Message] = field(default_factory=list)


def retrying(what: str, timeout: float, operation: Callable[[], T]) -> T:
    """Run ``operation`` again with backoff while the catalog or the warehouse fails (down, or a
    concurrent commit won the race), for up to ``timeout`` seconds; then raise its error. A
    ``DeliveryError`` (the data cannot be written as it is) is raised at once."""
    from pyiceberg.exceptions import CommitFailedException

    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return operation()
        except DeliveryError:
            raise
        except (CommitFailedException, OSError, ConnectionError) + _sqlalchemy_errors() as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("iceberg %s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _sqlalchemy_errors() -> tuple[type[BaseException], ...]:
    from sqlalchemy.exc import DBAPIError, OperationalError

    return (OperationalError, DBAPIError)


class IcebergTables:
    """The tables of one sink: loaded (or created) on demand, written one commit per batch."""

    def __init__(
        self, sink: str, options: IcebergOptions, source_dsn: str | None, catalog: Catalog | None = None
    ) -> None:
        self.sink = sink
        self.options = options
        self.source_dsn = source_dsn
        self._catalog = catalog
        self._retention: dict[tuple[str, str], Retention] = {}

    @property
    def catalog(self) -> Catalog:
        """The catalog, opened on first use (and again after ``reset``)."""
        if self._catalog is None:
            self._catalog = open_catalog(self.options)
        return self._catalog

    def reset(self) -> None:
        """Drop the catalog (its connections): the next use opens it again."""
        catalog, self._catalog = self._catalog, None
        engine = getattr(catalog, "engine", None)
        if engine is not None:
            engine.dispose()

    def schema_for(self, source: tuple[str, str]) -> Schema:
        """The schema a new table of ``source`` gets: the changelog's, or the source table's now."""
        if self.options.mode == "changelog":
            return changelog_schema()
        if self.source_dsn is None:
            raise DeliveryError(f"iceberg {self.sink}: no source database to read {source[0]}.{source[1]}'s columns")
        import psycopg

        with psycopg.connect(self.source_dsn, connect_timeout=10) as conn:
            columns, key = source_columns(conn, *source)
        if not columns:
            raise DeliveryError(f"iceberg {self.sink}: source table {source[0]}.{source[1]} not found")
        if not key:
            raise DeliveryError(f"iceberg {self.sink}: a mirror needs a primary key; {source[0]}.{source[1]} has none")
        return mirror_schema(columns, key)

    def table(self, identifier: tuple[str, str], source: tuple[str, str] | None) -> Table:
        """The table ``identifier``, created (with its namespace) when missing and ``create_table``
        allows it (``source``: the source table a mirror's columns come from)."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self.catalog.load_table(identifier)
        except NoSuchTableError:
            if not self.options.create_table or source is None:
                raise DeliveryError(
                    f"iceberg {self.sink}: table {'.'.join(identifier)} does not exist (create_table is off)"
                ) from None
        schema = self.schema_for(source)
        try:
            spec = partition_spec(self.options, schema)
        except ValueError as exc:
            raise DeliveryError(f"iceberg {self.sink}: {exc}") from None
        self.catalog.create_namespace_if_not_exists(identifier[0])
        log.info("iceberg %s: creating table %s", self.sink, ".".join(identifier))
        return self.catalog.create_table_if_not_exists(
            identifier,
            schema,
            partition_spec=spec,
            properties={"format-version": "2", SINK_PROPERTY: self.sink, **OWN_COMMIT_RETRY},
        )

    def commit(self, batch: TableBatch, force: bool = False) -> int:
        """Write ``batch`` to its table in one commit, less the messages at or before the table's
        recorded position (all of them: no commit) unless ``force`` (a parked message retried);
        returns how many messages it applied. Retried while the catalog is down, up to
        ``options.commit_timeout``; a failure the data causes is a ``DeliveryError``."""

        def attempt() -> int:
            try:
                return self._commit_once(batch, force)
            except DeliveryError:
                raise
            except Exception:
                self.reset()  # reconnect on the next attempt
                raise

        return retrying(f"commit to {'.'.join(batch.identifier)}", self.options.commit_timeout, attempt)

    def _commit_once(self, batch: TableBatch, force: bool) -> int:
        table = self.table(batch.identifier, batch.source)
        last = recorded_position(table)
        messages = batch.messages if force or last is None else [m for m in batch.messages if m.position > last]
        if not messages:
            return 0
        top = max(m.position for m in messages)
        if force and last is not None:
            top = max(top, last)
        position = f"{top[0]}:{top[1]}"
        summary = {POSITION_PROPERTY: position, SINK_PROPERTY: self.sink}
        if self.options.mode == "mirror":
            table = self.evolve(table, batch.source, messages)
        txn = table.transaction()
        if self.options.mode == "changelog":
            self._prune(txn, batch.identifier, summary)
            txn.append(changelog_table(messages, _arrow_schema(table)), snapshot_properties=summary)
        else:
            self._apply_mirror(txn, table, messages, summary)
        txn.set_properties({POSITION_PROPERTY: position, **OWN_COMMIT_RETRY})
        txn.commit_transaction()
        return len(messages)

    def _prune(self, txn: Any, identifier: tuple[str, str], summary: dict[str, str]) -> None:
        """A changelog's rows older than its retention period deleted in the batch's transaction,
        when a prune is due (``sinks.changelog.Retention``)."""
        retention = self._retention.setdefault(identifier, Retention(self.options.retention))
        if not retention.due():
            return
        from pyiceberg.expressions import LessThan

        cutoff = datetime.now(timezone.utc) - timedelta(seconds=retention.seconds or 0)
        with warnings.catch_warnings():  # nothing old enough yet: not worth a warning
            warnings.filterwarnings("ignore", "Delete operation did not match any records")
            txn.delete(LessThan("commit_timestamp", cutoff.isoformat()), snapshot_properties=summary)

    @staticmethod
    def _arrow(table: Table, rows: list[dict[str, Any]]) -> Any:
        import pyarrow as pa

        return pa.Table.from_pylist(rows, schema=_arrow_schema(table))

    def evolve(self, table: Table, source: tuple[str, str], messages: list[Message]) -> Table:
        """Columns the records have and the table not (an ADD COLUMN at the source) added, from the
        source's catalog, in a commit of their own (schema only, no data: harmless if repeated)."""
        known = set(table.schema().column_names)
        if all(name in known for m in messages for name in m.record):
            return table
        new = self.schema_for(source)
        with table.update_schema() as update:
            for f in new.fields:
                if f.name not in known:
                    update.add_column(f.name, f.field_type)
        log.info("iceberg %s: columns added to %s", self.sink, ".".join(table.name()))
        return self.catalog.load_table(table.name())

    def _apply_mirror(self, txn: Any, table: Table, messages: list[Message], summary: dict[str, str]) -> None:
        """The batch's net effect per primary key: a delete of every key it touches (every row, if it
        truncates), then an append of the keys' last states, in the one transaction."""
        from pyiceberg.expressions import AlwaysTrue

        shape = RowShape(table.schema())
        state: dict[tuple[Any, ...], dict[str, Any] | None] = {}
        truncated = False
        fill: list[tuple[Any, ...]] = []  # keys of updates that left unchanged TOAST values out
        for m in messages:
            if m.action == "truncate":
                state.clear()
                fill.clear()
                truncated = True
                continue
            row = shape.row(m.record)
            key = shape.key_of(row)
            if m.action == "delete":
                state[key] = None
                continue
            if m.changes:  # an update that changed the key: the old key's row goes
                old = shape.key_of({**row, **shape.row({k: v for k, v in m.changes.items() if k in shape.key})})
                if old != key:
                    state[old] = None
            if m.unchanged_toast:
                before = state.get(key)
                if before is not None:
                    row = {**before, **row}
                elif key not in state:
                    fill.append(key)
            state[key] = row
        if fill and not truncated:
            self._fill_unchanged(table, shape, state, fill)
        with warnings.catch_warnings():  # keys new to the table delete nothing: not worth a warning
            warnings.filterwarnings("ignore", "Delete operation did not match any records")
            if truncated:
                txn.delete(AlwaysTrue(), snapshot_properties=summary)
            elif state:
                txn.delete(_key_filter(shape.key, list(state)), snapshot_properties=summary)
        rows = [r for r in state.values() if r is not None]
        if rows:
            names = table.schema().column_names
            txn.append(self._arrow(table, [{n: r.get(n) for n in names} for r in rows]), snapshot_properties=summary)

    @staticmethod
    def _fill_unchanged(
        table: Table, shape: RowShape, state: dict[tuple[Any, ...], dict[str, Any] | None], keys: list[tuple[Any, ...]]
    ) -> None:
        """Unchanged TOAST values (left out of an update's record) taken from the table's row."""
        current = table.scan(row_filter=_key_filter(shape.key, keys)).to_arrow().to_pylist()
        for old in current:
            key = tuple(old[k] for k in shape.key)
            row = state.get(key)
            if row is not None:
                state[key] = {**old, **row}


def _key_filter(key: list[str], keys: list[tuple[Any, ...]]) -> Any:
    """The rows whose primary key is one of ``keys``."""
    from functools import reduce

    from pyiceberg.expressions import And, EqualTo, In, Or

    if len(key) == 1:
        return In(key[0], {k[0] for k in keys})
    terms = [reduce(And, [EqualTo(c, v) for c, v in zip(key, k)]) for k in keys]
    return terms[0] if len(terms) == 1 else reduce(Or, terms)


def _arrow_schema(table: Table) -> Any:
    """The table's schema in pyarrow's terms, without field ids (as ``append`` takes data)."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    return schema_to_pyarrow(table.schema(), include_field_ids=False)
