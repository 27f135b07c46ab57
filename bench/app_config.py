"""The ``sequin.yaml`` a benchmark gives its stream app: one source database, its sinks, the store and
the checkpoint. One place for the part every benchmark shares; each passes its own sinks."""

from __future__ import annotations

from pathlib import Path


def app_config(
    dsn: str,
    sinks: str,
    checkpoint: Path,
    *,
    store_dsn: str | None = None,
    database: str = "bench",
    slot: str = "bench_slot",
    publication: str = "bench_pub",
    stream: str = "",
) -> str:
    """The config text. ``sinks``: YAML list items, each starting ``  - name:``; ``store_dsn``: the
    store's database (default: the source's); ``stream``: further ``stream`` settings as YAML
    flow-mapping items, each ``, key: value``."""
    store = f"store: {{dsn: {store_dsn}}}\n" if store_dsn is not None else ""
    items = sinks.strip("\n")
    return f"""
databases:
  - name: {database}
    dsn: {dsn}
    slot: {{name: {slot}}}
    publication: {{name: {publication}}}
{store}sinks:
{items}
stream: {{checkpoint_location: {checkpoint}{stream}}}
"""


def sink(name: str, destination: str, tables: str = "[events]", settings: str = "") -> str:
    """One sink as an item of ``app_config``'s ``sinks``: ``destination`` a YAML flow mapping,
    ``settings`` further lines of the sink (each indented four spaces and ending in a newline)."""
    return f"  - name: {name}\n    tables: {tables}\n{settings}    destination: {destination}\n"
