"""message_render: messages and COPY binary stream rows rendered from Arrow change rows.

The end-to-end tests (test_stream_app, test_backfill_app) hold the rendering to the guarantees
through the real pipeline; these pin the escaping against PostgreSQL's own ``to_json`` and the
COPY binary encoding against a real COPY (the server-free ones: tests/unit/test_message_render.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pyarrow as pa

from sequin_provider import store
from sequin_provider.message_render import (
    COPY_BINARY_HEADER,
    COPY_BINARY_TRAILER,
    RenderedRows,
    copy_binary_tuple,
    json_string_arrays,
    render,
    stream_rows_copy_binary,
)
from sequin_provider.messages import rows_to_arrow
from tests.support.rendering import HOSTILE, change, sinks


def test_keys_are_escaped_as_postgresql_escapes_them(tmp_path: Path, dsn: str) -> None:
    """Group ids and ``record_pks`` must equal what the store renders for a backfill read of the
    same key (``to_json(text[])``), so a read and a change of one row share their group."""
    keys = [[k, str(n)] for n, k in enumerate(HOSTILE)] + [[]]
    batch = rows_to_arrow([change(10 + n, 0, "{}", k) for n, k in enumerate(keys)])
    with psycopg.connect(dsn) as conn:
        expected = [conn.execute("SELECT to_json(%s::text[])::text", (k,)).fetchone()[0] for k in keys]
    assert json_string_arrays(batch.column("record_pks")).to_pylist() == expected
    assert render(batch, sinks(tmp_path)["changes"]).group_id.to_pylist() == [f"public.t:{e}" for e in expected]
    sliced = batch.slice(3, 4)  # an Arrow slice: offsets that do not start at 0
    assert json_string_arrays(sliced.column("record_pks")).to_pylist() == expected[3:7]
    nulls = pa.array([["a"], None, []], pa.list_(pa.string()))
    assert json_string_arrays(nulls).to_pylist() == ['["a"]', None, "[]"]


def test_copy_binary_rows_load_exactly_and_incomplete_rows_are_left_out(tmp_path: Path, dsn: str) -> None:
    """The encoding against PostgreSQL's COPY binary: every field back as written, including
    empty strings, multi-byte text and the largest positions; rows with no message are not written."""
    data = pa.array([json.dumps({"k": k}, ensure_ascii=False) for k in HOSTILE[:-1]] + [None], pa.string())
    n = len(data)
    rows = RenderedRows(
        pa.array([2**63 - 1 - j for j in range(n)], pa.int64()),
        pa.array([2**31 - 1 - j for j in range(n)], pa.int32()),
        pa.array(HOSTILE[:-1] + ["g"], pa.string()),
        pa.array([""] + HOSTILE[1:], pa.string()),
        data,
    )
    payload = stream_rows_copy_binary("sïnk", rows)
    extra = copy_binary_tuple(("sïnk", -1, 0, "", "k", "{}"))  # the per-row form (transform sinks)
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        written = store.insert_stream_copy(
            conn, "sequin", [COPY_BINARY_HEADER, memoryview(payload), extra, COPY_BINARY_TRAILER], binary=True
        )
        back = conn.execute(
            "SELECT sink, commit_lsn, commit_idx, group_id, idempotency_key, data::text"
            " FROM sequin.stream_messages ORDER BY commit_lsn DESC"
        ).fetchall()
        # a replay of the same stream hits the positions and adds nothing
        again = store.insert_stream_copy(
            conn, "sequin", [COPY_BINARY_HEADER, memoryview(payload), extra, COPY_BINARY_TRAILER], binary=True
        )
    expected = [
        ("sïnk", 2**63 - 1 - j, 2**31 - 1 - j, HOSTILE[j], ([""] + HOSTILE[1:])[j], data[j].as_py())
        for j in range(n - 1)
    ]
    assert written == n and again == 0
    assert back == expected + [("sïnk", -1, 0, "", "k", "{}")]
    assert (
        stream_rows_copy_binary(
            "s",
            RenderedRows(
                *(a[:0] for a in (rows.commit_lsn, rows.commit_idx, rows.group_id, rows.idempotency_key, rows.data))
            ),
        ).size
        == 0
    )
