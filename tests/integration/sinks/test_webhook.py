"""Webhook sink and the persistent buffer: the stream app POSTs to real HTTP servers on loopback.

The receiving servers are plain ``http.server`` endpoints whose behaviour the tests switch
(reject a row, answer 500 at random, stall past the timeout, go down).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.buffer import DeliveryError, backoff_seconds
from sequin_provider.config import load_config
from sequin_provider.delivery import Outgoing, push_in_group_order
from sequin_provider.replication import confirmed_flush_lsn
from sequin_provider.spark.pipeline import payload_mode
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.receiver import Receiver
from tests.support.stream_app import cli, spark_jvm_arguments

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - name: hooks
    tables: [kv]{hooks_filter}
    destination: {{type: webhook, url: "{url}", batch: {batch}, batch_size: 5, timeout: {timeout}, secret: s3cret,
                   headers: {{X-Team: data}}}}
  - name: transformed
    tables: [kv]
    transform: "tests.support.transforms:refuse_thirteen"
    destination: {{type: sequin_stream}}
stream:
  checkpoint_location: {ckpt}
"""

FULL_PAYLOAD_FILTER = "\n    filter: \"record['k'] IS NOT NULL\""
"""Keeps every change of ``kv``, and being Spark SQL, makes the batches ``payload=full``: the push
sink is then sent by its own job, the batch repartitioned by group (the poison-pill test covers
the spooled path, where the stream tasks send their shares)."""


def key(m: dict[str, Any]) -> str:
    return m["metadata"]["idempotency_key"]


def position(m: dict[str, Any]) -> tuple[int, int]:
    return m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    rng = random.Random(1)
    for attempts, base in ((1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (30, 300.0)):
        values = [backoff_seconds(attempts, rng) for _ in range(200)]
        assert base * 0.85 <= min(values) and max(values) <= base * 1.15
        assert max(values) - min(values) > base * 0.1  # jittered, not constant


def test_push_keeps_group_order_and_parks_a_failed_group_behind_its_first_failure() -> None:
    sent: list[list[str]] = []
    keys_sent: dict[str, str] = {}
    lock = threading.Lock()

    def send(batch: list[str], keys: list[str]) -> None:
        if any('"bad"' in m for m in batch):
            raise DeliveryError("HTTP 400: no")
        with lock:
            sent.append(batch)
            keys_sent.update(zip(keys, batch))

    rows: list[tuple[int, int, str, str, str | None]] = [
        (i, 0, f"g{i % 3}", f"k{i}", json.dumps("bad" if i == 4 else f"m{i}")) for i in range(12)
    ]
    rows.insert(7, (6, 1, "g0", "k6b", None))
    msgs = Outgoing(*(list(column) for column in zip(*rows)), failed={7: ('"src"', "transform failed")})  # type: ignore[arg-type]
    result = push_in_group_order("s", msgs, send, batch_size=1, lanes=4, parked_groups={"g2"})
    delivered = [m for batch in sent for m in batch]
    assert keys_sent == {f"k{i}": json.dumps(f"m{i}") for i in (0, 1, 3, 6)}  # each message with its own key
    # g1: m1 ok, m4 refused -> m7, m10 parked behind it; g0: m0, m3, m6 ok, then the failed transform parks m9
    assert sorted(delivered) == sorted(json.dumps(f"m{i}") for i in (0, 1, 3, 6))
    parked = {(r.commit_lsn, r.commit_idx): (r.attempts, r.error) for r in result.parked}
    assert parked[(4, 0)] == (1, "HTTP 400: no") and parked[(6, 1)] == (1, "transform failed")
    assert {p for p, (a, _) in parked.items() if a == 0} == {(7, 0), (10, 0), (9, 0), (2, 0), (5, 0), (8, 0), (11, 0)}
    assert result.delivered == 4 and [(r.commit_lsn, r.commit_idx) for r in result.parked] == sorted(parked)


def _workload(dsn: str, keys: int, rounds: int) -> int:
    """Updates of ``keys`` rows, ``rounds`` times, in transactions of a few rows; returns the change count."""
    changes = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        for r in range(rounds):
            with conn.transaction():
                for k in range(1, keys + 1):
                    conn.execute("INSERT INTO kv VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (k, r))
                    changes += 1
    return changes


def test_poison_pill_is_parked_with_its_group_while_the_rest_flow_and_retry_delivers_in_order(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    receiver = Receiver(secret="s3cret").start()
    receiver.policy = lambda ms: (400 if any(m["record"]["k"] == 13 and m["record"]["v"] == 1 for m in ms) else 200, 0)
    config = write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(
            dsn=dsn, db=dbname, url=receiver.url, batch="false", timeout="5s", ckpt=tmp_path / "ckpt", hooks_filter=""
        ),
    )
    assert payload_mode(load_config(config).sinks) == "spool"  # the stream tasks send the push shares
    app = stream_app(config)
    app.wait_streaming(dsn)
    assert "-XX:TieredStopAtLevel=1" in spark_jvm_arguments(app)  # no per-change JVM code: C1 only
    try:
        total = _workload(dsn, keys=20, rounds=4)  # 80 changes; row 13's second version (v=1) is refused
        others = wait_for(
            lambda: (lambda ms: ms if len(ms) >= total - 3 else None)(receiver.messages()),
            120,
            what="every row but 13's last three versions",
        )
        assert len(others) == total - 3 and {m["record"]["k"] for m in others} == set(range(1, 21))
        assert [m["record"]["v"] for m in others if m["record"]["k"] == 13] == [0]  # nothing after the poison
        assert receiver.bad_signatures == 0

        # a batch delivers its other groups before it commits what it parks: wait for the park, not just the rest
        def parked_three() -> list[Any] | None:
            with psycopg.connect(dsn) as conn:
                found = store.list_buffered(conn, "sequin", "hooks")
            return found if len(found) >= 3 else None

        parked = wait_for(parked_three, 60, what="row 13's three versions parked")
        # the slot moves past the parked messages: they are durable in the buffer, no longer needed in the WAL
        last_commit = max(m.commit_lsn for m in parked)
        wait_for(lambda: confirmed_flush_lsn(dsn, f"slot_{dbname}") >= last_commit, 60, what="the slot advancing")
        assert [(m.state, m.attempts, json.loads(m.data)["record"]["v"]) for m in parked] == [
            ("parked", 1, 1),
            ("parked", 0, 2),
            ("parked", 0, 3),
        ]
        assert "HTTP 400" in parked[0].last_error
        # the transform sink parked row 13's messages too (its transform raises) and stored the rest
        # (the batch makes stream messages visible after its push sinks are done: wait for that too)
        stored = wait_for(
            lambda: (lambda ms: ms if len(ms) >= total - 4 else None)(sink_messages(dsn, "transformed")),
            60,
            what="the transform sink's messages visible",
        )
        assert len(stored) == total - 4 and all(m["k"] != 13 for m in stored)
        listed = cli(config, "buffer", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert sorted({m["sink"] for m in json.loads(listed.stdout)}) == ["hooks", "transformed"]

        # not due yet / still refused: the retry leaves them parked, with another attempt counted
        time.sleep(backoff_seconds(1) * 1.2)
        still = cli(config, "buffer", "retry", "--sink", "hooks")
        assert still.returncode == 1 and "delivered 0" in still.stdout and "still parked 3" in still.stdout
        receiver.policy = lambda ms: (200, 0)  # the endpoint is fixed
        delivered = wait_for(
            lambda: (lambda r: r if "still parked 0" in r.stdout else time.sleep(0.5))(
                cli(config, "buffer", "retry", "--sink", "hooks")
            ),
            60,
            what="retry delivering the parked group",
        )
        assert delivered.returncode == 0 and "delivered 3" in delivered.stdout
        thirteen = [m for m in receiver.messages() if m["record"]["k"] == 13]
        assert [m["record"]["v"] for m in thirteen] == [0, 1, 2, 3]  # in order, each once
        assert sorted(position(m) for m in thirteen) == [position(m) for m in thirteen]
        assert len({key(m) for m in receiver.messages()}) == len(receiver.messages()) == total  # nothing twice

        fixed = cli(config, "buffer", "retry", "--sink", "transformed", env={"SEQUIN_TEST_FIXED": "1"})
        assert fixed.returncode == 0 and "delivered 4" in fixed.stdout, fixed.stdout + fixed.stderr
        stored = sink_messages(dsn, "transformed")
        assert [m["v"] for m in stored if m["k"] == 13] == [0, 1, 2, 3] and len(stored) == total
    finally:
        receiver.stop()


def test_flaky_slow_and_down_endpoint_loses_nothing_and_keeps_group_order(
    dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    receiver = Receiver().start()
    rng = random.Random(3)
    slow_until = [0.0]

    def flaky(ms: list[dict[str, Any]]) -> tuple[int, float]:
        if time.monotonic() < slow_until[0]:
            return 200, 1.5  # past the 1 s timeout: the client gives up, we still take it
        return (500, 0.0) if rng.random() < 0.2 else (200, 0.0)

    receiver.policy = flaky
    config = write_config(
        tmp_path / "sequin.yaml",
        CONFIG.format(
            dsn=dsn,
            db=dbname,
            url=receiver.url,
            batch="true",
            timeout="1s",
            ckpt=tmp_path / "ckpt",
            hooks_filter=FULL_PAYLOAD_FILTER,
        ),
    )
    assert payload_mode(load_config(config).sinks) == "full"
    app = stream_app(config)
    app.wait_streaming(dsn)
    stop = threading.Event()

    def retry_loop() -> None:
        from sequin_provider.sinks.retry import retry_sinks

        loaded = load_config(config)
        while not stop.is_set():
            retry_sinks(loaded, "hooks")
            stop.wait(0.5)

    retrier = threading.Thread(target=retry_loop, daemon=True)
    retrier.start()
    try:
        total = _workload(dsn, keys=25, rounds=4)
        slow_until[0] = time.monotonic() + 3.0
        total += _workload(dsn, keys=25, rounds=2)
        time.sleep(3.0)
        receiver.stop()  # down
        total += _workload(dsn, keys=25, rounds=2)
        time.sleep(3.0)
        receiver.start()  # back, still flaky
        total += _workload(dsn, keys=25, rounds=2)
        with psycopg.connect(dsn) as conn:
            expected_keys = total
        wait_for(
            lambda: len({key(m) for m in receiver.messages()}) >= expected_keys,
            240,
            what=f"{expected_keys} distinct messages delivered",
        )
        wait_for(
            lambda: not store.list_buffered(psycopg.connect(dsn), "sequin", "hooks", "parked"),
            120,
            what="the buffer drained",
        )
    finally:
        stop.set()
        retrier.join(timeout=60)
        receiver.stop()
    got = receiver.messages()
    assert len({key(m) for m in got}) == total  # nothing lost
    first_seen: dict[str, list[tuple[int, int]]] = {}
    seen: set[str] = set()
    duplicates = []
    for m in got:
        if key(m) in seen:
            duplicates.append(key(m))
            continue
        seen.add(key(m))
        first_seen.setdefault(str(m["record"]["k"]), []).append(position(m))
    assert all(p == sorted(p) for p in first_seen.values())  # per group, new messages arrive in commit order
    ambiguous = {key(m) for m in receiver.stalled}
    assert set(duplicates) <= ambiguous  # duplicates only where a timeout made the delivery ambiguous
    with psycopg.connect(dsn) as conn:
        assert store.list_buffered(conn, "sequin", "hooks", "discarded") == []
    print(
        f"flaky webhook: {total} changes, {len(got)} deliveries, {len(duplicates)} duplicates,"
        f" {receiver.refused} requests refused, {len(ambiguous)} ambiguous"
    )
