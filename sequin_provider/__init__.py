"""Sequin-style Postgres change data capture as an Apache Airflow provider running on Spark."""

from __future__ import annotations

__version__ = "0.1.0"


def get_provider_info() -> dict[str, object]:
    """Airflow provider metadata (entry point ``apache_airflow_provider``)."""
    return {
        "package-name": "sequin-provider",
        "name": "Sequin",
        "description": "Postgres change data capture (logical replication) delivered by Spark, operated by Airflow.",
        "versions": [__version__],
    }
