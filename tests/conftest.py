"""Shared fixtures: one throwaway Postgres cluster per session, a database per test, the stream app."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg
import pytest

from sequin_provider import store
from sequin_provider.embedded_postgres import EmbeddedPostgres
from sequin_provider.messages import parse_message

ROOT = Path(__file__).resolve().parent.parent
_counter = itertools.count()


@pytest.fixture(scope="session")
def pg() -> Iterator[EmbeddedPostgres]:
    """The session's Postgres (wal_level=logical), or SEQUIN_TEST_DSN's server."""
    with EmbeddedPostgres() as cluster:
        yield cluster


@pytest.fixture
def dbname(request: pytest.FixtureRequest) -> str:
    """A fresh database name for this test."""
    return f"t{next(_counter)}_{request.node.name[:30].lower()}".replace("[", "_").replace("]", "").replace("-", "_")


@pytest.fixture
def dsn(pg: EmbeddedPostgres, dbname: str) -> str:
    """DSN of a fresh, empty database."""
    return pg.create_database(dbname)


def execute(dsn: str, *statements: str, params: Any = None) -> None:
    """Run statements in one autocommit session."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement, params)


def wait_for(predicate: Callable[[], Any], timeout: float = 120.0, interval: float = 0.25, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def write_config(path: Path, body: str) -> Path:
    """Write a sequin.yaml."""
    path.write_text(textwrap.dedent(body))
    return path


def sink_messages(dsn: str, sink: str, schema: str = "sequin") -> list[dict[str, Any]]:
    """A sink's stream messages, parsed, in position order."""
    with psycopg.connect(dsn) as conn:
        if not store.schema_version(conn, schema):
            return []
        return [parse_message(m.data) for m in store.stream_messages(conn, schema, sink)]


class StreamApp:
    """The replication stream app as a subprocess (its own process group, so it can be SIGKILLed whole)."""

    def __init__(self, config: Path, log_path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.config = config
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StreamApp:
        venv_bin = str(Path(sys.executable).parent)
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                   PATH=f"{venv_bin}:{os.environ.get('PATH', '')}", PYTHONPATH=str(ROOT), **self.extra_env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "spark_apps" / "replication_stream.py"),
                                      "--config", str(self.config)], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))
        return self

    def wait_streaming(self, dsn: str, timeout: float = 180.0) -> None:
        """Wait until the app has completed a micro-batch since it started."""
        def ready() -> bool:
            self.check_alive()
            try:
                with psycopg.connect(dsn) as conn:
                    rows = store.read_status(conn, "sequin") if store.schema_version(conn, "sequin") else []
            except psycopg.Error:
                return False
            return any(r["last_batch_at"] and r["app_started_at"] and r["last_batch_at"] > r["app_started_at"] for r in rows)
        wait_for(ready, timeout, what="the stream app to run a batch")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"stream app exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
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
        """Graceful stop (SIGTERM), then SIGKILL if it hangs."""
        if self.proc is None:
            return None
        proc = self.proc
        if proc.poll() is not None:
            self.proc = None
            return proc.returncode
        os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return code


@pytest.fixture
def stream_app(tmp_path: Path) -> Iterator[Callable[[Path], StreamApp]]:
    """Factory: ``stream_app(config_path)`` starts the app; all are stopped after the test."""
    apps: list[StreamApp] = []

    def factory(config: Path, extra_env: dict[str, str] | None = None) -> StreamApp:
        app = StreamApp(config, tmp_path / f"stream-app-{len(apps)}.log", extra_env).start()
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.stop()
