"""Sequin-style Postgres change data capture as an Apache Airflow provider running on Spark."""

from __future__ import annotations

__version__ = "0.1.0"

INTEGRATION = "Sequin"


def get_provider_info() -> dict[str, object]:
    """Airflow provider metadata (entry point ``apache_airflow_provider``).

    The ``sequin`` connection type is declared here with ``conn-fields`` / ``ui-field-behaviour``
    (Airflow >= 3.2), so its form is known without importing the hook.
    """
    return {
        "package-name": "sequin-provider",
        "name": "Sequin",
        "description": "Postgres change data capture (logical replication) delivered by Spark, operated by Airflow.",
        "versions": [__version__],
        "integrations": [
            {"integration-name": INTEGRATION, "tags": ["software"]},
        ],
        "hooks": [
            {"integration-name": INTEGRATION, "python-modules": ["sequin_provider.hooks.sequin"]},
        ],
        "operators": [
            {"integration-name": INTEGRATION, "python-modules": ["sequin_provider.operators.sequin"]},
        ],
        "sensors": [
            {"integration-name": INTEGRATION, "python-modules": ["sequin_provider.sensors.sequin"]},
        ],
        "triggers": [
            {"integration-name": INTEGRATION, "python-modules": ["sequin_provider.triggers.sequin"]},
        ],
        "notifications": ["sequin_provider.notifications.sequin.SequinNotifier"],
        "plugins": [{"name": "sequin", "plugin-class": "sequin_provider.plugins.sequin.SequinPlugin"}],
        "connection-types": [
            {
                "hook-class-name": "sequin_provider.hooks.sequin.SequinHook",
                "hook-name": "Sequin",
                "connection-type": "sequin",
                "conn-fields": {
                    "store_dsn": {
                        "label": "Store DSN",
                        "description": "Postgres DSN of the store database (stream messages, buffer, backfills)."
                        " Empty: the source database above.",
                        "schema": {"type": ["string", "null"], "format": "password"},
                    },
                    "store_schema": {
                        "label": "Store schema",
                        "description": "Schema of the store tables in the store database.",
                        "schema": {
                            "type": ["string", "null"],
                            "default": "sequin",
                            "pattern": "^[A-Za-z_][A-Za-z0-9_$]*$",
                        },
                    },
                    "config_path": {
                        "label": "Config path",
                        "description": "Path of the sequin.yaml the stream and backfill apps run with.",
                        "schema": {"type": ["string", "null"]},
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": [],
                    "relabeling": {"schema": "Database", "login": "User"},
                    "placeholders": {
                        "host": "localhost",
                        "port": "5432",
                        "schema": "source database name",
                        "login": "replication user",
                        "extra": '{"sslmode": "require"}',
                        "store_dsn": "postgresql://user:password@host:5432/store",
                        "config_path": "/opt/sequin/sequin.yaml",
                    },
                },
            }
        ],
    }
