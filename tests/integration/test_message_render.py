"""message_render: messages and COPY binary stream rows rendered from Arrow change rows.

The end-to-end tests (test_stream_app, test_backfill_app) hold the rendering to the guarantees
through the real pipeline; these pin the escaping against PostgreSQL's own ``to_json`` and the
COPY binary encoding against a real COPY (the server-free ones: tests/unit/test_message_render.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from sequin_provider import store
from sequin_provider.change_arrow import rows_to_arrow
from sequin_provider.message_render import (
    COPY_BINARY_HEADER,
    COPY_BINARY_TRAILER,
    RenderedRows,
    copy_binary_tuple,
    json_string_arrays,
    render,
    stream_rows_copy_binary,
)
from sequin_provider.messages import message_template
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


def test_changes_stored_compact_are_served_byte_for_byte_as_rendered_whole(tmp_path: Path, dsn: str) -> None:
    """A change stored compact (its own part and commit timestamp; its sink and table's template in
    ``message_templates``) is served exactly as ``render`` renders it whole: read back
    (``store.stream_messages``) and received (``stream_queue.receive``), for change and row
    messages, two tables, every action and keys that need escaping; and it is stored shorter."""
    from sequin_provider import stream_queue

    rows = [
        change(
            100 + n,
            n,
            json.dumps({"k": k, "n": n}, ensure_ascii=False),
            [k, str(n)],
            action=("insert", "update", "delete")[n % 3],
            changes=json.dumps({"n": n - 1}) if n % 3 == 1 else None,
            table=("public", "t") if n % 2 else ("other", "t2"),
        )
        for n, k in enumerate(HOSTILE)
    ]
    batch = rows_to_arrow(rows)
    renderings = sinks(tmp_path)
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        for name in ("changes", "rows"):
            sink = renderings[name]
            picked = batch if name == "changes" else batch.filter(pa.array([n % 2 == 1 for n in range(len(rows))]))
            whole, compact = render(picked, sink), render(picked, sink, compact=True)
            assert whole.compact is None and compact.compact is not None
            templates = [t for t in compact.compact.templates if t is not None]
            ids = store.message_template_ids(conn, "sequin", templates)
            assert store.message_template_ids(conn, "sequin", templates) == ids
            stored_as = f"{name}_compact"

            def copy(rows: Any) -> int:
                body = stream_rows_copy_binary(stored_as, rows, ids)
                chunks = [COPY_BINARY_HEADER, memoryview(body), COPY_BINARY_TRAILER]
                return store.insert_stream_copy(conn, "sequin", chunks, binary=True)

            # the first two, then all of them, as a replayed batch comes: the rest go through the
            # replay's path (a temporary table, ON CONFLICT DO NOTHING), which must keep their parts
            assert copy(render(picked.slice(0, 2), sink, compact=True)) == 2
            assert copy(compact) == len(picked) - 2
            store.advance_visible_lsn(conn, "sequin", [stored_as], 10_000)
            expected = whole.data.to_pylist()
            assert [m.data for m in store.stream_messages(conn, "sequin", stored_as)] == expected
            served = stream_queue.receive(conn, "sequin", stored_as, 100, 30.0, 1000)
            assert [d.data for d in served] == expected
            raw = conn.execute(
                "SELECT data, commit_timestamp FROM sequin.stream_messages WHERE sink = %s ORDER BY commit_lsn",
                (stored_as,),
            ).fetchall()
            assert [r[0] for r in raw] == compact.data.to_pylist()
            assert [r[1] for r in raw] == compact.compact.commit_timestamp.to_pylist()
            assert all(len(data) + len(ts) < len(e) / 2 for (data, ts), e in zip(raw, expected))
        templates = conn.execute("SELECT count(*) FROM sequin.message_templates").fetchone()[0]
    assert templates == 3  # the change sink's two tables, the row sink's one


def test_changes_are_rendered_whole_where_the_store_could_not_rebuild_them(tmp_path: Path) -> None:
    """``render``'s ``compact`` keeps a batch whole when its messages carry what a template does
    not: unchanged TOAST columns, backfill reads, truncates, a replay, custom or no grouping, the
    record alone, or a table whose name is not ASCII."""
    renderings = sinks(tmp_path)
    plain = [change(10, 0, '{"k":1}', ["1"]), change(10, 1, '{"k":2}', ["2"])]
    cases = {
        "toast": ([change(10, 0, '{"k":1}', ["1"], toast=["big"])], renderings["changes"], {}),
        "read": ([change(10, 0, '{"k":1}', ["1"], action="read", backfill=3)], renderings["changes"], {}),
        "truncate": ([change(10, 0, "null", [], action="truncate")], renderings["changes"], {}),
        "replay": (plain, renderings["changes"], {"replay_id": 4}),
        "custom group": (plain, renderings["changes"], {"group": pa.array(["a", "b"])}),
        "ungrouped": (plain, renderings["loose"], {}),
        "record only": (plain, renderings["bare"], {}),
        "non-ASCII table": (plain, replace(renderings["changes"], templates=(None, None)), {}),
    }
    for case, (changes, sink, options) in cases.items():
        batch = rows_to_arrow(changes)
        whole, compact = render(batch, sink, **options), render(batch, sink, compact=True, **options)
        assert compact.compact is None, case
        assert compact.data.to_pylist() == whole.data.to_pylist(), case
    assert render(rows_to_arrow(plain), renderings["changes"], compact=True).compact is not None
    assert message_template("schéma", "t", renderings["changes"].tail) is None
