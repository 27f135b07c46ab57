"""The decoder's CPU per change when it holds a whole batch, at glibc's defaults and with the heap's pages kept.

    .venv/bin/python bench/heap_pages.py [--batch 20000] [--batches 12] [--rounds 3]

The reader decodes a batch of changes and holds them until the batch is spooled; the next batch
is decoded after the last was freed. At glibc's defaults ``free`` gives the top of the heap back
to the kernel, so each batch faults its pages in again, zeroed (``worker_heap.keep_heap_pages``
says why that is the reader's largest kernel cost for wide rows). This captures real pgoutput
updates of one embedded cluster (``decode_throughput.capture``: 100 B and 1.6 kB rows, replica
identity default and full), then, for each shape, decodes ``--batches`` batches of ``--batch``
updates in a child process, holding each batch until the next: one child at glibc's defaults, one
after ``keep_heap_pages``, alternating for ``--rounds`` rounds (each child a fresh process, as the
setting is process-wide). The first two batches of a child are its warm-up. Prints the median CPU
per change and minor page faults per batch of each; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode_throughput import SHAPES, capture, relations_decoder, table_name  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402

MODES = ("glibc defaults", "pages kept")
WARMUP_BATCHES = 2


def held_batches(dsn: str, payloads_path: str, table: str, mode: str, batch: int, batches: int) -> list[list[float]]:
    """In this (child) process: ``[CPU seconds, minor faults]`` of decoding each batch of ``table``'s
    updates after its warm-up, each batch held until the next is decoded."""
    import gc
    import pickle

    from sequin_provider.spark import source, worker_heap

    gc.set_threshold(*source.READER_GC_THRESHOLDS)
    if mode == MODES[1] and not worker_heap.keep_heap_pages():
        raise SystemExit("keep_heap_pages had no effect: the C library is not glibc")
    # read a frame at a time: one big read, once freed, would raise glibc's trim threshold
    with open(payloads_path, "rb") as f:
        payloads = pickle.load(f)
    decoder = relations_decoder(dsn, payloads, compiled=True)
    names = {rel_id: rel.name for rel_id, rel in decoder.relations.items()}
    updates = [p for p in payloads if p[:1] == b"U" and names[int.from_bytes(p[1:5], "big")] == table]
    decoder.decode(next(p for p in payloads if p[:1] == b"B"))
    messages = (updates * (batch // len(updates) + 1))[:batch]
    costs = []
    for _ in range(batches):
        faults, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        rows = [decoder.decode(m) for m in messages]
        costs.append([time.process_time() - started, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults])
        del rows
    return costs[WARMUP_BATCHES:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=20_000, help="updates decoded and held per batch")
    parser.add_argument("--batches", type=int, default=12, help="batches per child process (two are warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="children per mode and shape, alternating")
    parser.add_argument("--rows", type=int, default=2000, help="rows per shape captured (each inserted, then updated)")
    parser.add_argument("--child", nargs=4, metavar=("DSN", "PAYLOADS", "TABLE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(held_batches(*args.child, args.batch, args.batches)))
        return 0
    import pickle
    import tempfile

    with EmbeddedPostgres(use_env_dsn=False) as pg, tempfile.TemporaryDirectory() as work:
        dsn = pg.create_database("heap_bench")
        payloads, _ = capture(dsn, args.rows)
        payloads_path = str(Path(work) / "payloads.pickle")
        Path(payloads_path).write_bytes(pickle.dumps(payloads))
        results: dict[tuple[str, str, str], list[list[float]]] = {}
        for width, identity in SHAPES:
            table = table_name(width, identity)
            for _ in range(args.rounds):
                for mode in MODES:
                    out = subprocess.run(
                        [sys.executable, __file__, "--batch", str(args.batch), "--batches", str(args.batches)]
                        + ["--child", dsn, payloads_path, table, mode],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    results.setdefault((width, identity, mode), []).extend(json.loads(out.stdout))
    print(
        f"| row | replica identity | µs per update, {MODES[0]} | {MODES[1]} | faults per batch, {MODES[0]} | {MODES[1]} |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for width, identity in SHAPES:
        default, kept = (results[(width, identity, mode)] for mode in MODES)
        cost = [statistics.median(c for c, _ in runs) / args.batch * 1e6 for runs in (default, kept)]
        faults = [statistics.median(f for _, f in runs) for runs in (default, kept)]
        print(f"| {width} | {identity} | {cost[0]:.2f} | {cost[1]:.2f} | {faults[0]:,.0f} | {faults[1]:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
