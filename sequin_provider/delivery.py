"""Per-sink selection, filter, grouping and transform (DESIGN §6 pipeline, §9).

Selection, filter and grouping are expressed as SQL over the change row so the Spark glue can
evaluate them in the JVM for a whole micro-batch; in that SQL ``record`` and ``changes`` are
``map<string,string>`` (values as text), ``action``, ``table_schema`` and ``table_name`` are
strings. Rendering and transforms are plain Python over the collected rows. This module imports
neither Spark nor Airflow.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from sequin_provider.config import SinkConfig
from sequin_provider.messages import (
    Consumer,
    render_change_message,
    render_metadata,
    render_record_message,
)


class TransformError(RuntimeError):
    """A sink's transform raised or returned something that is not JSON."""


def _sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _table_match(schema: str, name: str) -> str:
    return f"(table_schema = {_sql_string(schema)} AND table_name = {_sql_string(name)})"


def selection_predicate(sink: SinkConfig) -> str:
    """SQL predicate: this sink's tables and actions (record sinks never get deletes), and its filter."""
    actions = [a for a in sink.actions if not (sink.message_kind == "record" and a == "delete")]
    tables = " OR ".join(_table_match(t.schema, t.name) for t in sink.tables)
    predicate = f"({tables}) AND action IN ({', '.join(_sql_string(a) for a in actions) or 'NULL'})"
    if sink.filter:
        predicate += f" AND coalesce(({sink.filter}), false)"
    return predicate


def default_group_sql() -> str:
    """Group of a change by default: table plus primary key values."""
    return "concat(table_schema, '.', table_name, ':', to_json(record_pks))"


def group_expression(sink: SinkConfig) -> str:
    """SQL giving the group id of a row for this sink (DESIGN §2.2)."""
    if not sink.message_grouping:
        return "concat(CAST(commit_lsn AS STRING), ':', CAST(commit_idx AS STRING))"
    custom = [t for t in sink.tables if t.group_column_names]
    if not custom:
        return default_group_sql()
    cases = " ".join(
        f"WHEN {_table_match(t.schema, t.name)} THEN concat({_sql_string(t.qualified + ':')}, to_json(array("
        + ", ".join(f"record[{_sql_string(c)}]" for c in t.group_column_names) + ")))"
        for t in custom)
    return f"CASE {cases} ELSE {default_group_sql()} END"


def needs_parsed_record(sink: SinkConfig) -> bool:
    """Whether the sink's SQL refers to record/changes values (so they must be parsed)."""
    return bool(sink.filter) or any(t.group_column_names for t in sink.tables)


Transform = Callable[[dict[str, Any]], Any]


def load_transform(spec: str | None) -> Transform | None:
    """Resolve ``module:function`` (``record_only`` and None need no function)."""
    if spec is None or spec == "record_only":
        return None
    module_name, _, func_name = spec.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise TransformError(f"transform {spec!r} cannot be loaded: {exc}") from exc
    if not callable(func):
        raise TransformError(f"transform {spec!r} is not callable")
    return func  # type: ignore[no-any-return]


@dataclass
class MessageRenderer:
    """Turns the collected change rows of one sink into message JSON (after its transform)."""

    sink: SinkConfig
    database_name: str

    def __post_init__(self) -> None:
        self.consumer = Consumer(self.sink.consumer_id, self.sink.name, self.database_name)
        self.consumer_json = self.consumer.json_fragment()
        self.transform = load_transform(self.sink.transform)

    def render(self, columns: Mapping[str, Sequence[Any]], indices: Sequence[int]) -> Iterator[str]:
        """Message JSON for the rows at ``indices`` of the column-wise batch."""
        lsn, idx, ts = columns["commit_lsn"], columns["commit_idx"], columns["commit_timestamp"]
        schema, table, action = columns["table_schema"], columns["table_name"], columns["action"]
        record, changes, pks, toast = columns["record"], columns["changes"], columns["record_pks"], columns["unchanged_toast"]
        record_only = self.sink.transform == "record_only"
        record_kind = self.sink.message_kind == "record"
        for i in indices:
            if record_only:
                text = record[i]
            else:
                meta = render_metadata(self.consumer, self.consumer_json, lsn[i], idx[i], ts[i], schema[i], table[i],
                                       pks[i], toast[i])
                text = (render_record_message(meta, record[i]) if record_kind
                        else render_change_message(meta, action[i], record[i], changes[i]))
            if self.transform is not None:
                text = self.apply_transform(text)
            yield text

    def apply_transform(self, text: str) -> str:
        """Run the user's transform on one message; its result must be JSON-serialisable."""
        assert self.transform is not None
        try:
            result = self.transform(json.loads(text))
            return json.dumps(result, separators=(",", ":"), ensure_ascii=False)
        except Exception as exc:  # noqa: BLE001 - user code
            raise TransformError(f"transform {self.sink.transform!r} of sink {self.sink.name!r} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
