"""``SequinHook``: the source Postgres and the Sequin store as seen from Airflow (DESIGN §10).

The ``sequin`` connection holds the *source* database (host, port, login, password, schema = the
database name) and, in its extras, ``store_dsn`` (a separate store database; default: the source),
``store_schema`` (default ``sequin``) and ``config_path`` (the ``sequin.yaml`` the apps run with).
Other extras that libpq understands (``sslmode``, ``connect_timeout``, ...) are passed through.
Instead of its own host and of ``store_dsn``, the extras ``source_conn_id`` and ``store_conn_id`` may
name Postgres connections, resolved through ``PostgresHook``. Every connection id, these and the
``conn_id``s of ``sequin.yaml`` (``airflow_dsn``), is looked up through Airflow: environment
variables, secrets backends and the metadata database.

The hook is lazy, like the HTTP and dbt Cloud hooks: constructing it does no I/O (it is built at
DAG parse time inside operators); the connection is looked up on first use. Every query opens a
short psycopg 3 connection and closes it. The ``a*`` methods are the same queries for the
triggerer's event loop: the connection is looked up with ``aget_connection`` and the blocking
psycopg calls run in a worker thread (``asyncio.to_thread``), so the loop never blocks.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import psycopg
from airflow.providers.postgres.hooks.postgres import PostgresHook
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException
from psycopg.conninfo import make_conninfo

from sequin_provider import backfill as backfill_module
from sequin_provider import buffer, freshness, replay, replication, store
from sequin_provider.exceptions import StoreUnavailableError
from sequin_provider.supervision import BackfillServerSupervisorLock, StreamLock

if TYPE_CHECKING:
    from airflow.sdk import Connection

    from sequin_provider.config import SequinConfig

DEFAULT_STORE_SCHEMA = "sequin"
DEFAULT_CONNECT_TIMEOUT = 10
LIBPQ_EXTRAS = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "connect_timeout",
    "application_name",
    "options",
    "target_session_attrs",
    "keepalives",
    "keepalives_idle",
)
"""Connection extras handed to libpq as they are; the Sequin extras are not."""


REFERENCE_EXTRAS = ("source_conn_id", "store_conn_id")
"""Extras of a ``sequin`` connection that name other (Postgres) connections."""


def postgres_dsn(conn: Connection) -> str:
    """The libpq DSN of an Airflow connection to Postgres (host, port, login, password, schema = the
    database; the ``LIBPQ_EXTRAS`` among its extras)."""
    extras = conn.extra_dejson
    params: dict[str, Any] = {
        "host": conn.host or None,
        "port": conn.port or None,
        "user": conn.login or None,
        "password": conn.password or None,
        "dbname": conn.schema or None,
        "connect_timeout": DEFAULT_CONNECT_TIMEOUT,
    }
    params.update({name: extras[name] for name in LIBPQ_EXTRAS if extras.get(name) not in ("", None)})
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


def airflow_dsn(conn_id: str) -> str:
    """The DSN of Postgres connection ``conn_id`` as Airflow resolves it (``PostgresHook``: environment,
    secrets backends, metadata database); ``LookupError`` if Airflow has no such connection. The
    ``ConnResolver`` the Airflow layer hands to ``load_config``."""
    try:
        return postgres_dsn(PostgresHook(postgres_conn_id=conn_id).connection)
    except AirflowNotFoundException:
        raise LookupError(
            "Airflow has no such connection (looked up in AIRFLOW_CONN_* variables, the secrets"
            " backends and the metadata database)"
        ) from None


def referenced_conn_ids(conn: Connection) -> list[str]:
    """The connection ids a ``sequin`` connection's extras name (``source_conn_id``, ``store_conn_id``)."""
    extras = conn.extra_dejson
    found = [extras.get(name, extras.get(f"extra__sequin__{name}")) for name in REFERENCE_EXTRAS]
    return [str(conn_id) for conn_id in found if conn_id not in ("", None)]


@dataclass(frozen=True)
class SequinConnectionSettings:
    """What a ``sequin`` connection resolves to: where the source and the store are."""

    source_dsn: str = field(repr=False)
    store_dsn: str = field(repr=False)
    store_schema: str = DEFAULT_STORE_SCHEMA
    config_path: str | None = None

    @classmethod
    def from_connection(cls, conn: Connection, resolve: Callable[[str], str] = airflow_dsn) -> SequinConnectionSettings:
        """Read an Airflow connection (plain extras, or the ``extra__sequin__<name>`` form of old UIs);
        ``resolve`` gives the DSN of a connection named by ``source_conn_id``/``store_conn_id``."""
        extras = conn.extra_dejson

        def extra(name: str) -> Any:
            value = extras.get(name, extras.get(f"extra__sequin__{name}"))
            return None if value in ("", None) else value

        if extra("source_conn_id") is not None:
            if conn.host:
                raise ValueError(f"connection {conn.conn_id!r}: give either a host or source_conn_id, not both")
            source_dsn = resolve(str(extra("source_conn_id")))
        else:
            source_dsn = postgres_dsn(conn)
        if extra("store_conn_id") is not None:
            if extra("store_dsn") is not None:
                raise ValueError(f"connection {conn.conn_id!r}: give either store_dsn or store_conn_id, not both")
            store_dsn = resolve(str(extra("store_conn_id")))
        else:
            store_dsn = str(extra("store_dsn") or source_dsn)
        return cls(
            source_dsn=source_dsn,
            store_dsn=store_dsn,
            store_schema=str(extra("store_schema") or DEFAULT_STORE_SCHEMA),
            config_path=None if extra("config_path") is None else str(extra("config_path")),
        )


@contextmanager
def store_errors(what: str, kind: type[Exception] = psycopg.OperationalError) -> Iterator[None]:
    """``psycopg.OperationalError`` (a server out of reach; or any ``kind``) as ``StoreUnavailableError``:
    ``cannot reach <what>: <libpq's reason>``."""
    try:
        yield
    except kind as exc:
        raise StoreUnavailableError(f"cannot reach {what}: {str(exc).strip()}") from exc


# -- the queries, on DSNs (shared by the sync methods and, in a thread, by the async ones) ------


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def query_slot_info(dsn: str, slot: str) -> replication.SlotInfo | None:
    """State of replication slot ``slot`` on the source, or None if it does not exist."""
    with _connect(dsn) as conn:
        return replication.slot_info(conn, slot)


def query_heartbeat_at(dsn: str, schema: str, database: str) -> datetime | None:
    """When the stream app of ``database`` last recorded a batch (``stream_status.heartbeat_at``)."""
    with _connect(dsn) as conn:
        rows = [r for r in store.read_status(conn, schema) if r["database"] == database]
    return rows[0]["heartbeat_at"] if rows else None


def query_buffer_counts(dsn: str, schema: str) -> dict[str, dict[str, int]]:
    """``{sink: {"parked": n, "discarded": n}}`` of the buffer of parked messages."""
    with _connect(dsn) as conn:
        return store.buffer_counts(conn, schema)


def query_backfill(dsn: str, schema: str, backfill_id: int) -> store.Backfill:
    """One backfill row (``store.BackfillError`` if there is none)."""
    with _connect(dsn) as conn:
        return store.get_backfill(conn, schema, backfill_id)


def age_seconds(stamp: datetime | None, now: datetime | None = None) -> float | None:
    """Seconds since ``stamp`` (None stays None)."""
    if stamp is None:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return ((now or datetime.now(timezone.utc)) - stamp).total_seconds()


def select_sink(counts: Mapping[str, dict[str, int]], sink: str | None) -> dict[str, dict[str, int]]:
    """All sinks' counts, or only ``sink``'s (zeros when it has nothing in the buffer)."""
    if sink is None:
        return dict(counts)
    return {sink: dict(counts.get(sink, {"parked": 0, "discarded": 0}))}


class SequinHook(BaseHook):
    """Reads replication, stream and backfill state of a Sequin deployment.

    :param sequin_conn_id: the ``sequin`` connection (source Postgres + store extras).
    """

    conn_name_attr = "sequin_conn_id"
    default_conn_name = "sequin_default"
    conn_type = "sequin"
    hook_name = "Sequin"

    def __init__(self, sequin_conn_id: str = default_conn_name, logger_name: str | None = None) -> None:
        super().__init__(logger_name=logger_name)
        self.sequin_conn_id = sequin_conn_id
        self._settings: SequinConnectionSettings | None = None

    # -- connection --------------------------------------------------------------------------

    @property
    def settings(self) -> SequinConnectionSettings:
        """The resolved connection (looked up once, on first use)."""
        if self._settings is None:
            self._settings = SequinConnectionSettings.from_connection(self.get_connection(self.sequin_conn_id))
        return self._settings

    async def aget_settings(self) -> SequinConnectionSettings:
        """``settings`` for the event loop (async connection lookup)."""
        if self._settings is None:
            conn = await self.aget_connection(self.sequin_conn_id)
            named = {
                conn_id: postgres_dsn(await self.aget_connection(conn_id)) for conn_id in referenced_conn_ids(conn)
            }
            self._settings = SequinConnectionSettings.from_connection(conn, named.__getitem__)
        return self._settings

    def get_conn(self) -> psycopg.Connection[Any]:
        """A new psycopg connection to the source database (the caller closes it)."""
        return psycopg.connect(self.settings.source_dsn)

    def get_store_conn(self) -> psycopg.Connection[Any]:
        """A new psycopg connection to the store database (the caller closes it)."""
        return psycopg.connect(self.settings.store_dsn)

    def load_config(self, path: str | None = None) -> SequinConfig:
        """The ``sequin.yaml`` at ``path``, else the one named by the ``config_path`` extra (else
        ``SEQUIN_CONFIG`` / ./sequin.yaml), its ``conn_id``s resolved through Airflow (``airflow_dsn``)."""
        from sequin_provider.config import load_config

        return load_config(path or self.settings.config_path, resolve_conn_id=airflow_dsn)

    def test_connection(self) -> tuple[bool, str]:
        """For the UI's Test button: can we reach the source and the store, and is the store migrated?"""
        try:
            with _connect(self.settings.source_dsn) as conn:
                version = replication.server_version(conn)
            with _connect(self.settings.store_dsn) as conn:
                schema_version = store.schema_version(conn, self.settings.store_schema)
        except Exception as exc:  # noqa: BLE001 - reported to the UI
            return False, str(exc)
        if not schema_version:
            return (
                True,
                f"source reachable (server {version}); store schema {self.settings.store_schema!r} not initialised",
            )
        return True, f"source reachable (server {version}); store schema version {schema_version}"

    # -- the store: schema, locks -------------------------------------------------------------

    def migrate_store(self) -> None:
        """Create or upgrade the store schema (``StoreUnavailableError`` if the store cannot be reached)."""
        s = self.settings
        with store_errors("the store"):
            with psycopg.connect(s.store_dsn, connect_timeout=DEFAULT_CONNECT_TIMEOUT) as conn:
                store.migrate(conn, s.store_schema)

    def stream_lock(self, database: str, application_name: str) -> StreamLock:
        """The (not yet taken) lock "one supervised stream app of ``database``" in the store."""
        s = self.settings
        return StreamLock(s.store_dsn, s.store_schema, database, application_name)

    def backfill_server_supervisor_lock(self, database: str, application_name: str) -> BackfillServerSupervisorLock:
        """The (not yet taken) lock "one supervised backfill server of ``database``" in the store; it
        reads the server's own lock (``backfill.server_lock``) as the server's sign of life."""
        s = self.settings
        server = backfill_module.server_lock(s.store_dsn, s.store_schema, database)
        return BackfillServerSupervisorLock(s.store_dsn, s.store_schema, database, server, application_name)

    # -- backfills and the buffer -------------------------------------------------------------

    check_max_query_ms = staticmethod(store.check_max_query_ms)

    def create_backfill(
        self,
        config: SequinConfig,
        sink: str,
        table: str,
        sort_column: str | None,
        start_position: str | None,
        max_query_ms: int,
        requested_by: str | None = None,
        where: str | None = None,
    ) -> store.Backfill:
        """Validate a backfill against the source catalog and record it (nothing recorded if invalid;
        ``where``: only the rows matching this SQL condition):
        ``BackfillError`` names what is wrong (``BackfillConflict``: the table already has an active
        one), ``StoreUnavailableError`` if the source or the store cannot be reached."""
        s = self.settings
        with store_errors("the source or the store"):
            with psycopg.connect(s.source_dsn, autocommit=True) as source, psycopg.connect(s.store_dsn) as conn:
                store.migrate(conn, config.store.schema)
                conn.commit()
                return backfill_module.create_backfill(
                    source,
                    conn,
                    config,
                    sink,
                    table,
                    sort_column,
                    start_position,
                    max_query_ms,
                    requested_by,
                    where,
                )

    def transition_backfill(self, backfill_id: int, state: str, reason: str | None = None) -> store.Backfill:
        """Move a backfill to ``state`` (``BackfillError`` if it may not; ``StoreUnavailableError``)."""
        s = self.settings
        with store_errors("the store", psycopg.Error):
            with psycopg.connect(s.store_dsn, connect_timeout=DEFAULT_CONNECT_TIMEOUT) as conn:
                return store.transition_backfill(conn, s.store_schema, backfill_id, state, reason)

    def backfill_run_by(self, backfill_id: int, wait: float, application_name: str) -> str | None:
        """Who runs the backfill (holds its run lock) after ``wait`` seconds; None: nobody."""
        s = self.settings
        with store_errors("the store", psycopg.Error):
            return backfill_module.run_lock_holder(s.store_dsn, s.store_schema, backfill_id, wait, application_name)

    def place_backfill(
        self, database: str, backfill_id: int, takeover_wait: float | None, application_name: str
    ) -> backfill_module.Placement:
        """Where the backfill runs: ``backfill.place_backfill`` on this connection's store."""
        s = self.settings
        with store_errors("the store", psycopg.Error):
            return backfill_module.place_backfill(
                s.store_dsn, s.store_schema, database, backfill_id, takeover_wait, application_name
            )

    def retry_buffer(self, config: SequinConfig, sink: str | None, workers: int) -> list[buffer.RetryReport]:
        """One retry pass over the due parked messages of ``sink`` (or of every sink), with the config's
        stores (``sinks.retry.retry_sinks``, the function behind ``sequin buffer retry``)."""
        from sequin_provider.sinks.retry import retry_sinks

        with store_errors("the store"):
            return retry_sinks(config, sink, workers)

    def replay_changes(
        self, config: SequinConfig, request: replay.ReplayRequest, workers: int = 8
    ) -> replay.ReplayResult:
        """Replay retained changes into a sink and run its delivery once (``replay.replay_changes``,
        the function behind ``sequin replay``)."""
        with store_errors("the store"):
            return replay.replay_changes(config, request, workers=workers)

    def source_mark(self, source_dsn: str) -> freshness.Mark:
        """A ``freshness.Mark`` of the source now: every transaction committed so far is before its position."""
        with store_errors("the source", psycopg.Error):
            with psycopg.connect(source_dsn, autocommit=True, connect_timeout=DEFAULT_CONNECT_TIMEOUT) as conn:
                return freshness.take_mark(conn)

    def measure_freshness(
        self, source_dsn: str, store_dsn: str, slot: str, sinks: list[str], timeout: float
    ) -> freshness.Freshness:
        """Through which commit time ``sinks`` of one database are complete (``freshness.measure_freshness``
        on the config's source and store, with this connection's store schema)."""
        with store_errors("the source or the store", psycopg.Error):
            return freshness.measure_freshness(source_dsn, store_dsn, self.settings.store_schema, slot, sinks, timeout)

    # -- queries -----------------------------------------------------------------------------

    def slot(self, slot: str) -> replication.SlotInfo | None:
        """State of a replication slot of the source, or None if it does not exist."""
        return query_slot_info(self.settings.source_dsn, slot)

    def slot_lag_bytes(self, slot: str) -> int | None:
        """WAL bytes between the server's current position and what the slot's consumer confirmed
        (None if the slot does not exist or has no confirmed position)."""
        info = self.slot(slot)
        return None if info is None else info.lag_bytes

    def heartbeat_age_seconds(self, database: str) -> float | None:
        """Seconds since the stream app of ``database`` last recorded a batch (None: never)."""
        s = self.settings
        return age_seconds(query_heartbeat_at(s.store_dsn, s.store_schema, database))

    def parked_counts(self, sink: str | None = None) -> dict[str, dict[str, int]]:
        """``{sink: {"parked": n, "discarded": n}}`` for every sink with buffered messages, or for ``sink``."""
        s = self.settings
        return select_sink(query_buffer_counts(s.store_dsn, s.store_schema), sink)

    def backfill(self, backfill_id: int) -> store.Backfill:
        """A backfill by id (``store.BackfillError`` if there is none)."""
        s = self.settings
        return query_backfill(s.store_dsn, s.store_schema, int(backfill_id))

    def backfill_progress(self, backfill_id: int) -> str:
        """One line: state, rows done/total (percent), rows/s, ETA, error."""
        return backfill_module.progress_line(self.backfill(backfill_id))

    # -- the same, for the triggerer's event loop --------------------------------------------

    async def aslot(self, slot: str) -> replication.SlotInfo | None:
        """Async ``slot``."""
        s = await self.aget_settings()
        return await asyncio.to_thread(query_slot_info, s.source_dsn, slot)

    async def aslot_lag_bytes(self, slot: str) -> int | None:
        """Async ``slot_lag_bytes``."""
        info = await self.aslot(slot)
        return None if info is None else info.lag_bytes

    async def aheartbeat_age_seconds(self, database: str) -> float | None:
        """Async ``heartbeat_age_seconds``."""
        s = await self.aget_settings()
        return age_seconds(await asyncio.to_thread(query_heartbeat_at, s.store_dsn, s.store_schema, database))

    async def aparked_counts(self, sink: str | None = None) -> dict[str, dict[str, int]]:
        """Async ``parked_counts``."""
        s = await self.aget_settings()
        return select_sink(await asyncio.to_thread(query_buffer_counts, s.store_dsn, s.store_schema), sink)

    async def abackfill(self, backfill_id: int) -> store.Backfill:
        """Async ``backfill``."""
        s = await self.aget_settings()
        return await asyncio.to_thread(query_backfill, s.store_dsn, s.store_schema, int(backfill_id))
