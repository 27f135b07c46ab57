"""TRUNCATE delivered as a message that is a barrier for its table (DESIGN §5, docs/stream-behaviour.md).

End to end: real Postgres, the Spark stream app, four consumers of the HTTP pull API and a real
webhook endpoint; each sink's messages replayed in delivery order must give the table as it ends,
and the truncate must never overtake an earlier message of its table nor be overtaken by a later one.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from devtools.stream_process import wait_for
from sequin_provider import buffer, store, stream_queue
from sequin_provider.backfill.watermarks import HIGH_PREFIX, LOW_PREFIX, Watermark, WindowTracker, watermark_content
from sequin_provider.buffer import DeliveryError
from sequin_provider.config import ConfigError, load_config
from sequin_provider.delivery import Outgoing, push_in_group_order
from sequin_provider.spark.pipeline import payload_mode
from sequin_provider.store import ParkRow
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.receiver import Receiver
from tests.support.stream_api import ApiServer
from tests.support.stream_app import cli

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: pull
    tables: [kv]
    destination: {{type: sequin_stream}}
  - name: skipped
    tables: [kv]
    truncate: skip
    destination: {{type: sequin_stream}}
  - name: hooks
    tables: [kv]
    truncate: deliver{hooks_filter}
    destination: {{type: webhook, url: "{url}", batch: true, batch_size: 4, timeout: 5s}}
stream:
  checkpoint_location: {ckpt}
"""

FULL_PAYLOAD_FILTER = "\n    filter: \"record['k'] IS NOT NULL OR action = 'truncate'\""
"""Spark SQL in a sink makes the batches ``payload=full``: the push sink is then sent by its own
job, repartitioned by group (without it, the stream tasks send their shares of the spool file)."""

REFUSED = (7, 1)
"""The webhook refuses (k, v) while ``refusing`` is set: k=7's first update, before the first TRUNCATE."""


def workload(dsn: str) -> tuple[int, dict[int, int]]:
    """Inserts and updates of 50 keys, a TRUNCATE inside a transaction, more keys, a delete, another
    TRUNCATE, a few keys again; returns (changes committed, the table at the end)."""
    count = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(1, 51, 10):
            with conn.transaction():
                for k in range(start, start + 10):
                    conn.execute("INSERT INTO kv VALUES (%s, 0)", (k,))
                    count += 1
        with conn.transaction():
            for k in range(1, 51):
                conn.execute("UPDATE kv SET v = 1 WHERE k = %s", (k,))
                count += 1
        with conn.transaction():  # the truncate in the middle of a transaction
            for k in range(1, 11):
                conn.execute("UPDATE kv SET v = 2 WHERE k = %s", (k,))
            conn.execute("TRUNCATE kv")
            for k in range(1, 4):
                conn.execute("INSERT INTO kv VALUES (%s, 3)", (k,))
            count += 10 + 1 + 3
        for k in range(4, 21):
            conn.execute("INSERT INTO kv VALUES (%s, 3)", (k,))
            count += 1
        with conn.transaction():
            for k in range(1, 11):
                conn.execute("UPDATE kv SET v = 4 WHERE k = %s", (k,))
                count += 1
        conn.execute("DELETE FROM kv WHERE k = 5")
        conn.execute("TRUNCATE kv")
        count += 2
        for k in range(1, 6):
            conn.execute("INSERT INTO kv VALUES (%s, 5)", (k,))
            count += 1
        conn.execute("UPDATE kv SET v = 6 WHERE k = 2")
        count += 1
        table = dict(conn.execute("SELECT k, v FROM kv").fetchall())
    return count, table


def replay(messages: list[dict[str, Any]]) -> dict[int, int]:
    """A mirror of ``kv`` fed ``messages`` in order: inserts and updates upsert, deletes remove,
    a truncate empties it."""
    mirror: dict[int, int] = {}
    for m in messages:
        action = m["action"]
        if action == "truncate":
            assert m["record"] == {} and m["changes"] is None and m["metadata"]["record_pks"] == []
            mirror.clear()
        elif action == "delete":
            mirror.pop(m["record"]["k"], None)
        else:
            mirror[m["record"]["k"]] = m["record"]["v"]
    return mirror


def position(m: dict[str, Any]) -> tuple[int, int]:
    return m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]


def assert_truncate_metadata(messages: list[dict[str, Any]], sink: str, dbname: str) -> None:
    """Two truncates, with the usual metadata, at their place in their transactions."""
    truncates = [m for m in messages if m["action"] == "truncate"]
    assert len(truncates) == 2
    for t in truncates:
        meta = t["metadata"]
        assert (meta["table_schema"], meta["table_name"], meta["database_name"]) == ("public", "kv", "app")
        assert meta["idempotency_key"] == f"{meta['commit_lsn']}:{meta['commit_idx']}"
        assert meta["consumer"]["name"] == sink and meta["commit_timestamp"].endswith("Z")
    # the first truncate follows the 10 updates of its transaction and precedes its 3 inserts
    first = truncates[0]["metadata"]
    same = sorted(position(m)[1] for m in messages if position(m)[0] == first["commit_lsn"])
    assert same == list(range(14)) and first["commit_idx"] == 10
    assert truncates[1]["metadata"]["commit_idx"] == 0


def check_barrier(events: list[tuple[int, str, tuple[int, int], str]]) -> None:
    """``events``: (sequence, "recv" | "ack", position, action). Every message of ``kv`` before a
    truncate had its ack sent before the truncate was received; every later one was received only
    after the truncate's ack was sent."""
    received = {p: seq for seq, kind, p, _ in events if kind == "recv"}
    ack_sent = {p: seq for seq, kind, p, _ in events if kind == "ack"}
    truncates = sorted(p for _, kind, p, action in events if kind == "recv" and action == "truncate")
    assert truncates
    for t in truncates:
        for p, seq in received.items():
            if p < t:
                assert ack_sent[p] < received[t], f"truncate {t} received while {p} was unacked"
            elif p > t:
                assert ack_sent[t] < seq, f"{p} received before truncate {t} was acked"


@pytest.mark.parametrize("payload", ["spool", "full"])
def test_truncate_reaches_pull_consumers_and_a_webhook_as_a_barrier_and_skip_sends_none(
    payload: str, dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    receiver = Receiver().start()
    refusing = threading.Event()
    refusing.set()
    receiver.policy = lambda ms: (
        500 if refusing.is_set() and any((m["record"].get("k"), m["record"].get("v")) == REFUSED for m in ms) else 200,
        0.0,
    )
    config_path = write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(
            dsn=dsn,
            db=dbname,
            url=receiver.url,
            ckpt=tmp_path / "ckpt",
            hooks_filter=FULL_PAYLOAD_FILTER if payload == "full" else "",
        ),
    )
    assert payload_mode(load_config(config_path).sinks) == payload
    app = stream_app(config_path)
    app.wait_streaming(dsn)
    with psycopg.connect(dsn) as conn:
        token = stream_queue.create_token(conn, "sequin", "consumers")
        conn.commit()
    try:
        total, table = workload(dsn)
        assert table == {1: 5, 2: 6, 3: 5, 4: 5, 5: 5}

        # four pull consumers receive and ack; every receive and every ack is sequenced
        lock = threading.Lock()
        events: list[tuple[int, str, tuple[int, int], str]] = []
        delivered: list[dict[str, Any]] = []
        acked: set[str] = set()
        errors: list[str] = []
        done = threading.Event()
        with ApiServer(load_config(config_path)) as server:

            def consumer(n: int) -> None:
                with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as c:
                    while not done.is_set():
                        r = c.post("/api/sequin_streams/pull/receive", json={"batch_size": 5, "wait_for": 500})
                        if r.status_code != 200:
                            errors.append(r.text)
                            return
                        got = r.json()["data"]
                        with lock:
                            for m in got:
                                events.append((len(events), "recv", position(m["data"]), m["data"]["action"]))
                                delivered.append(m["data"])
                        if not got:
                            continue
                        time.sleep(0.005 * n)  # consumers of different speeds
                        with lock:
                            for m in got:
                                events.append((len(events), "ack", position(m["data"]), m["data"]["action"]))
                        a = c.post("/api/sequin_streams/pull/ack", json={"ack_ids": [m["ack_id"] for m in got]})
                        if a.status_code != 200:
                            errors.append(a.text)
                            return
                        with lock:
                            acked.update(m["data"]["metadata"]["idempotency_key"] for m in got)

            threads = [threading.Thread(target=consumer, args=(n,)) for n in range(4)]
            for t in threads:
                t.start()
            try:
                wait_for(lambda: len(acked) >= total or errors, 240, what=f"{total} pull messages acked")
            finally:
                time.sleep(1.0)  # anything more would arrive now
                done.set()
                for t in threads:
                    t.join(timeout=60)
        assert errors == []
        assert len(delivered) == total == len(acked)  # each once: no visibility timeout expired
        assert replay(delivered) == table
        assert_truncate_metadata(sorted(delivered, key=position), "pull", dbname)
        check_barrier(events)

        # the webhook: k=7's refused update parks the first truncate and every later message of kv
        # behind it; retried once the endpoint takes it, in position order through the barrier
        def parked() -> list[Any] | None:
            with psycopg.connect(dsn) as conn:
                found = store.list_buffered(conn, "sequin", "hooks", "parked")
            return found if found and max(position_of(m) for m in found) == last_position(dsn) else None

        held = wait_for(parked, 120, what="the webhook's messages after k=7's refusal parked")
        barrier = next(m for m in held if json.loads(m.data)["action"] == "truncate")
        refused = [m for m in held if m.attempts == 1]
        assert refused and all(position_of(m) < position_of(barrier) for m in refused)
        assert any(json.loads(m.data)["record"] == {"k": 7, "v": 1} for m in refused)
        before = receiver.messages()
        assert all(position(m) < position_of(barrier) for m in before)  # nothing of kv after the parked barrier
        refusing.clear()
        wait_for(
            lambda: (lambda r: r if "still parked 0" in r.stdout else time.sleep(0.5))(
                cli(config_path, "buffer", "retry", "--sink", "hooks")
            ),
            120,
            what="retry draining the buffer",
        )
        hooked = receiver.messages()
        assert len(hooked) == total and len({m["metadata"]["idempotency_key"] for m in hooked}) == total
        assert replay(hooked) == table
        assert_truncate_metadata(sorted(hooked, key=position), "hooks", dbname)
        for t in (position(m) for m in hooked if m["action"] == "truncate"):
            at = next(i for i, m in enumerate(hooked) if position(m) == t)
            assert all(position(m) < t for m in hooked[:at]), "a later message delivered before its truncate"
            assert all(position(m) > t for m in hooked[at + 1 :]), "an earlier message delivered after its truncate"

        # truncate: skip delivers every change and no truncate
        skipped = wait_for(
            lambda: (lambda ms: ms if len(ms) >= total - 2 else None)(sink_messages(dsn, "skipped")),
            60,
            what="the skip sink's messages",
        )
        assert len(skipped) == total - 2 and not [m for m in skipped if m["action"] == "truncate"]
    finally:
        receiver.stop()


def position_of(m: store.Parked) -> tuple[int, int]:
    return m.commit_lsn, m.commit_idx


def last_position(dsn: str) -> tuple[int, int] | None:
    """The position of the last change of the workload (the webhook parks up to it)."""
    with psycopg.connect(dsn) as conn:
        rows = store.stream_messages(conn, "sequin", "skipped")
    return (rows[-1].commit_lsn, rows[-1].commit_idx) if rows else None


# ---------------------------------------------------------------------------------------------
# The parts, on their own


def test_truncate_setting_is_validated(tmp_path: Path) -> None:
    body = CONFIG.format(
        dsn="postgresql://localhost/x", db="x", url="http://127.0.0.1:1/h", ckpt=tmp_path, hooks_filter=""
    ).replace("truncate: skip", "truncate: drop")
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path / "sequin.yaml", body))
    assert "sinks[1].truncate" in str(err.value) and "expected deliver or skip, got 'drop'" in str(err.value)
    ok = load_config(
        write_config(
            tmp_path / "ok.yaml",
            CONFIG.format(
                dsn="postgresql://localhost/x", db="x", url="http://127.0.0.1:1/h", ckpt=tmp_path, hooks_filter=""
            ),
        )
    )
    assert [s.truncate for s in ok.sinks] == ["deliver", "skip", "deliver"]


def _put(dsn: str, rows: list[tuple[int, int, str, str | None]]) -> None:
    """Stream rows (lsn, idx, group, barrier) of sink ``s``, made visible."""
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        store.insert_stream_messages(
            conn,
            "sequin",
            [
                ("s", lsn, idx, group, f"{lsn}:{idx}", json.dumps({"lsn": lsn, "idx": idx}), barrier)
                for lsn, idx, group, barrier in rows
            ],
        )
        store.advance_visible_lsn(conn, "sequin", ["s"], max(r[0] for r in rows))


def _receive(dsn: str, n: int = 100) -> list[tuple[int, int, str]]:
    with psycopg.connect(dsn) as conn:
        got = stream_queue.receive(conn, "sequin", "s", n, 60.0, 10_000)
    return [(*json.loads(d.data).values(), d.ack_id) for d in got]  # type: ignore[misc]


def _ack(dsn: str, got: list[tuple[int, int, str]]) -> None:
    with psycopg.connect(dsn) as conn:
        assert stream_queue.ack(conn, "sequin", "s", [a for _, _, a in got]) == len(got)


def test_receive_holds_a_truncate_behind_earlier_messages_of_its_table_and_later_ones_behind_it(dsn: str) -> None:
    t = "public.t:"
    _put(
        dsn,
        [
            (10, 0, 'public.t:["1"]', None),
            (10, 1, 'public.u:["1"]', None),
            (11, 0, 'public.t:["2"]', None),
            (12, 0, "public.t:[]", t),
            (12, 1, 'public.t:["3"]', None),
            (12, 2, 'public.u:["2"]', None),
            (13, 0, 'public.t:["1"]', None),
        ],
    )
    first = _receive(dsn)
    # t's earlier messages and u's (not behind the barrier); neither the truncate nor t's later ones
    assert [(lsn, idx) for lsn, idx, _ in first] == [(10, 0), (10, 1), (11, 0), (12, 2)]
    _ack(dsn, [g for g in first if (g[0], g[1]) != (11, 0)])
    assert _receive(dsn) == []  # (11, 0) of t is still in flight: the truncate waits
    _ack(dsn, [g for g in first if (g[0], g[1]) == (11, 0)])
    truncate = _receive(dsn)
    assert [(lsn, idx) for lsn, idx, _ in truncate] == [(12, 0)]  # alone: the later ones wait for its ack
    assert _receive(dsn) == []
    _ack(dsn, truncate)
    assert [(lsn, idx) for lsn, idx, _ in _receive(dsn)] == [(12, 1), (13, 0)]


def test_receive_of_an_ungrouped_sink_holds_every_message_behind_a_truncate(dsn: str) -> None:
    _put(dsn, [(10, 0, "10:0", None), (11, 0, "11:0", ""), (12, 0, "12:0", None)])
    first = _receive(dsn)
    assert [(lsn, idx) for lsn, idx, _ in first] == [(10, 0)]
    _ack(dsn, first)
    truncate = _receive(dsn)
    assert [(lsn, idx) for lsn, idx, _ in truncate] == [(11, 0)]
    _ack(dsn, truncate)
    assert [(lsn, idx) for lsn, idx, _ in _receive(dsn)] == [(12, 0)]


def _outgoing(rows: list[tuple[int, str, str | None]]) -> Outgoing:
    """Messages (lsn, group, barrier) at index 0, data = "lsn"."""
    out = Outgoing(
        [r[0] for r in rows],
        [0] * len(rows),
        [r[1] for r in rows],
        [f"{r[0]}:0" for r in rows],
        [str(r[0]) for r in rows],
    )
    out.barriers.update({i: r[2] for i, r in enumerate(rows) if r[2] is not None})
    return out


def test_push_sends_a_truncate_after_every_earlier_message_of_its_table_and_before_later_ones() -> None:
    rows = [
        (1, 't:["1"]', None),
        (2, 't:["2"]', None),
        (3, 'u:["1"]', None),
        (4, "t:[]", "t:"),
        (5, 't:["1"]', None),
        (6, 'u:["1"]', None),
        (7, 't:["3"]', None),
    ]
    sent: list[str] = []
    lock = threading.Lock()

    def send(batch: list[str], keys: list[str]) -> None:
        time.sleep(0.01 * (len(batch) % 3))
        with lock:
            sent.extend(batch)

    result = push_in_group_order("h", _outgoing(rows), send, 1, 4, set())
    assert result.parked == [] and result.delivered == 7
    at = sent.index("4")
    assert set(sent[:at]) >= {"1", "2"} and set(sent[at + 1 :]) >= {"5", "7"}


def test_push_parks_a_truncate_and_its_tables_later_messages_behind_an_earlier_failure() -> None:
    rows = [
        (1, 't:["1"]', None),
        (2, 't:["2"]', None),
        (3, "t:[]", "t:"),
        (4, 't:["2"]', None),
        (5, 'u:["1"]', None),
        (6, "t:[]", "t:"),
        (7, 't:["3"]', None),
    ]
    sent: list[str] = []

    def send(batch: list[str], keys: list[str]) -> None:
        if "1" in batch:
            raise DeliveryError("HTTP 500")
        sent.extend(batch)

    result = push_in_group_order("h", _outgoing(rows), send, 1, 4, set())
    assert sorted(sent) == ["2", "5"]
    assert [(r.commit_lsn, r.attempts, r.barrier) for r in result.parked] == [
        (1, 1, None),
        (3, 0, "t:"),
        (4, 0, None),
        (6, 0, "t:"),
        (7, 0, None),
    ]
    # a batch after it: t's messages wait behind the parked truncate, u's flow
    later = push_in_group_order(
        "h", _outgoing([(8, 't:["9"]', None), (9, 'u:["2"]', None)]), send, 1, 4, set(), barred={"t:"}
    )
    assert sent[-1:] == ["9"] and [r.commit_lsn for r in later.parked] == [8]


def test_retry_redelivers_parked_messages_in_position_order_through_a_barrier(dsn: str, tmp_path: Path) -> None:
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            CONFIG.format(dsn=dsn, db="x", url="http://127.0.0.1:1/h", ckpt=tmp_path, hooks_filter=""),
        )
    )
    rows = [
        (1, 't:["1"]', None),
        (2, 't:["2"]', None),
        (3, "t:[]", "t:"),
        (4, 't:["2"]', None),
        (5, 't:["3"]', None),
        (6, "t:[]", "t:"),
        (7, 't:["1"]', None),
    ]
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        store.park_messages(
            conn,
            "sequin",
            [
                ParkRow("hooks", lsn, 0, group, f"{lsn}:0", str(lsn), None, 0, "held", 0.0, barrier)
                for lsn, group, barrier in rows
            ],
        )
    delivered: list[int] = []
    lock = threading.Lock()

    def deliver(message: store.Parked, data: str) -> None:
        time.sleep(0.02 if message.commit_lsn in (1, 2) else 0.0)  # the earliest ones are slow
        with lock:
            delivered.append(int(data))

    sink = next(s for s in config.sinks if s.name == "hooks")
    report = buffer.retry_sink(config, sink, deliver)
    assert report.still_parked == 0 and report.delivered == 7
    for barrier in (3, 6):
        at = delivered.index(barrier)
        assert all(p < barrier for p in delivered[:at]) and all(p > barrier for p in delivered[at + 1 :]), delivered


def _row(lsn: int, action: str, table: str = "kv", key: str = "1", content: str = "") -> tuple:
    return (
        lsn,
        0,
        "2024-01-01T00:00:00Z",
        1,
        "public",
        table,
        action,
        content or "{}",
        None,
        [] if action in ("truncate", "message") else [key],
        [],
        None,
        None,
    )


def test_a_truncate_inside_a_backfill_window_makes_its_page_be_read_again() -> None:
    mark = Watermark(1, 7, 0, "public", "kv", ("k",))
    other = Watermark(2, 8, 0, "public", "other", ("k",))
    tracker = WindowTracker()
    rows = [
        (1, 0, "", 1, "", LOW_PREFIX, "message", watermark_content(mark), None, [], [], None, None),
        (1, 1, "", 1, "", LOW_PREFIX, "message", watermark_content(other), None, [], [], None, None),
        _row(2, "update", key="3"),
        _row(3, "truncate"),
        _row(4, "insert", key="4"),
        (5, 0, "", 1, "", HIGH_PREFIX, "message", watermark_content(mark), None, [], [], None, None),
        (5, 1, "", 1, "", HIGH_PREFIX, "message", watermark_content(other), None, [], [], None, None),
    ]
    closed = tracker.scan(rows)
    # kv's window saw a truncate: every row it read may be gone, so the page is not trusted (read again);
    # the other table's window is untouched
    assert [(c.mark.page_id, c.seen) for c in closed] == [(7, False), (8, True)]
