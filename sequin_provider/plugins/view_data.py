"""What the Sequin view shows, read from the sources and the store as one JSON-able snapshot.

Per database: its slot (active, lag in bytes) and the stream app's last batch (rows/s, when, the
heartbeat's age). Per sink: its kind's counts (``DestinationKind.counts``), parked and discarded
messages, and its database's throughput and lag (the stream reads a database's changes once for all
of its sinks). Backfills, newest first, with rows done of the estimate, rate and ETA
(``backfill.backfill_rate`` / ``backfill_eta_seconds``, as ``sequin backfill`` prints them). The
first ``BUFFER_LIMIT`` buffered messages with their errors. Values are data, never markup: the page
renders them as text.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg

from sequin_provider.config import SequinConfig

BACKFILL_LIMIT = 50
BUFFER_LIMIT = 200
BUFFER_SCHEMA_VERSION = 6  # the store migration that made buffered_messages


def _iso(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else None


def _age_seconds(value: Any, now: datetime) -> float | None:
    return round((now - value).total_seconds(), 1) if isinstance(value, datetime) else None


def _slot(config: SequinConfig, database: str) -> dict[str, Any]:
    """The slot of ``database``: active, lag bytes (or the error reaching the source)."""
    from sequin_provider.replication import slot_info

    db = config.database(database)
    out: dict[str, Any] = {"database": db.name, "slot": db.slot.name}
    try:
        with psycopg.connect(db.dsn, connect_timeout=5) as source:
            info = slot_info(source, db.slot.name)
    except psycopg.Error as exc:
        return {**out, "error": str(exc).strip()}
    if info is None:
        return {**out, "error": "the slot does not exist"}
    return {**out, "active": info.active, "lag_bytes": info.lag_bytes}


def backfill_entry(backfill: Any) -> dict[str, Any]:
    """A backfill row (``store.Backfill``) as the view shows it: rows done of the estimate, percent,
    rate, ETA and the same line ``sequin backfill`` prints."""
    from sequin_provider.backfill import backfill_eta_seconds, backfill_rate, progress_line

    rate = backfill_rate(backfill)
    total = backfill.rows_initial
    percent = min(100.0, 100.0 * backfill.rows_processed / total) if total else None
    return {
        "id": backfill.id,
        "sink": backfill.sink,
        "table": f"{backfill.table_schema}.{backfill.table_name}",
        "kind": backfill.kind,
        "state": backfill.state,
        "rows_done": backfill.rows_processed,
        "rows_total": total,
        "percent": None if percent is None else round(percent, 1),
        "rows_per_second": None if rate is None else round(rate, 1),
        "eta_seconds": backfill_eta_seconds(backfill, rate),
        "started_at": _iso(backfill.started_at),
        "progress": progress_line(backfill, rate),
        "error": backfill.error,
    }


def buffered_entry(message: Any) -> dict[str, Any]:
    """A buffered message (``store.Parked``) as the view shows it, with its last error."""
    from sequin_provider.pgoutput import int_to_lsn

    return {
        "sink": message.sink,
        "position": f"{int_to_lsn(message.commit_lsn)}:{message.commit_idx}",
        "group": message.group_id,
        "state": message.state,
        "attempts": message.attempts,
        "next_attempt_at": _iso(message.next_attempt_at),
        "error": message.last_error,
    }


def view_snapshot(config: SequinConfig) -> dict[str, Any]:
    """Everything the view shows, read now (one connection per source and per store)."""
    from sequin_provider import store

    now = datetime.now(timezone.utc)
    schema = config.store.schema
    snapshot: dict[str, Any] = {"generated_at": now.isoformat(), "databases": [], "sinks": [], "backfills": []}
    snapshot.update(buffered=[], buffered_total=0)
    for db in config.databases:
        entry = _slot(config, db.name)
        snapshot["databases"].append(entry)
        sinks = config.sinks_of(db.name)
        try:
            with psycopg.connect(config.store_dsn(db.name), connect_timeout=5) as conn:
                version = store.schema_version(conn, schema)
                status = next((r for r in store.read_status(conn, schema) if r["database"] == db.name), {})
                entry.update(
                    rows_per_second=status.get("rows_per_sec"),
                    last_batch_at=_iso(status.get("last_batch_at")),
                    heartbeat_at=_iso(status.get("heartbeat_at")),
                    heartbeat_age_seconds=_age_seconds(status.get("heartbeat_at"), now),
                    changes_total=status.get("total_rows"),
                )
                counts = store.buffer_counts(conn, schema) if version >= BUFFER_SCHEMA_VERSION else {}
                for sink in sinks:
                    buffered = counts.get(sink.name, {})
                    snapshot["sinks"].append(
                        {
                            "name": sink.name,
                            "database": db.name,
                            "type": sink.destination.kind.name,
                            "tables": [t.qualified for t in sink.tables],
                            "counts": sink.destination.kind.counts(conn, schema, sink.name) if version else {},
                            "parked": buffered.get("parked", 0),
                            "discarded": buffered.get("discarded", 0),
                            "rows_per_second": entry.get("rows_per_second"),
                            "lag_bytes": entry.get("lag_bytes"),
                            "heartbeat_at": entry.get("heartbeat_at"),
                            "heartbeat_age_seconds": entry.get("heartbeat_age_seconds"),
                        }
                    )
                names = {s.name for s in sinks}
                if version:
                    backfills = [b for b in store.list_backfills(conn, schema) if b.sink in names]
                    snapshot["backfills"].extend(backfill_entry(b) for b in backfills[:BACKFILL_LIMIT])
                if version >= BUFFER_SCHEMA_VERSION:
                    listed = store.list_buffered(conn, schema, limit=BUFFER_LIMIT)
                    snapshot["buffered"].extend(buffered_entry(m) for m in listed if m.sink in names)
                    snapshot["buffered_total"] += sum(
                        c.get("parked", 0) + c.get("discarded", 0) for s, c in counts.items() if s in names
                    )
        except psycopg.Error as exc:
            entry["store_error"] = str(exc).strip()
        for sink in snapshot["sinks"]:
            if sink["database"] == db.name:
                sink["destination"] = config.sink(sink["name"]).destination.kind.health(config.sink(sink["name"]))
    snapshot["backfills"].sort(key=lambda b: -b["id"])
    return snapshot
