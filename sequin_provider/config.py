"""Typed configuration (``sequin.yaml``) with errors that name the file, the key path and the reason.

The YAML is modelled on Sequin's ``sequin.yaml`` (DESIGN §4). Strings may use ``${VAR}`` or
``${VAR:-default}``. Connections are DSNs or Airflow connection ids. A ``conn_id`` is resolved by
a ``ConnResolver`` (``conn_id -> DSN``): by default from the ``AIRFLOW_CONN_<ID>`` environment
variable (URI or JSON), which is how the operators hand connections to the Spark apps they submit;
inside Airflow the hook passes one backed by Airflow (environment, secrets backends, metadata
database). This module never imports Airflow.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote, urlencode

import yaml
from psycopg.conninfo import conninfo_to_dict

from sequin_provider.exceptions import ConfigError, UnknownSinkError
from sequin_provider.sinks import registry
from sequin_provider.sinks.base import DestinationKind

DEFAULT_CONFIG_PATH = "sequin.yaml"
ACTIONS = ("insert", "update", "delete")
TRUNCATE_MODES = ("deliver", "skip")
"""A sink's ``truncate`` setting: a TRUNCATE of one of its tables is one message per table, or none."""
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")

ConnResolver = Callable[[str], str]
"""``conn_id -> DSN``; raises ``LookupError`` (its text: what to do) when the connection does not exist."""


__all__ = ["ConfigError", "UnknownSinkError"]  # defined in ``exceptions``, importable from here as before


@dataclass(frozen=True)
class SlotConfig:
    """The logical replication slot this database is read through."""

    name: str = "sequin_slot"
    create_if_not_exists: bool = True


@dataclass(frozen=True)
class PublicationConfig:
    """The publication that selects which tables' changes reach the slot."""

    name: str = "sequin_pub"
    create_if_not_exists: bool = True


@dataclass(frozen=True)
class DatabaseConfig:
    """A source database: how to reach it and its slot/publication."""

    name: str
    dsn: str = field(repr=False)
    slot: SlotConfig = SlotConfig()
    publication: PublicationConfig = PublicationConfig()
    heartbeat_interval: float = 15.0
    conn_id: str | None = None  # the Airflow connection ``dsn`` was resolved from, if any


@dataclass(frozen=True)
class StoreConfig:
    """The internal Postgres (stream messages, buffer, status). ``dsn`` None = the source database."""

    dsn: str | None = field(default=None, repr=False)
    schema: str = "sequin"
    conn_id: str | None = None  # the Airflow connection ``dsn`` was resolved from, if any


@dataclass(frozen=True)
class TableConfig:
    """A captured table of a sink, optionally with its own grouping columns."""

    schema: str
    name: str
    group_column_names: tuple[str, ...] = ()

    @property
    def qualified(self) -> str:
        """``schema.name``."""
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True)
class DestinationConfig:
    """Where a sink delivers: ``type`` names its kind (``sinks.registry``), ``options`` are that
    kind's typed settings (e.g. ``sinks.webhook.WebhookOptions``)."""

    type: str
    options: Any

    @property
    def kind(self) -> DestinationKind:
        """The destination kind (``sinks.base.DestinationKind``): stored or pushed, and its work."""
        return registry.kind(self.type)


@dataclass(frozen=True)
class InitialBackfill:
    """A backfill to create when a sink is first set up: the whole table, or from a sort position."""

    table: str  # schema.table
    sort_column: str | None = None
    start_position: str | None = None
    max_query_ms: int = 5000


@dataclass(frozen=True)
class SinkConfig:
    """One consumer of changes: which tables/actions, how to filter, transform, group and deliver."""

    name: str
    database: str
    tables: tuple[TableConfig, ...]
    destination: DestinationConfig
    actions: tuple[str, ...] = ACTIONS
    filter: str | None = None
    transform: str | None = None
    message_grouping: bool = True
    message_kind: str = "change"
    max_retry_count: int | None = None
    initial_backfill: tuple[InitialBackfill, ...] = ()
    truncate: str = "deliver"  # a TRUNCATE of a table: one ``truncate`` message (deliver) or none (skip)

    @property
    def consumer_id(self) -> str:
        """A stable UUID for this sink, used as ``metadata.consumer.id``."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"sequin-sink:{self.name}"))


@dataclass(frozen=True)
class StreamConfig:
    """Settings of the stream app: checkpoint folder and micro-batch sizing."""

    checkpoint_location: str = "var/checkpoints"
    spool_location: str | None = None  # default: <checkpoint>/sequin-spool (must be local or shared)
    max_batch_rows: int = 200_000
    max_batch_bytes: int = 256 * 1024 * 1024
    max_batch_wait: float = 0.25
    # the least time between micro-batch starts (Spark's processing-time trigger; 0: each batch starts
    # when the one before it ends): fewer, larger batches at steady rates, for some latency. 50 ms: at
    # 5,000 changes/s the app's CPU -41 % for p99 39 -> 67 ms (docs/performance.md, the trigger interval)
    trigger_interval: float = 0.05
    store_retry_timeout: float = 300.0
    # batches of up to this many changes are written by the driver (None: every batch on a local master, 0 on a cluster)
    driver_batch_rows: int | None = None


@dataclass(frozen=True)
class MetricsConfig:
    """Where the processes serve Prometheus ``/metrics`` (``metrics.md``): the stream app and the backfill
    server on a port of their own (None: not served), the pull API on its own app (``api``)."""

    host: str = "0.0.0.0"
    stream_port: int | None = None
    backfill_port: int | None = None
    api: bool = True

    def port(self, process: str, offset: int = 0) -> int | None:
        """The port of ``process`` (``stream`` or ``backfill``) for the app of the database at index
        ``offset`` of the config (each database's app is a process of its own), or None when off."""
        base = self.stream_port if process == "stream" else self.backfill_port
        return None if base is None else base + offset


@dataclass(frozen=True)
class SequinConfig:
    """The whole configuration file."""

    databases: tuple[DatabaseConfig, ...]
    sinks: tuple[SinkConfig, ...]
    store: StoreConfig = StoreConfig()
    stream: StreamConfig = StreamConfig()
    source: str = DEFAULT_CONFIG_PATH
    metrics: MetricsConfig = MetricsConfig()

    def database(self, name: str | None = None) -> DatabaseConfig:
        """The named database, or the only one."""
        if name is None:
            if len(self.databases) != 1:
                raise ConfigError(self.source, "databases", "several databases: name the one to use")
            return self.databases[0]
        for db in self.databases:
            if db.name == name:
                return db
        raise ConfigError(self.source, "databases", f"no database named {name!r}")

    def sink(self, name: str) -> SinkConfig:
        """The sink named ``name``; ``UnknownSinkError`` (a ``ConfigError``) names the configured ones."""
        for sink in self.sinks:
            if sink.name == name:
                return sink
        raise UnknownSinkError(self.source, name, [s.name for s in self.sinks])

    def has_sink(self, name: str) -> bool:
        """Whether a sink is named ``name``."""
        return any(s.name == name for s in self.sinks)

    def sinks_of(self, database: str) -> tuple[SinkConfig, ...]:
        """The sinks reading from ``database``."""
        return tuple(s for s in self.sinks if s.database == database)

    def store_dsn(self, database: str | None = None) -> str:
        """DSN of the store (defaults to the source database)."""
        return self.store.dsn or self.database(database).dsn

    def connections(self) -> dict[str, str]:
        """``{conn_id: DSN}`` of the Airflow connections the file names (databases, store, and the
        destinations whose options name one: ``conn_id`` and ``dsn`` attributes)."""
        named = [(db.conn_id, db.dsn) for db in self.databases] + [(self.store.conn_id, self.store.dsn)]
        for sink in self.sinks:
            options = sink.destination.options
            named.append((getattr(options, "conn_id", None), getattr(options, "dsn", None)))
        return {conn_id: dsn for conn_id, dsn in named if conn_id is not None and dsn is not None}

    def tables_of(self, database: str) -> list[TableConfig]:
        """Distinct tables captured from ``database`` across its sinks, in config order."""
        seen: dict[str, TableConfig] = {}
        for sink in self.sinks_of(database):
            for table in sink.tables:
                seen.setdefault(table.qualified, table)
        return list(seen.values())


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_duration(value: Any) -> float:
    """Seconds from ``15``, ``"15s"``, ``"500ms"``, ``"2m"``, ``"1h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like 15s, 500ms, 2m")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    match = DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration (examples: 15s, 500ms, 2m)")
    number, unit = float(match.group(1)), match.group(2) or "s"
    return number * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}[unit]


def substitute_env(text: str, environ: dict[str, str] | None = None) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}``; an unset variable without default is an error."""
    env = os.environ if environ is None else environ

    def repl(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise KeyError(name)

    return ENV_REF.sub(repl, text)


def airflow_conn_env(conn_id: str) -> str:
    """The environment variable Airflow reads connection ``conn_id`` from: ``AIRFLOW_CONN_<ID>``."""
    return f"AIRFLOW_CONN_{conn_id.upper()}"


def dsn_uri(dsn: str) -> str:
    """``dsn`` (a libpq URI or ``key=value`` string) as a ``postgresql://`` URI, the form of an
    ``AIRFLOW_CONN_<ID>`` value; parameters other than host, port, user, password and dbname go in
    the query string."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    user, password = params.pop("user", None), params.pop("password", None)
    auth = quote(user or "", safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    host = params.pop("host", "")
    host = f"[{host}]" if ":" in host and not host.startswith("/") else quote(host, safe="")
    port = params.pop("port", None)
    location = host + (f":{port}" if port else "")
    dbname = quote(params.pop("dbname", ""), safe="")
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{auth + '@' if auth else ''}{location}/{dbname}{query}"


def dsn_from_airflow_conn(conn_id: str, environ: dict[str, str] | None = None) -> str:
    """The DSN of Airflow connection ``conn_id`` from ``AIRFLOW_CONN_<ID>`` (URI or JSON);
    ``KeyError(<variable>)`` if it is not set."""
    env = os.environ if environ is None else environ
    var = airflow_conn_env(conn_id)
    raw = env.get(var)
    if not raw:
        raise KeyError(var)
    raw = raw.strip()
    if raw.startswith("{"):
        data = json.loads(raw)
        user = quote(str(data.get("login") or ""), safe="")
        password = data.get("password")
        auth = f"{user}:{quote(str(password), safe='')}@" if password else (f"{user}@" if user else "")
        host = data.get("host") or "localhost"
        port = f":{data['port']}" if data.get("port") else ""
        return f"postgresql://{auth}{host}{port}/{data.get('schema') or 'postgres'}"
    for prefix in ("postgres://", "postgresql://", "sequin://"):
        if raw.startswith(prefix):
            return "postgresql://" + raw[len(prefix) :]
    return raw


class _Reader:
    """Walks the YAML tree, producing typed values or a ConfigError with the key path."""

    def __init__(
        self, source: str, environ: dict[str, str] | None, resolve_conn_id: ConnResolver | None = None
    ) -> None:
        self.source = source
        self.environ = environ
        self.resolve_conn_id = resolve_conn_id or (lambda conn_id: dsn_from_airflow_conn(conn_id, environ))

    def fail(self, path: str, reason: str) -> ConfigError:
        return ConfigError(self.source, path, reason)

    def mapping(self, value: Any, path: str, allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                raise self.fail(f"{path}.{key}" if path else str(key), f"unknown key (allowed: {hint})")
        for key in sorted(required):
            if value.get(key) is None:
                raise self.fail(f"{path}.{key}" if path else key, "is required")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, "expected a non-empty string")
        try:
            return substitute_env(value, self.environ)
        except KeyError as exc:
            raise self.fail(path, f"environment variable {exc.args[0]} is not set and has no default") from None

    def identifier(self, value: Any, path: str) -> str:
        text = self.string(value, path)
        if not IDENTIFIER.match(text) or len(text) > 63:
            raise self.fail(path, f"{text!r} is not a valid Postgres identifier (letters, digits, _; at most 63)")
        return text

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {value!r}")
        return value

    def integer(self, value: Any, path: str, minimum: int = 0, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise self.fail(path, f"must be {bound}, got {value}")
        return value

    def duration(self, value: Any, path: str) -> float:
        try:
            return parse_duration(substitute_env(value, self.environ) if isinstance(value, str) else value)
        except (ValueError, KeyError) as exc:
            raise self.fail(path, str(exc)) from None

    def connection(self, value: dict[str, Any], path: str) -> tuple[str | None, str | None]:
        """``(dsn, conn_id)`` of a ``dsn:`` or ``conn_id:`` entry (the conn_id resolved); ``(None, None)``
        if it has neither."""
        has_dsn, has_conn = value.get("dsn") is not None, value.get("conn_id") is not None
        if has_dsn and has_conn:
            raise self.fail(path, "give either dsn or conn_id, not both")
        if has_dsn:
            return self.string(value["dsn"], f"{path}.dsn"), None
        if has_conn:
            conn_id = self.string(value["conn_id"], f"{path}.conn_id")
            try:
                return self.resolve_conn_id(conn_id), conn_id
            except KeyError as exc:
                raise self.fail(
                    f"{path}.conn_id", f"connection {conn_id!r} not found: set {exc.args[0]} or use dsn"
                ) from None
            except LookupError as exc:
                raise self.fail(f"{path}.conn_id", f"connection {conn_id!r} not found: {exc}") from None
            except json.JSONDecodeError as exc:
                raise self.fail(f"{path}.conn_id", f"connection {conn_id!r} is not valid JSON: {exc}") from None
        return None, None


def _parse_table(r: _Reader, value: Any, path: str) -> TableConfig:
    if isinstance(value, str):
        value = {"name": value}
    item = r.mapping(value, path, {"name", "group_column_names"}, {"name"})
    name = r.string(item["name"], f"{path}.name")
    parts = name.split(".")
    if len(parts) == 1:
        parts = ["public", parts[0]]
    if len(parts) != 2 or not all(IDENTIFIER.match(p) for p in parts):
        raise r.fail(f"{path}.name", f"{name!r} is not a table name (schema.table)")
    groups = item.get("group_column_names") or []
    if not isinstance(groups, list):
        raise r.fail(f"{path}.group_column_names", "expected a list of column names")
    cols = tuple(r.identifier(g, f"{path}.group_column_names[{i}]") for i, g in enumerate(groups))
    return TableConfig(schema=parts[0], name=parts[1], group_column_names=cols)


def _parse_destination(r: _Reader, value: Any, path: str) -> DestinationConfig:
    """``destination:``: its ``type`` picks a registered kind, which validates the other keys."""
    if not isinstance(value, dict) or "type" not in value:
        raise r.fail(
            f"{path}.type" if isinstance(value, dict) else path, f"is required ({' | '.join(registry.names())})"
        )
    name = r.string(value["type"], f"{path}.type")
    try:
        kind = registry.kind(name)
    except registry.UnknownDestinationError as exc:
        raise r.fail(f"{path}.type", str(exc)) from None
    return DestinationConfig(type=name, options=kind.parse_options(r, value, path))


def _parse_sink(r: _Reader, value: Any, path: str, databases: set[str]) -> SinkConfig:
    allowed = {
        "name",
        "database",
        "tables",
        "table",
        "actions",
        "filter",
        "transform",
        "message_grouping",
        "message_kind",
        "max_retry_count",
        "initial_backfill",
        "destination",
        "truncate",
    }
    item = r.mapping(value, path, allowed, {"name", "destination"})
    name = r.identifier(item["name"], f"{path}.name")
    database = r.string(item["database"], f"{path}.database") if item.get("database") is not None else None
    if database is None:
        if len(databases) != 1:
            raise r.fail(f"{path}.database", "is required when several databases are configured")
        database = next(iter(databases))
    if database not in databases:
        raise r.fail(f"{path}.database", f"no database named {database!r} (known: {', '.join(sorted(databases))})")
    raw_tables = item.get("tables")
    if raw_tables is None and item.get("table") is not None:
        raw_tables = [item["table"]]
    if not isinstance(raw_tables, list) or not raw_tables:
        raise r.fail(f"{path}.tables", "expected a non-empty list of tables")
    tables = tuple(_parse_table(r, t, f"{path}.tables[{i}]") for i, t in enumerate(raw_tables))
    actions = item.get("actions", list(ACTIONS))
    if not isinstance(actions, list) or not actions:
        raise r.fail(f"{path}.actions", "expected a non-empty list of insert/update/delete")
    for i, action in enumerate(actions):
        if action not in ACTIONS:
            raise r.fail(f"{path}.actions[{i}]", f"unknown action {action!r} (insert | update | delete)")
    kind = item.get("message_kind", "change")
    if kind not in ("change", "record"):
        raise r.fail(f"{path}.message_kind", f"expected change or record, got {kind!r}")
    transform = item.get("transform")
    if transform is not None:
        transform = r.string(transform, f"{path}.transform")
        if transform != "record_only" and not re.match(r"^[\w.]+:[\w]+$", transform):
            raise r.fail(f"{path}.transform", f"expected 'record_only' or 'module:function', got {transform!r}")
    truncate = item.get("truncate", "deliver")
    if truncate not in TRUNCATE_MODES:
        raise r.fail(f"{path}.truncate", f"expected deliver or skip, got {truncate!r}")
    retry = item.get("max_retry_count")
    return SinkConfig(
        name=name,
        database=database,
        tables=tables,
        destination=_parse_destination(r, item["destination"], f"{path}.destination"),
        actions=tuple(actions),
        filter=r.string(item["filter"], f"{path}.filter") if item.get("filter") is not None else None,
        transform=transform,
        message_grouping=r.boolean(item.get("message_grouping", True), f"{path}.message_grouping"),
        message_kind=kind,
        max_retry_count=None if retry is None else r.integer(retry, f"{path}.max_retry_count", 0),
        initial_backfill=_parse_initial_backfill(
            r, item.get("initial_backfill", False), f"{path}.initial_backfill", tables
        ),
        truncate=truncate,
    )


def _parse_initial_backfill(
    r: _Reader, value: Any, path: str, tables: tuple[TableConfig, ...]
) -> tuple[InitialBackfill, ...]:
    """``true`` (every table, whole), or one or a list of ``{table, sort_column, start_position, max_query_ms}``."""
    if value is None or value is False:
        return ()
    if value is True:
        return tuple(InitialBackfill(t.qualified) for t in tables)
    items = value if isinstance(value, list) else [value]
    out = []
    for i, raw in enumerate(items):
        where = f"{path}[{i}]" if isinstance(value, list) else path
        if not isinstance(raw, dict):
            raise r.fail(where, "expected true, or {table, sort_column, start_position} (or a list of them)")
        item = r.mapping(raw, where, {"table", "sort_column", "start_position", "max_query_ms"}, {"table"})
        name = r.string(item["table"], f"{where}.table")
        qualified = name if "." in name else f"public.{name}"
        if qualified not in {t.qualified for t in tables}:
            raise r.fail(f"{where}.table", f"{name!r} is not one of this sink's tables")
        sort_column = r.identifier(item["sort_column"], f"{where}.sort_column") if "sort_column" in item else None
        start = item.get("start_position")
        if (sort_column is None) != (start is None):
            raise r.fail(where, "a partial backfill needs both sort_column and start_position")
        if start is not None and not isinstance(start, (str, int, float)) or isinstance(start, bool):
            raise r.fail(f"{where}.start_position", "expected a value of the sort column (string or number)")
        out.append(
            InitialBackfill(
                qualified,
                sort_column,
                None if start is None else str(start),
                r.integer(item.get("max_query_ms", 5000), f"{where}.max_query_ms", 1, 600_000),
            )
        )
    return tuple(out)


def parse_config(
    data: Any,
    source: str = DEFAULT_CONFIG_PATH,
    environ: dict[str, str] | None = None,
    resolve_conn_id: ConnResolver | None = None,
) -> SequinConfig:
    """Validate a parsed YAML document and return the typed config; ``conn_id``s are resolved by
    ``resolve_conn_id`` (default: ``AIRFLOW_CONN_<ID>`` of ``environ``)."""
    r = _Reader(source, environ, resolve_conn_id)
    top = r.mapping(data, "", {"databases", "store", "sinks", "stream", "metrics"}, {"databases"})
    raw_dbs = top["databases"]
    if not isinstance(raw_dbs, list) or not raw_dbs:
        raise r.fail("databases", "expected a non-empty list")
    databases: list[DatabaseConfig] = []
    for i, raw in enumerate(raw_dbs):
        p = f"databases[{i}]"
        item = r.mapping(raw, p, {"name", "dsn", "conn_id", "slot", "publication", "heartbeat_interval"}, {"name"})
        dsn, conn_id = r.connection(item, p)
        if dsn is None:
            raise r.fail(p, "needs dsn or conn_id")
        slot = r.mapping(item.get("slot") or {}, f"{p}.slot", {"name", "create_if_not_exists"})
        pub = r.mapping(item.get("publication") or {}, f"{p}.publication", {"name", "create_if_not_exists"})
        databases.append(
            DatabaseConfig(
                name=r.identifier(item["name"], f"{p}.name"),
                dsn=dsn,
                slot=SlotConfig(
                    r.identifier(slot.get("name", "sequin_slot"), f"{p}.slot.name"),
                    r.boolean(slot.get("create_if_not_exists", True), f"{p}.slot.create_if_not_exists"),
                ),
                publication=PublicationConfig(
                    r.identifier(pub.get("name", "sequin_pub"), f"{p}.publication.name"),
                    r.boolean(pub.get("create_if_not_exists", True), f"{p}.publication.create_if_not_exists"),
                ),
                heartbeat_interval=r.duration(item.get("heartbeat_interval", "15s"), f"{p}.heartbeat_interval"),
                conn_id=conn_id,
            )
        )
    names = [d.name for d in databases]
    if len(set(names)) != len(names):
        raise r.fail("databases", "database names must be unique")
    store_raw = r.mapping(top.get("store") or {}, "store", {"dsn", "conn_id", "schema"})
    store_dsn, store_conn_id = r.connection(store_raw, "store")
    store = StoreConfig(
        dsn=store_dsn, schema=r.identifier(store_raw.get("schema", "sequin"), "store.schema"), conn_id=store_conn_id
    )
    raw_sinks = top.get("sinks") or []
    if not isinstance(raw_sinks, list):
        raise r.fail("sinks", "expected a list")
    sinks = tuple(_parse_sink(r, s, f"sinks[{i}]", set(names)) for i, s in enumerate(raw_sinks))
    sink_names = [s.name for s in sinks]
    if len(set(sink_names)) != len(sink_names):
        raise r.fail("sinks", "sink names must be unique")
    stream_raw = r.mapping(
        top.get("stream") or {},
        "stream",
        {
            "checkpoint_location",
            "spool_location",
            "max_batch_rows",
            "max_batch_bytes",
            "max_batch_wait",
            "trigger_interval",
            "store_retry_timeout",
            "driver_batch_rows",
        },
    )
    defaults = StreamConfig()
    stream = StreamConfig(
        checkpoint_location=r.string(
            stream_raw.get("checkpoint_location", defaults.checkpoint_location), "stream.checkpoint_location"
        ),
        spool_location=(
            r.string(stream_raw["spool_location"], "stream.spool_location")
            if stream_raw.get("spool_location") is not None
            else None
        ),
        max_batch_rows=r.integer(stream_raw.get("max_batch_rows", defaults.max_batch_rows), "stream.max_batch_rows", 1),
        max_batch_bytes=r.integer(
            stream_raw.get("max_batch_bytes", defaults.max_batch_bytes), "stream.max_batch_bytes", 1024
        ),
        max_batch_wait=r.duration(stream_raw.get("max_batch_wait", defaults.max_batch_wait), "stream.max_batch_wait"),
        trigger_interval=r.duration(
            stream_raw.get("trigger_interval", defaults.trigger_interval), "stream.trigger_interval"
        ),
        store_retry_timeout=r.duration(
            stream_raw.get("store_retry_timeout", defaults.store_retry_timeout), "stream.store_retry_timeout"
        ),
        driver_batch_rows=(
            r.integer(stream_raw["driver_batch_rows"], "stream.driver_batch_rows", 0)
            if stream_raw.get("driver_batch_rows") is not None
            else defaults.driver_batch_rows
        ),
    )
    return SequinConfig(
        databases=tuple(databases),
        sinks=sinks,
        store=store,
        stream=stream,
        source=source,
        metrics=_parse_metrics(r, top.get("metrics") or {}, len(databases)),
    )


def _parse_metrics(r: _Reader, value: Any, databases: int) -> MetricsConfig:
    """The ``metrics:`` mapping: ports are 1..65535, and a port per database (``port + index``) must fit."""
    raw = r.mapping(value, "metrics", {"host", "stream_port", "backfill_port", "api"})
    defaults = MetricsConfig()
    ports: dict[str, int | None] = {}
    for key in ("stream_port", "backfill_port"):
        port = raw.get(key)
        ports[key] = None if port is None else r.integer(port, f"metrics.{key}", 1, 65536 - databases)
    if ports["stream_port"] is not None and ports["stream_port"] == ports["backfill_port"]:
        raise r.fail("metrics.backfill_port", "must differ from metrics.stream_port")
    return MetricsConfig(
        host=r.string(raw.get("host", defaults.host), "metrics.host"),
        stream_port=ports["stream_port"],
        backfill_port=ports["backfill_port"],
        api=r.boolean(raw.get("api", defaults.api), "metrics.api"),
    )


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: dict[str, str] | None = None,
    resolve_conn_id: ConnResolver | None = None,
) -> SequinConfig:
    """Read and validate the config file (``SEQUIN_CONFIG`` or ``./sequin.yaml`` by default);
    ``conn_id``s are resolved by ``resolve_conn_id`` (default: ``AIRFLOW_CONN_<ID>`` of ``environ``)."""
    env = os.environ if environ is None else environ
    file = Path(path or env.get("SEQUIN_CONFIG") or DEFAULT_CONFIG_PATH)
    source = str(file)
    if not file.exists():
        raise ConfigError(source, "", "file not found (set SEQUIN_CONFIG or pass --config)")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        raise ConfigError(source, "", f"malformed YAML at {where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        raise ConfigError(source, "", "the file is empty")
    return parse_config(data, source, environ, resolve_conn_id)
