"""A class-data-sharing (CDS) archive of the classes a Spark app's local driver JVM loads.

Each start of a local-mode app (the stream app, a one-off backfill app, the backfill server) loads
and verifies some 15,000 of Spark's classes from its jars. With those classes in a JVM archive
(Java's dynamic CDS, ``-XX:SharedArchiveFile``), measured on 2 cores (Java 17, PySpark 4.2): the
Spark session starts in 2.6 s instead of 4.6, and its first job takes 1.0 s instead of 2.0, so a
restart after a crash recovers about 3 s sooner and costs that much less CPU.

The archive is written once per Java and PySpark install by ``python -m
sequin_provider.spark.class_archive`` (``make`` runs it): a throwaway local app with
``-XX:ArchiveClassesAtExit``, moved into place once its JVM has exited. The apps use it when it is
there and start as before when it is not. A JVM that finds the archive does not match it (another
Java, other jars) ignores it. ``$SEQUIN_SPARK_CLASS_ARCHIVE``: the archive's path, or ``off``.
Under spark-submit (a cluster, the Airflow operators) the driver's JVM options are spark-submit's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from sequin_provider.spark.local_checkpoint import driver_classpath, use_local_checkpoint_manager
from sequin_provider.spark.user_cache import cache_folder, configured_path, prune

ARCHIVE_ENV = "SEQUIN_SPARK_CLASS_ARCHIVE"


def _java_binary() -> str:
    """The ``java`` that Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the one on the PATH."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found else ""


def archive_path() -> Path | None:
    """Where the archive for this Java and this PySpark lives (``$SEQUIN_SPARK_CLASS_ARCHIVE``, else
    under the user's cache folder, named after both); None when the setting is ``off``."""
    return configured_path(ARCHIVE_ENV, _default_archive)


def _default_archive() -> Path:
    """The archive's path in the cache folder, named after the Java binary, PySpark and the jars."""
    import pyspark

    java = _java_binary()
    stamp = os.stat(java).st_mtime_ns if java and os.path.exists(java) else 0  # a reinstalled Java
    key = [pyspark.__version__, java, str(stamp)]
    # The JVM skips an archive when a jar of its class path has another size or time than when it
    # was written (a reinstalled venv, same paths): those name the archive too.
    jars = Path(pyspark.__file__).parent / "jars"
    ours = driver_classpath()  # first on the class path when built
    for jar in [*([Path(ours)] if ours else []), *sorted(jars.glob("*.jar"))]:
        info = jar.stat()
        key.append(f"{jar}:{info.st_size}:{info.st_mtime_ns}")
    return cache_folder() / f"spark-classes-{hashlib.sha256('|'.join(key).encode()).hexdigest()[:16]}.jsa"


def archive_options() -> str:
    """The driver JVM options that map the archive, or "" when there is none (or its path has a
    space, which Spark's option splitting would break). The JVM's own messages about the archive
    are silenced: one it cannot use is skipped, never an error."""
    path = archive_path()
    if path is None or " " in str(path) or not path.is_file():
        return ""
    return f"-XX:SharedArchiveFile={path} -Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"


def _exercise(spark: object) -> None:
    """Run what the apps run, so their classes are loaded and archived: SQL, Arrow to and from
    Python workers, JSON, a streaming query with a checkpoint."""
    import tempfile

    import pyarrow as pa

    def double(batches: object) -> object:
        for batch in batches:  # type: ignore[attr-defined]
            yield pa.RecordBatch.from_pydict({"id": [2 * v for v in batch.column(0).to_pylist()]})

    frame = spark.range(1000).repartition(2)  # type: ignore[attr-defined]
    frame.mapInArrow(double, "id long").selectExpr("to_json(named_struct('id', id)) AS j").collect()
    with tempfile.TemporaryDirectory() as folder:
        use_local_checkpoint_manager(spark, folder)
        query = (
            spark.readStream.format("rate")  # type: ignore[attr-defined]
            .option("rowsPerSecond", 100)
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", folder)
            .start()
        )
        try:
            query.processAllAvailable()
        finally:
            query.stop()


def build(path: Path) -> None:
    """Write the archive to ``path`` from a throwaway local app in this process (which must not
    have started Spark yet), then move it into place once the JVM has exited and written it."""
    from sequin_provider.spark.app import STREAM_JAVA_OPTIONS, spark_session

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    os.environ[ARCHIVE_ENV] = "off"  # the throwaway app writes the archive, it does not read one
    os.environ.pop("SEQUIN_SPARK_JAVA_OPTIONS", None)
    spark = spark_session(
        "sequin-class-archive",
        "local[2]",
        f"{STREAM_JAVA_OPTIONS} -XX:ArchiveClassesAtExit={partial} -Xlog:cds=off -Xlog:cds+dynamic=off",
    )
    jvm = spark.sparkContext._gateway.proc  # PySpark's handle on the JVM it launched
    try:
        _exercise(spark)
    finally:
        spark.stop()
        jvm.stdin.close()  # the gateway JVM exits when its stdin closes, writing the archive first
        jvm.wait(timeout=300)
    if not partial.is_file() or partial.stat().st_size == 0:
        raise RuntimeError(f"the JVM wrote no class archive to {partial}")
    os.replace(partial, path)
    prune(path, "spark-classes-*.jsa")  # ~160 MB each


def main() -> int:
    """Build the archive unless it exists; print where it is."""
    path = archive_path()
    if path is None:
        print(f"class archive: off (${ARCHIVE_ENV})")
        return 0
    if path.is_file():
        print(f"class archive: {path}")
        return 0
    build(path)
    print(f"class archive: wrote {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
