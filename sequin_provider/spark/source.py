"""The replication stream as a Spark Python data source (``format("sequin_replication")``).

A ``SimpleDataSourceStreamReader`` lives in one long-lived driver-side Python process, so it holds
the replication connection across micro-batches. Offsets are ``{"lsn": <end LSN of the last
complete transaction>}``; ``commit(end)`` is the only place the slot is acknowledged.
``readBetweenOffsets`` may run in another process (recovery after a restart): it opens its own
replication connection, re-reads exactly the recorded range and closes it.

Options: ``config`` (path of sequin.yaml, readable where the reader runs) and ``database``.
The DSN is resolved from the config in the reader's process, so it never appears in Spark plans.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from pyspark.sql.datasource import DataSource, SimpleDataSourceStreamReader

from sequin_provider.config import DatabaseConfig, StreamConfig, load_config
from sequin_provider.messages import CHANGE_SCHEMA_DDL, rows_to_arrow
from sequin_provider.replication import ChangeReader, confirmed_flush_lsn

log = logging.getLogger(__name__)


class SequinReplicationDataSource(DataSource):
    """Change rows (``messages.CHANGE_COLUMNS``) of one database's replication slot."""

    @classmethod
    def name(cls) -> str:
        return "sequin_replication"

    def schema(self) -> str:
        return CHANGE_SCHEMA_DDL

    def simpleStreamReader(self, schema: Any) -> SimpleDataSourceStreamReader:
        return ReplicationStreamReader(dict(self.options))


class ReplicationStreamReader(SimpleDataSourceStreamReader):
    """Reads whole transactions per micro-batch and acknowledges the slot on commit."""

    def __init__(self, options: dict[str, str]) -> None:
        self.config_path = options["config"]
        self.database_name = options.get("database") or None
        self._reader: ChangeReader | None = None
        self._db: DatabaseConfig | None = None
        self._stream: StreamConfig | None = None
        self._last_heartbeat = 0.0
        self._initial_lsn: int | None = None

    def _settings(self) -> tuple[DatabaseConfig, StreamConfig]:
        if self._db is None or self._stream is None:
            config = load_config(self.config_path)
            self._db = config.database(self.database_name)
            self._stream = config.stream
        return self._db, self._stream

    def _new_reader(self) -> ChangeReader:
        db, _ = self._settings()
        return ChangeReader(db.dsn, db.slot.name, db.publication.name)

    def initialOffset(self) -> dict:
        # Spark asks twice for a new query (to plan the read, then as batch 0's start) and the slot
        # may move in between (psycopg2 confirms a keepalive's wal_end when nothing unacknowledged
        # was received). A different start would miss the prefetched batch and force a re-read in
        # another process, which cannot get the slot while we stream: answer once, consistently.
        if self._initial_lsn is None:
            db, _ = self._settings()
            self._initial_lsn = confirmed_flush_lsn(db.dsn, db.slot.name)
        return {"lsn": self._initial_lsn}

    def read(self, start: dict) -> tuple[Iterator[Any], dict]:
        db, stream = self._settings()
        lsn = int(start["lsn"])
        if self._reader is None:
            self._reader = self._new_reader()
        if not self._reader.is_open or self._reader.position != lsn:
            self._reader.open(lsn)
        self._maybe_heartbeat(db)
        result = self._reader.read(stream.max_batch_rows, stream.max_batch_bytes, stream.max_batch_wait)
        if result.end_lsn == lsn:
            return iter([]), start
        # A heartbeat-only transaction gives a 0-row batch: the offset still advances, so the
        # slot is acknowledged past it and an idle database does not retain WAL.
        return iter([rows_to_arrow(result.rows)]), {"lsn": result.end_lsn}

    def _maybe_heartbeat(self, db: DatabaseConfig) -> None:
        if db.heartbeat_interval <= 0 or self._reader is None:
            return
        now = time.monotonic()
        if now - self._last_heartbeat < db.heartbeat_interval:
            return
        self._last_heartbeat = now
        try:
            self._reader.heartbeat()
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat must not stop the stream
            log.warning("heartbeat failed: %s", exc)

    def readBetweenOffsets(self, start: dict, end: dict) -> Iterator[Any]:
        if int(start["lsn"]) == int(end["lsn"]):
            # Spark runs batch 0 over (initial, initial) when the first read found nothing; an
            # empty range needs no slot (which the streaming reader holds at that moment).
            return iter([])
        reader = self._new_reader()
        try:
            reader.open(int(start["lsn"]))
            result = reader.read(0, 0, 0, stop_at=int(end["lsn"]))
        finally:
            reader.close()
        return iter([rows_to_arrow(result.rows)])

    def commit(self, end: dict) -> None:
        lsn = int(end["lsn"])
        if self._reader is None:
            self._reader = self._new_reader()
        if self._reader.is_open:
            self._reader.acknowledge(lsn)
            return
        # After a restart Spark commits the last finished batch before it replays an unfinished
        # one, whose readBetweenOffsets runs in another process and needs the slot: acknowledge
        # and let go of it rather than keep streaming from here.
        self._reader.open(lsn)
        try:
            self._reader.acknowledge(lsn)
        finally:
            self._reader.close()

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
