"""docs/configuration.md names every key the config parser accepts, and no key it refuses.

The parser is the model: for each mapping of ``sequin.yaml`` (the top, a database, its slot and
publication, the store, a sink, a table, a destination of every registered kind, an initial
backfill, the stream) the test adds a key the parser cannot know and reads the keys it allows from
the error (``unknown key (allowed: …)``). A key added to the parser without a line in the reference,
or a line left in the reference after its key went, fails here.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from sequin_provider.config import ConfigError, parse_config
from sequin_provider.sinks import registry

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "configuration.md"
UNKNOWN = "zz_not_a_key"

DESTINATION_EXAMPLES: dict[str, dict[str, Any]] = {
    "sequin_stream": {"type": "sequin_stream"},
    "webhook": {"type": "webhook", "url": "http://127.0.0.1:9/hook"},
    "nats_jetstream": {"type": "nats_jetstream", "subject": "cdc.{table_schema}.{table_name}", "stream": "CDC"},
    "redis_stream": {"type": "redis_stream", "stream_key": "cdc.{table_schema}.{table_name}"},
    "rabbitmq": {"type": "rabbitmq", "exchange": "cdc", "routing_key": "cdc.{table_name}"},
    "postgres_table": {
        "type": "postgres_table",
        "dsn": "postgresql://127.0.0.1/mirror",
        "table": "mirror.{table_name}",
    },
    "iceberg": {"type": "iceberg", "catalog": {"uri": "sqlite:///catalog.db", "warehouse": "/tmp/lake"}},
}
"""A valid ``destination:`` of each registered kind (a new kind adds its own here)."""


def minimal_config(destination: dict[str, Any]) -> dict[str, Any]:
    """A config with every mapping present, so an unknown key can be put into any of them."""
    return {
        "databases": [
            {"name": "shop", "dsn": "postgresql://127.0.0.1/shop", "slot": {"name": "s"}, "publication": {"name": "p"}}
        ],
        "store": {"schema": "sequin"},
        "sinks": [
            {
                "name": "orders",
                "tables": [{"name": "public.orders"}],
                "destination": destination,
                "initial_backfill": {"table": "public.orders"},
            }
        ],
        "stream": {"max_batch_rows": 1000},
        "metrics": {"stream_port": 9464},
    }


MAPPINGS: dict[str, tuple[str, ...]] = {
    "<top>": (),
    "databases": ("databases", 0),
    "databases.slot": ("databases", 0, "slot"),
    "databases.publication": ("databases", 0, "publication"),
    "store": ("store",),
    "sinks": ("sinks", 0),
    "sinks.tables": ("sinks", 0, "tables", 0),
    "sinks.initial_backfill": ("sinks", 0, "initial_backfill"),
    "stream": ("stream",),
    "metrics": ("metrics",),
}  # type: ignore[dict-item]
"""The mappings of the config (name -> where it is in ``minimal_config``), besides the destinations."""


def allowed_keys(destination: dict[str, Any], where: tuple[Any, ...]) -> set[str]:
    """The keys the parser accepts in the mapping at ``where``, read from its unknown-key error."""
    data = minimal_config(copy.deepcopy(destination))
    node: Any = data
    for step in where:
        node = node[step]
    node[UNKNOWN] = 1
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "sequin.yaml", environ={})
    match = re.search(r"unknown key \(allowed: ([^)]*)\)", caught.value.reason)
    assert match, f"{where}: expected an unknown-key error, got {caught.value}"
    return {key.strip() for key in match.group(1).split(",")}


def section(text: str, start: str, stop: str = r"^#{1,3} |^`destination` of ") -> str:
    """The part of the reference from the line that matches ``start`` to the next heading (or
    destination table)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(start, line))
    rest = next((j for j in range(first + 1, len(lines)) if re.search(stop, lines[j])), len(lines))
    return "\n".join(lines[first:rest])


def documented_keys(part: str) -> set[str]:
    """The backticked names in the first column of the part's table rows (``a`` or ``b``; ``x.y``
    documents ``x`` too)."""
    keys: set[str] = set()
    for line in part.splitlines():
        if line.startswith("| `"):
            names = re.findall(r"`([a-z_.]+)`", line.split("|")[1])
            keys.update(names, (name.split(".")[0] for name in names))
    return keys


def row_of(part: str, key: str) -> str:
    """The table row of ``key`` in a part of the reference."""
    return next((line for line in part.splitlines() if line.startswith(f"| `{key}`")), "")


def reference_sections() -> dict[str, tuple[str, str | None]]:
    """Each mapping's part of the reference and, for a nested mapping, its parent key's name."""
    text = REFERENCE.read_text()
    keys = section(text, r"^## Keys", r"^## (?!Keys)")
    parts = {top: section(keys, rf"^### `{top}`") for top in ("databases", "store", "sinks", "stream", "metrics")}
    return {
        "<top>": ("\n".join(f"| `{top}` |" for top in parts), None),
        "databases": (parts["databases"], None),
        "databases.slot": (parts["databases"], "slot"),
        "databases.publication": (parts["databases"], "publication"),
        "store": (parts["store"], None),
        "sinks": (parts["sinks"], None),
        "sinks.tables": (parts["sinks"], "tables"),
        "sinks.initial_backfill": (parts["sinks"], "initial_backfill"),
        "stream": (parts["stream"], None),
        "metrics": (parts["metrics"], None),
        **{
            f"destination:{kind}": (section(text, rf"^`destination` of `type: {kind}`"), None)
            for kind in registry.names()
        },
    }


def test_every_registered_destination_kind_has_an_example_here() -> None:
    assert set(registry.names()) == set(DESTINATION_EXAMPLES), "add the new kind to DESTINATION_EXAMPLES"


@pytest.mark.parametrize("mapping", [*MAPPINGS, *(f"destination:{kind}" for kind in DESTINATION_EXAMPLES)])
def test_the_reference_documents_exactly_the_keys_the_parser_accepts(mapping: str) -> None:
    if mapping.startswith("destination:"):
        kind = mapping.split(":", 1)[1]
        allowed = allowed_keys(DESTINATION_EXAMPLES[kind], ("sinks", 0, "destination")) - {"type"}
    else:
        allowed = allowed_keys(DESTINATION_EXAMPLES["sequin_stream"], MAPPINGS[mapping])
    part, parent = reference_sections()[mapping]
    if parent is None:
        documented = documented_keys(part)
        assert allowed - documented == set(), f"{mapping}: keys the reference does not describe"
        # a first-column name that is a nested key (slot.name) belongs to that mapping, not this one
        assert {k for k in documented if "." not in k} - allowed == set(), f"{mapping}: keys the parser refuses"
    else:
        # a nested mapping: `parent.key` in the first column, or the key named in the parent's row
        row = row_of(part, parent)
        missing = {key for key in allowed if f"`{parent}.{key}`" not in part and not re.search(rf"\b{key}\b", row)}
        assert missing == set(), f"{mapping}: keys the reference does not describe"
