"""What a DAG file may learn from ``sequin.yaml`` while Airflow parses it: the sinks and their tables.

The DAG processor parses every DAG file every few seconds, in a process that may not see the config
at all, and a DAG file must not do I/O that can fail or hang there. So the config is read at parse
time only when that is cheap and safe: ``$SEQUIN_CONFIG`` names a regular file (not a FIFO or a
device), of at most ``MAX_CONFIG_BYTES``, that parses as YAML. Only the sinks' names, databases and
tables are taken, without validation: no ``${ENV}`` substitution, no connection lookup, no import of
a destination's module (the run checks the whole config). Anything else gives None, and the DAG
falls back to what it does without the config (free-text fields).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

log = logging.getLogger(__name__)

CONFIG_ENV = "SEQUIN_CONFIG"
MAX_CONFIG_BYTES = 1 << 20
"""A larger file is not read at parse time (a config is a few KB)."""


@dataclass(frozen=True)
class SinkTables:
    """A configured sink, its database (None: the config's only one, when it has one) and its
    tables as ``schema.table``."""

    sink: str
    database: str | None
    tables: tuple[str, ...]


def qualified_table(name: str) -> str:
    """``schema.table`` of a config's table name (``public`` when it has no schema), as the config does."""
    return name if "." in name else f"public.{name}"


def read_small_config(environ: Mapping[str, str] | None = None) -> Any:
    """The YAML document of ``$SEQUIN_CONFIG`` if it is a regular file of at most ``MAX_CONFIG_BYTES``
    that parses; None otherwise (unset, missing, a FIFO, too large, unreadable, malformed)."""
    path = (os.environ if environ is None else environ).get(CONFIG_ENV)
    if not path:
        return None
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CONFIG_BYTES:
            return None
        with open(path, "rb") as file:
            text = file.read(MAX_CONFIG_BYTES + 1)
        return yaml.safe_load(text) if len(text) <= MAX_CONFIG_BYTES else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        log.debug("%s not read at parse time: %s", path, exc)
        return None


def sink_tables(data: Any) -> list[SinkTables] | None:
    """The sinks of a parsed config document and their tables, in the config's order; None when the
    document does not have that shape."""
    if not isinstance(data, dict) or not isinstance(data.get("sinks"), list):
        return None
    databases = data.get("databases")
    only = None
    if isinstance(databases, list) and len(databases) == 1 and isinstance(databases[0], dict):
        only = databases[0].get("name")
    found = []
    for raw in data["sinks"]:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("tables"), list):
            return None
        tables = []
        for table in raw["tables"]:
            name = table.get("name") if isinstance(table, dict) else table
            if not isinstance(name, str) or not name:
                return None
            tables.append(qualified_table(name))
        database = raw.get("database", only)
        found.append(SinkTables(raw["name"], database if isinstance(database, str) else None, tuple(tables)))
    return found or None


def configured_sink_tables(environ: Mapping[str, str] | None = None) -> list[SinkTables] | None:
    """The sinks and tables of ``$SEQUIN_CONFIG`` when it can be read cheaply (``read_small_config``),
    else None."""
    return sink_tables(read_small_config(environ))


def sink_choices(sinks: list[SinkTables] | None) -> dict[str, Any]:
    """``Param`` keywords that make a sink field a drop-down of the configured sinks (each shown with
    its tables); ``{}`` (free text) without them."""
    if not sinks:
        return {}
    return {
        "enum": [s.sink for s in sinks],
        "values_display": {s.sink: f"{s.sink} ({', '.join(s.tables)})" for s in sinks},
    }


def table_choices(sinks: list[SinkTables] | None) -> dict[str, Any]:
    """``Param`` keywords that offer every configured sink's tables as suggestions of a free text
    field (JSON Schema ``examples``: Airflow's form lists them under the field); ``{}`` without them.
    Suggestions, not an ``enum``: a table is also accepted without its schema (``items`` for
    ``public.items``), as scripts and the REST API send it, and the operator checks it at run time."""
    if not sinks:
        return {}
    tables: dict[str, None] = {}
    for s in sinks:
        tables.update(dict.fromkeys(s.tables))
    return {"examples": list(tables)}
