"""Run the long-lived Spark apps as child processes (demo, benchmarks, tests, supervisors): the
replication stream app, and the backfill server.

An app runs as ``python sequin_provider/spark_apps/<app>.py`` in its own process group: Python owns the Spark JVM,
so SIGTERM stops it cleanly, and SIGKILL of the group takes the JVM and its Python workers down
with it (a real crash).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Self

import psycopg

from sequin_provider import store
from sequin_provider.spark_apps import app_path

ROOT = Path(__file__).resolve().parent.parent
"""The source checkout (devtools are not part of the installed product)."""
APP = app_path("replication_stream.py")
BACKFILL_APP = app_path("backfill.py")


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 120.0,
    interval: float = 0.25,
    what: str = "condition",
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` naming ``what`` otherwise.
    A look that raises one of ``ignoring`` counts as not yet (a page element not rendered yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except ignoring:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def app_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a Spark app run as a child of this interpreter: its venv, this checkout on the path."""
    venv_bin = str(Path(sys.executable).parent)
    return dict(
        os.environ,
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        PATH=f"{venv_bin}:{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        **(extra or {}),
    )


def streaming_status(
    store_dsn: str,
    schema: str = "sequin",
    database: str | None = None,
    after: datetime | None = None,
    batch_after: datetime | None = None,
) -> dict[str, Any] | None:
    """The stream status row of an app (of ``database``, if given) that started after ``after`` and has
    completed a micro-batch since it started (and since ``batch_after``, if given); None while there is
    none (or the store is unreachable)."""
    try:
        with psycopg.connect(store_dsn, connect_timeout=5) as conn:
            rows = store.read_status(conn, schema) if store.schema_version(conn, schema) else []
    except psycopg.Error:
        return None
    for row in rows:
        started, last = row["app_started_at"], row["last_batch_at"]
        if (
            (database is None or row["database"] == database)
            and started
            and last
            and last > started
            and (after is None or started > after)
            and (batch_after is None or last > batch_after)
        ):
            return row
    return None


class StreamAppProcess:
    """The stream app for one config, started, watched and stopped from the outside."""

    name = "stream app"

    def __init__(
        self, config: Path, log_path: Path, extra_env: dict[str, str] | None = None, schema: str = "sequin"
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.schema = schema
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        """Start the app (its output goes to ``log_path``)."""
        env = app_env(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT)
        )
        log.close()
        return self

    def command(self) -> list[str]:
        """The app's command line."""
        return [sys.executable, str(APP), "--config", str(self.config)]

    def wait_streaming(self, store_dsn: str, timeout: float = 180.0) -> None:
        """Wait until the app has completed a micro-batch since it started."""

        def ready() -> bool:
            self.check_alive()
            return streaming_status(store_dsn, self.schema) is not None

        wait_for(ready, timeout, what="the stream app to run its first micro-batch")

    def check_alive(self) -> None:
        """Raise with the log tail when the app has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the app's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the app and everything it started (JVM, Python workers)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
            self.proc = None

    def stop(self, timeout: float = 60.0) -> int | None:
        """Graceful stop (SIGTERM), then SIGKILL of the group; returns the exit code."""
        if self.proc is None:
            return None
        proc = self.proc
        if proc.poll() is not None:
            self.kill()
            return proc.returncode
        os.kill(proc.pid, signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return code


class BackfillServerProcess(StreamAppProcess):
    """The backfill server (``sequin_provider/spark_apps/backfill.py --serve``) for one config; ``args`` are more of
    its options (``--database``, ``--max-page-rows``...)."""

    name = "backfill server"
    UP_LINE = "backfill server up"

    def __init__(
        self, config: Path, log_path: Path, *args: str, extra_env: dict[str, str] | None = None, schema: str = "sequin"
    ) -> None:
        super().__init__(config, log_path, extra_env, schema)
        self.args = args

    def command(self) -> list[str]:
        """``backfill.py --serve`` with this config and ``args``."""
        return [sys.executable, str(BACKFILL_APP), "--config", str(self.config), "--serve", *self.args]

    def wait_up(self, timeout: float = 180.0) -> None:
        """Wait until the server has its Spark and Python workers up and takes backfills."""

        def up() -> bool:
            self.check_alive()
            return self.UP_LINE in self.log_tail(1_000_000)

        wait_for(up, timeout, what="the backfill server to start")
