"""``sequin init``: check prerequisites, then create the store schema, publication and slot.

Everything is checked before anything is created, and a publication created by a run whose slot
creation then fails is dropped again, so a failed init leaves nothing half-made. Idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from sequin_provider import store
from sequin_provider.backfill import create_initial_backfills
from sequin_provider.config import SequinConfig
from sequin_provider.replication import (
    ReplicationError,
    check_prerequisites,
    check_slot_usable,
    create_slot,
    ensure_publication,
    server_version,
)
from sequin_provider.store import BackfillError


@dataclass
class InitReport:
    """What ``initialize`` found and did, for the CLI to print."""

    database: str
    created: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def initialize(config: SequinConfig, database: str | None = None) -> InitReport:
    """Provision one database (or the only one) for capture. Raises ``ReplicationError`` with every problem."""
    db = config.database(database)
    tables = config.tables_of(db.name)
    report = InitReport(db.name)
    with psycopg.connect(db.dsn, autocommit=True, connect_timeout=10) as conn:
        errors, warnings, infos = check_prerequisites(conn, tables)
        report.warnings += warnings
        try:
            slot = check_slot_usable(conn, db.slot.name)
        except ReplicationError as exc:
            errors.append(str(exc))
            slot = None
        if slot is None and not db.slot.create_if_not_exists and not errors:
            errors.append(f"slot {db.slot.name!r} does not exist and create_if_not_exists is false")
        if errors:
            raise ReplicationError(f"database {db.name!r} is not ready for capture:\n  - " + "\n  - ".join(errors))
        report.warnings += _delete_warnings(config, db.name, infos)
        for sink in config.sinks_of(db.name):
            report.created += sink.destination.kind.prepare_from_source(sink, conn)  # DestinationError names the sink
        version = server_version(conn)
        with psycopg.connect(config.store_dsn(db.name), connect_timeout=10) as store_conn:
            applied = store.migrate(store_conn, config.store.schema)
            store_conn.commit()
            try:
                backfills = create_initial_backfills(conn, store_conn, config, db.name)
            except BackfillError as exc:
                raise ReplicationError(f"initial backfill: {exc}") from None
        if applied:
            report.created.append(f"store schema {config.store.schema!r} (migrations {applied})")
        for b in backfills:
            report.created.append(
                f"initial backfill {b.id} of {b.table_schema}.{b.table_name} for sink {b.sink!r}"
                f" (pending: `sequin backfill run` or the Airflow operator runs it)"
            )
        if version < 140000:
            conn.execute("CREATE TABLE IF NOT EXISTS public.sequin_heartbeat (id int PRIMARY KEY, beat_at timestamptz)")
        pub_tables = list(tables)
        created_pub = ensure_publication(conn, db.publication.name, pub_tables, db.publication.create_if_not_exists)
        if version < 140000:
            from sequin_provider.config import TableConfig

            ensure_publication(conn, db.publication.name, [TableConfig("public", "sequin_heartbeat")], True)
        if created_pub:
            report.created.append(f"publication {db.publication.name!r} for {', '.join(t.qualified for t in tables)}")
        if slot is None:
            try:
                create_slot(conn, db.slot.name)
            except psycopg.Error as exc:
                if created_pub:
                    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(db.publication.name)))
                raise ReplicationError(f"cannot create slot {db.slot.name!r}: {str(exc).strip()}") from exc
            report.created.append(f"replication slot {db.slot.name!r} (pgoutput)")
    return report


def _delete_warnings(config: SequinConfig, database: str, infos: dict[str, Any]) -> list[str]:
    """Deletes under REPLICA IDENTITY DEFAULT carry only the key: filters on other columns see NULL
    (the delete is not delivered) and group columns other than the key are NULL (the delete lands
    in another group than the row's earlier changes). Say so before it surprises anyone."""
    out = []
    for sink in config.sinks_of(database):
        for table in sink.tables:
            info = infos.get(table.qualified)
            if info is None or info.replica_identity == "f" or "delete" not in sink.actions:
                continue
            if sink.filter:
                out.append(
                    f"sink {sink.name!r}: deletes of {table.qualified} carry only its key, so the filter sees "
                    f"NULL for other columns and may drop them; use REPLICA IDENTITY FULL"
                )
            if sink.message_grouping and set(table.group_column_names) - set(info.primary_key):
                out.append(
                    f"sink {sink.name!r}: deletes of {table.qualified} carry only its key, so group columns "
                    f"{list(table.group_column_names)} are NULL and deletes are not ordered with the row's "
                    f"earlier changes; use REPLICA IDENTITY FULL"
                )
    return out
