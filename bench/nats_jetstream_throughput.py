"""NATS JetStream sink benchmark: changes/s through the stream app into JetStream, beside nats-py's
own JetStream publish rate on the same server.

    .venv/bin/python bench/nats_jetstream_throughput.py [--changes 200000] [--server nats://127.0.0.1:4222]

One run on a fresh embedded cluster and a stream of its own on the server (deleted afterwards):
  (a) nats-py alone: messages like the sink's (the same JSON, a Nats-Msg-Id each) published to the
      stream, acknowledgements awaited per window of ``batch_size`` (the sink's way) and with
      4,000 in flight (the client's limit);
  (b) the stream app end to end: the `items`-style workload of bench/stream_throughput.py (inserts
      then updates, 500-row transactions) from the first commit to the last message in the stream.
Prints a Markdown table. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
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


def on_server(server: str, work: Any) -> Any:
    """``await work(client)`` on a fresh connection."""
    import nats

    async def main() -> Any:
        client = await nats.connect(server, connect_timeout=5, allow_reconnect=False)
        try:
            return await work(client)
        finally:
            await client.close()

    return asyncio.run(main())


def stream_messages(server: str, stream: str) -> int:
    async def count(client: Any) -> int:
        return (await client.jsm().stream_info(stream)).state.messages

    return on_server(server, count)


def sample_message(server: str, stream: str) -> bytes:
    async def last(client: Any) -> bytes:
        info = await client.jsm().stream_info(stream)
        return (await client.jsm().get_msg(stream, info.state.last_seq)).data

    return on_server(server, last)


def publish_limit(server: str, stream: str, subject: str, payload: bytes, count: int, window: int) -> float:
    """Messages/s of nats-py publishing ``count`` messages, ``window`` in flight, each acknowledged."""

    async def publish(client: Any) -> float:
        js = client.jetstream(timeout=30, publish_async_max_pending=max(window, 1) + 10)
        started = time.perf_counter()
        for lo in range(0, count, window):
            acks = [
                await js.publish_async(subject, payload, headers={"Nats-Msg-Id": f"limit-{window}-{n}"})
                for n in range(lo, min(lo + window, count))
            ]
            for ack in await asyncio.gather(*acks):
                assert ack.stream == stream and not ack.duplicate
        return count / (time.perf_counter() - started)

    return on_server(server, publish)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--warmup", type=int, default=20_000, help="changes streamed before measuring")
    parser.add_argument("--server", default="nats://127.0.0.1:4222")
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args()
    tag = uuid.uuid4().hex[:8]
    stream, subject = f"BENCH{tag}", f"bench{tag}.events"
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-nats-"))
    try:
        with EmbeddedPostgres(use_env_dsn=False) as pg:
            dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(TABLE)
            config_path = work / "sequin.yaml"
            destination = (
                f'{{type: nats_jetstream, servers: "{args.server}", subject: "{subject}", stream: {stream},'
                f' create_stream: true, stream_subjects: ["bench{tag}.>"], batch_size: {args.batch_size}}}'
            )
            config_path.write_text(app_config(dsn, sink("events", destination), work / "ckpt", store_dsn=store_dsn))
            initialize(load_config(config_path))
            app = StreamAppProcess(config_path, work / "app.log").start()
            try:
                app.wait_streaming(store_dsn)
                if args.warmup:
                    print(f"bench: warm-up with {args.warmup} changes ...", flush=True)
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        insert_rows(conn, WARMUP_FIRST_ID, args.warmup)
                    wait_for(lambda: stream_messages(args.server, stream) >= args.warmup, 600, what="the warm-up")
                before = stream_messages(args.server, stream)
                print(f"bench: writing {args.changes} changes ...", flush=True)
                t0, t_written = write_workload(dsn, args.changes, 1)
                wait_for(
                    lambda: stream_messages(args.server, stream) >= before + args.changes,
                    1800,
                    interval=0.2,
                    what="the stream to hold every change",
                )
                e2e_seconds = time.time() - t0
            finally:
                app.stop()
        payload = sample_message(args.server, stream)
        native = args.changes
        windowed = publish_limit(args.server, stream, f"bench{tag}.limit", payload, native, args.batch_size)
        pipelined = publish_limit(args.server, stream, f"bench{tag}.pipelined", payload, native, 4000)
    finally:
        try:
            on_server(args.server, lambda client: client.jsm().delete_stream(stream))
        except Exception as exc:  # noqa: BLE001  # a bench cleans up what it can
            print(f"bench: could not delete stream {stream}: {exc}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    e2e = args.changes / e2e_seconds
    record("nats_jetstream", e2e, pipelined, "nats-py JetStream publish, 4,000 in flight", acks_per_batch=windowed)
    print()
    print(f"| measure ({args.changes:,} messages of {len(payload)} bytes) | messages/s | vs nats-py pipelined |")
    print("|---|---:|---:|")
    print(f"| (a) nats-py JetStream publish, 4,000 in flight | {pipelined:,.0f} | 1.00 |")
    print(
        f"| (a') nats-py JetStream publish, acks awaited per {args.batch_size} | {windowed:,.0f} |"
        f" {windowed / pipelined:.2f} |"
    )
    print(
        f"| (b) end to end: commit -> acknowledged in the stream ({e2e_seconds:.1f}s; the writer alone"
        f" {t_written - t0:.1f}s) | {e2e:,.0f} | {e2e / pipelined:.2f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
