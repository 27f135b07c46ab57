"""RabbitMQ sink benchmark: changes/s through the stream app beside the broker's limit with pika alone.

    .venv/bin/python bench/rabbitmq_throughput.py [--changes 200000] [--warmup 20000]

Needs RabbitMQ on 127.0.0.1:5672 (guest/guest). One run on a fresh embedded cluster, an exchange and a
queue of its own (deleted afterwards), the ``events`` workload of bench/stream_throughput.py:
  (a) the stream app end to end: changes/s from the first commit to the last message in the queue
      (a ``rabbitmq`` sink, batch_size 100, one fixed routing key);
  (b) the broker's limit with pika alone: 4 threads, each its own connection, publishing the same
      messages with ``BlockingChannel.confirm_delivery`` (a confirm awaited per message);
  (c) the sink's publisher alone (``RabbitMQPublisher``: 4 threads, requests of 100, confirms awaited
      once per request), without Spark or Postgres.
Counts what is in the queue with a passive declare (no consumer). Prints a Markdown table and writes
bench/results/rabbitmq_throughput.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.destination_results import record  # noqa: E402
from bench.stream_throughput import TABLE, WARMUP_FIRST_ID, insert_rows, write_workload  # noqa: E402 - the stream benchmark's workload
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config, parse_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from tests.support.rabbitmq import URL, QueueReader, rabbitmq_running, unique_name  # noqa: E402

THREADS = 4
BATCH = 100
MESSAGE = json.dumps(
    {
        "record": {"id": 1, "account": 1, "amount": "0.01", "kind": "kind-1", "payload": {"n": 1, "tag": "x" * 32}},
        "changes": None,
        "action": "insert",
        "metadata": {"table_schema": "public", "table_name": "events", "idempotency_key": "1:0"},
    }
)


def queued(reader: QueueReader) -> int:
    """Messages in the reader's queue now."""
    return int(reader.channel.queue_declare(reader.queue, passive=True).method.message_count)


def threaded(count: int, work: Callable[[int], None]) -> float:
    """Seconds for ``THREADS`` threads to each run ``work(count // THREADS)``."""
    threads = [threading.Thread(target=work, args=(count // THREADS,)) for _ in range(THREADS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def pika_limit(exchange: str, count: int) -> float:
    """Messages/s of pika alone: confirmed publishes (one confirm awaited per message)."""
    import pika

    def publish(n: int) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(URL))
        channel = connection.channel()
        channel.confirm_delivery()
        props = pika.BasicProperties(content_type="application/json", delivery_mode=2, message_id="1:0")
        for _ in range(n):
            channel.basic_publish(exchange, "bench.events", MESSAGE.encode(), props, mandatory=True)
        connection.close()

    return count / threaded(count, publish)


def publisher_alone(exchange: str, count: int) -> float:
    """Messages/s of the sink's publisher alone (requests of ``BATCH``, ``THREADS`` at a time)."""
    sink = parse_config(
        {
            "databases": [{"name": "b", "dsn": "postgresql:///x"}],
            "sinks": [
                {
                    "name": "b",
                    "tables": ["events"],
                    "destination": {"type": "rabbitmq", "exchange": exchange, "routing_key": "bench.events"},
                }
            ],
        },
        "bench",
    ).sinks[0]
    pusher = sink.destination.kind.pusher(sink)
    batch, keys = [MESSAGE] * BATCH, [f"{n}:0" for n in range(BATCH)]

    def publish(n: int) -> None:
        for _ in range(n // BATCH):
            pusher.send(batch, keys)

    try:
        return count / threaded(count, publish)
    finally:
        pusher.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--warmup", type=int, default=20_000, help="changes streamed before measuring")
    args = parser.parse_args()
    if not rabbitmq_running():
        print("bench: needs RabbitMQ on 127.0.0.1:5672", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"changes": args.changes}
    reader = QueueReader(unique_name("sequin-bench"), ("bench.events",), exchange_type="direct")
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-"))
    try:
        with EmbeddedPostgres(use_env_dsn=False) as pg:
            dsn = pg.create_database("bench")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(TABLE)
            config_path = work / "sequin.yaml"
            destination = (
                f"{{type: rabbitmq, exchange: {reader.exchange}, routing_key: bench.events, batch_size: {BATCH}}}"
            )
            config_path.write_text(app_config(dsn, sink("events", destination), work / "ckpt"))
            initialize(load_config(config_path))
            app = StreamAppProcess(config_path, work / "app.log").start()
            try:
                app.wait_streaming(dsn)
                if args.warmup:
                    print(f"bench: warm-up with {args.warmup} changes ...", flush=True)
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        insert_rows(conn, WARMUP_FIRST_ID, args.warmup)
                    wait_for(lambda: queued(reader) >= args.warmup, 600, what="the warm-up")
                before = queued(reader)
                print(f"bench: writing {args.changes} changes (inserts then updates) ...", flush=True)
                t0, t_written = write_workload(dsn, args.changes, 1)
                wait_for(
                    lambda: queued(reader) >= before + args.changes, 900, interval=0.1, what="the queue to catch up"
                )
                t_done = time.time()
                results.update(
                    e2e_rate=args.changes / (t_done - t0), e2e_seconds=t_done - t0, writer_seconds=t_written - t0
                )
                print(f"bench: end to end {results['e2e_rate']:,.0f} changes/s ({t_done - t0:.1f}s)", flush=True)
            finally:
                app.stop()
        reader.channel.queue_purge(reader.queue)
        limit_count = min(args.changes, 40_000)
        results["pika_confirm_each"] = pika_limit(reader.exchange, limit_count)
        reader.channel.queue_purge(reader.queue)
        results["publisher_alone"] = publisher_alone(reader.exchange, limit_count)
    finally:
        reader.close()
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "rabbitmq_throughput.json").write_text(json.dumps(results, indent=2) + "\n")
    record(
        "rabbitmq",
        results["e2e_rate"],
        results["pika_confirm_each"],
        f"pika alone, {THREADS} connections, a confirm per message",
        publisher_alone=results["publisher_alone"],
    )
    print()
    print("| measure | messages/s |")
    print("|---|---:|")
    print(f"| (a) end to end: commit -> message in the queue ({args.changes:,} changes) | {results['e2e_rate']:,.0f} |")
    print(f"| (b) pika alone, {THREADS} connections, a confirm per message | {results['pika_confirm_each']:,.0f} |")
    print(
        f"| (c) the sink's publisher alone, {THREADS} threads, requests of {BATCH} | {results['publisher_alone']:,.0f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
