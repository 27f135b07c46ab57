"""Shared fixtures: one throwaway Postgres cluster per session, a database per test, the stream app.
Helpers live in ``tests.support``; this file holds fixtures only."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterator

import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from tests.support.stream_app import StreamApp

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
