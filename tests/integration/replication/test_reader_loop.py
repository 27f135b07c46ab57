"""The reader's compiled loop (``ReplicationStream.read_rows`` over ``_pgoutput_c.read_rows``) against
its reference, ``read()`` and ``change_row`` one message at a time.

Both read the same slot of a real server from the same position; the rows, their order and the
chunks they are handed out in must be identical. A message the compiled loop does not take (a
transaction's begin and commit, an update with old values, a truncate, a logical message, a
keepalive, a row whose rendering fails) goes back to the Python lines, which decode it as before.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from psycopg import pq

from devtools.stream_process import wait_for
from sequin_provider.config import TableConfig
from sequin_provider.pgoutput import Begin, Commit, PgOutputDecoder, TypeRegistry, as_string
from sequin_provider.pq_copy import libpq_copy_functions
from sequin_provider.replication import (
    REPLICATION_SESSION_OPTIONS,
    ChangeReader,
    create_slot,
    ensure_publication,
    int_to_lsn,
)
from sequin_provider.replication_protocol import ReplicationStream
from tests.support.postgres import execute

pytestmark = pytest.mark.skipif(
    pq.__impl__ != "binary",  # justified: the loop needs the libpq of psycopg's binary wheel, a dependency
    reason="the compiled loop reads through the libpq of psycopg's binary wheel",
)


def test_the_loop_finds_the_libpq_of_psycopgs_connections() -> None:
    functions = libpq_copy_functions()
    assert functions is not None and all(functions)


def _slot(dsn: str) -> str:
    """A slot name of this test's database (slot names are the cluster's)."""
    return "slot_" + psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]


def _chunks(dsn: str, start: int | tuple[int, int], count: int, compiled: bool, **limits: int) -> list[tuple[Any, ...]]:
    """Every chunk the reader hands out from ``start`` until ``count`` rows came, one per ``read``
    (``max_rows=1`` takes exactly one chunk): its rows, end position and whether it ends a transaction."""
    reader = ChangeReader(dsn, _slot(dsn), "pub", compiled=compiled, **limits)
    reader.open(start)
    chunks: list[tuple[Any, ...]] = []
    try:
        deadline = time.monotonic() + 60
        while sum(len(c[0]) for c in chunks) < count:
            assert time.monotonic() < deadline, f"{sum(len(c[0]) for c in chunks)} of {count} rows read"
            result = reader.read(1, 1 << 40, 1.0)
            if result.rows or result.transactions:
                chunks.append((result.rows, (result.end_lsn, result.end_idx), result.transactions))
    finally:
        reader.close()
    return _folded(chunks)


def _folded(chunks: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``chunks`` with each chunk of no rows (a transaction with nothing for us) folded into the next
    one: ``read`` takes such a chunk together with the next only if that one had already arrived, so
    where they part depends on the walsender's pace (a loaded CI machine parted them differently in
    two reads of the same slot); every other chunk ends where the limits or a transaction end it."""
    out: list[tuple[Any, ...]] = []
    carried = 0
    for rows, end, transactions in chunks:
        if not rows and transactions:
            carried += transactions
            continue
        out.append((rows, end, transactions + carried))
        carried = 0
    if carried:
        out.append(([], chunks[-1][1], carried))
    return out


def test_the_compiled_loop_hands_out_what_the_reference_hands_out(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    execute(
        dsn,
        "CREATE TABLE kv (id int PRIMARY KEY, v text, n numeric)",
        "CREATE TABLE full_kv (id int PRIMARY KEY, v text)",
        "ALTER TABLE full_kv REPLICA IDENTITY FULL",
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_publication(conn, "pub", [TableConfig("public", "kv"), TableConfig("public", "full_kv")], True)
        start = create_slot(conn, _slot(dsn))
    big = "repeat(md5(g::text), 1 + g % 40)"  # rows of 32 B to 1.3 kB: the byte limit falls inside runs of rows
    execute(
        dsn,
        f"INSERT INTO kv SELECT g, {big}, g / 7.0 FROM generate_series(1, 2500) g",  # cut into chunks
        "INSERT INTO full_kv SELECT g, 'f' || g FROM generate_series(1, 50) g",
        "BEGIN; UPDATE kv SET n = -n WHERE id % 3 = 0; SELECT pg_logical_emit_message(true, 'sequin:mark', 'm');"
        " UPDATE kv SET id = id + 10000 WHERE id % 97 = 0; DELETE FROM kv WHERE id % 5 = 0; COMMIT",
        "UPDATE full_kv SET v = v || '!'",  # old values: the Python lines
        "ALTER TABLE kv ADD COLUMN extra text DEFAULT 'x'",  # a new Relation message mid-stream
        "INSERT INTO kv (id, v, n) SELECT g, 'later', g FROM generate_series(20001, 20300) g",
        "TRUNCATE full_kv",
        "DELETE FROM kv WHERE id > 20150",
    )
    with psycopg.connect(dsn) as conn:
        total = conn.execute(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',"
            " 'publication_names', 'pub', 'messages', 'true') WHERE get_byte(data, 0) IN (73, 85, 68, 77, 84)",
            (_slot(dsn),),
        ).fetchone()[0]  # type: ignore[index]
    limits = {"chunk_rows": 300, "chunk_bytes": 64 * 1024}
    reference = _chunks(dsn, start, total, False, **limits)
    compiled = _chunks(dsn, start, total, True, **limits)
    assert sum(len(c[0]) for c in reference) == total > 2500 + 50 + 300
    assert [c[1:] for c in compiled] == [c[1:] for c in reference]  # the same chunks, ending at the same positions
    assert compiled == reference
    # a compiled decoder without the loop's libpq (another psycopg implementation): one message at a time
    monkeypatch.setattr("sequin_provider.replication.libpq_copy_functions", lambda: None)
    assert _chunks(dsn, start, total, True, **limits) == reference
    monkeypatch.undo()
    # resumed inside the first (large) transaction: the rows handed out before are skipped, then the loop takes over
    resume = reference[2][1]
    assert resume[1] > 0  # a position inside a transaction
    rest = total - sum(len(c[0]) for c in reference[:3])
    assert _chunks(dsn, resume, rest, True, **limits) == _chunks(dsn, resume, rest, False, **limits)


class _PoisonRegistry(TypeRegistry):
    """Text values render through a Python converter that fails on ``poison``: a row whose
    rendering raises inside the compiled loop."""

    def converter(self, oid: int, _depth: int = 0) -> Any:
        if oid != 25:
            return super().converter(oid, _depth)

        def text(value: str) -> str:
            if value == "poison":
                raise ValueError("a poison value")
            return as_string(value)

        return text


def _stream(dsn: str, start: int) -> ReplicationStream:
    stream = ReplicationStream(dsn, REPLICATION_SESSION_OPTIONS)
    stream.start(_slot(dsn), int_to_lsn(start), {"proto_version": "1", "publication_names": "pub"})
    return stream


def _read_all(stream: ReplicationStream, decoder: PgOutputDecoder, compiled: bool, commits: int) -> list[object]:
    """What one transaction after another gives until ``commits`` commits: each row, and each
    message the rows' path did not take as the decoder's result (or its error's class)."""
    out: list[object] = []
    deadline = time.monotonic() + 30
    while sum(isinstance(o, Commit) for o in out) < commits:
        assert time.monotonic() < deadline
        if compiled:
            pending: list[Any] = []
            _, message = stream.read_rows(decoder.take_rows, pending, 3, 1 << 30)  # type: ignore[arg-type]
            out += pending
        else:
            message = stream.read()
            if message is not None:
                row = _or_error(decoder.change_row, message[1])
                if row is not None:
                    out.append(row)
                    continue
        if message is None:
            time.sleep(0.01)
            continue
        out.append(_or_error(decoder.decode, message[1]))
    return out


def _or_error(call: Any, payload: bytes) -> object:
    try:
        return call(payload)
    except Exception as exc:  # noqa: BLE001 - compared between the loop and its reference
        return type(exc)


def test_a_row_that_fails_to_render_goes_back_to_the_decoder_and_the_rows_around_it_are_taken(dsn: str) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text)")
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_publication(conn, "pub", [TableConfig("public", "kv")], True)
        start = create_slot(conn, _slot(dsn))
    execute(
        dsn,
        "INSERT INTO kv VALUES (1, 'a'), (2, 'poison'), (3, 'b'), (4, 'c'), (5, 'd'), (6, 'e'), (7, 'f')",
        "INSERT INTO kv VALUES (8, 'g')",
    )
    results = []
    for compiled in (True, False):
        stream = _stream(dsn, start)
        try:
            results.append(_read_all(stream, PgOutputDecoder(_PoisonRegistry(), compiled=True), compiled, 2))
        finally:
            stream.close()
    loop, reference = results
    assert loop == reference
    rows = [o for o in loop if isinstance(o, tuple)]
    assert [json_id(r) for r in rows] == [1, 3, 4, 5, 6, 7, 8]  # every other row, in order
    assert [o for o in loop if isinstance(o, type)] == [ValueError]  # the poison row: the decoder raises its error


def json_id(row: tuple) -> int:
    """The ``id`` of a change row's record (its eighth field, JSON text)."""
    return int(json.loads(row[7])["id"])


def test_the_loop_stops_at_its_row_and_byte_limits(dsn: str) -> None:
    execute(dsn, "CREATE TABLE kv (id int PRIMARY KEY, v text)")
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_publication(conn, "pub", [TableConfig("public", "kv")], True)
        start = create_slot(conn, _slot(dsn))
    execute(dsn, "INSERT INTO kv SELECT g, 'v' || g FROM generate_series(1, 10) g")
    stream = _stream(dsn, start)
    decoder = PgOutputDecoder(TypeRegistry(), compiled=True)
    try:
        deadline = time.monotonic() + 30
        begin = None
        while begin is None:  # the Begin comes first, through the Python lines
            assert time.monotonic() < deadline
            _, message = stream.read_rows(decoder.take_rows, [], 4, 1 << 30)  # type: ignore[arg-type]
            if message is not None:
                decoded = decoder.decode(message[1])
                begin = decoded if isinstance(decoded, Begin) else None
        # The loop takes what is buffered: it stops at four rows only if more had come. The
        # walsender writes a transaction's messages as it decodes its records; once it is past the
        # commit record, all ten are on this side of the loopback socket (a loaded CI machine
        # once handed the loop its first row alone).
        _wait_until_sent_past(dsn, begin.final_lsn)
        while True:  # the Relation comes before the rows, through the Python lines
            assert time.monotonic() < deadline
            pending: list[Any] = []
            _, message = stream.read_rows(decoder.take_rows, pending, 4, 1 << 30)  # type: ignore[arg-type]
            if message is not None:
                decoder.decode(message[1])
            if pending:
                break
        assert len(pending) == 4  # the row limit
        one: list[Any] = []
        while not one:  # the rest of the transaction may still be on its way
            added, message = stream.read_rows(decoder.take_rows, one, 100, 1)  # type: ignore[arg-type]
            assert message is None and time.monotonic() < deadline
        assert len(one) == 1 and added > 0  # the byte limit, checked before each row
        rest: list[Any] = []
        message = None
        while message is None:
            assert time.monotonic() < deadline
            _, message = stream.read_rows(decoder.take_rows, rest, 100, 1 << 30)  # type: ignore[arg-type]
        assert isinstance(decoder.decode(message[1]), Commit)
        assert [json_id(r) for r in pending + one + rest] == list(range(1, 11))
        assert [r[1] for r in pending + one + rest] == list(range(10))  # the transaction's change indexes
    finally:
        stream.close()


def _wait_until_sent_past(dsn: str, lsn: int) -> None:
    """Until the walsender of this test's slot has decoded, and so written out, the record at ``lsn``
    (``pg_stat_replication.sent_lsn`` is the end of the last record it processed)."""
    query = (
        "SELECT r.sent_lsn > %s::pg_lsn FROM pg_stat_replication r"
        " JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = %s"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:

        def sent() -> bool:
            return conn.execute(query, (int_to_lsn(lsn), _slot(dsn))).fetchone() == (True,)

        wait_for(sent, 30, 0.01, what="the walsender to send the whole transaction")
