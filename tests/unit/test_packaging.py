"""The installed environment matches the pins, and the provider is discoverable by Airflow."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pyspark

import sequin_provider


def test_pyspark_is_whole_and_matches_pyspark_client() -> None:
    # providers-apache-spark pulls pyspark-client, which writes into pyspark's folder: same version only.
    assert metadata.version("pyspark") == metadata.version("pyspark-client") == pyspark.__version__
    jars = list((Path(pyspark.__file__).parent / "jars").glob("spark-core_*.jar"))
    assert jars, "pyspark's jars are missing (pyspark was overwritten by pyspark-client?)"


def test_provider_entry_point() -> None:
    (entry,) = [
        e for e in metadata.entry_points(group="apache_airflow_provider") if e.value.startswith("sequin_provider")
    ]
    info = entry.load()()
    assert info["package-name"] == "sequin-provider"
    assert info["versions"] == [sequin_provider.__version__]


def test_console_script() -> None:
    (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "sequin"]
    assert entry.value == "sequin_provider.cli:main"


def test_the_cli_store_and_airflow_side_load_no_pyarrow() -> None:
    """What records, follows or serves messages without Spark (the ``sequin`` CLI's start and its
    config's destination kinds, the store, the pull API, a backfill's control, the Airflow hook)
    imports neither pyarrow nor PySpark: pyarrow was 0.1-0.2 s of every command's start. Only the
    pipeline's modules need it (``change_arrow``, ``message_render``, ``sinks.stored``)."""
    import subprocess
    import sys

    code = (
        "import sys, sequin_provider.cli, sequin_provider.store, sequin_provider.backfill,"
        " sequin_provider.backfill.control,"
        " sequin_provider.hooks.sequin, sequin_provider.freshness, sequin_provider.replay, sequin_provider.stream_api;"
        " sequin_provider.cli.build_parser(); import sequin_provider.sinks.registry as r; r.kinds();"
        " print(sorted(m for m in ('pyarrow', 'pyspark') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
