"""Delivery benchmark: the Sequin Stream pull API and the webhook sink, each beside its limit.

    .venv/bin/python bench/delivery_throughput.py [--seconds 5] [--changes 100000]

One run on a fresh embedded cluster:
  (a) pull API: messages/s received + acked over HTTP (``sequin api`` in its own process) with
      1, 4 and 16 consumer processes at batch_size 1, 10 and 100 (http.client consumers; 4 httpx
      consumers at batch 100 beside them);
  (a') the same receive/ack queries run directly against the store (4 processes, batch 100):
      the store's limit, without HTTP;
  (b) webhook sink end to end: changes/s from the first commit to the last message taken by a
      minimal local HTTP server, through the stream app;
  (b') that server's own limit: batched POSTs of the same size from 8 threads.
Prints a Markdown table and writes bench/results/delivery_throughput.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.webhook_endpoint import ReceivedCount  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres, free_port  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider import store, stream_queue  # noqa: E402
from sequin_provider.change_arrow import rows_to_arrow  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.message_render import (  # noqa: E402
    COPY_BINARY_HEADER,
    COPY_BINARY_TRAILER,
    SinkRendering,
    render,
    stream_rows_copy_binary,
)
from sequin_provider.messages import message_template, metadata_head, metadata_tail  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402

RECORD = json.dumps({"id": 1, "account": 7, "amount": "12.50", "kind": "kind-3"})
TAIL = metadata_tail("4f1d2c8e-0b7a-4e59-9a36-1c2b3d4e5f60", "bench", "bench")
RENDERING = SinkRendering(
    "bench",
    "change",
    True,
    ("public\0events",),
    (metadata_head("public", "events"),),
    TAIL,
    ("insert", "update", "delete"),
    (message_template("public", "events", TAIL),),
)
"""A plain Sequin Stream sink of one table, whose messages ``fill`` writes."""


def answers(url: str) -> bool:
    """Whether an HTTP server answers 200 at ``url`` yet."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def bench_changes(numbers: range, groups: int) -> pa.RecordBatch:
    """Insert change rows of ``public.events`` (``RECORD``): number ``i`` at position
    (1000 + i // 10, i % 10), keyed ``i % groups``."""
    return rows_to_arrow(
        [
            (1000 + i // 10, i % 10, "2026-11-28T08:00:00.123456Z", 7, "public", "events", "insert")
            + (RECORD, None, [str(i % groups)], [], None, None)
            for i in numbers
        ]
    )


def fill(store_dsn: str, messages: int, groups: int, compact: bool = True) -> None:
    """``messages`` visible insert messages of sink ``bench`` over ``groups`` groups (primary keys),
    rendered and written as the stream app writes them (``message_render``; ``compact``: stored
    compact, as a plain sink's are). The acked ledger goes too: positions acked in an earlier run
    would not be written again."""
    with psycopg.connect(store_dsn) as conn:
        conn.execute("TRUNCATE sequin.stream_messages, sequin.stream_acked")
        conn.commit()
        ids = store.message_template_ids(conn, "sequin", [t for t in RENDERING.templates if t is not None])
        for lo in range(0, messages, 50_000):
            changes = bench_changes(range(lo, min(lo + 50_000, messages)), groups)
            body = stream_rows_copy_binary("bench", render(changes, RENDERING, compact=compact), ids)
            store.insert_stream_copy(
                conn, "sequin", [COPY_BINARY_HEADER, memoryview(body), COPY_BINARY_TRAILER], binary=True
            )
        store.advance_visible_lsn(conn, "sequin", ["bench"], 1000 + messages)
    with psycopg.connect(store_dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE sequin.stream_messages")


def http_consumer(args: tuple[str, str, int, float, Any]) -> int:
    """Receive + ack over HTTP until the deadline; returns messages acked.

    A plain ``http.client`` keep-alive loop: the consumers share this machine's 2 cores with the API
    and the store, and httpx costs about 22 µs of CPU per message at batch 100 against 8.5 µs for
    this loop (measured), so a heavier client would mostly measure itself. ``httpx_consumer`` is
    the same loop with httpx, reported beside it."""
    url, token, batch, seconds, barrier = args
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    receive_body = json.dumps({"batch_size": batch})
    acked = 0
    barrier.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        conn.request("POST", "/api/sequin_streams/bench/receive", receive_body, headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"receive answered {response.status}: {body[:200]!r}")
        got = json.loads(body)["data"]
        if not got:
            continue
        conn.request(
            "POST", "/api/sequin_streams/bench/ack", json.dumps({"ack_ids": [m["ack_id"] for m in got]}), headers
        )
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"ack answered {response.status}")
        acked += len(got)
    conn.close()
    return acked


def httpx_consumer(args: tuple[str, str, int, float, Any]) -> int:
    """``http_consumer`` with an httpx client."""
    url, token, batch, seconds, barrier = args
    acked = 0
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client:
        barrier.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got = client.post("/api/sequin_streams/bench/receive", json={"batch_size": batch}).json()["data"]
            if not got:
                continue
            client.post("/api/sequin_streams/bench/ack", json={"ack_ids": [m["ack_id"] for m in got]})
            acked += len(got)
    return acked


def sql_consumer(args: tuple[str, str, int, float, Any]) -> int:
    """The same receive + ack, straight against the store, on a connection set up as the API's."""
    store_dsn, _, batch, seconds, barrier = args
    acked = 0
    with psycopg.connect(store_dsn, autocommit=True) as conn:
        conn.execute("SET jit = off")
        barrier.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got = stream_queue.receive(conn, "sequin", "bench", batch, 30.0, 1_000_000)
            if got:
                stream_queue.ack(conn, "sequin", "bench", [d.ack_id for d in got])
                acked += len(got)
    return acked


def run_consumers(target: Any, where: str, token: str, consumers: int, batch: int, seconds: float) -> float:
    with mp.Manager() as manager:
        barrier = manager.Barrier(consumers)
        with mp.get_context("spawn").Pool(consumers) as pool:
            started = time.monotonic()
            counts = pool.map(target, [(where, token, batch, seconds, barrier)] * consumers)
            elapsed = time.monotonic() - started
    return sum(counts) / max(min(elapsed, seconds + 0.5), seconds)


class CountingHandler(BaseHTTPRequestHandler):
    """A minimal webhook endpoint: 200 for every POST, counts messages; GET returns the count."""

    count = 0
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with CountingHandler.lock:
            CountingHandler.count += len(body["data"]) if isinstance(body, dict) and "data" in body else 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        data = str(CountingHandler.count).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class BackloggedServer(ThreadingHTTPServer):
    """A listen backlog for every lane of every partition (the default, 5, refuses connections
    under the sink's 16 concurrent requests, and a refused request parks its batch: a run of this
    benchmark then waited 15 minutes for 100 messages only a buffer retry would deliver)."""

    request_queue_size = 256


def serve_counter(port: int) -> None:
    server = BackloggedServer(("127.0.0.1", port), CountingHandler)
    server.daemon_threads = True
    server.serve_forever()


def server_limit(url: str, batch: int, seconds: float) -> float:
    """Batched POSTs from 8 threads for ``seconds``: messages/s the endpoint itself takes."""
    message = render(bench_changes(range(1), 1), RENDERING).data[0].as_py()
    body = ('{"data":[' + ",".join([message] * batch) + "]}").encode()
    sent = [0] * 8

    def post(n: int) -> None:
        with httpx.Client(timeout=30) as client:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                client.post(url, content=body, headers={"Content-Type": "application/json"})
                sent[n] += batch

    threads = [threading.Thread(target=post, args=(n,)) for n in range(8)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(sent) / (time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each pull measurement")
    parser.add_argument("--changes", type=int, default=100_000, help="changes through the webhook sink")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-"))
    results: dict[str, Any] = {"seconds": args.seconds, "pull": [], "changes": args.changes}
    with EmbeddedPostgres(use_env_dsn=False) as pg:
        dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
        hook_port, api_port = free_port(), free_port()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE events (id bigint PRIMARY KEY, account int NOT NULL, amount numeric(12,2))")
        config_path = work / "sequin.yaml"
        hook = f'{{type: webhook, url: "http://127.0.0.1:{hook_port}/hook", batch_size: 100, concurrency: 8}}'
        sinks = sink(
            "bench",
            "{type: sequin_stream, max_ack_pending: 1000000, max_waiting: 100}",
            settings="    actions: [delete]\n",
        ) + sink("hook", hook)
        config_path.write_text(app_config(dsn, sinks, work / "ckpt", store_dsn=store_dsn))
        initialize(load_config(config_path))
        with psycopg.connect(store_dsn) as conn:
            token = stream_queue.create_token(conn, "sequin", "bench")
            conn.commit()

        # (a) pull API ------------------------------------------------------------------------
        api = subprocess.Popen(
            [sys.executable, "-m", "sequin_provider.cli", "--config", str(config_path), "api", "--port", str(api_port)],
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{api_port}"
        try:
            wait_for(lambda: answers(f"{url}/health"), 60, what="the API")
            for consumers in (1, 4, 16):
                for batch in (1, 10, 100):
                    fill(store_dsn, 300_000 if batch == 100 else 100_000, 50_000)
                    rate = run_consumers(http_consumer, url, token, consumers, batch, args.seconds)
                    results["pull"].append({"consumers": consumers, "batch_size": batch, "rate": rate})
                    print(
                        f"bench: pull API, {consumers} consumers, batch_size {batch}: {rate:,.0f} messages/s",
                        flush=True,
                    )
            fill(store_dsn, 300_000, 50_000)
            results["pull_httpx"] = run_consumers(httpx_consumer, url, token, 4, 100, args.seconds)
            print(
                f"bench: pull API, 4 httpx consumers, batch_size 100: {results['pull_httpx']:,.0f} messages/s",
                flush=True,
            )
        finally:
            api.terminate()
            api.wait(timeout=30)
        fill(store_dsn, 300_000, 50_000)
        results["pull_store_limit"] = run_consumers(sql_consumer, store_dsn, token, 4, 100, args.seconds)
        print(
            f"bench: store limit (SQL, 4 processes, batch 100): {results['pull_store_limit']:,.0f} messages/s",
            flush=True,
        )

        # (b) webhook ---------------------------------------------------------------------------
        server = mp.get_context("spawn").Process(target=serve_counter, args=(hook_port,), daemon=True)
        server.start()
        hook_url = f"http://127.0.0.1:{hook_port}"
        wait_for(lambda: answers(hook_url), 30, what="the webhook server")
        results["webhook_server_limit"] = server_limit(f"{hook_url}/hook", 100, args.seconds)
        print(f"bench: webhook server limit: {results['webhook_server_limit']:,.0f} messages/s", flush=True)
        app = StreamAppProcess(config_path, work / "app.log").start()
        received = ReceivedCount(hook_url)
        try:
            app.wait_streaming(store_dsn)
            base = received()
            started = time.time()
            with psycopg.connect(dsn, autocommit=True) as conn:
                for lo in range(1, args.changes + 1, 500):
                    conn.execute(
                        "INSERT INTO events SELECT g, g %% 1000, (g %% 10000) / 100.0 FROM generate_series(%s::bigint, %s::bigint) g",
                        (lo, min(lo + 499, args.changes)),
                    )
            wait_for(
                lambda: received() >= base + args.changes,
                900,
                interval=0.1,
                what="the webhook server to receive every change",
            )
            results["webhook_e2e"] = args.changes / (time.time() - started)
            print(f"bench: webhook sink end to end: {results['webhook_e2e']:,.0f} changes/s", flush=True)
        finally:
            received.close()
            app.stop()
            server.terminate()

    table = ["| measurement | messages/s |", "| --- | ---: |"]
    for row in results["pull"]:
        table.append(f"| pull API, {row['consumers']} consumers, batch_size {row['batch_size']} | {row['rate']:,.0f} |")
    table.append(f"| pull API, 4 consumers using httpx, batch_size 100 | {results['pull_httpx']:,.0f} |")
    table.append(
        f"| store limit: the same queries over SQL (4 processes, batch 100) | {results['pull_store_limit']:,.0f} |"
    )
    table.append(f"| webhook sink end to end (stream app -> local server, batch 100) | {results['webhook_e2e']:,.0f} |")
    table.append(
        f"| webhook server limit (8 threads posting batches of 100) | {results['webhook_server_limit']:,.0f} |"
    )
    print("\n".join(table))
    out = ROOT / "bench" / "results" / "delivery_throughput.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
