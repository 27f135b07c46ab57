"""Routing: which target of a destination a message goes to (a stream key, a subject, a routing key,
a table), from the message itself.

A route is written in ``sequin.yaml`` as either

- a template: text with placeholders ``{table_schema}``, ``{table_name}``, ``{action}`` and
  ``{record.<column>}`` (a column of the row; a delete's key columns are always there), e.g.
  ``"cdc.{table_schema}.{table_name}"`` or ``"orders-{record.region}"``; a template without
  placeholders is a fixed name and costs nothing per message;
- or ``"module:function"``: a function of the message (its JSON as a dict) returning the target.

A bad template (an unknown placeholder, an unbalanced brace) or a malformed function name is a
config error naming the key path. A message whose route cannot be computed (a column it does not
have, a function that raises or returns no text) raises ``DeliveryError``: the message is parked
with that error, and its group waits, like a message the destination refused.
"""

from __future__ import annotations

import importlib
import json
import re
import string
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import msgspec

from sequin_provider.exceptions import DeliveryError
from sequin_provider.sinks.base import OptionReader
from sequin_provider.sinks.change_message import decode_wire, loads_json, routing_view

PLACEHOLDERS = ("table_schema", "table_name", "action")
"""The message fields a template may name, besides ``record.<column>``."""
FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
RECORD_FIELD = re.compile(r"^record\.(\w+)$")
MAX_KEPT_TARGETS = 10_000
"""At most this many (action, table) targets a template route keeps (``Route.target_of_fields``)."""


@dataclass(frozen=True)
class Route:
    """A parsed route: ``target(message)`` is the target name of one rendered message."""

    spec: str
    parts: tuple[tuple[str, str | None], ...] = ()
    """The template as (literal text, placeholder or None) pairs; empty for a function."""
    function: str | None = None
    _resolved: dict[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict, compare=False, repr=False)
    _by_table: dict[tuple[str | None, str | None, str | None], str] = field(
        default_factory=dict, compare=False, repr=False
    )
    """A template's targets by (action, schema, table), when it names no record column."""

    @cached_property
    def fixed(self) -> str | None:
        """The target when it does not depend on the message, else None (computed once: it is
        asked for every message)."""
        if self.function is None and all(name is None for _, name in self.parts):
            return "".join(text for text, _ in self.parts)
        return None

    def target(self, message: str) -> str:
        """The target name of ``message`` (its rendered JSON); ``DeliveryError`` when it has none."""
        fixed = self.fixed
        if fixed is not None:
            return fixed
        if self.function is None:  # a template reads a few parts: typed by msgspec, the record only if named
            try:
                wire = decode_wire(message)
            except msgspec.DecodeError:  # not JSON, or a transform's shape: read the whole of it below
                pass
            else:
                metadata = wire.metadata
                record = loads_json(bytes(wire.record)) if self.reads_record else None
                return self.target_of_fields(wire.action, metadata.table_schema, metadata.table_name, record)
        try:
            data = json.loads(message)
        except ValueError as exc:
            raise DeliveryError(f"route {self.spec!r}: the message is not JSON: {exc}") from None
        return self.target_of(data)

    @cached_property
    def reads_record(self) -> bool:
        """Whether the template names a column of the record."""
        return any(name is not None and name.startswith("record.") for _, name in self.parts)

    def target_of_fields(
        self, action: str | None, table_schema: str | None, table_name: str | None, record: Any
    ) -> str:
        """``target_of`` of a template route from the fields it reads, for a caller that has them
        typed (``record`` is read only if the template names a column of it). A template of the
        table and action alone is computed once per (action, table) and kept: most messages of a
        batch share a few tables, and a dict lookup is a fifth of building the message's view."""
        fixed = self.fixed
        if fixed is not None:
            return fixed
        if self.function is not None or self.reads_record:
            return self.target_of(routing_view(action, table_schema, table_name, record))
        key = (action, table_schema, table_name)
        target = self._by_table.get(key)
        if target is None:
            target = self.target_of(routing_view(action, table_schema, table_name, None))  # raises: nothing kept
            if len(self._by_table) < MAX_KEPT_TARGETS:
                self._by_table[key] = target
        return target

    def target_of(self, data: dict[str, Any]) -> str:
        """``target`` of a message its caller has parsed already (a sink that reads the message anyway
        saves parsing it twice)."""
        fixed = self.fixed
        if fixed is not None:
            return fixed
        if self.function is not None:
            return self._call(data)
        out = []
        for text, name in self.parts:
            out.append(text)
            if name is not None:
                out.append(_field(data, name, self.spec))
        return "".join(out)

    def _call(self, data: dict[str, Any]) -> str:
        func = self._resolved.get("f")
        if func is None:
            module, _, name = self.function.partition(":")  # type: ignore[union-attr]
            try:
                func = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise DeliveryError(f"route {self.spec!r} cannot be loaded: {exc}") from None
            self._resolved["f"] = func
        try:
            value = func(data)
        except Exception as exc:  # noqa: BLE001  # the user's function: its error parks the message
            raise DeliveryError(f"route {self.spec!r} failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(value, str) or not value:
            raise DeliveryError(f"route {self.spec!r} returned {value!r}, not a non-empty string")
        return value


def _field(data: dict[str, Any], name: str, spec: str) -> str:
    """A placeholder's value in a message: metadata fields, the action, or a record column."""
    if name == "action":
        value = data.get("action")
    elif name in ("table_schema", "table_name"):
        value = (data.get("metadata") or {}).get(name)
    else:
        column = RECORD_FIELD.match(name).group(1)  # type: ignore[union-attr]  # checked at parse
        record = data.get("record") or {}
        if column not in record:
            raise DeliveryError(f"route {spec!r}: the message's record has no column {column!r}")
        value = record[column]
    if value is None:
        raise DeliveryError(f"route {spec!r}: {{{name}}} is null in the message")
    return value if isinstance(value, str) else json.dumps(value)


def parse_route(reader: OptionReader, value: Any, path: str) -> Route:
    """A route from ``sequin.yaml`` at ``path`` (see the module's docstring); errors name the path."""
    spec = reader.string(value, path)
    if FUNCTION.match(spec) and "{" not in spec:
        return Route(spec, function=spec)
    try:
        parsed = list(string.Formatter().parse(spec))
    except ValueError as exc:
        raise reader.fail(
            path,
            f"not a valid template ({exc}): use {{table_schema}}, {{table_name}}, "
            f"{{action}}, {{record.<column>}}, or 'module:function'",
        ) from None
    parts: list[tuple[str, str | None]] = []
    for text, name, format_spec, conversion in parsed:
        if name is not None and (format_spec or conversion or not (name in PLACEHOLDERS or RECORD_FIELD.match(name))):
            raise reader.fail(
                path,
                f"unknown placeholder {{{name}}} (known: {{table_schema}}, {{table_name}}, "
                f"{{action}}, {{record.<column>}})",
            )
        parts.append((text, name))
    return Route(spec, tuple(parts))
