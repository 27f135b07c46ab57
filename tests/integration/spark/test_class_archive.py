"""A local Spark app with a class archive its JVM cannot use starts and runs all the same
(``spark.class_archive``: a stale or corrupt archive is skipped, never an error). That a good one is
mapped: ``test_stream_app.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sequin_provider.spark.class_archive import ARCHIVE_ENV

PROGRAM = """
from sequin_provider.spark.app import spark_session
spark = spark_session("archive-check", "local[1]")
print("count", spark.range(7).count(), spark.sparkContext.getConf().get("spark.driver.extraJavaOptions"))
spark.stop()
"""


def test_a_corrupt_archive_is_skipped_and_the_app_runs(tmp_path: Path) -> None:
    archive = tmp_path / "spark.jsa"
    archive.write_bytes(os.urandom(100_000))
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, ARCHIVE_ENV: str(archive)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    count, options = done.stdout.split("count ", 1)[1].split(" ", 1)
    assert count == "7" and f"-XX:SharedArchiveFile={archive}" in options.split()  # offered, skipped, ran
