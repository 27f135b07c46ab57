"""The wheel is the product: built from the checkout, installed into a fresh venv without the checkout,
it runs a backfill through ``SequinBackfillOperator`` and ``SparkSubmitHook`` (local Spark, real Postgres).

The fresh venv gets its third-party dependencies from this venv's site-packages through a folder of
symlinks that leaves out everything of ``sequin-provider`` (the editable install of the checkout, its
finder and its metadata), so the only ``sequin_provider`` it can import is the wheel's. Its processes
run outside the checkout, without ``PYTHONPATH``. Built without build isolation when this venv's
setuptools is new enough (offline), else with it (pip fetches setuptools).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from tests.support.airflow import sequin_connection
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.stream_app import StreamApp

ROOT = Path(__file__).resolve().parents[2]
ROWS = 300
BUILD_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "var",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.so",
    "spark-warehouse",
    "metastore_db",
    ".pytest_cache",
)
SPARK_SCRIPTS = ("spark-submit", "spark-class", "find-spark-home", "find_spark_home.py", "load-spark-env.sh")

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_wheel}}
    publication: {{name: pub_wheel}}
    heartbeat_interval: 1s
sinks:
  - {{name: items_sink, tables: [items], destination: {{type: sequin_stream}}}}
stream:
  checkpoint_location: {ckpt}
"""

# Runs in the fresh venv: the operator as an Airflow worker runs it, then where things came from.
RUN_BACKFILL = textwrap.dedent("""
    import json, sys
    import sequin_provider
    from sequin_provider.operators.backfill import SequinBackfillOperator
    from sequin_provider.operators.spark_submit import default_application

    op = SequinBackfillOperator(task_id="backfill", sink="items_sink", table="items", max_query_ms=2000)
    backfill_id = op.execute(context={})
    print(json.dumps({"backfill_id": backfill_id, "package": sequin_provider.__file__,
                      "application": default_application("backfill.py")}))
""")


def needs_build_isolation() -> bool:
    """This venv's setuptools cannot build the project (``build-system.requires``: setuptools>=77)."""
    try:
        major = int(metadata.version("setuptools").split(".")[0])
    except metadata.PackageNotFoundError:
        return True
    return major < 77


def build_wheel(out: Path) -> Path:
    """The project's wheel, built from a copy of the checkout (the checkout itself stays untouched)."""
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=BUILD_IGNORE)
    isolation = [] if needs_build_isolation() else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out / "dist"), str(source)],
        check=True,
        cwd=out,
        timeout=600,
    )
    (wheel,) = (out / "dist").glob("sequin_provider-*.whl")
    return wheel


def dependencies_without_the_checkout(into: Path) -> Path:
    """A folder of symlinks to this venv's site-packages, minus every trace of sequin-provider."""
    into.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if "sequin_provider" in name or name.startswith("__editable__") or name.endswith(".pth"):
            continue
        (into / entry.name).symlink_to(entry)
    return into


def fresh_venv(at: Path, deps: Path, wheel: Path) -> Path:
    """A venv with the wheel installed and ``deps`` on its path; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(at)], check=True, timeout=120)
    python = at / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=clean_env(at),
    ).stdout.strip()
    (Path(purelib) / "_dependencies.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        timeout=300,
        cwd=at,
        env=clean_env(at),
    )
    for script in SPARK_SCRIPTS:  # pyspark's launchers, where a pip install of pyspark puts them
        (at / "bin" / script).symlink_to(Path(sys.executable).parent / script)
    return python


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """This environment without the checkout on ``PYTHONPATH`` and without this venv on ``PATH``."""
    ours = str(Path(sys.executable).parent)
    path = [str(venv / "bin"), *(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != ours)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "PYSPARK_", "VIRTUAL_ENV"))}
    return {**env, "PATH": os.pathsep.join(path), "VIRTUAL_ENV": str(venv), **extra}


class WheelStreamApp(StreamApp):
    """The stream app run by the fresh venv's python from the installed package, outside the checkout."""

    def __init__(self, python: Path, config: Path, log_path: Path) -> None:
        super().__init__(config, log_path)
        self.python = python

    def start(self) -> WheelStreamApp:
        venv = self.python.parent.parent
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.config.parent,
                env=clean_env(venv, PYSPARK_PYTHON=str(self.python), PYSPARK_DRIVER_PYTHON=str(self.python)),
            )
        return self

    def command(self) -> list[str]:
        return [str(self.python), "-m", "sequin_provider.spark_apps.replication_stream", "--config", str(self.config)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel built from this checkout."""
    yield build_wheel(tmp_path_factory.mktemp("wheel-build"))


def test_the_wheel_holds_the_product_and_no_dev_tooling(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    tops = {name.split("/")[0] for name in names}
    assert tops == {"sequin_provider", f"sequin_provider-{wheel.name.split('-')[1]}.dist-info"}, tops
    assert {
        "sequin_provider/spark_apps/__init__.py",
        "sequin_provider/spark_apps/backfill.py",
        "sequin_provider/spark_apps/replication_stream.py",
        "sequin_provider/operators/backfill.py",
        "sequin_provider/_pgoutput_c.c",
    } <= set(names)
    for dev in ("devtools/", "tests/", "bench/", "spark_apps/", "dags/"):
        assert not [n for n in names if n.startswith(dev)], dev
    for gone in (
        "demo",
        "demo_airflow",
        "up",
        "airflow_standalone",
        "stream_process",
        "embedded_postgres",
        "postgres_binaries",
    ):
        assert f"sequin_provider/{gone}.py" not in names
    assert "sequin = sequin_provider.cli:main" in entry_points
    assert "provider_info = sequin_provider:get_provider_info" in entry_points
    assert "sequin = sequin_provider.plugins.sequin:SequinPlugin" in entry_points


def test_installed_wheel_runs_a_backfill_through_the_operator_and_spark_submit(
    wheel: Path, pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    python = fresh_venv(tmp_path / "venv", dependencies_without_the_checkout(tmp_path / "deps"), wheel)
    dsn = pg.create_database("wheel_install")
    execute(
        dsn,
        "CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL)",
        f"INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, {ROWS}) g",
    )
    work = tmp_path / "work"
    work.mkdir()
    config = write_config(work / "sequin.yaml", CONFIG.format(dsn=dsn, ckpt=work / "ckpt"))
    env = clean_env(
        tmp_path / "venv",
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW_CONN_SEQUIN_DEFAULT=sequin_connection(dsn, config_path=str(config)),
        AIRFLOW_CONN_SPARK_DEFAULT=json.dumps({"conn_type": "spark", "host": "local[1]"}),
    )
    app = WheelStreamApp(python, config, tmp_path / "stream-app.log").start()
    try:
        app.wait_streaming(dsn)
        done = subprocess.run(
            [str(python), "-c", RUN_BACKFILL], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-4000:]
        ran = json.loads(done.stdout.strip().splitlines()[-1])
        reads = wait_for(
            lambda: [m for m in sink_messages(dsn, "items_sink") if m["action"] == "read"],
            60,
            what="the reads in the sink",
        )
    finally:
        app.stop()
    venv = str((tmp_path / "venv").resolve())
    assert ran["package"].startswith(venv) and ran["application"].startswith(venv), ran
    assert ran["application"].endswith("/sequin_provider/spark_apps/backfill.py")
    assert not ran["package"].startswith(str(ROOT) + os.sep)
    assert len(reads) == ROWS, len(reads)
    assert sorted(m["record"]["id"] for m in reads) == list(range(1, ROWS + 1))
    assert {m["record"]["name"] for m in reads} == {f"item {i}" for i in range(1, ROWS + 1)}
