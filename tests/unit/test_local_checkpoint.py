"""Where the checkpoint jar lives and when the apps put it on the class path (``spark.local_checkpoint``).
That it is used and forks no chmod: ``tests/integration/spark/test_local_checkpoint.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sequin_provider.spark.local_checkpoint import JAR_ENV, driver_classpath, jar_path


def test_off_means_no_jar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JAR_ENV, "off")
    assert jar_path() is None and driver_classpath() == ""


def test_a_named_jar_is_used_only_once_it_exists(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    jar = tmp_path / "sequin.jar"
    monkeypatch.setenv(JAR_ENV, str(jar))
    assert jar_path() == jar and driver_classpath() == ""
    jar.write_bytes(b"PK")
    assert driver_classpath() == str(jar)


def test_a_path_with_the_class_path_separator_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    jar = tmp_path / "a:b" / "sequin.jar"
    jar.parent.mkdir()
    jar.write_bytes(b"PK")
    monkeypatch.setenv(JAR_ENV, str(jar))
    assert driver_classpath() == ""


def test_the_default_is_in_the_cache_folder_named_after_the_sources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(JAR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = jar_path()
    assert path is not None and path.parent == tmp_path / "sequin" and path.name.startswith("sequin-spark-")
    assert path.suffix == ".jar"
