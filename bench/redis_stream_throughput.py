"""Redis Stream sink benchmark: changes/s into Redis through the stream app, beside Redis's own limit.

    .venv/bin/python bench/redis_stream_throughput.py [--changes 200000] [--warmup 20000]

One run on a fresh embedded cluster and the machine's Redis (127.0.0.1:6379 unless --url):
  (a) the stream app end to end: changes/s from the first commit of the ``events`` workload
      (bench/stream_throughput.py's, inserts then updates in 500-row transactions) to the last
      entry in Redis (sink ``redis_stream``, one stream, batch_size 100);
  (a') the sink's sender alone (``RedisStreamSender.send``: one idempotent add script per 100
       messages), one connection, the same messages: its cost without Spark;
  (b) Redis's limit with its native client alone: plain ``XADD`` of the same messages, pipelined
      1,000 per round trip on one connection.
Prints a Markdown table and writes bench/results/redis_stream_throughput.json. Every key it makes is
under a fresh prefix and deleted at the end. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.destination_results import record  # noqa: E402
from bench.stream_throughput import TABLE, WARMUP_FIRST_ID, insert_rows, write_workload  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.sinks.routing import Route  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "redis_stream_throughput.json"


def sample_messages(client: Any, key: str, count: int) -> tuple[list[str], list[str]]:
    """``count`` messages and idempotency keys shaped like the stream's (its entries, repeated with new keys)."""
    found = [(f[b"data"].decode(), f[b"key"].decode()) for _, f in client.xrange(key, count=1000)]
    messages = [found[i % len(found)][0] for i in range(count)]
    return messages, [f"bench:{i}" for i in range(count)]


def native_xadd(client: Any, key: str, messages: list[str], keys: list[str], pipeline: int = 1000) -> float:
    """Messages/s of plain pipelined XADD on one connection."""
    started = time.monotonic()
    for lo in range(0, len(messages), pipeline):
        pipe = client.pipeline(transaction=False)
        for m, k in zip(messages[lo : lo + pipeline], keys[lo : lo + pipeline]):
            pipe.xadd(key, {"data": m, "key": k})
        pipe.execute()
    return len(messages) / (time.monotonic() - started)


def sender_alone(config_path: Path, stream: str, messages: list[str], keys: list[str]) -> float:
    """Messages/s of the sink's own sender (the add script, 100 per request) on one connection."""
    sink = load_config(config_path).sinks[0]
    sender = sink.destination.kind.pusher(sink)
    sender.route = Route(stream, ((stream, None),))  # a fixed key of the benchmark's own
    try:
        started = time.monotonic()
        for lo in range(0, len(messages), sender.batch_size):
            sender.send(messages[lo : lo + sender.batch_size], keys[lo : lo + sender.batch_size])
        return len(messages) / (time.monotonic() - started)
    finally:
        sender.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--warmup", type=int, default=20_000, help="changes streamed before measuring")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    import redis

    client = redis.Redis.from_url(args.url, socket_timeout=30)
    prefix = f"sequin-bench-{uuid.uuid4().hex[:8]}"
    key = f"{prefix}.events"
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-redis-"))
    results: dict[str, Any] = {"changes": args.changes}
    try:
        with EmbeddedPostgres(use_env_dsn=False) as pg:
            dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(TABLE)
            config_path = work / "sequin.yaml"
            destination = f'{{type: redis_stream, url: "{args.url}", stream_key: "{key}", batch_size: 100}}'
            config_path.write_text(app_config(dsn, sink("events", destination), work / "ckpt", store_dsn=store_dsn))
            initialize(load_config(config_path))
            app = StreamAppProcess(config_path, work / "app.log").start()
            try:
                app.wait_streaming(store_dsn)
                if args.warmup:
                    print(f"bench: warm-up with {args.warmup} changes ...", flush=True)
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        insert_rows(conn, WARMUP_FIRST_ID, args.warmup)
                    wait_for(lambda: client.xlen(key) >= args.warmup, 600, what="the warm-up")
                base = client.xlen(key)
                print(f"bench: writing {args.changes} changes (inserts then updates) ...", flush=True)
                started, written = write_workload(dsn, args.changes, 1)
                wait_for(lambda: client.xlen(key) >= base + args.changes, 1800, what="every change in Redis")
                ended = time.time()
                time.sleep(1.0)
                if client.xlen(key) != base + args.changes:
                    raise SystemExit(f"Redis holds {client.xlen(key) - base:,} new entries, expected {args.changes:,}")
                results["end_to_end"] = args.changes / (ended - started)
                results["write_seconds"] = written - started
            finally:
                app.stop()
            messages, keys = sample_messages(client, key, args.changes)
            results["sender_alone"] = sender_alone(config_path, f"{prefix}.sender", messages, keys)
            results["native_xadd"] = native_xadd(client, f"{prefix}.native", messages, keys)
            results["message_bytes"] = sum(map(len, messages)) // len(messages)
    finally:
        stale = list(client.scan_iter(match=f"{prefix}*", count=10_000))
        for lo in range(0, len(stale), 1000):
            client.delete(*stale[lo : lo + 1000])
        client.close()
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    record(
        "redis_stream",
        results["end_to_end"],
        results["native_xadd"],
        "plain XADD pipelined 1,000 per round trip",
        sender_alone=results["sender_alone"],
    )
    print()
    print(f"| {args.changes:,} changes, ~{results['message_bytes']} B messages | changes/s |")
    print("|---|---:|")
    print(f"| (a) stream app -> redis_stream sink, end to end | {results['end_to_end']:,.0f} |")
    print(f"| (a') the sink's sender alone (idempotent add script, 100 per request) | {results['sender_alone']:,.0f} |")
    print(f"| (b) Redis limit: plain XADD pipelined 1,000 per round trip | {results['native_xadd']:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
