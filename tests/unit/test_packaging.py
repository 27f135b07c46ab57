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
