"""How a local app writes a local streaming checkpoint, with no process forked per file.

Spark writes two checkpoint files per micro-batch (the offsets before it, the commit after it), each
as a temporary file renamed into place. Through Hadoop's local file system without Hadoop's native
library (pip's PySpark has none), every file created has its permission set by a forked ``chmod``,
once for the file and once for its ``.crc``: measured from the stream app's 4 GB driver JVM on 2
cores, 12.8 ms per checkpoint file through Spark's ``FileSystemBasedCheckpointFileManager``, most of
a micro-batch's ``walCommit`` and ``commitOffsets`` phases. The class this module compiles
(``java/LocalCheckpointFileManager.java``) is that manager over a local file system that sets the
same permission bits through ``java.nio``: 1.9 ms per file.

The jar is compiled once per PySpark by ``python -m sequin_provider.spark.local_checkpoint`` (``make``
runs it; ``javac`` from a JDK 17+), into the user's cache folder; ``spark_session`` puts it on a
local driver's class path and ``use_local_checkpoint_manager`` chooses it when the JVM has it.
Without it (no JDK, ``$SEQUIN_SPARK_JAR=off``, spark-submit without ``--driver-class-path``) a local
checkpoint goes through Spark's ``FileSystemBasedCheckpointFileManager`` as before: same files,
slower. A checkpoint on another file system (HDFS, S3...) is left to Spark's default.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from sequin_provider.spark.user_cache import cache_folder, configured_path, prune

JAR_ENV = "SEQUIN_SPARK_JAR"
JAVA_SOURCES = Path(__file__).parent / "java"
CHECKPOINT_FILE_MANAGER_CONF = "spark.sql.streaming.checkpointFileManagerClass"
FILE_SYSTEM_MANAGER = "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
"""Spark's own manager over Hadoop's ``FileSystem`` API: the fallback for a local checkpoint.

Spark's default one (``FileContext``) has Hadoop's local file system look up whether the destination
of every rename is a symbolic link, which without Hadoop's native library forks ``readlink``: about
six processes per micro-batch (offsets, commits, the source's metadata), measured with strace at a
steady 5,000 changes/s. This one renames the same way (one ``rename(2)`` in the same directory,
atomic on a local file system) without that lookup."""
NIO_MANAGER = "io.sequin.spark.LocalCheckpointFileManager"
"""``FILE_SYSTEM_MANAGER`` over ``io.sequin.spark.NioLocalFileSystem`` (no ``chmod`` processes)."""


def jar_path() -> Path | None:
    """Where the compiled jar for these sources and this PySpark lives (``$SEQUIN_SPARK_JAR``, else
    under the user's cache folder, named after both); None when the setting is ``off``."""
    return configured_path(JAR_ENV, _default_jar)


def _default_jar() -> Path:
    """The jar's path in the cache folder, named after the Java sources and PySpark."""
    import pyspark

    digest = hashlib.sha256(pyspark.__version__.encode())
    for source in sorted(JAVA_SOURCES.glob("*.java")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return cache_folder() / f"sequin-spark-{digest.hexdigest()[:16]}.jar"


def driver_classpath() -> str:
    """The jar's path for ``spark.driver.extraClassPath`` when it is built, else "" (also when its
    path has a ``:``, the class path's separator)."""
    path = jar_path()
    if path is None or ":" in str(path) or not path.is_file():
        return ""
    return str(path)


def build(path: Path) -> None:
    """Compile ``JAVA_SOURCES`` against PySpark's jars into the jar ``path`` (written beside it,
    then renamed into place). Raises ``FileNotFoundError`` without ``javac``,
    ``subprocess.CalledProcessError`` when it fails."""
    import pyspark

    home = os.environ.get("JAVA_HOME")
    javac = (shutil.which("javac", path=os.path.join(home, "bin")) if home else None) or shutil.which("javac")
    if javac is None:
        raise FileNotFoundError("javac (a JDK 17 or newer) is not installed")
    jars = Path(pyspark.__file__).parent / "jars"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as classes:
        sources = [str(s) for s in sorted(JAVA_SOURCES.glob("*.java"))]
        subprocess.run(
            [javac, "--release", "17", "-nowarn", "-d", classes, "-cp", f"{jars}/*", *sources],
            check=True,
            capture_output=True,
            text=True,
        )
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: sequin_provider\n")
            for compiled in sorted(Path(classes).rglob("*.class")):
                jar.write(compiled, compiled.relative_to(classes).as_posix())
    os.replace(partial, path)
    prune(path, "sequin-spark-*.jar")


def manager_class(spark: Any) -> str:
    """``NIO_MANAGER`` when the session's driver JVM can load it, else ``FILE_SYSTEM_MANAGER``."""
    try:
        spark.sparkContext._jvm.java.lang.Class.forName(NIO_MANAGER)  # PySpark's handle on the JVM
    except Exception:  # noqa: BLE001 - py4j's error for ClassNotFoundException
        return FILE_SYSTEM_MANAGER
    return NIO_MANAGER


def use_local_checkpoint_manager(spark: Any, checkpoint_dir: str) -> None:
    """Checkpoint a local ``checkpoint_dir`` through ``manager_class``, unless the user chose a
    manager (``--conf``) or the checkpoint is on another file system (HDFS, S3...), where the
    default's semantics are the ones Spark documents."""
    scheme = checkpoint_dir.split(":", 1)[0] if "://" in checkpoint_dir else ""
    if scheme not in ("", "file") or spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None):
        return
    spark.conf.set(CHECKPOINT_FILE_MANAGER_CONF, manager_class(spark))


def main() -> int:
    """Build the jar unless it exists; print where it is, or why there is none (not an error: the
    apps then write checkpoints through ``FILE_SYSTEM_MANAGER``)."""
    path = jar_path()
    if path is None:
        print(f"checkpoint jar: off (${JAR_ENV})")
        return 0
    if path.is_file():
        print(f"checkpoint jar: {path}")
        return 0
    try:
        build(path)
    except FileNotFoundError as exc:
        print(f"checkpoint jar: not built, {exc}; local checkpoints fork chmod per file (slower, same files)")
        return 0
    except subprocess.CalledProcessError as exc:
        print(f"checkpoint jar: javac failed:\n{exc.stderr}", file=sys.stderr)
        return 1
    print(f"checkpoint jar: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
