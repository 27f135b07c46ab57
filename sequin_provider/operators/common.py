"""What the Sequin operators share: finding and loading ``sequin.yaml`` against the connection.

The Spark apps and the domain code read the config file; the ``sequin`` connection says where it
is (``config_path`` extra) and where the store is. Both must name the same store schema, or the
operator would record a backfill (or take a lock) where the apps never look.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psycopg.conninfo import conninfo_to_dict

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.config import DEFAULT_CONFIG_PATH, ConfigError, SequinConfig

if TYPE_CHECKING:
    from sequin_provider.hooks.sequin import SequinHook


def config_file(hook: SequinHook, config_path: str | None) -> Path:
    """The config file: the operator's ``config_path``, else the connection's, else ``SEQUIN_CONFIG``
    or ``./sequin.yaml``; absolute, because the Spark apps run in another working directory."""
    path = config_path or hook.settings.config_path or os.environ.get("SEQUIN_CONFIG") or DEFAULT_CONFIG_PATH
    return Path(path).expanduser().absolute()


def load_sequin_config(hook: SequinHook, config_path: str | None) -> tuple[SequinConfig, Path]:
    """Load and check the config (its ``conn_id``s resolved through Airflow); a bad file or a schema
    mismatch fails the task without retries."""
    path = config_file(hook, config_path)
    with airflow_errors():
        config = hook.load_config(str(path))
        schema = hook.settings.store_schema
        if schema != config.store.schema:
            raise ConfigError(
                str(path),
                "store.schema",
                f"connection {hook.sequin_conn_id!r} names store schema {schema!r} but {path} has"
                f" store.schema {config.store.schema!r}: the operator and the Spark apps must use the"
                " same store",
            )
    return config, path


def optional_text(value: object) -> str | None:
    """A templated optional value: None and "" mean unset; anything else as text (dates in ISO form)."""
    if value is None:
        return None
    if hasattr(value, "isoformat"):
        return str(value.isoformat())  # type: ignore[union-attr]
    text = str(value).strip()
    return text or None


def _server(dsn: str) -> tuple[str, str, str]:
    try:
        parts = conninfo_to_dict(dsn)
    except Exception:  # noqa: BLE001 - an unparsable DSN is reported by whoever connects with it
        return ("?", "?", "?")
    return (str(parts.get("host") or "localhost"), str(parts.get("port") or "5432"), str(parts.get("dbname") or ""))


def warn_if_elsewhere(log: Any, what: str, connection_dsn: str, config_dsn: str) -> None:
    """Warn when the connection and the config seem to name different databases for ``what``: the
    operator would look at one, the Spark app at the other. Only a warning, because the worker and
    the Spark driver may reach the same server under different host names."""
    ours, theirs = _server(connection_dsn), _server(config_dsn)
    if ours != theirs:
        log.warning(
            "the %s of the sequin connection (%s:%s/%s) differs from the config's (%s:%s/%s): the operator"
            " and the Spark app must reach the same database",
            what,
            *ours,
            *theirs,
        )


def task_instance_key(context: Any) -> str | None:
    """``airflow:dag/task/run[map index]`` of the running task instance, the same for all its tries
    (None without one): recorded with what the task starts, so that a retry can find it."""
    ti = context.get("ti") if context else None
    if ti is None:
        return None
    key = f"airflow:{ti.dag_id}/{ti.task_id}/{ti.run_id}"
    map_index = getattr(ti, "map_index", None)
    return f"{key}[{map_index}]" if isinstance(map_index, int) and map_index >= 0 else key
