"""One chaos round: the pipeline under a random workload while faults are injected, then the checker.

The parts are the product's own: the stream app (a supervised child process, as the Airflow
supervisor runs it), the backfill app (``spark_apps/backfill.py``, retried as the Airflow task
would be), a Sequin Stream sink read by two consumers through ``stream_queue`` (the functions
behind the HTTP pull API), a webhook sink posting to a loopback endpoint, and the buffer retry
(``retry_sinks``, what the buffer DAG calls). Faults: SIGKILL of the stream app (at any moment, or
right after a micro-batch is in the store while the consumers ack it, before Spark commits it),
Postgres restarts (fast and immediate), the store unreachable, the webhook endpoint down, slow past
its timeout, or answering 500 to 20 % of requests.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import psycopg

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import ROOT, StreamAppProcess, app_env, streaming_status, wait_for
from sequin_provider import stream_queue
from sequin_provider.backfill import create_backfill
from sequin_provider.config import load_config
from sequin_provider.messages import parse_message
from sequin_provider.spark.pipeline import TEST_STALL_AFTER_STORE_ENV
from tests.support.chaos.checker import SinkReport, check_sink
from tests.support.chaos.workload import Workload, committed_changes, create_schema, final_rows, row_key
from tests.support.receiver import Receiver

SCHEMA = "sequin"
SINKS = ("stream", "hooks")
BACKFILLS = (("stream", "accounts"), ("hooks", "accounts"))  # the seeded rows reach each sink only by a backfill

CONFIG = """
databases:
  - name: app
    dsn: {source}
    slot: {{name: {db}_slot}}
    publication: {{name: {db}_pub}}
    heartbeat_interval: 1s
store: {{dsn: {store}}}
sinks:
  - name: stream
    tables: [accounts, lines]
    destination: {{type: sequin_stream}}
  - name: hooks
    tables: [accounts, lines]
    destination: {{type: webhook, url: "{url}", batch: true, batch_size: 50, timeout: 1s}}
stream:
  checkpoint_location: {checkpoint}
  spool_location: {spool}
  max_batch_wait: 100ms
"""


@dataclass(frozen=True)
class Profile:
    """How hard a round shakes the pipeline."""

    name: str
    kills: int
    acked_kills: int  # kills right after a batch is in the store and visible, its offset not committed
    pg_restarts: tuple[str, ...]
    store_down: float
    webhook_down: float
    webhook_slow: float
    webhook_errors: float
    rate: float
    seed_accounts: int
    accounts: int
    orders: int
    drain_timeout: float


SHORT = Profile(
    "short",
    kills=1,
    acked_kills=1,
    pg_restarts=("fast", "immediate"),
    store_down=5,
    webhook_down=5,
    webhook_slow=4,
    webhook_errors=8,
    rate=300,
    seed_accounts=2_000,
    accounts=3_000,
    orders=800,
    drain_timeout=300,
)
FULL = Profile(
    "full",
    kills=4,
    acked_kills=2,
    pg_restarts=("fast", "immediate"),
    store_down=20,
    webhook_down=30,
    webhook_slow=15,
    webhook_errors=30,
    rate=500,
    seed_accounts=20_000,
    accounts=25_000,
    orders=5_000,
    drain_timeout=900,
)
PROFILES = {p.name: p for p in (SHORT, FULL)}


@dataclass
class RoundResult:
    """What a round did and what the checker found, per sink."""

    round_no: int
    profile: str
    seed: int
    faults: list[str]
    app_starts: int = 0
    backfill_runs: int = 0
    workload_transactions: int = 0
    workload_errors: int = 0
    seconds: float = 0.0
    reports: list[SinkReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.reports) and all(r.ok for r in self.reports)

    def lines(self) -> list[str]:
        """The summary: one line for the round, one per sink."""
        head = (
            f"chaos round {self.round_no} ({self.profile}, seed {self.seed}): {len(self.faults)} faults"
            f" [{', '.join(self.faults)}], stream app started {self.app_starts}x, backfill runs {self.backfill_runs},"
            f" {self.workload_transactions} transactions, {self.seconds:.0f}s"
        )
        return [head, *(f"  {r.line()}" for r in self.reports), *(f"  note: {n}" for n in self.notes)]

    def as_json(self) -> dict[str, Any]:
        return {
            "round": self.round_no,
            "profile": self.profile,
            "seed": self.seed,
            "faults": self.faults,
            "app_starts": self.app_starts,
            "backfill_runs": self.backfill_runs,
            "seconds": round(self.seconds, 1),
            "transactions": self.workload_transactions,
            "ok": self.ok,
            "sinks": [{k: v for k, v in vars(r).items()} for r in self.reports],
            "notes": self.notes,
        }


class Supervisor:
    """Keeps one stream app running, as the Airflow supervisor does: a dead app is started again."""

    def __init__(self, config: Path, workdir: Path, store_dsn: str, app_env: dict[str, str] | None = None) -> None:
        self.config = config
        self.app_env = app_env or {}
        self.workdir = workdir
        self.store_dsn = store_dsn
        self.starts = 0
        self.stall_trigger = workdir / "stall-after-store"
        self.app: StreamAppProcess | None = None
        self.started_at = datetime.now(timezone.utc)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._start_app()
        self._thread.start()
        return self

    def _start_app(self) -> None:
        with self.lock:
            self.started_at = datetime.now(timezone.utc)
            self.app = StreamAppProcess(
                self.config,
                self.workdir / "stream-app.log",
                {**self.app_env, TEST_STALL_AFTER_STORE_ENV: str(self.stall_trigger)},
            ).start()
            self.starts += 1

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            app = self.app
            if app is None or app.proc is None or app.proc.poll() is not None:
                self._stop.wait(1.0)  # like the operator's restart backoff
                if not self._stop.is_set():
                    self._start_app()

    def wait_streaming(self, since: datetime, timeout: float = 240.0) -> None:
        """Wait until the current app has completed a micro-batch since it started and since ``since``."""
        wait_for(
            lambda: streaming_status(self.store_dsn, SCHEMA, after=self.started_at, batch_after=since),
            timeout,
            interval=0.5,
            what="the stream app to stream again",
        )

    def kill_after_store(self, acking: float = 2.0) -> None:
        """SIGKILL the app right after a micro-batch is in the store and visible, before Spark
        commits its offset, ``acking`` seconds after the consumers could receive and ack it (the
        app stalls there: ``TEST_STALL_AFTER_STORE_ENV``); the next app replays the batch."""
        stalled = Path(f"{self.stall_trigger}.stalled")
        stalled.unlink(missing_ok=True)
        self.stall_trigger.touch()
        wait_for(stalled.exists, 180, interval=0.1, what="the stream app to stall after a batch is in the store")
        stalled.unlink()
        time.sleep(acking)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the app and its JVM (the supervisor starts it again)."""
        with self.lock:
            if self.app is not None:
                self.app.kill()
            self.started_at = datetime.now(timezone.utc)  # only an app started from now on counts as back

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self.lock:
            if self.app is not None:
                self.app.stop()


class Worker:
    """A daemon loop that survives connection errors (consumers, the buffer retry, backfills)."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)
        self.failures = 0
        self.last_error = ""

    def start(self) -> Worker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _guarded(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a fault cut it off: note it and go on, as a supervisor would
                self.failures += 1
                self.last_error = repr(exc)
                self._stop.wait(0.5)

    def step(self) -> None:
        raise NotImplementedError


class StreamConsumer(Worker):
    """Receives and acks the stream sink's messages, recording them in the order received, and in
    ``acked`` the keys of each batch whose ack took every message: key -> how many messages were
    recorded when its first ack returned (a later delivery of the key is an acked message come back)."""

    def __init__(
        self, store_dsn: str, received: list[dict[str, Any]], acked: dict[str, int], lock: threading.Lock, name: str
    ) -> None:
        super().__init__(name)
        self.store_dsn = store_dsn
        self.received = received
        self.acked = acked
        self.lock = lock
        self.conn: psycopg.Connection[Any] | None = None

    def step(self) -> None:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.conn = psycopg.connect(self.store_dsn, connect_timeout=5, autocommit=True)
        try:
            batch = stream_queue.receive(self.conn, SCHEMA, "stream", 100, 10.0, 10_000)
            messages = [parse_message(d.data) for d in batch]
            with self.lock:
                self.received.extend(messages)
            if batch:
                if stream_queue.ack(self.conn, SCHEMA, "stream", [d.ack_id for d in batch]) == len(batch):
                    with self.lock:  # an ack that matched fewer (a visibility timeout ran out) proves nothing
                        for m in messages:  # the first ack counts: a message come back is acked again
                            self.acked.setdefault(m["metadata"]["idempotency_key"], len(self.received))
            else:
                self._stop.wait(0.1)
        except psycopg.Error:
            self.conn.close()
            raise


class BufferRetry(Worker):
    """Retries the webhook sink's parked messages every half second (the buffer DAG's job)."""

    def __init__(self, config: Path) -> None:
        super().__init__("chaos-buffer-retry")
        self.config = load_config(config)

    def step(self) -> None:
        from sequin_provider.sinks.retry import retry_sinks

        retry_sinks(self.config, "hooks")
        self._stop.wait(0.5)


class Backfills(Worker):
    """Runs each backfill of ``BACKFILLS`` to completion with ``spark_apps/backfill.py``; a run that
    fails (a restart cut it off) is resumed while its record is running, else started anew."""

    def __init__(self, config: Path, source_dsn: str, store_dsn: str, workdir: Path) -> None:
        super().__init__("chaos-backfills")
        self.config_path = config
        self.config = load_config(config)
        self.source_dsn = source_dsn
        self.store_dsn = store_dsn
        self.workdir = workdir
        self.todo = list(BACKFILLS)
        self.current: int | None = None
        self.runs = 0
        self.done = threading.Event()

    def step(self) -> None:
        if not self.todo:
            self.done.set()
            self._stop.wait(1.0)
            return
        sink, table = self.todo[0]
        if self.current is None or self._state(self.current) not in ("pending", "running"):
            with (
                psycopg.connect(self.source_dsn, autocommit=True, connect_timeout=5) as source,
                psycopg.connect(self.store_dsn, connect_timeout=5) as conn,
            ):
                self.current = create_backfill(source, conn, self.config, sink, table).id
        self.runs += 1
        with open(self.workdir / f"backfill-{self.current}.log", "ab") as log:
            code = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "spark_apps" / "backfill.py"),
                    "--config",
                    str(self.config_path),
                    "--backfill-id",
                    str(self.current),
                ],
                env=app_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
                timeout=900,
            ).returncode
        if code == 0:
            self.todo.pop(0)
            self.current = None
        else:
            self._stop.wait(2.0)

    def _state(self, backfill_id: int) -> str:
        from sequin_provider import store

        with psycopg.connect(self.store_dsn, connect_timeout=5) as conn:
            return store.get_backfill(conn, SCHEMA, backfill_id).state


def assert_clean(result: RoundResult, profile: Profile) -> None:
    """Fail unless the round lost, reordered and redelivered-after-ack nothing, drained, and every
    kill was followed by a new app."""
    assert result.reports, "the round produced no report"
    for report in result.reports:
        assert report.ok, f"{report.line()}\n" + "\n".join(report.examples)
        assert report.redelivered_after_ack == 0  # an acked message never comes back, across the kills
        assert report.committed > 1000 and report.reads >= profile.seed_accounts // 2
    assert "not drained" not in " ".join(result.notes)
    assert result.app_starts >= 1 + profile.kills + profile.acked_kills  # every kill was followed by a new app


def fault_plan(profile: Profile, rng: random.Random) -> list[str]:
    """The round's faults in a random order, with the backfill started midway."""
    faults = ["kill"] * profile.kills + ["kill-acked"] * profile.acked_kills
    faults += [f"restart-{m}" for m in profile.pg_restarts]
    faults += ["store-down", "webhook-down", "webhook-slow", "webhook-errors"]
    rng.shuffle(faults)
    faults.insert(len(faults) // 3, "backfill")
    return faults


class ChaosRound:
    """Sets up a round's databases and pipeline, injects the faults, drains and checks; ``app_env``
    is added to the stream app's environment (e.g. ``SEQUIN_SPARK_MASTER``: a cluster's master) and
    ``spool_location`` is the config's ``stream.spool_location``."""

    def __init__(
        self,
        pg: EmbeddedPostgres,
        workdir: Path,
        profile: Profile,
        round_no: int,
        seed: int,
        log: Callable[[str], None] = print,
        app_env: dict[str, str] | None = None,
        spool_location: str | None = None,
    ) -> None:
        self.pg = pg
        self.app_env = app_env
        self.spool_location = spool_location
        self.workdir = workdir
        self.profile = profile
        self.rng = random.Random(seed)
        self.log = log
        self.db = f"chaos_{seed}_{round_no}"
        self.result = RoundResult(round_no, profile.name, seed, [])

    def run(self) -> RoundResult:
        started = time.monotonic()
        p = self.profile
        self.workdir.mkdir(parents=True, exist_ok=True)
        source_dsn = self.pg.create_database(self.db)
        store_dsn = self.pg.create_database(f"{self.db}_store")
        create_schema(source_dsn, p.seed_accounts)
        receiver = Receiver().start()
        config = self.workdir / "sequin.yaml"
        config.write_text(
            CONFIG.format(
                source=source_dsn,
                store=store_dsn,
                db=self.db,
                url=receiver.url,
                checkpoint=self.workdir / "checkpoint",
                spool=json.dumps(self.spool_location),
            )
        )
        supervisor = Supervisor(config, self.workdir, store_dsn, self.app_env).start()
        received: list[dict[str, Any]] = []
        acked: dict[str, int] = {}
        lock = threading.Lock()
        consumers = [StreamConsumer(store_dsn, received, acked, lock, f"chaos-consumer-{i}") for i in range(2)]
        retry = BufferRetry(config)
        backfills = Backfills(config, source_dsn, store_dsn, self.workdir)
        workload = Workload(source_dsn, p.rate, p.accounts, p.orders, self.rng.randrange(1 << 30))
        workers: list[Worker] = [*consumers, retry]
        try:
            supervisor.wait_streaming(since=supervisor.started_at)
            for worker in workers:
                worker.start()
            workload.start()
            for fault in fault_plan(p, self.rng):
                time.sleep(self.rng.uniform(1.0, 5.0))
                self.log(f"[{time.monotonic() - started:6.0f}s] {fault}")
                self._inject(fault, supervisor, receiver, backfills, store_dsn)
                self.result.faults.append(fault)
                supervisor.wait_streaming(since=datetime.now(timezone.utc))  # recovered before the next fault
            time.sleep(3.0)
            workload.stop()
            self.log(f"[{time.monotonic() - started:6.0f}s] workload stopped; draining")
            self._drain(source_dsn, received, acked, lock, receiver, backfills)
        finally:
            for worker in [*workers, backfills]:
                worker.stop()
            supervisor.stop()
            receiver.stop()
        self.result.app_starts = supervisor.starts
        self.result.backfill_runs = backfills.runs
        self.result.workload_transactions = workload.transactions
        self.result.workload_errors = workload.errors
        self.result.reports = self._check(source_dsn, received, acked, lock, receiver)
        self.result.seconds = time.monotonic() - started
        if not self.result.ok:
            self._keep_evidence(source_dsn, {"stream": received, "hooks": receiver.messages()})
        return self.result

    def _keep_evidence(self, source_dsn: str, deliveries: dict[str, list[dict[str, Any]]]) -> None:
        """A failed round leaves what is needed to find the cause: every committed change (with its
        transaction and time) and every delivery per sink, in order, under the round's folder."""
        with psycopg.connect(source_dsn) as conn, open(self.workdir / "committed.tsv", "w") as out:
            for row in conn.execute("SELECT seq, tbl, pk, action, ver, xid, at FROM chaos_audit ORDER BY seq"):
                out.write("\t".join(str(v) for v in row) + "\n")
        for sink, messages in deliveries.items():
            with open(self.workdir / f"delivered-{sink}.jsonl", "w") as out:
                for m in messages:
                    meta = m["metadata"]
                    out.write(
                        json.dumps(
                            {
                                "key": meta["idempotency_key"],
                                "lsn": meta["commit_lsn"],
                                "idx": meta["commit_idx"],
                                "table": meta["table_name"],
                                "action": m["action"],
                                "pk": row_key(meta["table_name"], m["record"]),
                                "ver": int(m["record"]["ver"]),
                            }
                        )
                        + "\n"
                    )
        self.log(f"evidence kept in {self.workdir}: committed.tsv, delivered-<sink>.jsonl")

    def _inject(
        self, fault: str, supervisor: Supervisor, receiver: Receiver, backfills: Backfills, store_dsn: str
    ) -> None:
        p = self.profile
        if fault == "kill":
            supervisor.kill()
        elif fault == "kill-acked":
            supervisor.kill_after_store()
        elif fault.startswith("restart-"):
            if self.pg.external:
                self.result.notes.append(f"{fault} skipped: SEQUIN_TEST_DSN's server cannot be restarted")
                return
            self.pg.restart(fault.split("-", 1)[1])
        elif fault == "store-down":
            admin = self.pg.dsn("postgres")
            store_db = f"{self.db}_store"
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"ALTER DATABASE {store_db} WITH ALLOW_CONNECTIONS false")
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (store_db,))
            time.sleep(p.store_down)
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"ALTER DATABASE {store_db} WITH ALLOW_CONNECTIONS true")
        elif fault == "webhook-down":
            receiver.stop()
            time.sleep(p.webhook_down)
            receiver.start()
        elif fault == "webhook-slow":
            receiver.policy = lambda ms: (200, 1.5)  # past the sink's 1 s timeout: ambiguous deliveries
            time.sleep(p.webhook_slow)
            receiver.policy = lambda ms: (200, 0.0)
        elif fault == "webhook-errors":
            rng = random.Random(self.rng.random())
            receiver.policy = lambda ms: (500, 0.0) if rng.random() < 0.2 else (200, 0.0)
            time.sleep(p.webhook_errors)
            receiver.policy = lambda ms: (200, 0.0)
        elif fault == "backfill":
            backfills.start()
        else:
            raise ValueError(f"unknown fault {fault!r}")

    def _drain(
        self,
        source_dsn: str,
        received: list[dict[str, Any]],
        acked: dict[str, int],
        lock: threading.Lock,
        receiver: Receiver,
        backfills: Backfills,
    ) -> None:
        deadline = time.monotonic() + self.profile.drain_timeout
        if not backfills.done.wait(max(1.0, deadline - time.monotonic())):
            self.result.notes.append(f"backfills not done after {self.profile.drain_timeout:.0f}s: {backfills.todo}")
        while time.monotonic() < deadline:
            reports = self._check(source_dsn, received, acked, lock, receiver)
            if all(r.lost == 0 and r.state_mismatches == 0 for r in reports):
                time.sleep(3.0)  # a late duplicate or stray message would show up now
                return
            time.sleep(5.0)
        self.result.notes.append(f"not drained after {self.profile.drain_timeout:.0f}s")

    def _check(
        self,
        source_dsn: str,
        received: list[dict[str, Any]],
        acked: dict[str, int],
        lock: threading.Lock,
        receiver: Receiver,
    ) -> list[SinkReport]:
        committed = committed_changes(source_dsn)
        final = final_rows(source_dsn)
        with lock:
            stream_deliveries, stream_acked = list(received), dict(acked)
        return [
            check_sink("stream", committed, stream_deliveries, final, row_key, stream_acked),
            check_sink("hooks", committed, receiver.messages(), final, row_key),
        ]


def write_results(path: Path, results: list[RoundResult]) -> None:
    """The rounds' results as JSON (``make chaos`` keeps them under var/chaos)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.as_json() for r in results], indent=2, default=str))
