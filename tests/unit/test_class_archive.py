"""Where the Spark class archive lives and the JVM options that map it (``spark.class_archive``).
That a running app's JVM really maps it: ``tests/integration/spark/test_stream_app.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sequin_provider.spark.class_archive import ARCHIVE_ENV, archive_options, archive_path


def test_off_means_no_archive_and_no_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARCHIVE_ENV, "off")
    assert archive_path() is None and archive_options() == ""


def test_a_named_archive_is_mapped_only_once_it_exists(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    archive = tmp_path / "spark.jsa"
    monkeypatch.setenv(ARCHIVE_ENV, str(archive))
    assert archive_path() == archive and archive_options() == ""  # not written yet: the JVM starts as before
    archive.write_bytes(b"x")
    assert archive_options().split() == [
        f"-XX:SharedArchiveFile={archive}",
        "-Xshare:auto",
        "-Xlog:cds=off",
        "-Xlog:cds+dynamic=off",
    ]


def test_a_path_with_a_space_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    archive = tmp_path / "with space" / "spark.jsa"  # Spark splits extraJavaOptions on spaces
    archive.parent.mkdir()
    archive.write_bytes(b"x")
    monkeypatch.setenv(ARCHIVE_ENV, str(archive))
    assert archive_options() == ""


def test_the_default_is_named_after_this_java_and_this_pyspark(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = archive_path()
    assert first is not None and first.parent == tmp_path / "sequin" and first.suffix == ".jsa"
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "another-jdk"))
    assert archive_path() != first  # another Java: another archive (a mismatched one would be ignored)


def test_a_reinstalled_jar_names_another_archive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The JVM skips an archive whose class path jars changed size or time (a venv installed again at
    the same path, as CI does): such an install must not find the old archive and keep skipping it."""
    import pyspark

    jars = tmp_path / "pyspark" / "jars"
    jars.mkdir(parents=True)
    (jars / "spark-core.jar").write_bytes(b"jar")
    monkeypatch.setattr(pyspark, "__file__", str(tmp_path / "pyspark" / "__init__.py"))
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = archive_path()
    os.utime(jars / "spark-core.jar", ns=(1, 1))
    assert archive_path() != before
