"""Routing templates and functions (sinks/routing.py): the target of real rendered messages, config
errors with the key path, and a message without a route raising DeliveryError (it is parked)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sequin_provider.exceptions import ConfigError, DeliveryError
from sequin_provider.sinks.routing import parse_route


class Reader:
    """The two calls of the config parser's reader a route uses (``sinks.base.OptionReader``)."""

    def fail(self, path: str, reason: str) -> ConfigError:
        return ConfigError("sequin.yaml", path, reason)

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, "expected a non-empty string")
        return value


def message(action: str = "insert", **record: Any) -> str:
    return json.dumps(
        {
            "record": record,
            "changes": None,
            "action": action,
            "metadata": {"table_schema": "public", "table_name": "orders", "commit_lsn": 1},
        }
    )


def route_of(spec: str) -> Any:
    return parse_route(Reader(), spec, "sinks[0].destination.stream_key")


def by_region(data: dict[str, Any]) -> str:
    return f"region-{data['record']['region']}"


def test_a_fixed_name_needs_no_message() -> None:
    route = route_of("cdc-orders")
    assert route.fixed == "cdc-orders" and route.target("not even json") == "cdc-orders"


def test_a_template_names_the_table_the_action_and_record_columns() -> None:
    route = route_of("cdc.{table_schema}.{table_name}.{action}.{record.region}.{record.id}")
    assert route.fixed is None
    assert route.target(message("update", id=7, region="eu")) == "cdc.public.orders.update.eu.7"


def test_a_function_gets_the_message() -> None:
    route = route_of(f"{__name__}:by_region")
    assert route.target(message(id=1, region="us")) == "region-us"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("cdc.{table}", "unknown placeholder {table}"),
        ("cdc.{record}", "unknown placeholder {record}"),
        ("cdc.{}", "unknown placeholder {}"),
        ("cdc.{action!r}", "unknown placeholder {action}"),
        ("cdc.{action", "not a valid template"),
        ("cdc.}", "not a valid template"),
    ],
)
def test_bad_templates_are_config_errors_with_the_key_path(spec: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        route_of(spec)
    assert caught.value.path == "sinks[0].destination.stream_key" and reason in caught.value.reason


def test_a_message_without_its_route_raises_delivery_error() -> None:
    with pytest.raises(DeliveryError, match="no column 'region'"):
        route_of("x.{record.region}").target(message(id=1))
    with pytest.raises(DeliveryError, match="is null"):
        route_of("x.{record.region}").target(message(id=1, region=None))
    with pytest.raises(DeliveryError, match="cannot be loaded"):
        route_of("no_such_module_here:f").target(message(id=1))
    with pytest.raises(DeliveryError, match="failed: KeyError"):
        route_of(f"{__name__}:by_region").target(message(id=1))


@pytest.mark.parametrize(
    "text",
    [
        message(region="eu", id=1),
        message(region=1.5e400, id=1),  # Infinity: not JSON to msgspec, json.loads reads it
        '{"record": {"region": 1e400}, "action": "insert", "metadata": {"table_name": "o"}}',  # beyond a double
        message(region={"a": [1, 2]}, id=10**30),
        json.dumps({"record": None, "action": "truncate", "metadata": {"table_schema": "s", "table_name": "t"}}),
        json.dumps({"order": {"region": "eu"}, "action": 3}),  # a transform's shape: msgspec's types refuse it
    ],
)
def test_a_template_reads_a_message_as_json_loads_does(text: str) -> None:
    for spec in ("{table_schema}.{table_name}.{action}", "orders-{record.region}"):
        route = route_of(spec)
        try:
            expected: str | type[Exception] = route.target_of(json.loads(text))
        except DeliveryError:
            expected = DeliveryError
        if expected is DeliveryError:
            with pytest.raises(DeliveryError):
                route.target(text)
        else:
            assert route.target(text) == expected


def test_a_template_of_the_table_alone_keeps_each_tables_target_and_never_an_error() -> None:
    route = route_of("cdc.{table_schema}.{table_name}.{action}")
    for schema, table, action in [("public", "orders", "insert"), ("public", "orders", "delete"), ("s", "t", "insert")]:
        view = {"action": action, "metadata": {"table_schema": schema, "table_name": table}, "record": {}}
        for _ in range(2):  # the second time from what the route kept
            assert route.target_of_fields(action, schema, table, {}) == route.target_of(view)
    assert route.target_of_fields("insert", "s", "t", None) == "cdc.s.t.insert"
    for _ in range(2):  # a message without its table is refused each time: nothing was kept for it
        with pytest.raises(DeliveryError, match="is null"):
            route.target_of_fields("insert", "public", None, {})
    by_record = route_of("orders-{record.region}")
    assert by_record.target_of_fields("insert", "public", "orders", {"region": "eu"}) == "orders-eu"
    assert by_record.target_of_fields("insert", "public", "orders", {"region": "us"}) == "orders-us"
