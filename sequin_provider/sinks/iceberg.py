"""Iceberg sink: each micro-batch's messages of the sink in one Iceberg commit per table, through
a SQL catalog (``pyiceberg``) and a warehouse directory (docs/iceberg.md).

Batched, not pushed (``DestinationKind.batched``): the driver gets the sink's messages of a batch
at once, in position order (``spark.pipeline.batch_outgoing``), checks each (``send`` of
``BatchCollector``: a message whose values do not fit is parked with its group, as a pushed
kind's refusal), then commits each table's share in one transaction that records its position
(``sinks.iceberg_tables``): a batch is in a table whole or not at all, and a replayed batch is
skipped. A commit that cannot be made (the catalog down) is retried for ``commit_timeout``, then
fails the batch, which Spark replays when the stream app restarts: the slot is not acknowledged
until the batch is committed.

Two modes: ``changelog`` appends every message as a row (position, action, idempotency key,
table, ``record``/``changes`` as JSON text); ``mirror`` keeps a table equal to its source table
(per batch: delete every key the batch touches, append their last states).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from sequin_provider.buffer import retry_sink
from sequin_provider.exceptions import DeliveryError, DestinationError
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.changelog import CHANGELOG_COLUMNS, ChangelogSelection, parse_retention
from sequin_provider.sinks.iceberg_rows import Message, RowShape, parse_message
from sequin_provider.sinks.iceberg_tables import IcebergTables, TableBatch, open_catalog, retrying
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.registry import register
from sequin_provider.sinks.routing import Route, parse_route

if TYPE_CHECKING:
    from pyiceberg.table import Table

    from sequin_provider.buffer import Render, RetryReport
    from sequin_provider.config import SequinConfig, SinkConfig
    from sequin_provider.delivery import Outgoing
    from sequin_provider.sinks.sequin_stream import SequinStreamSink

log = logging.getLogger(__name__)

MODES = ("changelog", "mirror")
TRANSFORMS = ("identity", "year", "month", "day", "hour", "bucket", "truncate")
_PARTITION = re.compile(r"^\s*(?:(\w+)\(\s*(?:(\d+)\s*,\s*)?(\w+)\s*\)|(\w+))\s*$")
DEFAULT_TABLE = "{table_schema}_{table_name}"


@dataclass(frozen=True)
class IcebergOptions:
    """An iceberg destination's settings (docs/iceberg.md)."""

    catalog_uri: str = field(repr=False)
    warehouse: str
    table: Route
    catalog_name: str = "sequin"
    namespace: str = "sequin"
    mode: str = "changelog"
    partition_by: tuple[tuple[str, str, int | None], ...] = ()
    """(transform, column, width of bucket/truncate) per partition field."""
    create_table: bool = True
    commit_timeout: float = 300.0
    retention: float | None = None
    """A changelog's retention period in seconds (``sinks.changelog.Retention``); None keeps every row."""

    def identifier(self, table_schema: str, table_name: str) -> tuple[str, str]:
        """The Iceberg table (namespace, name) of a source table."""
        values = {"table_schema": table_schema, "table_name": table_name}
        return self.namespace, "".join(text + (values[name] if name else "") for text, name in self.table.parts)


def parse_partition(reader: OptionReader, value: Any, path: str) -> tuple[str, str, int | None]:
    """``column``, ``day(column)`` (``year``, ``month``, ``hour``, ``identity``), ``bucket(16, column)``
    or ``truncate(4, column)``."""
    text = reader.string(value, path)
    found = _PARTITION.match(text)
    if found is None:
        raise reader.fail(path, f"expected a column or transform(column), got {text!r}")
    transform, width, column, plain = found.groups()
    if plain:
        return "identity", plain, None
    if transform not in TRANSFORMS:
        raise reader.fail(path, f"unknown transform {transform!r} ({' | '.join(TRANSFORMS)})")
    if (transform in ("bucket", "truncate")) != (width is not None):
        form = f"{transform}(N, column)" if transform in ("bucket", "truncate") else f"{transform}(column)"
        raise reader.fail(path, f"expected {form}, got {text!r}")
    return transform, column, None if width is None else int(width)


class BatchCollector(PushSink):
    """The driver's ``PushSink`` of one batch: ``send`` checks a message and keeps it for its
    table's commit (``deliver`` then parks what it refuses, with its group, as a pushed kind's)."""

    batch_size = 1
    lanes = 1

    def __init__(self, sink: str, options: IcebergOptions, tables: IcebergTables) -> None:
        self.sink = sink
        self.options = options
        self.tables = tables
        self.batches: dict[tuple[str, str], TableBatch] = {}
        self._shapes: dict[tuple[str, str], RowShape] = {}
        self._identifiers: dict[tuple[str, str], tuple[str, str]] = {}
        """Source table -> its Iceberg table (the route rendered once per table, not per message)."""

    def send(self, messages: list[str], keys: list[str]) -> None:
        """Keep each message for its table; ``DeliveryError`` if it is no change message or, in a
        mirror, a value does not fit its column."""
        for text in messages:
            message = parse_message(text)
            source = (message.table_schema, message.table_name)
            identifier = self._identifiers.get(source)
            if identifier is None:
                identifier = self._identifiers[source] = self.options.identifier(*source)
            batch = self.batches.get(identifier)
            if batch is None:
                batch = self.batches[identifier] = TableBatch(identifier, source)
            elif self.options.mode == "mirror" and batch.source != source:
                raise DeliveryError(f"iceberg {self.sink}: {'.'.join(identifier)} already mirrors another table")
            if self.options.mode == "mirror" and message.action != "truncate":
                self._check(identifier, batch, message)
            batch.messages.append(message)

    def _check(self, identifier: tuple[str, str], batch: TableBatch, message: Message) -> None:
        """A mirror row of the message can be made (columns new at the source are added first)."""
        shape = self._shapes.get(identifier)
        if shape is None or any(name not in shape.columns for name in message.record):
            table = self._table(identifier, batch, message)
            shape = self._shapes[identifier] = RowShape(table.schema())
        shape.key_of(shape.row(message.record))

    def _table(self, identifier: tuple[str, str], batch: TableBatch, message: Message) -> Table:
        def load() -> Table:
            table = self.tables.table(identifier, batch.source)
            return self.tables.evolve(table, batch.source, [message])

        return retrying(f"loading {'.'.join(identifier)}", self.options.commit_timeout, load)

    def commit(self) -> int:
        """One commit per table of what was kept; returns the messages applied (not skipped). A table
        whose messages were all parked (it is missing, say) gets no commit: its messages wait in the buffer."""
        return sum(self.tables.commit(batch) for batch in self.batches.values() if batch.messages)


class IcebergKind(DestinationKind):
    """``type: iceberg``: batched; one Iceberg commit per micro-batch and table (``BatchCollector``)."""

    name = "iceberg"
    stored = False
    batched = True

    def __init__(self) -> None:
        self._tables: dict[tuple[str, IcebergOptions], IcebergTables] = {}

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> IcebergOptions:
        """``catalog`` (``uri``, ``warehouse``, ``name``), ``namespace``, ``table``, ``mode``,
        ``partition_by``, ``create_table``, ``commit_timeout``, ``retention`` (a changelog's)."""
        keys = {"catalog", "namespace", "table", "mode", "partition_by", "create_table", "commit_timeout", "retention"}
        item = self.option_keys(reader, value, path, keys, {"catalog"})
        catalog = reader.mapping(item["catalog"], f"{path}.catalog", {"uri", "warehouse", "name"}, {"uri", "warehouse"})
        uri = reader.string(catalog["uri"], f"{path}.catalog.uri")
        if not re.match(r"^(postgresql(\+\w+)?|sqlite)://", uri):
            raise reader.fail(
                f"{path}.catalog.uri", "expected a SQLAlchemy URL: postgresql+psycopg2://... or sqlite:///..."
            )
        warehouse = reader.string(catalog["warehouse"], f"{path}.catalog.warehouse")
        if "://" not in warehouse:
            if not os.path.isabs(warehouse):
                raise reader.fail(f"{path}.catalog.warehouse", "expected file:///<absolute path> or an absolute path")
            warehouse = "file://" + warehouse
        route = parse_route(reader, item.get("table", DEFAULT_TABLE), f"{path}.table")
        if route.function is not None or any(n not in (None, "table_schema", "table_name") for _, n in route.parts):
            raise reader.fail(f"{path}.table", "a table name is a template over {table_schema} and {table_name} only")
        mode = reader.string(item.get("mode", "changelog"), f"{path}.mode")
        if mode not in MODES:
            raise reader.fail(f"{path}.mode", f"expected {' or '.join(MODES)}, got {mode!r}")
        partitions = item.get("partition_by") or []
        if not isinstance(partitions, list):
            raise reader.fail(f"{path}.partition_by", "expected a list of columns or transforms")
        partition_by = tuple(parse_partition(reader, p, f"{path}.partition_by[{n}]") for n, p in enumerate(partitions))
        for n, (_, column, _) in enumerate(partition_by):
            if mode == "changelog" and column not in CHANGELOG_COLUMNS:
                raise reader.fail(
                    f"{path}.partition_by[{n}]",
                    f"a changelog has no column {column!r} ({', '.join(CHANGELOG_COLUMNS)})",
                )
        retention = parse_retention(reader, item.get("retention"), f"{path}.retention", mode)
        return IcebergOptions(
            catalog_uri=uri,
            warehouse=warehouse,
            table=route,
            catalog_name=reader.string(catalog.get("name", "sequin"), f"{path}.catalog.name"),
            namespace=reader.string(item.get("namespace", "sequin"), f"{path}.namespace"),
            mode=mode,
            partition_by=partition_by,
            create_table=reader.boolean(item.get("create_table", True), f"{path}.create_table"),
            commit_timeout=reader.duration(item.get("commit_timeout", 300), f"{path}.commit_timeout"),
            retention=retention,
        )

    def tables(self, sink: SinkConfig, source_dsn: str | None) -> IcebergTables:
        """The sink's tables (one catalog per sink and process)."""
        key = (sink.name, sink.destination.options)
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = IcebergTables(sink.name, sink.destination.options, source_dsn)
        return found

    def commit_batch(
        self, config: SequinConfig, sink: SinkConfig, messages: Outgoing, store: SequinStreamSink
    ) -> tuple[int, int]:
        """Check and keep the batch's messages (parking refusals with their groups), then one
        commit per table; returns (delivered, parked)."""
        if not messages:
            return 0, 0
        collector = BatchCollector(sink.name, sink.destination.options, self.tables(sink, _source_dsn(config, sink)))
        delivered, parked = collector.deliver(messages, store, config.store.schema)
        applied = collector.commit()
        if applied != delivered:
            log.info("iceberg %s: %d messages already committed (a replayed batch)", sink.name, delivered - applied)
        return delivered, parked

    def retry(self, config: SequinConfig, sink: SinkConfig, render: Render, workers: int) -> RetryReport:
        """Each due parked message applied on its own commit, in group order, one commit at a time
        (``workers`` is not used), whatever the table's recorded position (it is behind it: later
        messages of other groups went on)."""
        options: IcebergOptions = sink.destination.options
        tables = self.tables(sink, _source_dsn(config, sink))

        def deliver(_: Any, data: str) -> None:
            collector = BatchCollector(sink.name, options, tables)
            collector.send([data], [])
            for batch in collector.batches.values():
                tables.commit(batch, force=True)

        # One commit at a time: concurrent commits to a table would be retried by pyiceberg with the
        # position each computed before the other landed, and the recorded position could go back.
        return retry_sink(config, sink, deliver, render, workers=1)

    def prepare(self, sink: SinkConfig) -> list[str]:
        """The catalog reachable, the namespace there (created unless ``create_table`` is off), each
        table there; a changelog's missing tables are created (a mirror's at its first batch, from
        its source table's columns). Two tables mirrored into one is an error."""
        options: IcebergOptions = sink.destination.options
        try:
            catalog = open_catalog(options, timeout=5)
        except ImportError as exc:
            raise DestinationError(sink.name, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any failure to reach or set up the catalog
            raise DestinationError(sink.name, f"iceberg catalog: {type(exc).__name__}: {_first_line(exc)}") from None
        created: list[str] = []
        targets = {t.qualified: options.identifier(t.schema, t.name) for t in sink.tables}
        if options.mode == "mirror" and len(set(targets.values())) < len(targets):
            raise DestinationError(sink.name, f"mirror: table {options.table.spec!r} maps two source tables to one")
        try:
            from pyiceberg.exceptions import NoSuchTableError

            if (options.namespace,) not in catalog.list_namespaces():
                if not options.create_table:
                    raise DestinationError(sink.name, f"iceberg namespace {options.namespace!r} does not exist")
                catalog.create_namespace_if_not_exists(options.namespace)
                created.append(f"iceberg namespace {options.namespace}")
            tables = IcebergTables(sink.name, options, None, catalog)
            for source, identifier in targets.items():
                try:
                    catalog.load_table(identifier)
                except NoSuchTableError:
                    if not options.create_table:
                        raise DestinationError(
                            sink.name, f"iceberg table {'.'.join(identifier)} does not exist (create_table is off)"
                        ) from None
                    if options.mode == "changelog":
                        tables.table(identifier, tuple(source.split(".", 1)))  # type: ignore[arg-type]
                        created.append(f"iceberg table {'.'.join(identifier)}")
        except DestinationError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DestinationError(sink.name, f"iceberg: {type(exc).__name__}: {_first_line(exc)}") from None
        finally:
            getattr(catalog, "engine", None) and catalog.engine.dispose()  # type: ignore[attr-defined]
        return created

    def keeps_changelog(self, sink: SinkConfig) -> bool:
        """A sink in ``mode: changelog``."""
        return sink.destination.options.mode == "changelog"  # type: ignore[no-any-return]

    def changelog_rows(
        self, config: SequinConfig, sink: SinkConfig, selection: ChangelogSelection
    ) -> list[tuple[Any, ...]]:
        """The scan, with the condition run by the store's Postgres (``sinks.iceberg_changelog``)."""
        from sequin_provider.sinks.iceberg_changelog import changelog_rows

        return changelog_rows(sink, selection, config.store_dsn(sink.database))

    def replay_refusal(self, sink: SinkConfig) -> str | None:
        """A mirror: its retry applies a message whatever the table holds, so old changes would land
        over newer rows."""
        if sink.destination.options.mode == "mirror":
            return "it is an Iceberg mirror: it would apply old changes over newer rows (rebuild it with a backfill)"
        return None

    def health(self, sink: SinkConfig) -> str | None:
        """``ok`` when the catalog answers and has the namespace, else what is wrong."""
        options: IcebergOptions = sink.destination.options
        try:
            catalog = open_catalog(options, timeout=2)
            try:
                if (options.namespace,) not in catalog.list_namespaces():
                    return f"namespace {options.namespace!r} missing"
            finally:
                catalog.engine.dispose()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001
            return f"catalog unreachable: {type(exc).__name__}: {_first_line(exc)}"
        return "ok"


def _source_dsn(config: SequinConfig, sink: SinkConfig) -> str | None:
    try:
        return config.database(sink.database).dsn
    except Exception:  # noqa: BLE001 - no such database: a mirror's table is then not created
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


KIND = register(IcebergKind())
