"""Shared fixtures: one throwaway Postgres cluster per session, a database per test, the stream app."""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import StreamAppProcess, wait_for  # noqa: F401 - wait_for is shared with the tests
from sequin_provider import store
from sequin_provider.messages import parse_message

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


def write_config(path: Path, body: str) -> Path:
    """Write a sequin.yaml."""
    path.write_text(textwrap.dedent(body))
    return path


def sink_messages(dsn: str, sink: str, schema: str = "sequin") -> list[dict[str, Any]]:
    """A sink's stream messages that a consumer may be served (visible), parsed, in position order."""
    with psycopg.connect(dsn) as conn:
        if not store.schema_version(conn, schema):
            return []
        return [parse_message(m.data) for m in store.stream_messages(conn, schema, sink, visible_only=True)]


def put_stream_messages(dsn: str, sink: str, messages: list[tuple[int, int, str]], visible: bool = True) -> None:
    """Write (commit_lsn, commit_idx, group) messages as the stream app does, then make them visible."""
    rows = [(sink, lsn, idx, group, f"{lsn}:{idx}", json.dumps({"record": {"lsn": lsn, "idx": idx, "g": group},
                                                                "action": "insert", "changes": None,
                                                                "metadata": {"commit_lsn": lsn, "commit_idx": idx}}))
            for lsn, idx, group in messages]
    with psycopg.connect(dsn) as conn:
        store.insert_stream_messages(conn, "sequin", rows)
        if visible:
            store.advance_visible_lsn(conn, "sequin", [sink], max(m[0] for m in messages))


class StreamApp(StreamAppProcess):
    """The stream app for tests: a dead app fails the test with its log."""

    def check_alive(self) -> None:
        try:
            super().check_alive()
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None


def spark_jvm_arguments(app: StreamAppProcess) -> list[str]:
    """The command line of the Spark JVM the app's driver started (local mode: it runs the executors too)."""
    assert app.proc is not None
    for child in psutil.Process(app.proc.pid).children(recursive=True):
        if child.name() == "java":
            return child.cmdline()
    raise AssertionError("the stream app runs no JVM")


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
