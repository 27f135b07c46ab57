"""spark/local_checkpoint: a local checkpoint is written by our manager, which forks no ``chmod``.

The chmod processes are counted by a ``chmod`` on the ``PATH`` of a fresh Spark driver (a child
process: the JVM's environment is fixed when it starts) that logs each call and runs the real one.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from devtools.stream_process import wait_for
from sequin_provider.spark.local_checkpoint import (
    CHECKPOINT_FILE_MANAGER_CONF,
    FILE_SYSTEM_MANAGER,
    NIO_MANAGER,
    driver_classpath,
    manager_class,
    use_local_checkpoint_manager,
)

APP = r"""
import json, os, sys, time
from sequin_provider.spark.app import spark_session
from sequin_provider.spark.local_checkpoint import CHECKPOINT_FILE_MANAGER_CONF, manager_class

out, log = sys.argv[1], sys.argv[2]
spark = spark_session("sequin-checkpoint-chmod", "local[1]")
report = {"chosen": manager_class(spark)}
for name, manager in (("ours", manager_class(spark)), ("spark", sys.argv[3])):
    spark.conf.set(CHECKPOINT_FILE_MANAGER_CONF, manager)
    before = os.path.getsize(log) if os.path.exists(log) else 0
    query = (
        spark.readStream.format("rate").option("rowsPerSecond", 50).load()
        .writeStream.format("noop").option("checkpointLocation", f"{out}/{name}").start()
    )
    while (query.lastProgress or {}).get("batchId", -1) < 3:
        time.sleep(0.1)
    query.stop()
    after = os.path.getsize(log) if os.path.exists(log) else 0
    report[name] = open(log).read()[before:after].count("\n") if after else 0
if report["chosen"] != sys.argv[3]:
    jvm = spark.sparkContext._jvm
    jvm.io.sequin.spark.NioLocalFileSystem.Raw().setPermission(
        jvm.org.apache.hadoop.fs.Path(f"{out}/ours/metadata"), jvm.org.apache.hadoop.fs.permission.FsPermission(0o640)
    )
print("REPORT " + json.dumps(report))
spark.stop()
"""


def run_app(tmp_path: Path, **env: str) -> dict[str, object]:
    """Run ``APP`` in a fresh driver whose ``chmod`` logs to ``tmp_path/chmod.log``: the manager it
    chose, and the chmod calls of three micro-batches through it ("ours") and through Spark's."""
    wrappers, log = tmp_path / "bin", tmp_path / "chmod.log"
    wrappers.mkdir()
    (wrappers / "chmod").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec /bin/chmod "$@"\n')
    (wrappers / "chmod").chmod(0o755)
    run = subprocess.run(
        [sys.executable, "-c", APP, str(tmp_path), str(log), FILE_SYSTEM_MANAGER],
        env={**os.environ, **env, "PATH": f"{wrappers}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def test_a_local_checkpoint_forks_no_chmod_and_writes_what_sparks_manager_writes(tmp_path: Path) -> None:
    assert driver_classpath(), "the checkpoint jar is not built: run `make spark-archive` (needs javac)"
    report = run_app(tmp_path)
    assert report["chosen"] == NIO_MANAGER
    assert report["spark"] >= 8  # Spark's manager: offsets and commits, a file and its .crc each, per batch
    assert report["ours"] == 0

    for name in ("ours", "spark"):  # the same files, with the same permission bits
        offsets = {p.name for p in (tmp_path / name / "offsets").iterdir()}
        assert {"0", "1", "2", "3", ".0.crc", ".1.crc"} <= offsets
    mode = {name: stat.S_IMODE((tmp_path / name / "commits" / "1").stat().st_mode) for name in ("ours", "spark")}
    assert mode["ours"] == mode["spark"] == 0o666 & ~current_umask()
    assert stat.S_IMODE((tmp_path / "ours" / "metadata").stat().st_mode) == 0o640  # set through java.nio


def test_without_the_jar_a_local_checkpoint_goes_through_sparks_manager(tmp_path: Path) -> None:
    """No jar (no JDK to build it, ``$SEQUIN_SPARK_JAR=off``): Spark's FileSystem manager, as before."""
    report = run_app(tmp_path, SEQUIN_SPARK_JAR="off")
    assert report["chosen"] == FILE_SYSTEM_MANAGER
    assert report["ours"] >= 8 and report["spark"] >= 8


def current_umask() -> int:
    """This process's umask (the driver it starts inherits it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_remote_checkpoint_and_a_chosen_manager_are_left_alone(tmp_path: Path) -> None:
    """A local checkpoint's offsets and commits go through ``manager_class``; a remote checkpoint
    and a manager the user chose are left alone."""
    from sequin_provider.spark.app import spark_session

    spark = spark_session("sequin-checkpoint-tests", "local[1]")
    try:
        assert manager_class(spark) == NIO_MANAGER
        checkpoint = tmp_path / "ckpt"
        use_local_checkpoint_manager(spark, str(checkpoint))
        query = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 100)
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", str(checkpoint))
            .start()
        )
        try:
            wait_for(lambda: (query.lastProgress or {}).get("batchId", -1) >= 2, 60, what="three micro-batches")
            execution = query._jsq.streamingQuery()  # Scala's protected members are public to py4j
            assert execution.offsetLog().fileManager().getClass().getName() == NIO_MANAGER
            assert execution.commitLog().fileManager().getClass().getName() == NIO_MANAGER
        finally:
            query.stop()
        assert {"0", "1", "2"} <= {p.name for p in (checkpoint / "commits").iterdir()}

        spark.conf.unset(CHECKPOINT_FILE_MANAGER_CONF)
        use_local_checkpoint_manager(spark, "hdfs://namenode:8020/sequin/ckpt")
        assert spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None) is None
        use_local_checkpoint_manager(spark, f"file://{checkpoint}")
        assert spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None) == NIO_MANAGER
        spark.conf.set(CHECKPOINT_FILE_MANAGER_CONF, "com.example.TheirManager")
        use_local_checkpoint_manager(spark, str(checkpoint))
        assert spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None) == "com.example.TheirManager"
    finally:
        spark.stop()
