"""The decoder's CPU per change, by message shape, compiled and in its Python references.

    .venv/bin/python bench/decode_throughput.py [--rows 2000] [--repeat 5]

Captures real pgoutput payloads of one embedded cluster (inserts, then updates of the same rows,
of 100 B and 1.6 kB rows, under replica identity default and full), then decodes each shape's
messages with ``PgOutputDecoder`` (``compiled=True``: ``_pgoutput_c``; ``False``: the references in
``pgoutput``), best of ``--repeat``. Beside them, in the same run, the server's own cost of producing
those messages: ``pg_logical_slot_peek_binary_changes`` over the same WAL (the walsender's decoding
and pgoutput's encoding, without the network). Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from sequin_provider.config import TableConfig  # noqa: E402
from sequin_provider.pgoutput import PgOutputDecoder, TypeRegistry  # noqa: E402
from sequin_provider.replication import Catalog, create_slot, ensure_publication  # noqa: E402

NOTES = {
    "100 B": "md5(g::text) || md5(g::text)",
    "1.6 kB": "(SELECT string_agg(md5(g::text || i), '') FROM generate_series(1, 50) i)",
}
"""The ``note`` column of each width (64 characters, or 1,600)."""

SHAPES = [(width, identity) for width in NOTES for identity in ("default", "full")]

PEEK = (
    "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',"
    " 'publication_names', 'pub')"
)


def table_name(width: str, identity: str) -> str:
    """The table of one shape."""
    return f"t_{'wide' if width == '1.6 kB' else 'narrow'}_{identity}"


def capture(dsn: str, rows: int) -> tuple[list[bytes], float]:
    """Every shape's payloads (Relation, Begin, changes, Commit), and the server's seconds to
    produce them once (a peek of the slot, best of three)."""
    tables = [table_name(w, i) for w, i in SHAPES]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for width, identity in SHAPES:
            t = table_name(width, identity)
            conn.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, account bigint NOT NULL, note text NOT NULL)")
            if identity == "full":
                conn.execute(f"ALTER TABLE {t} REPLICA IDENTITY FULL")
        ensure_publication(conn, "pub", [TableConfig("public", t) for t in tables], True)
        create_slot(conn, "decode_bench")
        conn.execute("SET synchronous_commit = on")
        for width, identity in SHAPES:
            t = table_name(width, identity)
            conn.execute(f"INSERT INTO {t} SELECT g, g, {NOTES[width]} FROM generate_series(1, {rows}) g")
            conn.execute(f"UPDATE {t} SET note = upper(note)")
        server = []
        for _ in range(3):
            started = time.perf_counter()
            conn.execute(PEEK, ("decode_bench",))
            server.append(time.perf_counter() - started)
        payloads = [
            bytes(r[0])
            for r in conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes('decode_bench', NULL, NULL,"
                " 'proto_version', '1', 'publication_names', 'pub')"
            ).fetchall()
        ]
        conn.execute("SELECT pg_drop_replication_slot('decode_bench')")
    return payloads, min(server)


def relations_decoder(dsn: str, payloads: list[bytes], compiled: bool) -> PgOutputDecoder:
    """A decoder (``compiled``: ``_pgoutput_c``, else the Python references) that has read the
    Relation messages among ``payloads``, with the cluster's types and keys."""
    catalog = Catalog(dsn)
    try:
        decoder = PgOutputDecoder(TypeRegistry(catalog.type_info), catalog.primary_key, compiled=compiled)
        for payload in payloads:
            if payload[:1] == b"R":
                decoder.decode(payload)
    finally:
        catalog.close()
    return decoder


def decode_costs(
    dsn: str, payloads: list[bytes], compiled: bool, repeat: int
) -> dict[tuple[str, str, str], tuple[float, int]]:
    """µs per message of each (width, identity, action), best of ``repeat`` passes, and the
    messages' mean size in bytes."""
    decoder = relations_decoder(dsn, payloads, compiled)
    by_relid = {rel_id: rel.name for rel_id, rel in decoder.relations.items()}
    shape_of = {table_name(w, i): (w, i) for w, i in SHAPES}
    groups: dict[tuple[str, str, str], list[bytes]] = {}
    for payload in payloads:
        action = {b"I": "insert", b"U": "update"}.get(payload[:1])
        if action:
            groups.setdefault((*shape_of[by_relid[int.from_bytes(payload[1:5], "big")]], action), []).append(payload)
    decoder.decode(next(p for p in payloads if p[:1] == b"B"))
    costs = {}
    for key, messages in groups.items():
        best = float("inf")
        for _ in range(repeat):
            started = time.perf_counter()
            for message in messages:
                decoder.decode(message)
            best = min(best, time.perf_counter() - started)
        costs[key] = (best / len(messages) * 1e6, sum(map(len, messages)) // len(messages))
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000, help="rows per shape (each inserted, then updated)")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the messages; the best counts")
    args = parser.parse_args()
    with EmbeddedPostgres(use_env_dsn=False) as pg:
        dsn = pg.create_database("decode_bench")
        payloads, server_seconds = capture(dsn, args.rows)
        compiled = decode_costs(dsn, payloads, True, args.repeat)
        reference = decode_costs(dsn, payloads, False, args.repeat)
    changes = 2 * args.rows * len(SHAPES)
    print(f"server: {server_seconds / changes * 1e6:.2f} µs per change to produce them (all shapes, one peek)")
    print("| row | replica identity | change | bytes | compiled µs | Python µs |")
    print("|---|---|---|---:|---:|---:|")
    for key in sorted(compiled):
        (cost, size), (reference_cost, _) = compiled[key], reference[key]
        print(f"| {' | '.join(key)} | {size:,} | {cost:.2f} | {reference_cost:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
