"""The SQL of the postgres_table sink (``sinks.postgres_table``): its targets' catalog, their creation
and checks at ``sequin init``, and the position-guarded statements a request is applied with.

Every statement takes the request's messages as one JSON array (``%(rows)s``) and reads each row's
values with the target columns' types (``json_to_record``: a json column keeps its text as written),
its position from the message's metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

from psycopg import sql

from sequin_provider.exceptions import DeliveryError
from sequin_provider.sinks.routing import PLACEHOLDERS

if TYPE_CHECKING:
    import psycopg

    from sequin_provider.config import SinkConfig
    from sequin_provider.sinks.postgres_table import PostgresTableOptions

LSN, IDX = "_sequin_lsn", "_sequin_idx"
TOMBSTONES, TRUNCATES = "_sequin_tombstones", "_sequin_truncates"
ORDINAL = "_sequin_ord"
"""The ordinal joining a request's records to their positions (``Target.source``)."""
_SIDE_TABLES_LOCK = 0x5E9_7AB1E
"""The advisory lock (with the schema's hash) under which a schema's side tables are created."""


class TargetError(Exception):
    """A target table cannot be used (missing, no key, columns that do not map); its text says which."""


def split_name(name: str) -> tuple[str, str]:
    """``schema.table`` (or ``table``, in ``public``) as its two parts."""
    schema, dot, table = name.partition(".")
    return (schema, table) if dot else ("public", schema)


def catalog(conn: psycopg.Connection[Any], name: str) -> tuple[dict[str, str], list[str]] | None:
    """The columns (name -> type, in order) and primary-key columns of table ``name``; None if absent."""
    row = conn.execute("SELECT to_regclass(%s)::oid", (sql.Identifier(*split_name(name)).as_string(conn),)).fetchone()
    if row is None or row[0] is None:
        return None
    oid = row[0]
    columns = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (oid,),
    ).fetchall()
    key = conn.execute(
        "SELECT a.attname FROM pg_index i, unnest(i.indkey) WITH ORDINALITY AS k(attnum, n), pg_attribute a"
        " WHERE i.indrelid = %s AND i.indisprimary AND a.attrelid = i.indrelid AND a.attnum = k.attnum ORDER BY k.n",
        (oid,),
    ).fetchall()
    return dict(columns), [k for (k,) in key]


def target_columns(conn: psycopg.Connection[Any], name: str) -> dict[str, str] | None:
    """The columns of target ``name``, None if it does not exist."""
    found = catalog(conn, name)
    return None if found is None else found[0]


def fixed_targets(sink: SinkConfig, options: PostgresTableOptions) -> dict[str, str]:
    """``{source table: target}`` for the sink's tables whose target the route gives without a row (a
    fixed name or ``{table_schema}``/``{table_name}``); a route of rows or a function names none."""
    route = options.table
    if route.function is not None or any(p not in (None, *PLACEHOLDERS[:2]) for _, p in route.parts):
        return {}
    out = {}
    for table in sink.tables:
        message = {"metadata": {"table_schema": table.schema, "table_name": table.name}}
        out[table.qualified] = route.target(json.dumps(message))
    return out


def ensure_side_tables(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Create ``schema``'s tombstone and truncate tables if missing (serialized by an advisory lock
    so concurrent writers do not collide); returns whether it created them. ``conn`` is autocommit."""
    if conn.execute("SELECT to_regclass(%s)", (sql.Identifier(schema, TRUNCATES).as_string(conn),)).fetchone()[0]:
        return False
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_SIDE_TABLES_LOCK, schema))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (table_name text, key jsonb, lsn bigint NOT NULL, idx int NOT NULL,"
                " PRIMARY KEY (table_name, key))"
            ).format(sql.Identifier(schema, TOMBSTONES))
        )
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (table_name text PRIMARY KEY, lsn bigint NOT NULL, idx int NOT NULL)"
            ).format(sql.Identifier(schema, TRUNCATES))
        )
    return True


def prepare_targets(
    conn: psycopg.Connection[Any],
    source: psycopg.Connection[Any] | None,
    sink: SinkConfig,
    options: PostgresTableOptions,
) -> list[str]:
    """Check (or create) each target the route names for the sink's tables: present (or created from
    the source's columns with ``create_table``), keyed, with the position columns (added when missing),
    every source column mapping onto a target column; the side tables of its schema. Returns what it
    created. ``conn`` (the target) is autocommit; ``source`` the source database, if known."""
    created: list[str] = []
    targets = fixed_targets(sink, options)
    if options.create_table and len(targets) < len(sink.tables):
        raise TargetError(
            f"create_table needs a table route of {{table_schema}}/{{table_name}} only, not {options.table.spec!r}"
        )
    rename = dict(options.columns)
    seen_source: set[str] = set()
    for qualified, target in targets.items():
        origin = catalog(source, qualified) if source is not None else None
        if source is not None and origin is None:
            raise TargetError(f"source table {qualified} does not exist")
        mapped = {rename.get(c, c): t for c, t in origin[0].items()} if origin else {}
        mapped_key = [rename.get(c, c) for c in origin[1]] if origin else []
        seen_source.update(origin[0] if origin else ())
        found = catalog(conn, target)
        if found is None:
            if not options.create_table:
                raise TargetError(f"target table {target} does not exist (create_table is off)")
            if origin is None:
                raise TargetError(f"create_table needs the source's catalog to create {target} (run sequin init)")
            if not mapped_key:
                raise TargetError(f"source table {qualified} has no primary key to create {target} with")
            _create_target(conn, target, mapped, mapped_key)
            created.append(f"table {target} (from {qualified})")
            found = catalog(conn, target)
            assert found is not None
        columns, key = found
        if not key:
            raise TargetError(f"target table {target} has no primary key")
        if origin is not None:
            missing = [c for c in mapped if c not in columns]
            if missing:
                raise TargetError(f"target table {target} has no column {', '.join(missing)} (of {qualified})")
            if set(mapped_key) != set(key):
                raise TargetError(
                    f"target table {target}'s primary key ({', '.join(key)}) is not {qualified}'s"
                    f" ({', '.join(mapped_key) or 'none'})"
                )
        added = [c for c in (LSN, IDX) if c not in columns]
        for column in added:
            kind = "bigint" if column == LSN else "integer"
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {} NOT NULL DEFAULT 0").format(
                    sql.Identifier(*split_name(target)), sql.Identifier(column), sql.SQL(kind)
                )
            )
        if added:
            created.append(f"position columns {', '.join(added)} of {target}")
        schema = split_name(target)[0]
        if ensure_side_tables(conn, schema):
            created.append(f"tables {schema}.{TOMBSTONES}, {schema}.{TRUNCATES}")
    unknown = sorted(set(rename) - seen_source) if source is not None and targets else []
    if unknown:
        raise TargetError(f"columns names no column of the sink's tables: {', '.join(unknown)}")
    return created


def _create_target(conn: psycopg.Connection[Any], target: str, columns: dict[str, str], key: list[str]) -> None:
    schema, table = split_name(target)
    defs = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in columns.items()]
    defs += [sql.SQL("_sequin_lsn bigint NOT NULL DEFAULT 0"), sql.SQL("_sequin_idx integer NOT NULL DEFAULT 0")]
    defs.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key))))
    try:
        with conn.transaction():
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            conn.execute(
                sql.SQL("CREATE TABLE {} ({})").format(sql.Identifier(schema, table), sql.SQL(", ").join(defs))
            )
    except Exception as exc:  # noqa: BLE001 - psycopg's error, reported as the reason
        raise TargetError(f"cannot create {target}: {' '.join(str(exc).split())}") from None


@dataclass
class Target:
    """A target table as the writer needs it: its columns' types, its key, and the SQL per column set."""

    name: str
    types: dict[str, str]
    key: list[str]
    rename: Mapping[str, str]
    _statements: dict[Any, sql.Composed] = field(default_factory=dict, repr=False)

    @property
    def schema(self) -> str:
        """The target's schema (where its side tables are)."""
        return split_name(self.name)[0]

    @property
    def table(self) -> str:
        """The target's name in its schema (the side tables' ``table_name``)."""
        return split_name(self.name)[1]

    @cached_property
    def key_sources(self) -> list[str]:
        """The source columns of the key, in the key's order."""
        back = {t: s for s, t in self.rename.items()}
        return [back.get(k, k) for k in self.key]

    def column_of(self, source: str, sink: str) -> str:
        """The target column of source column ``source``; ``DeliveryError`` if the target has none."""
        column = self.rename.get(source, source)
        if column not in self.types:
            raise DeliveryError(f"postgres_table {sink}: target {self.name} has no column {column!r} (of {source!r})")
        return column

    def key_of(self, record: Mapping[str, Any], sink: str) -> tuple[str, ...]:
        """The row's key (its key columns' JSON) for collapsing a request's changes by row."""
        sources = self.key_sources
        try:  # a scalar as it is (one column holds one type); a json or array key as its JSON text
            if len(sources) == 1:  # the usual key, without the generator (a tenth of the sink's reading)
                v = record[sources[0]]
                return (v if isinstance(v, (str, int, float)) else json.dumps(v),)
            return tuple(
                v if isinstance(v, (str, int, float)) else json.dumps(v) for v in map(record.__getitem__, sources)
            )
        except KeyError as exc:
            raise DeliveryError(f"postgres_table {sink}: the record has no key column {exc.args[0]!r}") from None

    def source(self, columns: list[str], sink: str) -> sql.Composed:
        """The ``src`` query of a request: each record (``%(records)s``: a JSON array of the
        messages' records, their text as the messages hold it) typed as the target's columns and
        paired with its position (``%(lsns)s``, ``%(idxs)s``: arrays in the same order), so the
        server parses each record once and nothing else of the message."""
        defs = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(self.types[self.column_of(c, sink)])) for c in columns
        )
        return sql.SQL(
            "SELECT r.*, p._sequin_lsn, p._sequin_idx"
            " FROM ROWS FROM (json_to_recordset(%(records)s::json) AS ({defs})) WITH ORDINALITY AS r({names}, {n})"
            " JOIN unnest(%(lsns)s::bigint[], %(idxs)s::int[]) WITH ORDINALITY AS p(_sequin_lsn, _sequin_idx, {n})"
            " USING ({n})"
        ).format(defs=defs, names=sql.SQL(", ").join(map(sql.Identifier, columns)), n=sql.Identifier(ORDINAL))

    def _key(self, alias: str) -> sql.Composed:
        return sql.SQL("jsonb_build_array({})").format(
            sql.SQL(", ").join(sql.Identifier(alias, c) for c in self.key_sources)
        )

    def upsert(self, columns: frozenset[str], sink: str) -> sql.Composed:
        """Insert or replace the rows (of these source columns) unless the target holds a newer
        position for the row, a newer tombstone, or a newer truncate; older tombstones are dropped.
        The table's truncate position is read once per statement (an initPlan: one comparison per
        row, not a probe), and the clearing of tombstones is skipped when the table has none."""
        found = self._statements.get(columns)
        if found is not None:
            return found
        ordered = sorted(columns)
        names = [self.column_of(c, sink) for c in ordered]
        targets = [sql.Identifier(n) for n in names]
        tomb, trunc = sql.Identifier(self.schema, TOMBSTONES), sql.Identifier(self.schema, TRUNCATES)
        sets = [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names if n not in self.key]
        sets += [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in (LSN, IDX)]
        statement = sql.SQL(
            "WITH src AS ({source}),"
            " cleared AS (DELETE FROM {tomb} tb USING src WHERE EXISTS (SELECT 1 FROM {tomb} WHERE table_name = %(t)s)"
            " AND tb.table_name = %(t)s AND tb.key = {key}"
            " AND (tb.lsn, tb.idx) < (src._sequin_lsn, src._sequin_idx))"
            " INSERT INTO {target} AS d ({columns}, _sequin_lsn, _sequin_idx)"
            " SELECT {values}, src._sequin_lsn, src._sequin_idx FROM src"
            " WHERE NOT EXISTS (SELECT 1 FROM {tomb} tb WHERE tb.table_name = %(t)s AND tb.key = {key}"
            " AND (tb.lsn, tb.idx) >= (src._sequin_lsn, src._sequin_idx))"
            " AND ((src._sequin_lsn, src._sequin_idx) > (SELECT lsn, idx FROM {trunc} WHERE table_name = %(t)s)) IS NOT FALSE"
            " ON CONFLICT ({pk}) DO UPDATE SET {sets}"
            " WHERE (d._sequin_lsn, d._sequin_idx) < (EXCLUDED._sequin_lsn, EXCLUDED._sequin_idx)"
        ).format(
            source=self.source(ordered, sink),
            tomb=tomb,
            trunc=trunc,
            key=self._key("src"),
            target=sql.Identifier(self.schema, self.table),
            columns=sql.SQL(", ").join(targets),
            values=sql.SQL(", ").join(sql.Identifier("src", c) for c in ordered),
            pk=sql.SQL(", ").join(map(sql.Identifier, self.key)),
            sets=sql.SQL(", ").join(sets),
        )
        self._statements[columns] = statement
        return statement

    def delete(self, sink: str) -> sql.Composed:
        """Delete the rows unless the target holds a newer position for them, and leave (or move
        forward) a tombstone at each delete's position."""
        found = self._statements.get("delete")
        if found is not None:
            return found
        keys = self.key_sources
        match = sql.SQL(" AND ").join(
            sql.SQL("d.{} = src.{}").format(sql.Identifier(t), sql.Identifier(s)) for t, s in zip(self.key, keys)
        )
        statement = sql.SQL(
            "WITH src AS ({source}),"
            " gone AS (DELETE FROM {target} d USING src WHERE {match}"
            " AND (d._sequin_lsn, d._sequin_idx) < (src._sequin_lsn, src._sequin_idx))"
            " INSERT INTO {tomb} AS tb (table_name, key, lsn, idx)"
            " SELECT %(t)s, {key}, src._sequin_lsn, src._sequin_idx FROM src"
            " ON CONFLICT (table_name, key) DO UPDATE SET lsn = EXCLUDED.lsn, idx = EXCLUDED.idx"
            " WHERE (tb.lsn, tb.idx) < (EXCLUDED.lsn, EXCLUDED.idx)"
        ).format(
            source=self.source(keys, sink),
            target=sql.Identifier(self.schema, self.table),
            match=match,
            tomb=sql.Identifier(self.schema, TOMBSTONES),
            key=self._key("src"),
        )
        self._statements["delete"] = statement
        return statement


class TargetCache:
    """The target tables a writer has met, read from the target's catalog once."""

    def __init__(self, rename: Mapping[str, str]) -> None:
        self.rename = dict(rename)
        self._targets: dict[str, Target] = {}
        self.changelogs: set[str] = set()
        """A changelog's tables found (or created) with the changelog's columns."""

    def get(self, conn: psycopg.Connection[Any], name: str, sink: str) -> Target:
        """Target ``name``; ``DeliveryError`` if it is missing, has no key or no position columns."""
        found = self._targets.get(name)
        if found is not None:
            return found
        described = catalog(conn, name)
        if described is None:
            raise DeliveryError(f"postgres_table {sink}: target table {name} does not exist")
        types, key = described
        if not key:
            raise DeliveryError(f"postgres_table {sink}: target table {name} has no primary key")
        if LSN not in types or IDX not in types:
            raise DeliveryError(f"postgres_table {sink}: target table {name} has no {LSN}, {IDX} (run sequin init)")
        ensure_side_tables(conn, split_name(name)[0])  # a route that only rows name: not met by sequin init
        target = self._targets[name] = Target(name, types, key, self.rename)
        return target

    def forget(self) -> None:
        """Read the catalog again next time (after an error: the target may have been altered)."""
        self._targets.clear()
        self.changelogs.clear()


@dataclass(frozen=True)
class Rows:
    """A request's changes of one target, as the statements take them: the records' JSON texts
    (as the messages hold them) and each one's position, in the same order."""

    records: list[str]
    lsns: list[int]
    idxs: list[int]

    def params(self, target: Target) -> dict[str, Any]:
        """The statements' parameters (the positions as array literals: psycopg adapts a list of
        ints one element at a time in Python)."""
        return {
            "records": "[" + ",".join(self.records) + "]",
            "lsns": "{" + ",".join(map(str, self.lsns)) + "}",
            "idxs": "{" + ",".join(map(str, self.idxs)) + "}",
            "t": target.table,
        }


def upsert_rows(conn: psycopg.Connection[Any], target: Target, columns: frozenset[str], rows: Rows, sink: str) -> None:
    """Apply upserts (one record per row) to ``target``."""
    conn.execute(target.upsert(columns, sink), rows.params(target))


def delete_rows(conn: psycopg.Connection[Any], target: Target, rows: Rows, sink: str) -> None:
    """Apply deletes (one record per row: its key columns at least) to ``target``."""
    conn.execute(target.delete(sink), rows.params(target))


def truncate(conn: psycopg.Connection[Any], target: Target, position: tuple[int, int]) -> None:
    """Empty ``target`` of what is older than a truncate at ``position``, and keep that position so
    nothing older comes back: TRUNCATE when it holds nothing newer, else a DELETE of the older rows."""
    name = sql.Identifier(target.schema, target.table)
    params = {"t": target.table, "lsn": position[0], "idx": position[1]}
    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(name))
    conn.execute(
        sql.SQL(
            "INSERT INTO {} AS tr (table_name, lsn, idx) VALUES (%(t)s, %(lsn)s, %(idx)s)"
            " ON CONFLICT (table_name) DO UPDATE SET lsn = EXCLUDED.lsn, idx = EXCLUDED.idx"
            " WHERE (tr.lsn, tr.idx) < (EXCLUDED.lsn, EXCLUDED.idx)"
        ).format(sql.Identifier(target.schema, TRUNCATES)),
        params,
    )
    conn.execute(
        sql.SQL("DELETE FROM {} WHERE table_name = %(t)s AND (lsn, idx) < (%(lsn)s, %(idx)s)").format(
            sql.Identifier(target.schema, TOMBSTONES)
        ),
        params,
    )
    newer = conn.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE (_sequin_lsn, _sequin_idx) >= (%(lsn)s, %(idx)s))").format(name),
        params,
    ).fetchone()
    if newer and newer[0]:
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE (_sequin_lsn, _sequin_idx) < (%(lsn)s, %(idx)s)").format(name), params
        )
    else:
        conn.execute(sql.SQL("TRUNCATE {}").format(name))
