"""Backfill benchmark: rows/s from start to every row in the sink, beside COPY of the same table.

    .venv/bin/python bench/backfill_throughput.py [--rows 1000000] [--write-rate 2000]

One run on a fresh embedded cluster (source and store in separate databases):
  (a) ``COPY (SELECT * FROM t) TO STDOUT`` of the table: the read limit;
  (b) a full backfill into a Sequin Stream sink with the stream app running and the table idle
      (``--idle-runs`` times, the stream table emptied in between as consumers empty it, their
      acks deleting the previous run's reads and a VACUUM after them: the first run of a fresh
      cluster also creates, among other things, the table's pages and the WAL segments that later
      runs reuse, as a store that has taken such bursts before does):
      rows/s from ``sequin backfill start`` to the last read durable in the sink, and from the
      backfill's ``running`` to ``completed`` (without the start of its local Spark);
  (b') the same into a sink with a filter, whose reads go through the stream app's Spark
      pipeline instead of being written by the backfill task (measured last, with a stream app
      restarted with that sink: a filter makes every micro-batch a Spark job, so the other runs
      get a stream app with the plain sink alone, as a deployment without filters has);
  (c) (b) while a writer updates random rows at ``--write-rate`` changes/s;
  (d) (b) with a backfill server up (``sequin backfill serve``, ``--idle-runs`` times): the same
      command hands it the backfill, which then pays no Spark start of its own;
  (e) (d) while the writer of (c) runs.
Prints a Markdown table and writes bench/results/backfill_throughput.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.machine_memory import add_touch_memory_argument, touch_memory_for  # noqa: E402
from bench.stream_throughput import (  # noqa: E402 - the same table as the stream benchmark
    ROW,
    SOURCE_BACKENDS,
    STORE_BACKENDS,
    TABLE,
    add_pg_setting_argument,
    cpu_by_class,
    process_class,
)
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.stream_process import BackfillServerProcess, StreamAppProcess  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402


def seed_events(dsn: str, rows: int) -> None:
    """The ``events`` table with ``rows`` rows, vacuumed and analyzed: what a backfill reads."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)
        conn.execute(
            f"INSERT INTO events (id, account, amount, kind, payload) SELECT {ROW} FROM generate_series(1, {rows}) g"
        )
        conn.execute("VACUUM ANALYZE events")


def bench_config(dsn: str, store_dsn: str, checkpoint: Path, filtered: bool) -> str:
    """The benchmark's ``sequin.yaml``: the plain Sequin Stream sink ``events``, and with ``filtered``
    also ``events_filtered``, whose filter makes its stream app run every micro-batch as a Spark job
    (``payload=full``): the plain runs get a stream app without it, as a deployment without filters has."""
    sinks = sink("events", "{type: sequin_stream}")
    if filtered:
        # the benchmark never deletes: this sink takes its backfill's reads only
        sinks += sink(
            "events_filtered", "{type: sequin_stream}", settings='    filter: "true"\n    actions: [delete]\n'
        )
    return app_config(dsn, sinks, checkpoint, store_dsn=store_dsn)


def empty_stream_table(store_dsn: str) -> None:
    """The stream table emptied between runs as the sink's consumers and autovacuum empty it (their
    acks delete every read, then a VACUUM), and a checkpoint, so each run starts from the same
    store. The table keeps its pages (migration 20, ``vacuum_truncate`` off), as a store that took
    the previous run's burst does; before that migration this was a ``TRUNCATE``, which also gives
    them back (docs/performance.md, "Backfills")."""
    with psycopg.connect(store_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM sequin.stream_messages")
        conn.execute("VACUUM sequin.stream_messages")
        conn.execute("CHECKPOINT")


def wal_segments(dsn: str) -> int:
    """How many WAL segment files the cluster has. A new cluster creates a 16 MB segment for each 16
    MB of WAL until its checkpoints have old ones to recycle (a 1,000,000-row backfill writes about
    400 MB); a benchmark prints the segments each run added, so a run that created them is seen as
    such (docs/performance.md, "Backfills": about 3 ms of CPU each, a small part of why a fresh
    cluster's first runs are slower)."""
    with psycopg.connect(dsn) as conn:
        return int(conn.execute("SELECT count(*) FROM pg_ls_waldir()").fetchone()[0])  # type: ignore[index]


def copy_seconds(dsn: str) -> float:
    started = time.monotonic()
    with psycopg.connect(dsn) as conn, conn.cursor() as cur, cur.copy("COPY (SELECT * FROM events) TO STDOUT") as copy:
        for _ in copy:
            pass
    return time.monotonic() - started


def reads_in_sink(store_dsn: str, backfill_id: int) -> int:
    with psycopg.connect(store_dsn) as conn:
        return int(
            conn.execute("SELECT rows_emitted FROM sequin.backfills WHERE id = %s", (backfill_id,)).fetchone()[0]
        )  # type: ignore[index]


def running_seconds(store_dsn: str, sink: str) -> float:
    """How long the sink's last backfill ran, from ``running`` to ``completed`` (the Spark app's
    start-up excluded): the store's own timestamps."""
    with psycopg.connect(store_dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM finished_at - started_at) FROM sequin.backfills WHERE sink = %s"
            " ORDER BY id DESC LIMIT 1",
            (sink,),
        ).fetchone()
    return float(row[0])  # type: ignore[index]


def in_sink_seconds(store_dsn: str, sink: str, started_at: float) -> float:
    """Seconds from ``started_at`` (``time.time()`` when the command was run) to the sink's last
    backfill's ``completed``, when its last reads became visible in the sink (a range's last page
    waits for the batch that shows them): the issue's "from start to all rows in the sink", without
    the app's own stop after it."""
    with psycopg.connect(store_dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM finished_at) FROM sequin.backfills WHERE sink = %s ORDER BY id DESC LIMIT 1",
            (sink,),
        ).fetchone()
    return float(row[0]) - started_at  # type: ignore[index]


def run_backfill(config_path: Path, rows: int, sink: str = "events") -> tuple[float, str, float]:
    """``sequin backfill start`` as a user runs it (its own local Spark); returns (seconds to its exit,
    last progress line, ``time.time()`` at its start, for ``in_sink_seconds``). Its log goes to
    ``backfill-<sink>-<n>.log`` beside the config (kept with ``--keep``)."""
    started_at = time.time()
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sequin_provider.cli",
            "--config",
            str(config_path),
            "backfill",
            "start",
            sink,
            "events",
        ],
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - started
    runs = len(list(config_path.parent.glob(f"backfill-{sink}-*.log")))
    (config_path.parent / f"backfill-{sink}-{runs + 1}.log").write_text(out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"backfill failed:\n{out.stderr[-4000:]}")
    lines = [line for line in out.stderr.splitlines() if "completed" in line]
    breakdown = page_breakdown(out.stderr)
    if breakdown:
        print(
            f"bench:   where a range's time went (summed over its pages, mean of {breakdown['ranges']} ranges):"
            f" select {breakdown['select_s']:.1f}s, render+stage {breakdown['stage_s']:.1f}s, blocked waiting for"
            f" the stream app {breakdown['waited_s']:.1f}s; {breakdown['pages']} pages, each taken by the stream"
            f" app {breakdown['window_s'] / max(breakdown['pages_per_range'], 1):.2f}s after its staging on average"
            " (the later pages in flight staged meanwhile)",
            flush=True,
        )
    return seconds, (lines[-1] if lines else ""), started_at


PAGE_LINE = re.compile(
    r"backfill \d+ range (\d+) page \d+: (\d+) rows; select (\d+) ms, render\+stage (\d+) ms,"
    r" window (\d+) ms \(waited (\d+) ms\)"
)


def page_breakdown(log: str) -> dict[str, float] | None:
    """From the backfill app's per-page log lines: seconds per phase, summed per range, mean over ranges.
    A page's window runs from its staging until the stream app took it, and overlaps the staging of the
    pages after it (up to ``pages_in_flight``); ``waited`` is the time the range was blocked on it."""
    per_range: dict[str, list[float]] = {}
    pages = 0
    for match in PAGE_LINE.finditer(log):
        totals = per_range.setdefault(match.group(1), [0.0, 0.0, 0.0, 0.0])
        for i, group in enumerate((3, 4, 5, 6)):
            totals[i] += int(match.group(group)) / 1000.0
        pages += 1
    if not per_range:
        return None
    n = len(per_range)
    return {
        "ranges": n,
        "pages": pages,
        "select_s": sum(t[0] for t in per_range.values()) / n,
        "stage_s": sum(t[1] for t in per_range.values()) / n,
        "window_s": sum(t[2] for t in per_range.values()) / n,
        "waited_s": sum(t[3] for t in per_range.values()) / n,
        "pages_per_range": pages / n,
    }


BACKFILL_BACKENDS = {
    SOURCE_BACKENDS: "postgres: source backends (page SELECTs, watermarks)",
    STORE_BACKENDS: "postgres: store backends (reads COPY, pages, stream writes)",
}
"""What each database's backends do in a backfill."""


def backfill_process_class(proc: psutil.Process) -> str | None:
    """``process_class``, with Postgres backends told apart by database (source or store) and the
    backfill app's processes (children of its CLI) by their own class."""
    klass = process_class(proc)
    if klass in BACKFILL_BACKENDS:
        return BACKFILL_BACKENDS[klass]
    try:  # a process can exit (or turn zombie) between any two of these calls
        argv = proc.cmdline()
        parents = proc.parents()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    cmd = " ".join(argv)
    if any(_is_backfill_server(_cmdline(p)) for p in parents) or _is_backfill_server(argv):
        if cmd.split(" ", 1)[0].endswith("java"):
            return "backfill server: JVM"
        return "backfill server: Python (driver, range tasks)"
    if any(_is_backfill_cli(_cmdline(p)) for p in parents) or _is_backfill_cli(argv):
        if cmd.split(" ", 1)[0].endswith("java"):  # not proc.name(): psutil keeps the launcher's (bash) name
            return "backfill app: JVM"
        return "backfill app: Python (CLI, range tasks)"
    if klass == "this benchmark (workload client, polling)":
        return "this benchmark (its CPU sampler, the concurrent writer)"
    return klass


def _is_backfill_server(argv: list[str]) -> bool:
    """``spark_apps/backfill.py --serve`` (``BackfillServerProcess``)."""
    return "--serve" in argv and any(a.endswith("backfill.py") for a in argv)


def _is_backfill_cli(argv: list[str]) -> bool:
    """``python -m sequin_provider.cli … backfill start …`` (``run_backfill``)."""
    return "sequin_provider.cli" in argv and "backfill" in argv


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class CpuSampler:
    """CPU seconds per process class over a run, sampled every ``interval`` s: processes that exit
    during the run (the backfill app, its sessions) count up to their last sample.

    A process is classified once (``backfill_process_class`` reads its parents' command lines) and
    again only when its program changes: a launcher that execs java keeps its pid and start time
    but not its ``argv[0]``. Classifying every process at every sample cost the sampler 12-14 % of
    a core during a backfill, taken from the run it measures."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._classes: dict[int, tuple[float, str, str | None]] = {}  # pid: start time, argv[0], class
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def classify(self, proc: psutil.Process) -> str | None:
        """``backfill_process_class`` of ``proc``, remembered until its start time or ``argv[0]`` changes."""
        try:
            started = proc.create_time()
            program = next(iter(proc.cmdline()), "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        known = self._classes.get(proc.pid)
        if known is not None and known[0] == started and known[1] == program:
            return known[2]
        klass = backfill_process_class(proc)
        self._classes[proc.pid] = (started, program, klass)
        return klass

    def _sample(self, first: bool = False) -> None:
        for pid, (klass, seconds) in cpu_by_class(self.classify, exited=False).items():
            if pid not in self._last:
                self._first[pid] = seconds if first else 0.0
            elif self._last[pid][0].startswith("backfill app") and not klass.startswith("backfill app"):
                klass = self._last[pid][0]  # its JVM can outlive the CLI for a moment, reparented
            self._last[pid] = (klass, seconds)

    def totals(self) -> dict[str, float]:
        """CPU seconds per class."""
        out: dict[str, float] = {}
        for pid, (klass, seconds) in self._last.items():
            out[klass] = out.get(klass, 0.0) + seconds - self._first.get(pid, 0.0)
        return out


def writer(dsn: str, rows: int, rate: int, stop: threading.Event, counter: list[int]) -> None:
    rng = random.Random(7)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            tick = time.monotonic()
            with conn.transaction():
                for _ in range(max(1, rate // 20)):
                    conn.execute(
                        "UPDATE events SET amount = amount + 1, updated_at = now() WHERE id = %s",
                        (rng.randint(1, rows),),
                    )
                    counter[0] += 1
            time.sleep(max(0.0, 0.05 - (time.monotonic() - tick)))


ALL_RUNS = {"idle", "serve", "spark", "busy"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--write-rate", type=int, default=2_000, help="updates/s during run (c)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (the stream app's log) for a look")
    parser.add_argument(
        "--only",
        default="idle,serve,spark,busy",
        help="which backfill runs, comma-separated: idle (b), serve (d), spark (b'), busy (c)",
    )
    parser.add_argument("--idle-runs", type=int, default=3, help="how many times run (b) is measured")
    parser.add_argument(
        "--max-page-rows", type=int, default=None, help="the backfill server's page size ceiling (run d; its default)"
    )
    add_pg_setting_argument(parser)
    add_touch_memory_argument(parser)
    args = parser.parse_args()
    runs = set(args.only.split(","))
    if not runs or not runs <= ALL_RUNS:
        parser.error("--only takes idle, serve, spark and busy, comma-separated")
    work = Path(tempfile.mkdtemp(prefix="sequin-bench-backfill-"))
    results: dict[str, object] = {
        "rows": args.rows,
        "pg_settings": dict(args.pg_setting),
        "memory_touched": touch_memory_for(args),
    }
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
        seed_events(dsn, args.rows)
        config_path = work / "sequin.yaml"  # the plain sink alone: (b), (c), (d), (e)
        config_path.write_text(bench_config(dsn, store_dsn, work / "ckpt", filtered=False))
        filter_config_path = work / "sequin-filter.yaml"  # and the sink with a filter: (b')
        filter_config_path.write_text(bench_config(dsn, store_dsn, work / "ckpt-filter", filtered=True))
        initialize(load_config(filter_config_path))  # both sinks
        copy_s = min(copy_seconds(dsn) for _ in range(3))
        results.update(copy_seconds=copy_s, copy_rate=args.rows / copy_s)
        print(f"bench: COPY of {args.rows:,} rows: {copy_s:.2f}s ({args.rows / copy_s:,.0f} rows/s)", flush=True)
        app = StreamAppProcess(config_path, work / "app.log").start()
        try:
            app.wait_streaming(store_dsn)

            def measured(key: str, sink: str, label: str, config: Path = config_path) -> float:
                """Run one backfill into ``sink``, record it under ``key`` and print it; its seconds."""
                segments = wal_segments(dsn)
                with CpuSampler() as cpu:
                    seconds, line, started_at = run_backfill(config, args.rows, sink)
                results[f"{key}_new_wal_segments"] = wal_segments(dsn) - segments
                running = running_seconds(store_dsn, sink)
                in_sink = in_sink_seconds(store_dsn, sink, started_at)
                per_row = {k: v / args.rows * 1e6 for k, v in sorted(cpu.totals().items(), key=lambda kv: -kv[1])}
                results[f"{key}_cpu_us_per_row"] = per_row
                print(
                    f"bench: CPU per row during {key}: {sum(per_row.values()):.1f} us in all; "
                    + "; ".join(f"{k} {v:.1f}" for k, v in per_row.items()),
                    flush=True,
                )
                results.update(
                    {
                        f"{key}_seconds": seconds,
                        f"{key}_rate": args.rows / seconds,
                        f"{key}_progress": line,
                        f"{key}_running_seconds": running,
                        f"{key}_running_rate": args.rows / running,
                        f"{key}_in_sink_seconds": in_sink,
                        f"{key}_in_sink_rate": args.rows / in_sink,
                    }
                )
                print(
                    f"bench: backfill, {label}: {seconds:.1f}s to its exit ({args.rows / seconds:,.0f} rows/s);"
                    f" all rows in the sink after {in_sink:.1f}s ({args.rows / in_sink:,.0f} rows/s); running"
                    f" {running:.1f}s, {args.rows / running:,.0f} rows/s; {results[f'{key}_new_wal_segments']} new WAL"
                    f" segments -- {line}",
                    flush=True,
                )
                return seconds

            if "idle" in runs:
                for n in range(1, args.idle_runs + 1):
                    if n > 1:
                        empty_stream_table(store_dsn)
                    measured("idle" if n == 1 else f"idle_{n}", "events", f"table idle, run {n} of {args.idle_runs}")

            def busy(key: str, label: str) -> None:
                """``measured`` while a writer updates random rows at ``--write-rate``."""
                stop, counter = threading.Event(), [0]
                thread = threading.Thread(target=writer, args=(dsn, args.rows, args.write_rate, stop, counter))
                thread.start()
                try:
                    seconds_w = measured(key, "events", label)
                finally:
                    stop.set()
                    thread.join()
                results.update({f"{key}_concurrent_updates": counter[0], f"{key}_update_rate": counter[0] / seconds_w})
                print(f"bench: {counter[0]:,} concurrent updates ({counter[0] / seconds_w:,.0f}/s)", flush=True)

            if "serve" in runs:
                server_args = () if args.max_page_rows is None else ("--max-page-rows", str(args.max_page_rows))
                server = BackfillServerProcess(config_path, work / "server.log", *server_args).start()
                try:
                    server.wait_up()
                    for n in range(1, args.idle_runs + 1):
                        empty_stream_table(store_dsn)
                        measured(
                            "serve" if n == 1 else f"serve_{n}",
                            "events",
                            f"with a backfill server up, run {n} of {args.idle_runs}",
                        )
                    empty_stream_table(store_dsn)
                    busy("serve_busy", f"with a backfill server up, {args.write_rate:,} updates/s requested")
                finally:
                    server.stop()
            if "busy" in runs:
                busy("busy", f"{args.write_rate:,} updates/s requested")
            if "spark" in runs:  # a stream app with a filter sink: every batch of it is a Spark job
                app.stop()
                app = StreamAppProcess(filter_config_path, work / "app-filter.log").start()
                app.wait_streaming(store_dsn)
                measured(
                    "spark", "events_filtered", "into a sink with a filter (reads through Spark)", filter_config_path
                )
        finally:
            app.stop()
    if args.keep:
        print(f"bench: work folder kept: {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    if runs == ALL_RUNS:  # a partial run leaves the recorded results alone
        (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
        (ROOT / "bench" / "results" / "backfill_throughput.json").write_text(json.dumps(results, indent=2))
    print()
    print(
        "| measure | rows/s, start to all rows in the sink | rows/s, start to the app's exit | seconds (to exit)"
        " | rows/s while running | vs COPY (running) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| (a) COPY (SELECT * FROM events) TO STDOUT, the read limit | | {results['copy_rate']:,.0f} | {copy_s:.2f}"
        " | | 1.00 |"
    )
    later = [f"idle_{n}" for n in range(2, args.idle_runs + 1)] if "idle" in runs else []
    for key, label in (
        (
            "idle",
            "(b) backfill into the Sequin Stream sink, table idle (reads written by the task)"
            + (", run 1 (the fresh cluster's first)" if later else ""),
        ),
        *((k, f"(b) again, run {k.split('_')[1]} (WAL segments recycled, store warm)") for k in later),
        *(
            (k, f"(d) (b) with a backfill server up (`sequin backfill serve`), run {n}")
            for n, k in enumerate(["serve", *(f"serve_{n}" for n in range(2, args.idle_runs + 1))], 1)
        ),
        ("serve_busy", f"(e) (d) while {args.write_rate:,} updates/s hit the table"),
        ("spark", "(b') the same into a sink with a filter (reads through the stream app's Spark)"),
        ("busy", f"(c) (b) while {args.write_rate:,} updates/s hit the table"),
    ):
        if key.split("_")[0] not in runs:
            continue
        rate, running = float(results[f"{key}_rate"]), float(results[f"{key}_running_rate"])  # type: ignore[arg-type]
        in_sink = float(results[f"{key}_in_sink_rate"])  # type: ignore[arg-type]
        print(
            f"| {label} | {in_sink:,.0f} | {rate:,.0f} | {results[f'{key}_seconds']:.1f} | {running:,.0f} |"
            f" {running / float(results['copy_rate']):.2f} |"
        )  # type: ignore[arg-type]
    for name, value in args.pg_setting:
        print(f"\nServer setting over the embedded cluster's defaults: `{name}={value}`.")
    touched = results["memory_touched"]
    if touched["gib"]:  # type: ignore[index]
        print(
            f"\nThe machine's RAM was written once before the runs ({touched['gib']:.1f} GiB, {touched['us_per_page']:.2f} us"  # type: ignore[index]
            " per 4 KiB page): bench/machine_memory.py says why."
        )
    else:
        print(
            "\nThe machine's RAM was not written before the runs (--touch-memory 0): bench/machine_memory.py says why."
        )
    print(
        "\nStart: `sequin backfill start` run (its own local Spark starts with it); all rows in the sink: the"
        " backfill's `completed` (its last reads visible); exit: the command's exit, after its Spark stopped;"
        " while running: from the backfill's `running` to `completed` (the store's timestamps)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
