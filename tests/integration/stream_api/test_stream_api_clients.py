"""The pull API against clients as they really behave, each test on a real `sequin api` process.

Client libraries cancel a long poll when they shut down (the connection closes mid-wait); a client
can go between the claim and the answer; the API process is stopped with SIGTERM while polls are
open, sometimes after Postgres; clients send `wait_for` as a duration string and numbers as JSON
strings, as Sequin's own server accepts. Messages are put with the store's write path (no Spark).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres, free_port
from devtools.stream_process import wait_for
from sequin_provider import store, stream_queue
from tests.support.config import write_config
from tests.support.postgres import execute
from tests.support.postgres import put_stream_messages as put

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_clients}}
    publication: {{name: pub_clients}}
sinks:
  - {{name: one_waiter, tables: [kv], destination: {{type: sequin_stream, max_waiting: 1}}}}
  - {{name: three_waiters, tables: [kv], destination: {{type: sequin_stream, max_waiting: 3}}}}
  - {{name: slow_claim, tables: [kv], destination: {{type: sequin_stream}}}}
  - {{name: forms, tables: [kv], destination: {{type: sequin_stream}}}}
  - {{name: refused, tables: [kv], destination: {{type: sequin_stream}}}}
  - {{name: shutdown, tables: [kv], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {ckpt}
"""


class ApiProcess:
    """`sequin api` as a child process on a free port, its output in a log file."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path, self.log_path = config_path, log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sequin_provider.cli",
                    "--config",
                    str(self.config_path),
                    "api",
                    "--port",
                    str(self.port),
                ],
                stdout=log,
                stderr=log,
            )

        def healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 60, what="sequin api to serve")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, limit: float = 30.0) -> float:
        """SIGTERM, then the seconds until the process exited (killed after ``limit``)."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()


@dataclass
class Api:
    """A running API with its store and a token."""

    dsn: str
    process: ApiProcess
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.process.url, timeout=60, headers=self.headers)


def prepare_store(dsn: str, config_dir: Path) -> tuple[Path, str]:
    """The config of a store in ``dsn`` and an API token."""
    execute(dsn, "CREATE TABLE kv (k int PRIMARY KEY, v int)")
    config_path = write_config(config_dir / "sequin.yaml", CONFIG.format(dsn=dsn, ckpt=config_dir / "ckpt"))
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        token = stream_queue.create_token(conn, "sequin", "clients")
        conn.commit()
    return config_path, token


@pytest.fixture(scope="module")
def api(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One `sequin api` process for the module's tests; each test uses its own sink."""
    directory = tmp_path_factory.mktemp("api_clients")
    dsn = pg.create_database("api_clients")
    config_path, token = prepare_store(dsn, directory)
    process = ApiProcess(config_path, directory / "api.log").start()
    try:
        yield Api(dsn, process, token)
    finally:
        process.stop()


class RawPoll:
    """A receive sent over its own connection, as a client library sends it; ``abandon`` closes the
    connection before the answer, as a client that cancels its poll (or dies) does."""

    def __init__(self, api: Api, sink: str, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", api.process.port), timeout=30)
        self.sock.sendall(
            f"POST /api/sequin_streams/{sink}/receive HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {api.token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )

    def answered(self) -> bool:
        """Whether any answer (or the connection's end) arrived, without waiting."""
        self.sock.setblocking(False)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
            return True
        except BlockingIOError:
            return False
        finally:
            self.sock.settimeout(30)

    def abandon(self) -> None:
        self.sock.close()

    def answer(self) -> tuple[int, Any] | None:
        """(status, JSON body, or the text of a body that is not JSON) of the answer, or None when the
        connection closed without one."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        while len(body) < length:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed mid-answer: {data!r}"
            body += chunk
        self.sock.close()
        try:
            return int(head.split(b" ")[1]), json.loads(body)
        except ValueError:
            return int(head.split(b" ")[1]), body.decode(errors="replace")


def deliveries(dsn: str, sink: str) -> dict[int, int]:
    """commit_lsn -> deliver_count of a sink's messages."""
    with psycopg.connect(dsn) as conn:
        return dict(
            conn.execute(
                "SELECT commit_lsn, deliver_count FROM sequin.stream_messages WHERE sink = %s", (sink,)
            ).fetchall()
        )


def receive_all(client: httpx.Client, sink: str, count: int, within: float) -> list[dict[str, Any]]:
    """Receive (without waiting) until ``count`` messages came or ``within`` seconds passed."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + within
    while len(got) < count and time.monotonic() < deadline:
        response = client.post(f"/api/sequin_streams/{sink}/receive", json={"batch_size": 100})
        assert response.status_code == 200, response.text
        got += response.json()["data"]
        if len(got) < count:
            time.sleep(0.1)
    return got


# ------------------------------------------------------------------------------------------------
# abandoned polls


def test_messages_arriving_after_a_client_cancelled_its_poll_go_to_a_live_client_at_once(api: Api) -> None:
    async def cancelled_poll() -> None:
        async with httpx.AsyncClient(base_url=api.process.url, timeout=60, headers=api.headers) as client:

            def send() -> asyncio.Task[httpx.Response]:
                return asyncio.create_task(
                    client.post("/api/sequin_streams/one_waiter/receive", json={"batch_size": 10, "wait_for": 20000})
                )

            poll = send()
            async with httpx.AsyncClient(base_url=api.process.url, timeout=60, headers=api.headers) as other:

                async def waiting() -> bool:  # max_waiting is 1: a second poll is refused while ours waits
                    r = await other.post("/api/sequin_streams/one_waiter/receive", json={"wait_for": 500})
                    return r.status_code == 429

                for _ in range(50):
                    await asyncio.sleep(0.3)  # the poll reaches the server before the probe
                    if poll.done():  # refused because a probe held the slot: send it again
                        assert poll.result().status_code == 429, poll.result().text
                        poll = send()
                    elif await waiting():
                        break
                else:
                    raise AssertionError("the poll never waited")
            poll.cancel()  # what a client library does when it shuts down: the connection closes
            with pytest.raises(asyncio.CancelledError):
                await poll

    asyncio.run(cancelled_poll())
    put(api.dsn, "one_waiter", [(100 + i, 0, f"g{i}") for i in range(5)])
    with api.client() as live:
        # the live client gets all five now; before the fix the dead request claimed them for 30 s
        got = receive_all(live, "one_waiter", 5, within=5)
        assert sorted(m["data"]["metadata"]["commit_lsn"] for m in got) == [100, 101, 102, 103, 104]
        # and the freed max_waiting slot takes a new long poll
        assert live.post("/api/sequin_streams/one_waiter/receive", json={"wait_for": 500}).json() == {"data": []}
    assert deliveries(api.dsn, "one_waiter") == {100 + i: 1 for i in range(5)}  # delivered once: to the live client


def test_abandoned_polls_three_times_max_waiting_leave_no_429_for_a_live_client(api: Api) -> None:
    url = "/api/sequin_streams/three_waiters/receive"

    async def live_polls(n: int) -> list[int]:
        """The statuses of ``n`` live long polls sent together."""
        async with httpx.AsyncClient(base_url=api.process.url, timeout=60, headers=api.headers) as client:
            answers = await asyncio.gather(*(client.post(url, json={"wait_for": 500}) for _ in range(n)))
        return [a.status_code for a in answers]

    def three_waiting(polls: list[RawPoll]) -> bool:
        """Whether the three polls wait (a fourth poll is refused); a poll refused because a probe
        held a slot is sent again."""
        for i, poll in enumerate(polls):
            if poll.answered():
                answer = poll.answer()
                assert answer is not None and answer[0] == 429, answer
                polls[i] = RawPoll(api, "three_waiters", {"wait_for": 60000})
        time.sleep(0.3)  # the polls reach the server before the probe
        return asyncio.run(live_polls(1)) == [429]

    for round_ in range(3):  # max_waiting is 3: three rounds of three polls, each abandoned mid-wait
        polls = [RawPoll(api, "three_waiters", {"wait_for": 60000}) for _ in range(3)]
        wait_for(lambda: three_waiting(polls), 20, interval=0, what=f"round {round_}: three polls waiting")
        assert not any(p.answered() for p in polls), f"round {round_}: a poll was answered before it was abandoned"
        for p in polls:
            p.abandon()
        # the three slots free as soon as the server sees the connections close (before the fix: 429 for 60 s)
        wait_for(
            lambda: asyncio.run(live_polls(3)) == [200, 200, 200],
            5,
            interval=0.1,
            what=f"round {round_}: three live polls accepted",
        )
    polls = [RawPoll(api, "three_waiters", {"wait_for": 60000}) for _ in range(3)]
    time.sleep(0.5)
    put(api.dsn, "three_waiters", [(7, 0, "a"), (8, 0, "b"), (9, 0, "c")])
    results = [p.answer() for p in polls]
    assert all(r is not None and r[0] == 200 for r in results), results
    assert sorted(r[1]["data"][0]["data"]["metadata"]["commit_lsn"] for r in results if r) == [7, 8, 9]


def test_a_client_gone_while_its_messages_were_claimed_gets_them_released_at_once(api: Api) -> None:
    """The claim is held up (the sink's pending counter is locked) while the client disconnects:
    what it claimed is released, visible at once and not counted as delivered. Once for a plain
    receive, once for a long poll woken by the messages."""
    execute(
        api.dsn, "INSERT INTO sequin.stream_pending (sink, pending) VALUES ('slow_claim', 0) ON CONFLICT DO NOTHING"
    )
    for lsns, body in (([1, 2, 3], {"batch_size": 10}), ([4, 5, 6], {"batch_size": 10, "wait_for": 20000})):
        messages = [(lsn, 0, f"g{lsn}") for lsn in lsns]
        with psycopg.connect(api.dsn) as blocker:
            blocker.execute("SELECT * FROM sequin.stream_pending WHERE sink = 'slow_claim' FOR UPDATE")
            if "wait_for" in body:
                poll = RawPoll(api, "slow_claim", body)
                time.sleep(0.5)  # waiting, then woken by the messages
                put(api.dsn, "slow_claim", messages)
            else:
                put(api.dsn, "slow_claim", messages)
                poll = RawPoll(api, "slow_claim", body)
            with psycopg.connect(api.dsn, autocommit=True) as watcher:
                wait_for(
                    lambda: (
                        watcher.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                            " AND wait_event_type = 'Lock'"
                        ).fetchone()[0]
                        == 1
                    ),
                    10,
                    interval=0.05,  # type: ignore[index]
                    what="the claim to wait for the pending counter's lock",
                )
            poll.abandon()
            time.sleep(0.5)  # the server sees the connection close while the claim waits
            blocker.rollback()  # the claim completes now, into a closed connection
        with api.client() as live:
            got = receive_all(live, "slow_claim", 3, within=5)
            assert sorted(m["data"]["metadata"]["commit_lsn"] for m in got) == lsns, body
            # delivered once: to the live client
            assert deliveries(api.dsn, "slow_claim") == {lsn: 1 for lsn in lsns}, body
            acked = live.post("/api/sequin_streams/slow_claim/ack", json={"ack_ids": [m["ack_id"] for m in got]})
            assert acked.status_code == 200
        with psycopg.connect(api.dsn) as conn:  # the release took its messages off the pending count too
            assert conn.execute("SELECT pending FROM sequin.stream_pending WHERE sink = 'slow_claim'").fetchone() == (
                0,
            )


# ------------------------------------------------------------------------------------------------
# shutdown


def test_sigterm_with_ten_open_polls_exits_within_five_seconds_without_tracebacks(api: Api, tmp_path: Path) -> None:
    process = ApiProcess(api.process.config_path, tmp_path / "api.log").start()
    own = Api(api.dsn, process, api.token)
    try:
        polls = [RawPoll(own, "shutdown", {"wait_for": 60000}) for _ in range(10)]
        time.sleep(1.0)  # all ten are waiting
        assert not any(p.answered() for p in polls)
        took = process.terminate()
        answers = [p.answer() for p in polls]
    finally:
        process.stop()
    assert took < 5, f"sequin api took {took:.1f} s to exit:\n{process.log()}"
    # uvicorn ends by raising the signal it handled again: the exit status says SIGTERM
    assert process.proc is not None and process.proc.returncode in (0, -signal.SIGTERM), process.log()
    assert "Traceback" not in process.log() and "ERROR" not in process.log(), process.log()
    assert all(a is None or a == (200, {"data": []}) for a in answers), answers


def test_sigterm_after_postgres_stopped_exits_within_five_seconds_without_tracebacks(tmp_path: Path) -> None:
    with EmbeddedPostgres() as cluster:  # its own cluster: the test stops it
        if cluster.external:  # justified: a server we do not own is not ours to stop
            pytest.skip("SEQUIN_TEST_DSN's server cannot be stopped")
        dsn = cluster.create_database("stopped")
        config_path, token = prepare_store(dsn, tmp_path)
        process = ApiProcess(config_path, tmp_path / "api.log").start()
        api = Api(dsn, process, token)
        try:
            polls = [RawPoll(api, "shutdown", {"wait_for": 60000}) for _ in range(5)]
            time.sleep(1.0)
            cluster.stop(remove=False)
            time.sleep(2.5)  # the polls' re-checks meet the stopped server
            took = process.terminate()
            answers = [p.answer() for p in polls]
        finally:
            process.stop()
    assert took < 5, f"sequin api took {took:.1f} s to exit:\n{process.log()}"
    assert "Traceback" not in process.log(), process.log()
    # a poll that met the stopped store says so (503), or ends empty at shutdown
    unavailable = [a for a in answers if a is not None and a[0] == 503]
    assert all(isinstance(a[1], dict) and a[1]["code"] == "unavailable" for a in unavailable), answers
    assert all(a is None or a == (200, {"data": []}) for a in answers if a not in unavailable), answers


# ------------------------------------------------------------------------------------------------
# input forms

BATCH_SIZE_ERROR = "Invalid `{0}`. `{0}` must be an integer between 1 and 1000."
WAIT_FOR_FORMAT_ERROR = "Invalid `wait_for`. When using duration strings, format must be like '60s', '5m', or '1000ms'."
WAIT_FOR_RANGE_ERROR = (
    "Invalid `wait_for`. Must be between 500 and 300,000 milliseconds, or use duration format"
    " like '60s', '5m', '1000ms'."
)


def test_the_input_forms_sequins_server_accepts_are_accepted(api: Api) -> None:
    put(api.dsn, "forms", [(i, 0, f"g{i}") for i in range(1, 7)])  # six groups: six deliverable messages
    url = "/api/sequin_streams/forms/receive"
    with api.client() as client:

        def count(response: httpx.Response) -> int:
            """How many messages came; nacked, so the next request finds all six again."""
            assert response.status_code == 200, response.text
            got = response.json()["data"]
            nacked = client.post("/api/sequin_streams/forms/nack", json={"ack_ids": [m["ack_id"] for m in got]})
            assert nacked.status_code == 200, nacked.text
            return len(got)

        cases: list[tuple[dict[str, Any] | None, dict[str, str] | None, int]] = [  # (JSON body, query, count)
            ({"batch_size": "2"}, None, 2),  # numbers as JSON strings
            ({"max_batch_size": "3"}, None, 3),
            ({"batch_size": "+4"}, None, 4),
            ({"batch_size": "05"}, None, 5),
            ({"batch_size": 6, "wait_for": "60s"}, None, 6),  # wait_for as a duration string
            ({"batch_size": 6, "wait_for": "5m"}, None, 6),
            ({"batch_size": 6, "wait_for": "500ms"}, None, 6),
            ({"batch_size": 6, "wait_for": "1000"}, None, 6),  # milliseconds as text
            ({"batch_size": 6, "wait_for": 300000}, None, 6),
            (None, {"batch_size": "2", "wait_for": "1s"}, 2),  # the query string
            ({"batch_size": "3"}, {"batch_size": "1"}, 3),  # the body's value wins
            ({"max_batch_size": 2}, {"batch_size": "5"}, 5),  # batch_size wins over max_batch_size
            ({"batch_size": None, "wait_for": None}, None, 1),  # null: the default
            (None, None, 1),
        ]
        counts = [count(client.post(url, json=body, params=query)) for body, query, _ in cases]
        assert counts == [n for _, _, n in cases]
        assert count(client.get(url, params={"batch_size": "4", "wait_for": "2s"})) == 4
        # a duration string is a real long poll on an empty stream: 1s waits a second, 500ms half of one
        acked = client.post(url, json={"batch_size": 10}).json()["data"]
        cleared = client.post("/api/sequin_streams/forms/ack", json={"ack_ids": [m["ack_id"] for m in acked]})
        assert cleared.status_code == 200
        for wait, at_least in (("1s", 1.0), ("500ms", 0.5)):
            started = time.monotonic()
            assert client.post(url, json={"wait_for": wait}).json() == {"data": []}
            assert time.monotonic() - started >= at_least * 0.95


def test_the_input_forms_sequins_server_refuses_get_its_400(api: Api) -> None:
    put(api.dsn, "refused", [(50, 0, "z")])
    url = "/api/sequin_streams/refused/receive"
    refused: list[tuple[dict[str, Any] | None, dict[str, str] | None, str]] = [
        *(
            ({"batch_size": v}, None, BATCH_SIZE_ERROR.format("batch_size"))
            for v in (
                0,
                "0",
                1001,
                "1001",
                -1,
                "-1",
                "x",
                "",
                " 5",
                "5 ",
                "5.0",
                5.0,
                2.5,
                "1_000",
                "\u0665",
                True,
                [5],
                {"n": 5},
            )
        ),
        ({"max_batch_size": "0"}, None, BATCH_SIZE_ERROR.format("max_batch_size")),
        ({"batch_size": "x", "wait_for": "x"}, None, BATCH_SIZE_ERROR.format("batch_size")),  # batch_size first
        *(
            ({"wait_for": v}, None, WAIT_FOR_FORMAT_ERROR)
            for v in ("x", "", "1h", "1.5s", "-1", " 1s", "1S", "1 s", "\u0665s")
        ),
        *(
            ({"wait_for": v}, None, WAIT_FOR_RANGE_ERROR)
            for v in (100, "100", "100ms", 499, 300001, "6m", "301s", -1, 1000.0, True, ["1s"], {"ms": 1000})
        ),
        (None, {"batch_size": "x"}, BATCH_SIZE_ERROR.format("batch_size")),
        (None, {"batch_size": ""}, BATCH_SIZE_ERROR.format("batch_size")),
        (None, {"wait_for": "1h"}, WAIT_FOR_FORMAT_ERROR),
        (None, {"wait_for": "100"}, WAIT_FOR_RANGE_ERROR),
        (None, {"max_batch_size": "1001"}, BATCH_SIZE_ERROR.format("max_batch_size")),
    ]
    with api.client() as client:
        answers = [client.post(url, json=body, params=query) for body, query, _ in refused]
        not_an_object = client.post(url, json=[{"batch_size": 1}])
        not_json = client.post(url, content=b"{batch_size: 1", headers={"Content-Type": "application/json"})
    for (body, query, summary), answer in zip(refused, answers):
        assert answer.status_code == 400 and answer.json() == {"code": "bad_request", "summary": summary}, (
            body,
            query,
            answer.text,
        )
    assert not_an_object.status_code == 400 and not_an_object.json()["code"] == "bad_request"
    assert not_json.status_code == 400 and not_json.json()["code"] == "bad_request"
    assert deliveries(api.dsn, "refused") == {50: 0}  # nothing was claimed by a refused request
