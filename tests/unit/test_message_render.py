"""message_render without a server: messages and COPY binary stream rows rendered from Arrow change rows.

These pin the exact bytes, every message kind, the backfill read's key, and the compiled COPY binary
encoder against its Arrow reference; the escaping against PostgreSQL's own ``to_json`` and the
encoding against a real COPY are tests/integration/test_message_render.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from sequin_provider import pgoutput
from sequin_provider.change_arrow import rows_to_arrow
from sequin_provider.config import load_config
from sequin_provider.message_render import (
    copy_binary_rows,
    render,
)
from sequin_provider.messages import parse_message
from tests.support.rendering import HOSTILE, change, sinks


def test_a_change_renders_to_the_exact_message_bytes(tmp_path: Path) -> None:
    """The whole message, byte for byte: the record and changes texts verbatim (numeric digits,
    key order, whitespace), metadata in the documented order."""
    record = '{"id":1,"amount":10.50,"note":"a\\tb","big":123456789012345678901234567890}'
    batch = rows_to_arrow([change(4242, 3, record, ["1"], changes='{"amount":9.5}', toast=["body"])])
    rows = render(batch, sinks(tmp_path)["changes"])
    consumer = json.dumps(
        {"id": load_config(tmp_path / "sequin.yaml").sinks[0].consumer_id, "name": "changes"}, separators=(",", ":")
    )
    assert rows.data.to_pylist() == [
        '{"record":' + record + ',"changes":{"amount":9.5},"action":"update","metadata":{"table_schema":"public",'
        '"table_name":"t","commit_timestamp":"2026-11-22T08:00:00.123456Z","commit_lsn":4242,"commit_idx":3,'
        '"idempotency_key":"4242:3","record_pks":["1"],"database_name":"app","consumer":'
        + consumer
        + ',"unchanged_toast_columns":["body"]}}'
    ]
    assert rows.group_id.to_pylist() == ['public.t:["1"]']
    assert rows.idempotency_key.to_pylist() == ["4242:3"]
    assert (rows.commit_lsn.to_pylist(), rows.commit_idx.to_pylist()) == ([4242], [3])


def test_every_message_kind_parses_and_keeps_its_record_verbatim(tmp_path: Path) -> None:
    rendering = sinks(tmp_path)
    records = [json.dumps({"k": k, "n": n}, ensure_ascii=n % 2 == 0) for n, k in enumerate(HOSTILE)]
    batch = rows_to_arrow(
        [
            change(
                1000 + n,
                n,
                r,
                [k, str(n)],
                action=("insert", "update", "delete")[n % 3],
                changes='{"n":0}' if n % 3 == 1 else None,
                table=("public", "t") if n % 2 else ("other", "t2"),
            )
            for n, (k, r) in enumerate(zip(HOSTILE, records))
        ]
    )
    full = [parse_message(d) for d in render(batch, rendering["changes"]).data.to_pylist()]
    assert [m["record"] for m in full] == [json.loads(r) for r in records]
    assert [m["action"] for m in full] == [("insert", "update", "delete")[n % 3] for n in range(len(HOSTILE))]
    assert [m["changes"] for m in full] == [{"n": 0} if n % 3 == 1 else None for n in range(len(HOSTILE))]
    assert [m["metadata"]["record_pks"] for m in full] == [[k, str(n)] for n, k in enumerate(HOSTILE)]
    assert [m["metadata"]["table_name"] for m in full] == ["t" if n % 2 else "t2" for n in range(len(HOSTILE))]
    assert all(r in d for r, d in zip(records, render(batch, rendering["changes"]).data.to_pylist()))
    # a sink whose tables do not name the change renders nothing for it (the JVM never selects it)
    row_messages = render(batch, rendering["rows"]).data.to_pylist()
    assert [d is None for d in row_messages] == [n % 2 == 0 for n in range(len(HOSTILE))]
    assert [sorted(parse_message(d)) for d in row_messages if d] == [["metadata", "record"]] * (len(HOSTILE) // 2)
    assert render(batch, rendering["bare"]).data.to_pylist() == records
    loose = render(batch, rendering["loose"])
    assert loose.group_id.to_pylist() == [f"{1000 + n}:{n}" for n in range(len(HOSTILE))]


def test_a_backfill_read_is_keyed_by_backfill_and_primary_key(tmp_path: Path) -> None:
    batch = rows_to_arrow(
        [
            change(50, 0, '{"k":"a"}', ['a"b', "1"], action="read", backfill=9),
            change(50, 1, '{"k":"c"}', ["c", "2"], action="update"),
        ]
    )
    rows = render(batch, sinks(tmp_path)["changes"])
    assert rows.idempotency_key.to_pylist() == ['backfill:9:["a\\"b","1"]', "50:1"]
    assert [parse_message(d)["metadata"]["idempotency_key"] for d in rows.data.to_pylist()] == [
        'backfill:9:["a\\"b","1"]',
        "50:1",
    ]
    assert parse_message(rows.data[0].as_py())["changes"] is None


def test_the_compiled_copy_encoder_writes_the_references_bytes() -> None:
    """``copy_binary_rows`` in one compiled pass equals its Arrow reference byte for byte: hostile
    and empty strings, multi-byte text, extreme integers, Arrow slices (offsets not from 0), and a
    column whose strings are all empty (no data buffer)."""
    assert pgoutput.COMPILED
    n = len(HOSTILE)
    text = pa.array([f"{k}|{j}" * (j % 3) for j, k in enumerate(HOSTILE)], pa.string())
    columns = [
        b"\x00\x04",
        pa.array([2**63 - 1, -(2**63), 0] + list(range(n - 3)), pa.int64()),
        pa.array([2**31 - 1, -(2**31)] + list(range(n - 2)), pa.int32()),
        pa.array(HOSTILE, pa.string()),
        b"\x00\x00\x00\x01x",
        text,
        pa.array([""] * n, pa.string()),
    ]
    for lo, hi in [(0, n), (2, 7), (n - 1, n), (3, 3)]:
        fields = [c if isinstance(c, bytes) else c.slice(lo, hi - lo) for c in columns]
        compiled = copy_binary_rows(fields, compiled=True).to_pybytes()
        assert compiled == copy_binary_rows(fields, compiled=False).to_pybytes()
        assert len(compiled) == (hi - lo) * (2 + 12 + 8 + 5 + 4) + sum(
            4 + len(v.encode()) for c in (HOSTILE, text.to_pylist()) for v in c[lo:hi]
        )
    large = [b"\x00\x01", pa.array(HOSTILE, pa.large_string())]  # 64-bit offsets: cast, not misread
    assert copy_binary_rows(large, compiled=True) == copy_binary_rows([large[0], pa.array(HOSTILE)], compiled=False)
    for compiled in (True, False):  # nulls, ragged columns or other types are the caller's bug, refused alike
        with pytest.raises(TypeError, match="int16"):
            copy_binary_rows([pa.array([1], pa.int16())], compiled=compiled)
        with pytest.raises(ValueError, match="no nulls"):
            copy_binary_rows([pa.array(["a", None])], compiled=compiled)
        with pytest.raises(ValueError, match="one length"):
            copy_binary_rows([pa.array(["a"]), pa.array([1, 2], pa.int64())], compiled=compiled)


def test_the_compiled_copy_encoder_refuses_buffers_that_do_not_hold_their_rows() -> None:
    """Called with buffers that disagree with the row count (a bug in the caller), the compiled
    encoder raises instead of reading past them."""
    from sequin_provider import _pgoutput_c

    offsets = pa.array([0, 1, 3], pa.int32()).buffers()[1]
    ok = _pgoutput_c.copy_binary_rows(2, [(3, offsets, b"abc", 0)])
    assert ok == b"\x00\x00\x00\x01a\x00\x00\x00\x02bc"
    bad = [
        (3, [(3, offsets, b"abc", 0)]),  # one row more than the offsets hold
        (2, [(3, offsets, b"ab", 0)]),  # offsets past the data
        (2, [(3, pa.array([0, 2, 1], pa.int32()).buffers()[1], b"abc", 0)]),  # offsets that shrink
        (2, [(3, pa.array([-1, 0, 1], pa.int32()).buffers()[1], b"abc", 0)]),  # a negative offset
        (2, [(1, b"\x00" * 15, 0)]),  # 2 int64 need 16 bytes
        (2, [(2, b"\x00" * 8, 1)]),  # 2 int32 from offset 1 need 12 bytes
        (2, [(2, b"\x00" * 8, -1)]),
        (2, [(9, b"x")]),
        (2, [(0, b"x", 0)]),
        (-1, [(0, b"x")]),
    ]
    for n, specs in bad:
        with pytest.raises(ValueError):
            _pgoutput_c.copy_binary_rows(n, specs)
    for specs in ([("x", b"y")], [(0,)], ["not a tuple"], [(0, 5)]):
        with pytest.raises((TypeError, ValueError)):
            _pgoutput_c.copy_binary_rows(1, specs)
