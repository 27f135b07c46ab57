"""Reading an Iceberg changelog back (``sinks.changelog``: a replay's source, docs/replays.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from sequin_provider.exceptions import ReplayError
from sequin_provider.sinks.changelog import CHANGELOG_COLUMNS, ChangelogSelection, read_changes

if TYPE_CHECKING:
    from sequin_provider.config import SinkConfig


def changelog_rows(sink: SinkConfig, selection: ChangelogSelection, store_dsn: str) -> list[tuple[Any, ...]]:
    """The selection's rows of ``sink``'s Iceberg changelog tables, in position order: the range and
    tables pushed down into the scan, then the rows copied into a temporary table of ``store_dsn``'s
    Postgres, which runs the condition (``read_changes``, as for a Postgres changelog)."""
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.expressions import AlwaysTrue, And, EqualTo, GreaterThanOrEqual, LessThan, LessThanOrEqual, Or

    from sequin_provider.sinks.iceberg_tables import open_catalog

    options = sink.destination.options
    row_filter: Any = AlwaysTrue()
    for bound, since in ((selection.since, True), (selection.until, False)):
        if bound is None:
            continue
        if bound.timestamp is not None:
            term = GreaterThanOrEqual if since else LessThan
            row_filter = And(row_filter, term("commit_timestamp", bound.timestamp.isoformat()))
        elif bound.position is not None:  # the LSN only: the exact (lsn, idx) bound is the SQL's
            term = GreaterThanOrEqual if since else LessThanOrEqual
            row_filter = And(row_filter, term("commit_lsn", bound.position[0]))
    tables = [And(EqualTo("table_schema", s), EqualTo("table_name", t)) for s, t in selection.tables]
    row_filter = And(row_filter, tables[0] if len(tables) == 1 else Or(*tables))
    try:
        catalog = open_catalog(options, timeout=10)
    except Exception as exc:  # noqa: BLE001
        raise ReplayError(f"sink {sink.name!r}: iceberg catalog: {type(exc).__name__}: {exc}") from None
    import pyarrow as pa

    parts = []
    try:
        for identifier in sorted({options.identifier(s, t) for s, t in selection.tables}):
            try:
                table = catalog.load_table(identifier)
            except NoSuchTableError:
                continue
            parts.append(table.scan(row_filter=row_filter, selected_fields=CHANGELOG_COLUMNS).to_arrow())
    finally:
        getattr(catalog, "engine", None) and catalog.engine.dispose()  # type: ignore[attr-defined]
    if not parts:
        return []
    scanned = pa.concat_tables(parts)
    with psycopg.connect(store_dsn, connect_timeout=10) as conn:
        conn.execute(
            "CREATE TEMP TABLE replay_changelog (commit_lsn bigint, commit_idx integer, action text,"
            " idempotency_key text, table_schema text, table_name text, commit_timestamp timestamptz,"
            " record_pks text[], record json, changes json) ON COMMIT DROP"
        )
        columns = sql.SQL(", ").join(map(sql.Identifier, CHANGELOG_COLUMNS))
        with conn.cursor().copy(sql.SQL("COPY replay_changelog ({}) FROM STDIN").format(columns)) as copy:
            for row in scanned.select(list(CHANGELOG_COLUMNS)).to_pylist():
                copy.write_row([row[c] for c in CHANGELOG_COLUMNS])
        return read_changes(conn, sql.Identifier("replay_changelog"), selection)
