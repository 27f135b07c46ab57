"""The Sequin Stream HTTP pull API over real HTTP (uvicorn on loopback) and a real store.

Most tests put messages into the stream with the store's own write path (what the stream app
calls); the end-to-end test feeds the stream with the stream app itself.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import fastapi.routing
import httpx
import psycopg
import pytest

from devtools.stream_process import wait_for
from sequin_provider import store, stream_queue
from sequin_provider.config import load_config
from sequin_provider.stream_api import StreamService
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.postgres import put_stream_messages as put
from tests.support.stream_api import ApiServer
from tests.support.stream_app import StreamApp

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
  - {{name: kv, tables: [kv], destination: {{type: sequin_stream}}}}
  - {{name: quick, tables: [kv], destination: {{type: sequin_stream, visibility_timeout: 1s}}}}
  - {{name: capped, tables: [kv], destination: {{type: sequin_stream, visibility_timeout: 1s, max_ack_pending: 2}}}}
  - {{name: few_waiters, tables: [kv], destination: {{type: sequin_stream, max_waiting: 2}}}}
stream:
  checkpoint_location: {ckpt}
"""


@pytest.fixture
def api(dsn: str, dbname: str, tmp_path: Path) -> Iterator[tuple[str, Path, httpx.Client]]:
    """(dsn, config path, an authenticated client of a running API)."""
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    config_path = write_config(tmp_path / "sequin.yaml", CONFIG.format(dsn=dsn, db=dbname, ckpt=tmp_path / "ckpt"))
    config = load_config(config_path)
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        token = stream_queue.create_token(conn, "sequin", "tests")
    with (
        ApiServer(config) as server,
        httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client,
    ):
        yield dsn, config_path, client


def receive(client: httpx.Client, sink: str, **params: Any) -> list[dict[str, Any]]:
    response = client.post(f"/api/sequin_streams/{sink}/receive", json=params)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def positions(received: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(m["data"]["metadata"]["commit_lsn"], m["data"]["metadata"]["commit_idx"]) for m in received]


def settle(client: httpx.Client, sink: str, op: str, received: list[dict[str, Any]]) -> None:
    response = client.post(f"/api/sequin_streams/{sink}/{op}", json={"ack_ids": [m["ack_id"] for m in received]})
    assert response.status_code == 200 and response.json() == {"success": True}, response.text


def test_the_apis_store_sessions_commit_each_statement_and_never_jit(dsn: str, dbname: str, tmp_path: Path) -> None:
    """A receive and an ack are one round trip each on an autocommit session
    (test_stream_queue.py); and a receive's statement reads its head's size from the store, so the
    planner guesses a tenth of the stream and would JIT-compile it on a big stream (58 ms per
    receive, against 2-3 ms to run it)."""
    config_path = write_config(tmp_path / "sequin.yaml", CONFIG.format(dsn=dsn, db=dbname, ckpt=tmp_path / "ckpt"))
    service = StreamService(load_config(config_path))
    pool = service.pools[service.streams["kv"].store_dsn]
    pool.open(wait=True)
    try:
        with pool.connection() as conn:
            assert conn.autocommit
            assert conn.execute("SHOW jit").fetchone() == ("off",)
    finally:
        pool.close()


def test_receive_gives_one_message_per_group_in_order_and_ack_releases_the_next(
    api: tuple[str, Path, httpx.Client],
) -> None:
    dsn, _, client = api
    put(dsn, "kv", [(100, 0, "a"), (100, 1, "b"), (200, 0, "a"), (300, 0, "c"), (300, 1, "a")])
    put(dsn, "kv", [(400, 0, "d")], visible=False)  # written but its batch is not whole yet: never served
    first = receive(client, "kv", batch_size=10)
    assert positions(first) == [(100, 0), (100, 1), (300, 0)]  # a, b, c: one per group, the head of each
    assert all(m["data"]["record"]["g"] in "abc" for m in first)
    assert receive(client, "kv", batch_size=10) == []  # every group's head is outstanding
    settle(client, "kv", "ack", first[:1])  # ack a's first: a's second becomes deliverable
    assert positions(receive(client, "kv", batch_size=10)) == [(200, 0)]
    # GET with the query string, and the legacy prefix
    settle(client, "kv", "ack", first[1:])
    legacy = client.get("/api/http_pull_consumers/kv/receive", params={"batch_size": 5})
    assert legacy.status_code == 200 and legacy.json() == {"data": []}  # a's (300,1) waits behind (200,0)
    with psycopg.connect(dsn) as conn:
        assert store.stream_counts(conn, "sequin", "kv") == {"total": 3, "visible": 2, "outstanding": 1}


def test_receive_ack_and_nack_skip_fastapis_request_handling(
    api: tuple[str, Path, httpx.Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream endpoints are served by plain Starlette routes ahead of FastAPI's (whose per-request
    dependency solving cost the API a fifth of its CPU); FastAPI's stay for the OpenAPI document."""
    dsn, _, client = api
    solved: list[str] = []
    solve = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kwargs: Any) -> Any:
        solved.append(kwargs["request"].url.path)
        return await solve(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    put(dsn, "kv", [(10, 0, "a"), (20, 0, "b")])
    got = receive(client, "kv", batch_size=1)
    settle(client, "kv", "nack", got)
    settle(client, "kv", "ack", receive(client, "kv", batch_size=2))
    legacy = client.get("/api/http_pull_consumers/kv/receive", params={"batch_size": 5})
    assert legacy.status_code == 200 and legacy.json() == {"data": []}
    assert solved == []
    # their methods are FastAPI's: no HEAD, which Starlette would add to a GET route (and which
    # would claim messages nobody gets)
    put(dsn, "kv", [(30, 0, "c")])
    head = client.head("/api/sequin_streams/kv/receive", params={"batch_size": 5})
    assert head.status_code == 405
    assert positions(receive(client, "kv", batch_size=5)) == [(30, 0)]
    health = client.get("/health")  # a FastAPI route, for contrast
    assert health.status_code == 200 and solved == ["/health"]


def test_visibility_timeout_returns_unacked_messages_and_nack_is_immediate(api: tuple[str, Path, httpx.Client]) -> None:
    dsn, _, client = api
    put(dsn, "quick", [(10, 0, "a"), (20, 0, "a"), (30, 0, "b")])
    got = receive(client, "quick", batch_size=10)
    assert positions(got) == [(10, 0), (30, 0)]
    assert receive(client, "quick", batch_size=10) == []
    # the consumer "dies": after the 1 s visibility timeout the same messages come back, with new ack ids
    again = wait_for(lambda: receive(client, "quick", batch_size=10) or None, 30, what="redelivery after timeout")
    assert positions(again) == [(10, 0), (30, 0)]
    assert {m["ack_id"] for m in again}.isdisjoint(m["ack_id"] for m in got)
    settle(client, "quick", "ack", got)  # stale ack ids: accepted, change nothing
    with psycopg.connect(dsn) as conn:
        assert store.stream_counts(conn, "sequin", "quick")["total"] == 3
    settle(client, "quick", "nack", again[:1])  # nack: visible again at once
    assert positions(receive(client, "quick", batch_size=10)) == [(10, 0)]
    with psycopg.connect(dsn) as conn:
        counts = dict(
            conn.execute("SELECT commit_lsn, deliver_count FROM sequin.stream_messages WHERE sink = 'quick'").fetchall()
        )
    assert counts == {10: 3, 20: 0, 30: 2}


def test_max_ack_pending_stops_new_messages_while_redeliveries_flow(api: tuple[str, Path, httpx.Client]) -> None:
    dsn, _, client = api
    put(dsn, "capped", [(i, 0, f"g{i}") for i in range(1, 6)])
    assert positions(receive(client, "capped", batch_size=10)) == [(1, 0), (2, 0)]  # capped at 2 pending
    assert receive(client, "capped", batch_size=10) == []
    # their visibility times out: still pending (unacked), so only they are redelivered, not g3..g5
    redelivered = wait_for(lambda: receive(client, "capped", batch_size=10) or None, 30, what="redelivery")
    assert positions(redelivered) == [(1, 0), (2, 0)]
    settle(client, "capped", "ack", redelivered)
    assert positions(receive(client, "capped", batch_size=10)) == [(3, 0), (4, 0)]


def test_long_poll_returns_when_a_message_arrives_and_max_waiting_answers_429(
    api: tuple[str, Path, httpx.Client],
) -> None:
    dsn, _, client = api
    results: dict[str, Any] = {}

    def poll(key: str, wait_for_ms: int) -> None:
        started = time.monotonic()
        response = client.post("/api/sequin_streams/few_waiters/receive", json={"wait_for": wait_for_ms})
        results[key] = (response.status_code, response.json(), time.monotonic() - started)

    pollers = [threading.Thread(target=poll, args=(f"p{i}", 60_000)) for i in range(2)]
    for t in pollers:
        t.start()
    time.sleep(1.0)  # both are waiting now
    third = client.post("/api/sequin_streams/few_waiters/receive", params={"wait_for": 1000})
    assert third.status_code == 429 and third.json()["code"] == "too_many_requests"
    assert receive(client, "few_waiters") == []  # a receive without wait_for is not a waiter
    put(dsn, "few_waiters", [(7, 0, "x"), (7, 1, "y")])  # two groups: one message for each poller
    for t in pollers:
        t.join(timeout=60)
    got = sorted(positions(results[k][1]["data"])[0] for k in ("p0", "p1"))
    assert got == [(7, 0), (7, 1)]
    assert all(results[k][2] < 30 for k in ("p0", "p1"))  # woken by the message, not by their 60 s deadline
    after = client.post("/api/sequin_streams/few_waiters/receive", json={"wait_for": 500})
    assert after.status_code == 200 and after.json() == {"data": []}  # waiters are counted down again


def test_receives_arriving_while_a_claim_is_in_flight_share_the_next_claim(api: tuple[str, Path, httpx.Client]) -> None:
    """One claim of a sink at a time in an API process (``receive_rounds``): the first receive's
    claim is held up in the store (the sink's pending counter locked), three more arrive meanwhile
    and wait in the API, not in the store; then one claim serves the three, each its batch, every
    message once and in position order across the split."""
    dsn, _, client = api
    put(dsn, "kv", [(i, 0, f"g{i}") for i in range(1, 31)])
    execute(dsn, "INSERT INTO sequin.stream_pending (sink, pending) VALUES ('kv', 0) ON CONFLICT DO NOTHING")
    answers: dict[str, list[dict[str, Any]]] = {}

    def receiving(key: str, batch_size: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(key, receive(client, "kv", batch_size=batch_size)))
        thread.start()
        return thread

    def waiting_on_the_counter(watcher: psycopg.Connection[Any]) -> int:
        row = watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
        return int(row[0]) if row else 0

    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as watcher:
        blocker.execute("SELECT * FROM sequin.stream_pending WHERE sink = 'kv' FOR UPDATE")
        threads = [receiving("first", 10)]
        wait_for(lambda: waiting_on_the_counter(watcher) == 1, 10, interval=0.05, what="the first claim to wait")
        threads += [receiving(f"then{i}", 5) for i in range(3)]
        in_rounds = 'sequin_api_receives_in_claim_rounds{sink="kv"} 4.0'
        wait_for(lambda: in_rounds in client.get("/metrics").text, 10, interval=0.05, what="four receives in rounds")
        assert waiting_on_the_counter(watcher) == 1  # three wait for the claim in flight, not in the store
        blocker.rollback()
        for thread in threads:
            thread.join(timeout=30)
    assert positions(answers["first"]) == [(i, 0) for i in range(1, 11)]
    shares = sorted(positions(answers[f"then{i}"]) for i in range(3))
    assert shares == [[(i, 0) for i in range(start, start + 5)] for start in (11, 16, 21)]
    metrics = client.get("/metrics").text
    assert 'sequin_api_store_claims_total{sink="kv"} 2.0' in metrics
    assert 'sequin_api_receive_requests_total{sink="kv"} 4.0' in metrics
    assert 'sequin_api_receives_in_claim_rounds{sink="kv"} 0.0' in metrics


def test_bad_requests_get_the_documented_error_and_leave_the_stream_alone(api: tuple[str, Path, httpx.Client]) -> None:
    dsn, config_path, client = api
    put(dsn, "kv", [(5, 0, "a"), (6, 0, "b")])
    url = "/api/sequin_streams/kv"
    unauth = httpx.Client(base_url=str(client.base_url), timeout=30)
    cases: list[tuple[httpx.Response, int, str]] = [
        (unauth.post(f"{url}/receive"), 401, "unauthorized"),
        (unauth.post(f"{url}/receive", headers={"Authorization": "Bearer sqn_nope"}), 401, "unauthorized"),
        (unauth.post(f"{url}/receive", headers={"Authorization": "Basic dXNlcjpwYXNz"}), 401, "unauthorized"),
        (client.post("/api/sequin_streams/nope/receive"), 404, "not_found"),
        (client.post(f"{url}/receive", json={"batch_size": 0}), 400, "bad_request"),
        (client.post(f"{url}/receive", json={"batch_size": 1001}), 400, "bad_request"),
        (client.post(f"{url}/receive", json={"batch_size": "x"}), 400, "bad_request"),
        (client.post(f"{url}/receive", json={"batch_size": True}), 400, "bad_request"),
        (client.get(f"{url}/receive", params={"batch_size": "x"}), 400, "bad_request"),
        (client.get(f"{url}/receive", params={"batch_size": 1001}), 400, "bad_request"),
        (client.post(f"{url}/receive", json={"wait_for": 100}), 400, "bad_request"),
        (
            client.post(f"{url}/receive", content=b"{not json", headers={"Content-Type": "application/json"}),
            400,
            "bad_request",
        ),
        (client.post(f"{url}/ack", json={"ack_ids": ["not-a-uuid"]}), 400, "bad_request"),
        (client.post(f"{url}/ack", json={"ack_ids": []}), 400, "bad_request"),
        (client.post(f"{url}/ack", json={}), 400, "bad_request"),
        (client.post(f"{url}/nack", json=["x"]), 400, "bad_request"),
        (
            client.post(f"{url}/ack", content=b"x" * (2 * 1024 * 1024), headers={"Content-Type": "application/json"}),
            413,
            "payload_too_large",
        ),
    ]
    for i, (response, status, code) in enumerate(cases):
        assert response.status_code == status, (i, response.text)
        body = response.json()
        assert body["code"] == code and body["summary"], (i, body)
    assert "batch_size" in cases[4][0].json()["summary"]
    # a revoked token is refused with 403 (after the short token cache)
    token = subprocess.run(
        [sys.executable, "-m", "sequin_provider.cli", "--config", str(config_path), "token", "create", "short-lived"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert token.returncode == 0, token.stderr
    secret = token.stdout.strip()
    headers = {"Authorization": f"Bearer {secret}"}
    assert unauth.post(f"{url}/receive", headers=headers).status_code == 200
    revoked = subprocess.run(
        [sys.executable, "-m", "sequin_provider.cli", "--config", str(config_path), "token", "revoke", "short-lived"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoked.returncode == 0, revoked.stderr
    refused = wait_for(
        lambda: (lambda r: r if r.status_code == 403 else None)(unauth.post(f"{url}/receive", headers=headers)),
        30,
        what="revoked token refused",
    )
    assert refused.json()["code"] == "forbidden"
    listed = subprocess.run(
        [sys.executable, "-m", "sequin_provider.cli", "--config", str(config_path), "token", "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "short-lived" in listed.stdout and "revoked" in listed.stdout and secret not in listed.stdout
    again = subprocess.run(
        [sys.executable, "-m", "sequin_provider.cli", "--config", str(config_path), "token", "create", "tests"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "exists" in again.stderr
    unauth.close()
    # none of it touched the stream (one message above went to the short-lived token's receive)
    with psycopg.connect(dsn) as conn:
        assert store.stream_counts(conn, "sequin", "kv")["total"] == 2
        assert secret not in json.dumps(conn.execute("SELECT * FROM sequin.api_tokens").fetchall(), default=str)


def test_openapi_document_describes_the_endpoints(api: tuple[str, Path, httpx.Client]) -> None:
    _, _, client = api
    document = client.get("/openapi.json").json()
    paths = document["paths"]
    assert set(paths) == {f"/api/sequin_streams/{{name}}/{op}" for op in ("receive", "ack", "nack")}
    receive_post = paths["/api/sequin_streams/{name}/receive"]["post"]
    params = {p["name"]: p for p in receive_post["parameters"]}
    assert set(params) == {"name", "batch_size", "max_batch_size", "wait_for"}
    assert params["batch_size"]["schema"]["anyOf"][0] == {"type": "integer", "maximum": 1000, "minimum": 1}
    assert set(receive_post["responses"]) == {"200", "400", "401", "403", "404", "413", "429", "503"}
    assert receive_post["security"] == [{"HTTPBearer": []}]
    assert "get" in paths["/api/sequin_streams/{name}/receive"]
    ack = document["components"]["schemas"]["AckRequest"]
    assert ack["properties"]["ack_ids"]["items"] == {"type": "string", "format": "uuid"}


def test_four_consumers_on_a_stream_fed_by_the_stream_app_each_message_once_in_group_order(
    pg: Any, dsn: str, dbname: str, tmp_path: Path, stream_app: Any
) -> None:
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    config_path = write_config(tmp_path / "sequin.yaml", CONFIG.format(dsn=dsn, db=dbname, ckpt=tmp_path / "ckpt"))
    app: StreamApp = stream_app(config_path)
    app.wait_streaming(dsn)
    with psycopg.connect(dsn) as conn:
        token = stream_queue.create_token(conn, "sequin", "consumers")
        conn.commit()
    rng = random.Random(7)
    expected = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        for batch in range(40):  # 40 transactions of 1-60 changes on 30 hot keys
            with conn.transaction():
                for _ in range(rng.randint(1, 60)):
                    k = rng.randint(1, 30)
                    conn.execute(
                        "INSERT INTO kv VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v", (k, batch)
                    )
                    expected += 1
    lock = threading.Lock()
    received: list[tuple[int, str, tuple[int, int], str]] = []  # (sequence, group, position, key)
    acked: list[str] = []
    done = threading.Event()
    errors: list[str] = []
    with ApiServer(load_config(config_path)) as server:

        def consumer(n: int) -> None:
            with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as c:
                while not done.is_set():
                    r = c.post("/api/sequin_streams/kv/receive", json={"batch_size": 10, "wait_for": 1000})
                    if r.status_code != 200:
                        errors.append(r.text)
                        return
                    got = r.json()["data"]
                    with lock:
                        for m in got:
                            meta = m["data"]["metadata"]
                            received.append(
                                (
                                    len(received),
                                    json.dumps(meta["record_pks"]),
                                    (meta["commit_lsn"], meta["commit_idx"]),
                                    meta["idempotency_key"],
                                )
                            )
                    if got:
                        if rng.random() < 0.3:
                            time.sleep(0.01)  # some consumers are slower
                        a = c.post("/api/sequin_streams/kv/ack", json={"ack_ids": [m["ack_id"] for m in got]})
                        assert a.status_code == 200
                        with lock:
                            acked.extend(m["data"]["metadata"]["idempotency_key"] for m in got)

        threads = [threading.Thread(target=consumer, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(acked) >= expected or errors, 180, what=f"{expected} messages acked")
        finally:
            time.sleep(1.5)  # anything more would arrive now
            done.set()
            for t in threads:
                t.join(timeout=60)
    assert errors == []
    assert len(acked) == expected and len(set(acked)) == expected  # each acked exactly once
    assert len(received) == expected  # nobody received a message twice (no visibility timeout expired)
    by_group: dict[str, list[tuple[int, int]]] = {}
    for _, group, position, _ in sorted(received):
        by_group.setdefault(group, []).append(position)
    assert len(by_group) == 30
    assert all(p == sorted(p) for p in by_group.values())  # each group received in commit order
    with psycopg.connect(dsn) as conn:
        assert store.stream_counts(conn, "sequin", "kv")["total"] == 0
