"""How the stream's cost grows with the work: each shape of workload beside its decode limit.

    .venv/bin/python bench/scaling.py [--changes 200000] [--groups-changes 1000000] [--only width,tables,...]
                                      [--touch-memory GIB]

One embedded cluster; per case a fresh source database and store, the stream app into Sequin Stream
sinks after a warm-up of half the changes, throughput = changes / (first commit -> the last micro-batch
durable in every sink). Beside it, ``pg_recvlogical`` draining the same workload from its own slot in
the same run (the decode limit of that shape), and the CPU per change by process (``cpu_by_class`` of
stream_throughput.py): the app's (driver, JVM, reader, Python workers, standalone executors'), the
store's backends, the walsender, and everything (the workload's own writes included). The cases:

  width    rows of ~100 B vs ~1.6 KB (Sequin's published cases), one table, inserts then updates; and
           ~1.6 KB with REPLICA IDENTITY FULL (an update's message carries the old note too: ~3.3 KB,
           over the store's TOAST threshold, so its data is stored compressed)
  tables   the same changes over 1 vs 20 tables of one sink
  sinks    1, 2 and 4 Sequin Stream sinks of one table on one stream
  groups   1,000 vs 1,000,000 distinct groups (``group_column_names: [account]``), inserts only
  workers  local[2] vs a standalone cluster of 1 worker x 2 cores vs 2 workers x 1 core (on one machine
           the second worker adds no cores: the difference is the parallel overhead, not a speed-up)

Before the runs it writes most of the machine's free RAM once, as compare.py does (``--touch-memory``,
0 to skip: bench/machine_memory.py): otherwise every new page of the store's table and WAL, and every
large buffer of the app, is first backed by the host during the runs, and the wide cases pay most.
Prints a Markdown table and writes bench/results/scaling.json and bench/results/scaling.md. Not a test:
no thresholds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.app_config import app_config, sink  # noqa: E402
from bench.machine_memory import add_touch_memory_argument, touch_memory_for  # noqa: E402
from bench.stream_throughput import (  # noqa: E402
    APP_CLASSES,
    STORE_BACKENDS,
    cpu_by_class,
    cpu_delta,
    current_lsn,
    run_pg_recvlogical,
    sink_count,
)
from devtools.embedded_postgres import EmbeddedPostgres  # noqa: E402
from devtools.spark_cluster import SparkCluster  # noqa: E402
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: E402
from sequin_provider.config import load_config  # noqa: E402
from sequin_provider.provisioning import initialize  # noqa: E402
from sequin_provider.replication import create_slot  # noqa: E402

NOTE = {"narrow": "md5(g::text) || md5((g + 1)::text)", "wide": "repeat(md5(g::text), 50)"}
"""The ``note`` column: 64 characters (a row of about 100 B with its id, account and header) or 1,600."""
TXN_ROWS = 500


@dataclass(frozen=True)
class Case:
    """One row of the table: a workload shape and how the stream app is set up for it."""

    family: str
    name: str
    tables: int = 1
    width: str = "narrow"
    sinks: int = 1
    groups: int | None = None  # None: grouped by primary key (the default); else by account = id % groups
    inserts_only: bool = False
    cluster: tuple[int, int] | None = None  # (workers, cores each); None: local[2]
    identity_full: bool = False  # REPLICA IDENTITY FULL: an update's message carries the old values too

    @property
    def shape(self) -> tuple[int, str, int | None, bool, bool]:
        """What the source sees: cases of one shape share one decode-limit measurement."""
        return (self.tables, self.width, self.groups, self.inserts_only, self.identity_full)


CASES = [
    Case("width", "rows of ~100 B"),
    Case("width", "rows of ~1.6 KB", width="wide"),
    Case("width", "rows of ~1.6 KB, replica identity full", width="wide", identity_full=True),
    Case("tables", "1 table"),
    Case("tables", "20 tables", tables=20),
    Case("sinks", "1 sink"),
    Case("sinks", "2 sinks", sinks=2),
    Case("sinks", "4 sinks", sinks=4),
    Case("groups", "1,000 groups", groups=1_000, inserts_only=True),
    Case("groups", "1,000,000 groups", groups=1_000_000, inserts_only=True),
    Case("workers", "local[2]"),
    Case("workers", "cluster: 1 worker x 2 cores", cluster=(1, 2)),
    Case("workers", "cluster: 2 workers x 1 core", cluster=(2, 1)),
]


@dataclass
class Source:
    """A source database with ``tables`` tables ``t01``... and a counter of ids written so far."""

    dsn: str
    tables: list[str]
    width: str
    groups: int | None
    next_id: int = 1
    written: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, dsn: str, case: Case) -> Source:
        tables = [f"t{n:02d}" for n in range(1, case.tables + 1)]
        with psycopg.connect(dsn, autocommit=True) as conn:
            for table in tables:
                conn.execute(
                    f"CREATE TABLE {table} (id bigint PRIMARY KEY, account bigint NOT NULL, note text NOT NULL)"
                )
                if case.identity_full:
                    conn.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        return cls(dsn, tables, case.width, case.groups)

    def write(self, changes: int, inserts_only: bool) -> float:
        """``changes`` changes spread round-robin over the tables, in transactions of ``TXN_ROWS``
        rows: inserts then updates of the same ids (half each), or inserts only; returns the wall
        time of the first commit."""
        inserts = changes if inserts_only else changes // 2
        first, last = self.next_id, self.next_id + inserts - 1
        self.next_id = last + 1
        account = f"g % {self.groups}" if self.groups else "g"
        started = time.time()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for n, lo in enumerate(range(first, last + 1, TXN_ROWS)):
                table = self.tables[n % len(self.tables)]
                conn.execute(
                    f"INSERT INTO {table} SELECT g, {account}, {NOTE[self.width]}"
                    f" FROM generate_series({lo}, {min(lo + TXN_ROWS - 1, last)}) g"
                )
            for n, lo in enumerate(range(first, first + changes - inserts, TXN_ROWS)):
                table = self.tables[n % len(self.tables)]
                hi = min(lo + TXN_ROWS - 1, first + changes - inserts - 1)
                conn.execute(f"UPDATE {table} SET note = upper(note) WHERE id BETWEEN {lo} AND {hi}")
        return started


def config_text(case: Case, source: Source, store_dsn: str, slot: str, work: Path) -> str:
    """The stream app's config of ``case``: ``case.sinks`` Sequin Stream sinks of every table."""
    tables = ", ".join(f"{{name: {t}, group_column_names: [account]}}" if case.groups else t for t in source.tables)
    sinks = "".join(sink(f"sink{n}", "{type: sequin_stream}", tables=f"[{tables}]") for n in range(1, case.sinks + 1))
    return app_config(source.dsn, sinks, work / "checkpoint", store_dsn=store_dsn, database="scale", slot=slot)


def decode_limit(dsn: str, source: Source, changes: int, inserts_only: bool) -> float:
    """pg_recvlogical's changes/s draining ``changes`` of this shape from a fresh slot."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_slot(conn, "recv_slot")
    source.write(changes, inserts_only)
    seconds = run_pg_recvlogical(dsn, "recv_slot", current_lsn(dsn))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('recv_slot')")
    return changes / seconds


def per_change(cpu: dict[str, float], changes: int) -> dict[str, float]:
    """µs of CPU per change: the app's processes, the store's backends, the walsender, and everything."""
    app = sum(seconds for klass, seconds in cpu.items() if klass.startswith(APP_CLASSES))
    return {
        "app_cpu_us_per_change": app / changes * 1e6,
        "store_cpu_us_per_change": cpu.get(STORE_BACKENDS, 0.0) / changes * 1e6,
        "walsender_cpu_us_per_change": sum(s for k, s in cpu.items() if "walsender" in k) / changes * 1e6,
        "all_cpu_us_per_change": sum(cpu.values()) / changes * 1e6,
    }


def measure(
    n: int, case: Case, pg: EmbeddedPostgres, changes: int, limits: dict[Any, float], log: Callable[[str], None]
) -> dict[str, Any]:
    """Case ``n``: its decode limit (once per shape), then the app's throughput and CPU per change."""
    work = Path(tempfile.mkdtemp(prefix=f"scaling-{case.family}-"))
    dsn = pg.create_database(f"src_{n}")
    store_dsn = pg.create_database(f"store_{n}")
    source = Source.create(dsn, case)
    config = work / "sequin.yaml"
    slot = f"scale_slot_{n}"
    config.write_text(config_text(case, source, store_dsn, slot, work))
    initialize(load_config(config))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))  # made again by the app, after the limit runs
    if case.shape not in limits:
        limits[case.shape] = decode_limit(dsn, source, changes, case.inserts_only)
    limit = limits[case.shape]
    cluster = SparkCluster(work / "cluster", workers=case.cluster[0], cores=case.cluster[1]) if case.cluster else None
    env: dict[str, str] = {}
    if cluster is not None:
        (work / "cluster").mkdir()
        cluster.start().wait_ready()
        env = {"SEQUIN_SPARK_MASTER": cluster.url, "SEQUIN_SPARK_DRIVER_MEMORY": "1g"}
    app = StreamAppProcess(config, work / "stream-app.log", env).start()
    try:
        app.wait_streaming(store_dsn, timeout=300)
        base = sink_count(store_dsn)
        source.write(changes // 2, case.inserts_only)  # warm-up
        wait_for(lambda: sink_count(store_dsn) >= base + changes // 2, 900, interval=0.2, what="the warm-up")
        base, cpu0 = sink_count(store_dsn), cpu_by_class()
        started = source.write(changes, case.inserts_only)
        wait_for(lambda: sink_count(store_dsn) >= base + changes, 900, interval=0.1, what="the measured run")
        rate = changes / (time.time() - started)
        cpu = cpu_delta(cpu0, cpu_by_class())
    finally:
        app.stop()
        if cluster is not None:
            cluster.stop()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))  # retains nothing while the next cases run
    with psycopg.connect(store_dsn) as conn:
        rows = conn.execute("SELECT count(*) FROM sequin.stream_messages").fetchone()[0]  # type: ignore[index]
    expected = (changes + changes // 2) * case.sinks
    if rows < expected:
        raise SystemExit(f"{case.name}: the sinks hold {rows:,} messages, expected {expected:,}")
    result = {
        "family": case.family,
        "case": case.name,
        "changes": changes,
        "changes_per_s": rate,
        "decode_limit": limit,
        "of_limit": rate / limit,
        **per_change(cpu, changes),
        "cpu_seconds": cpu,
    }
    log(
        f"scaling: {case.family:8s} {case.name:30s} {rate:10,.0f}/s  limit {limit:10,.0f}/s  "
        f"{rate / limit:5.2f}x  CPU us/change: app {result['app_cpu_us_per_change']:5.1f}, store "
        f"{result['store_cpu_us_per_change']:4.1f}, walsender {result['walsender_cpu_us_per_change']:4.1f}, "
        f"all {result['all_cpu_us_per_change']:5.1f}"
    )
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    """The table, one row per case, grouped by family."""
    lines = [
        "| family | case | changes | changes/s | decode limit (same shape) | of the limit"
        " | CPU µs/change: app | store | walsender | all |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['family']} | {r['case']} | {r['changes']:,} | {r['changes_per_s']:,.0f} | {r['decode_limit']:,.0f}"
            f" | {r['of_limit']:.2f} | {r['app_cpu_us_per_change']:.1f} | {r['store_cpu_us_per_change']:.1f}"
            f" | {r['walsender_cpu_us_per_change']:.1f} | {r['all_cpu_us_per_change']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000, help="changes per measured run")
    parser.add_argument("--groups-changes", type=int, default=1_000_000, help="changes of the groups cases")
    families = sorted({c.family for c in CASES})
    parser.add_argument("--only", default=",".join(families), help=f"families to run, of {','.join(families)}")
    add_touch_memory_argument(parser)
    args = parser.parse_args()
    chosen = {f.strip() for f in args.only.split(",") if f.strip()}
    unknown = chosen - set(families)
    if unknown:
        parser.error(f"unknown families: {', '.join(sorted(unknown))} (known: {', '.join(families)})")
    results: list[dict[str, Any]] = []
    limits: dict[Any, float] = {}
    touched = touch_memory_for(args)
    with EmbeddedPostgres(use_env_dsn=False) as pg:
        for n, case in enumerate(c for c in CASES if c.family in chosen):
            changes = args.groups_changes if case.family == "groups" else args.changes
            results.append(measure(n, case, pg, changes, limits, lambda line: print(line, flush=True)))
    table = markdown(results)
    print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(
        json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "memory_touched": touched, "results": results}, indent=2)
    )
    (out / "scaling.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
