"""Replication stream benchmark: decode limit vs. our end-to-end throughput, and latency at 5k/s.

    .venv/bin/python bench/stream_throughput.py [--changes 300000] [--rate 5000] [--seconds 20]

One run on a fresh embedded cluster (source and store in separate databases):
  (a) pg_recvlogical draining the workload from its own pgoutput slot: the decode limit;
  (a') our pgoutput decoder (ChangeReader) alone draining a third slot: Python decode cost;
  (b) the stream app end to end: changes/s from the first commit to the last durable sink row;
  (c) commit -> sink latency p50/p99 at a steady rate (commit_timestamp vs. the sink row's insert time),
      and the CPU per change of each process at that rate (``--trigger-interval``: the app's
      stream.trigger_interval, which trades latency for CPU there).
Prints a Markdown table and writes bench/results/stream_throughput.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from devtools.embedded_postgres import EmbeddedPostgres, find_server_bindir  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.pgoutput import int_to_lsn, lsn_to_int  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.replication import ChangeReader, create_slot  # noqa: E402
from sequin_provider.store import READ_DATA, TEMPLATE_JOIN  # noqa: E402

TABLE = (
    "CREATE TABLE events (id bigint PRIMARY KEY, account int NOT NULL, amount numeric(12,2), kind text,"
    " payload jsonb, updated_at timestamptz NOT NULL DEFAULT now())"
)
ROW = "g, g % 1000, (g % 10000) / 100.0, 'kind-' || (g % 7), jsonb_build_object('n', g, 'tag', md5(g::text))"


_COUNTERS: dict[str, psycopg.Connection] = {}


def _counter(store_dsn: str) -> psycopg.Connection:
    """One kept connection per store (a new connection per poll would cost the machine a backend
    fork each time and skew the figures)."""
    conn = _COUNTERS.get(store_dsn)
    if conn is None or conn.closed:
        conn = _COUNTERS[store_dsn] = psycopg.connect(store_dsn, autocommit=True)
    return conn


def sink_count(store_dsn: str) -> int:
    """Changes the stream app has written to the store so far: the running total of its status row,
    which it adds to once a micro-batch's rows are committed, read in O(1). The benchmarks poll this
    every 0.1 s; counting the stream table instead scanned up to a million rows per poll, up to half a
    core of the store's CPU taken from the app being measured (measured: 80 ms per count at 1,000,000
    rows). Each benchmark writes one table to one sink, so this is the sink's message count;
    ``check_sink`` holds the two equal once per run."""
    row = _counter(store_dsn).execute("SELECT coalesce(sum(total_rows), 0) FROM sequin.stream_status").fetchone()
    return int(row[0])  # type: ignore[index]


def check_sink(store_dsn: str) -> None:
    """Fail the benchmark if the status total and the sink's rows disagree (one count, off the clock)."""
    rows = int(_counter(store_dsn).execute("SELECT count(*) FROM sequin.stream_messages").fetchone()[0])  # type: ignore[index]
    total = sink_count(store_dsn)
    if rows != total:
        raise SystemExit(f"the sink holds {rows:,} messages but the stream app counted {total:,}")


def current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return lsn_to_int(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]


WARMUP_FIRST_ID = 10_000_001  # the warm-ups' ids, above every workload's


def insert_rows(conn: psycopg.Connection, first_id: int, rows: int, txn_rows: int = 500) -> None:
    """Insert ``rows`` rows of ``events`` with ids from ``first_id``, in transactions of ``txn_rows``
    (``conn`` in autocommit): the workload's inserts and the benchmarks' warm-ups."""
    last = first_id + rows - 1
    for lo in range(first_id, last + 1, txn_rows):
        conn.execute(
            f"INSERT INTO events (id, account, amount, kind, payload)"
            f" SELECT {ROW} FROM generate_series({lo}, {min(lo + txn_rows - 1, last)}) g"
        )


def write_workload(dsn: str, changes: int, first_id: int, txn_rows: int = 500) -> tuple[float, float]:
    """Inserts then updates (half each) of ids from ``first_id``, in transactions of ``txn_rows``;
    returns (start, end) wall times."""
    inserts = changes // 2
    started = time.time()
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert_rows(conn, first_id, inserts, txn_rows)
        for lo in range(first_id, first_id + changes - inserts, txn_rows):
            hi = min(lo + txn_rows - 1, first_id + changes - inserts - 1)
            conn.execute(f"UPDATE events SET amount = amount + 1, updated_at = now() WHERE id BETWEEN {lo} AND {hi}")
    return started, time.time()


def run_pg_recvlogical(dsn: str, slot: str, end_lsn: int) -> float:
    """Seconds pg_recvlogical needs to stream the slot up to ``end_lsn`` (pgoutput, binary)."""
    binary = shutil.which("pg_recvlogical") or str(find_server_bindir() / "pg_recvlogical")
    out = Path(tempfile.mkdtemp()) / "recv.out"
    started = time.monotonic()
    subprocess.run(
        [
            binary,
            "-d",
            dsn,
            "--slot",
            slot,
            "--start",
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=bench_pub",
            "--endpos",
            int_to_lsn(end_lsn),
            "-f",
            str(out),
            "--no-loop",
        ],
        check=True,
        capture_output=True,
    )
    elapsed = time.monotonic() - started
    shutil.rmtree(out.parent, ignore_errors=True)
    return elapsed


def run_decoder_only(dsn: str, slot: str, start_lsn: int, end_lsn: int, expected: int) -> float:
    """Seconds our ChangeReader needs to decode the same workload (no Spark, no sink)."""
    reader = ChangeReader(dsn, slot, "bench_pub")
    reader.open(start_lsn)
    started = time.monotonic()
    seen = 0
    try:
        while seen < expected:
            result = reader.read(200_000, 1 << 30, 0.5)
            seen += len(result.rows)
            if result.transactions == 0 and reader.position and reader.position[0] >= end_lsn:
                break
    finally:
        reader.close()
    return time.monotonic() - started


STEADY_SESSION_OPTIONS = "-c synchronous_commit=on"
"""The steady writer's session commits as PostgreSQL does by default, flushing its WAL at each
commit (cheap here: the embedded cluster runs with ``fsync`` off). The cluster's own default is
``synchronous_commit=off``, for the throughput runs; under it a commit reaches the disk, and so any
logical decoder (walsender: flushed WAL only), at the WAL writer's next round (``wal_writer_delay``,
200 ms), which added 0-200 ms to every change's latency whatever the consumer."""


def steady_writes(dsn: str, rate: int, seconds: float, first_id: int) -> int:
    """``rate`` inserts/s into ``events`` in 100 transactions/s for ``seconds`` (ids from
    ``first_id``), committed as ``STEADY_SESSION_OPTIONS`` says; returns the rows written."""
    txn_rows = max(1, rate // 100)
    total, tick = 0, 0
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True, options=STEADY_SESSION_OPTIONS) as conn:
        while time.monotonic() - started < seconds:
            lo = first_id + tick * txn_rows
            conn.execute(
                f"INSERT INTO events (id, account, amount, kind, payload) SELECT {ROW}"
                f" FROM generate_series({lo}, {lo + txn_rows - 1}) g"
            )
            total += txn_rows
            tick += 1
            pause = started + tick / 100.0 - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    return total


SETTLE_SECONDS = 5
"""Seconds of the steady rate written before the measured window, not measured. The window then
starts in the steady state the figure names, not in the aftermath of the throughput runs just
before it (the store's autovacuum and checkpoint, the JVM collecting the big batches' garbage): in
runs of 2026-11-27 the first 2-3 s after the bursts held micro-batches of 125-300 ms against 60-80
ms after, and they alone made a p99 of 230-350 ms. ``bench/compare.py`` settles every contender alike."""


def latency_run(
    dsn: str, store_dsn: str, rate: int, seconds: int, first_id: int, settle: int = SETTLE_SECONDS
) -> dict[str, float]:
    """Steady ``rate`` changes/s for ``settle`` then ``seconds`` seconds (``steady_writes``); commit ->
    durable sink row percentiles (ms) of the changes of the last ``seconds``."""
    before = sink_count(store_dsn)
    settled = steady_writes(dsn, rate, settle, first_id) if settle else 0
    first_id += settled
    started = time.monotonic()
    total = steady_writes(dsn, rate, seconds, first_id)
    achieved = total / (time.monotonic() - started)
    wait_for(lambda: sink_count(store_dsn) >= before + settled + total, 120, what="latency run to drain")
    with psycopg.connect(store_dsn) as conn:
        row = conn.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY ms),"
            f" max(ms) FROM ({LATENCIES_MS}) t",
            (first_id, first_id + total - 1),
        ).fetchone()
    return {"rate": achieved, "p50_ms": float(row[0]), "p99_ms": float(row[1]), "max_ms": float(row[2])}  # type: ignore[index]


_MESSAGE = READ_DATA.format(m="m", s="sequin", t="t")
LATENCIES_MS = (
    f"SELECT extract(epoch FROM m.inserted_at - (({_MESSAGE})::json->'metadata'->>'commit_timestamp')::timestamptz)"
    f" * 1000 AS ms FROM sequin.stream_messages m {TEMPLATE_JOIN.format(s='sequin', t='t', template='m.template')}"
    f" WHERE (({_MESSAGE})::json->'record'->>'id')::bigint BETWEEN %s AND %s"
)
"""Each message's milliseconds from its commit to its row in the store (``ms``), of the benchmark
rows whose ids lie between two bounds (parameters), as consumers are served them (``READ_DATA``)."""


APP_CLASSES = ("Spark JVM", "reader process", "Python workers", "driver")
"""The classes of ``process_class`` that are the stream app's own processes (standalone executors'
JVMs and Python workers included: they are classed by their command lines, wherever they run)."""


def print_cpu_by_class(cpu: dict[str, float], changes: int) -> None:
    """One line per class of ``cpu``, busiest first: its CPU seconds and µs per change."""
    width = max(map(len, cpu), default=0)
    for klass, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"  {klass:<{width}} {seconds:6.1f}s  {1e6 * seconds / changes:5.1f} us/change")


STORE_BACKENDS = "postgres: store backends (stream writes, status)"
"""Backends of a store database (the benchmarks name theirs ``bench_store``, ``store_N``...)."""
SOURCE_BACKENDS = "postgres: source backends (the workload's sessions)"
"""Backends of any other database: the benchmarks' sources."""
SERVER_PROCESSES = "postgres: server processes (postmaster, checkpointer, autovacuum...)"


def backend_database(cmd: str) -> str | None:
    """The database a Postgres backend serves, from its command line (``postgres: [cluster:] user
    database host state``); None for the server's own processes (postmaster, checkpointer,
    autovacuum...)."""
    words = cmd.split()
    if len(words) > 1 and words[1].endswith(":"):  # the server's cluster_name
        del words[1]
    if len(words) < 4 or words[0] != "postgres:" or words[1] in ("autovacuum", "logical", "parallel"):
        return None
    return words[2]


def process_class(proc: psutil.Process) -> str | None:
    """Which part of the system a process is, by its command line."""
    try:
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if name == "postgres" or cmd.startswith("postgres"):
        if "walsender" in cmd or "START_REPLICATION" in cmd:
            return "postgres: walsender (logical decoding)"
        database = backend_database(cmd)
        if database is None:
            return SERVER_PROCESSES
        return STORE_BACKENDS if "store" in database else SOURCE_BACKENDS
    if "java" in name:
        return "Spark JVM"
    if "python_streaming_source_runner" in cmd:
        return "reader process (pgoutput decode, spool)"
    if "pyspark.daemon" in cmd or "pyspark/daemon" in cmd or "pyspark.worker" in cmd:
        return "Python workers (spool read, COPY)"
    if "replication_stream.py" in cmd:
        return "driver (foreachBatch)"
    if proc.pid == os.getpid():
        return "this benchmark (workload client, polling)"
    return None


def cpu_by_class(
    classify: Callable[[psutil.Process], str | None] = process_class, exited: bool = True
) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process that belongs to the pipeline (``classify``), and with
    ``exited`` of the servers' exited backends (their postmaster's reaped children)."""
    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter():
        klass = classify(proc)
        if klass is None:
            continue
        try:  # a process can exit between its classification and these reads
            times = proc.cpu_times()
            has_parent = bool(proc.ppid())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[proc.pid] = (klass, times.user + times.system)
        if exited and klass.startswith("postgres") and has_parent and _is_postmaster(proc):
            # backends that exited in between (per-task store connections, the writer's sessions)
            # are charged to their postmaster once reaped: their CPU would otherwise go unseen
            out[-proc.pid] = (EXITED_BACKENDS, times.children_user + times.children_system)
    return out


EXITED_BACKENDS = "postgres: exited backends (short sessions)"


def _is_postmaster(proc: psutil.Process) -> bool:
    """The server's main process (its parent is not a postgres process)."""
    try:
        return psutil.Process(proc.ppid()).name() != "postgres"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per class between two samples (processes born in between count from zero)."""
    totals: dict[str, float] = {}
    for pid, (klass, seconds) in after.items():
        totals[klass] = totals.get(klass, 0.0) + seconds - (before.get(pid, (klass, 0.0))[1])
    return totals


def batch_breakdown(log_text: str) -> dict[str, float]:
    """Sums of the pipeline's per-batch figures and Spark's phase timings from the app log."""
    batch = re.compile(r"batch \d+: (\d+) changes -> \d+ new messages in ([\d.]+)s \(store COPY ([\d.]+)s")
    progress = re.compile(r"progress batch \d+: (\d+) input rows, (.*)")
    totals: dict[str, float] = {"batches": 0.0, "rows": 0.0, "foreach_batch": 0.0, "store_copy": 0.0}
    for m in batch.finditer(log_text):
        totals["batches"] += 1
        totals["rows"] += int(m.group(1))
        totals["foreach_batch"] += float(m.group(2))
        totals["store_copy"] += float(m.group(3))
    for m in progress.finditer(log_text):
        for key, value in re.findall(r"(\w+)=(\d+)", m.group(2)):
            totals[f"spark_{key}_s"] = totals.get(f"spark_{key}_s", 0.0) + int(value) / 1000.0
    return totals


def keep_batch_lines(name: str, log_text: str) -> None:
    """Write the app log's batch lines of one part of the run (sizes, paths, Spark phases) to
    ``bench/results/<name>`` (gitignored), to read after the run."""
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("\n".join(line for line in log_text.splitlines() if "batch" in line))


def add_pg_setting_argument(parser: argparse.ArgumentParser) -> None:
    """``--pg-setting NAME=VALUE`` (repeatable): a server setting of the benchmark's embedded cluster,
    over its defaults (``EmbeddedPostgres``), to measure how the figures depend on the server's tuning."""
    parser.add_argument(
        "--pg-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=_pg_setting,
        help="a setting of the embedded cluster, e.g. shared_buffers=4GB (repeatable)",
    )


def _pg_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    # pg_ctl hands the settings to a shell: names and values stay within these characters
    if not sep or not re.fullmatch(r"[a-z_][a-z0-9_.]*", name) or not re.fullmatch(r"[A-Za-z0-9_.:/+-]+", value):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (letters, digits, _ . : / + -), got {text!r}")
    return name, value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=300_000)
    parser.add_argument("--rate", type=int, default=5_000)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument(
        "--settle", type=int, default=SETTLE_SECONDS, help="seconds at the steady rate before (c) measures"
    )
    parser.add_argument("--runs", type=int, default=3, help="repetitions of (b); the median is reported")
    parser.add_argument("--warmup", type=int, default=100_000, help="changes streamed before measuring (JIT warm-up)")
    parser.add_argument(
        "--driver-batch-rows",
        type=int,
        default=None,
        help="the app's stream.driver_batch_rows (default: the app's own; 0: every micro-batch runs its Spark job)",
    )
    parser.add_argument(
        "--trigger-interval",
        default=None,
        help="the app's stream.trigger_interval (e.g. 100ms; default: the app's own; 0: each micro-batch as soon as"
        " the last one ends)",
    )
    add_pg_setting_argument(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-"))
    results: dict[str, object] = {
        "changes": args.changes,
        "runs": args.runs,
        "pg_settings": dict(args.pg_setting),
    }
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(TABLE)
        config_path = work / "sequin.yaml"
        batch_rows = "null" if args.driver_batch_rows is None else args.driver_batch_rows
        interval = "" if args.trigger_interval is None else f", trigger_interval: {args.trigger_interval}"
        config_path.write_text(
            app_config(
                dsn,
                sink("events", "{type: sequin_stream}"),
                work / "ckpt",
                store_dsn=store_dsn,
                stream=f", driver_batch_rows: {batch_rows}{interval}",
            )
        )
        config = load_config(config_path)
        results["trigger_interval"] = f"{config.stream.trigger_interval * 1000:g}ms"  # the app's, set or default
        initialize(config)
        app = StreamAppProcess(config_path, work / "app.log").start()
        try:
            app.wait_streaming(store_dsn)
            if args.warmup:
                print(f"bench: warm-up with {args.warmup} changes ...", flush=True)
                warm = sink_count(store_dsn)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    insert_rows(conn, WARMUP_FIRST_ID, args.warmup)
                wait_for(lambda: sink_count(store_dsn) >= warm + args.warmup, 600, what="the warm-up")
            with psycopg.connect(dsn, autocommit=True) as conn:  # the reference slots see only the workload
                start_lsn = create_slot(conn, "recv_slot")
                create_slot(conn, "decoder_slot")
            print(f"bench: writing {args.changes} changes (inserts then updates, 500-row transactions) ...", flush=True)
            log_mark = app.log_path.stat().st_size
            cpu_before = cpu_by_class()
            machine_before = psutil.cpu_times()
            rates: list[float] = []
            busy_seconds = 0.0
            for run in range(args.runs):
                before = sink_count(store_dsn)
                t0, t_written = write_workload(dsn, args.changes, 1 + run * args.changes)
                wait_for(
                    lambda before=before: sink_count(store_dsn) >= before + args.changes,
                    900,
                    interval=0.1,
                    what="the sink to catch up",
                )
                t_done = time.time()
                check_sink(store_dsn)
                rates.append(args.changes / (t_done - t0))
                busy_seconds += t_done - t0
                print(
                    f"bench: run {run + 1}: end to end {rates[-1]:,.0f} changes/s ({t_done - t0:.1f}s; the writer "
                    f"alone took {t_written - t0:.1f}s)",
                    flush=True,
                )
            end_lsn = current_lsn(dsn)
            cpu = cpu_delta(cpu_before, cpu_by_class())
            machine_after = psutil.cpu_times()
            results["cpu_seconds"] = cpu
            results["machine_busy_seconds"] = (
                sum(machine_after)
                - sum(machine_before)
                - (machine_after.idle - machine_before.idle)
                - (machine_after.iowait - machine_before.iowait)
            )
            e2e = statistics.median(rates)
            results.update(e2e_rates=rates, e2e_rate=e2e, e2e_seconds=busy_seconds)
            throughput_log = app.log_path.read_bytes()[log_mark:].decode(errors="replace")
            keep_batch_lines("throughput_batches.log", throughput_log)
            log_mark = app.log_path.stat().st_size
            cpu_before, changes_before = cpu_by_class(), sink_count(store_dsn)
            latency = latency_run(dsn, store_dsn, args.rate, args.seconds, args.runs * args.changes + 1, args.settle)
            results["latency_cpu_seconds"] = cpu_delta(cpu_before, cpu_by_class())
            results["latency_changes"] = sink_count(store_dsn) - changes_before
            latency_log = app.log_path.read_bytes()[log_mark:].decode(errors="replace")
            keep_batch_lines("latency_batches.log", latency_log)
            results["latency"] = latency
            print(
                f"bench: latency at {latency['rate']:,.0f}/s: p50 {latency['p50_ms']:.0f} ms, p99 {latency['p99_ms']:.0f} ms",
                flush=True,
            )
        finally:
            app.stop()
        breakdown = batch_breakdown(throughput_log)
        recv_seconds = run_pg_recvlogical(dsn, "recv_slot", end_lsn)
        total_changes = args.runs * args.changes
        decoder_seconds = run_decoder_only(dsn, "decoder_slot", start_lsn, end_lsn, total_changes)
    shutil.rmtree(work, ignore_errors=True)
    recv_rate = total_changes / recv_seconds
    decoder_rate = total_changes / decoder_seconds
    results.update(
        recv_seconds=recv_seconds,
        recv_rate=recv_rate,
        decoder_seconds=decoder_seconds,
        decoder_rate=decoder_rate,
        breakdown=breakdown,
    )
    lat = results["latency"]  # type: ignore[assignment]
    print()
    print("| measure | changes/s | seconds | vs pg_recvlogical |")
    print("|---|---:|---:|---:|")
    print(f"| (a) pg_recvlogical, pgoutput decode limit | {recv_rate:,.0f} | {recv_seconds:.1f} | 1.00 |")
    print(
        f"| (a') our pgoutput decoder alone (ChangeReader) | {decoder_rate:,.0f} | {decoder_seconds:.1f} | {decoder_rate / recv_rate:.2f} |"
    )
    print(
        f"| (b) end to end: commit -> durable Sequin Stream row, median of {args.runs} (min {min(rates):,.0f}, "
        f"max {max(rates):,.0f}) | {e2e:,.0f} | {results['e2e_seconds']:.1f} | {e2e / recv_rate:.2f} |"
    )
    print(
        f"| (c) latency at {lat['rate']:,.0f} changes/s | p50 {lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms, max {lat['max_ms']:.0f} ms | | |"
    )
    if breakdown["batches"]:
        phases = ", ".join(f"{k[6:-2]} {v:.1f}s" for k, v in sorted(breakdown.items()) if k.startswith("spark_"))
        print(
            f"\nwhere the time goes in (b): {breakdown['batches']:.0f} micro-batches, {breakdown['rows']:,.0f} rows; "
            f"Spark phases (summed): {phases}; inside addBatch, the store COPYs took {breakdown['store_copy']:.1f}s "
            f"(summed over partitions, which run in parallel)"
        )
    cpu = results.get("cpu_seconds") or {}
    if cpu:
        total_cpu = sum(cpu.values())
        busy = results["machine_busy_seconds"]
        print(
            f"\nCPU during (b): the machine was busy {busy:.1f} of {psutil.cpu_count() * results['e2e_seconds']:.1f} "
            f"core-seconds ({100 * busy / (psutil.cpu_count() * results['e2e_seconds']):.0f}%, "
            f"{1e6 * busy / total_changes:.0f} us of CPU per change); by process (long-lived ones, "
            f"{total_cpu:.1f}s of it):"
        )
        print_cpu_by_class(cpu, total_changes)
    lat_cpu, lat_changes = results.get("latency_cpu_seconds") or {}, int(results.get("latency_changes") or 0)
    if lat_cpu and lat_changes:
        app = {k: v for k, v in lat_cpu.items() if k.startswith(APP_CLASSES)}
        print(
            f"\nCPU during (c) ({lat_changes:,} changes at the steady rate, its settle included; trigger_interval "
            f"{results['trigger_interval']}): the app's processes {1e6 * sum(app.values()) / lat_changes:.1f} us per change, "
            f"all processes {1e6 * sum(lat_cpu.values()) / lat_changes:.1f}:"
        )
        print_cpu_by_class(lat_cpu, lat_changes)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_throughput.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
