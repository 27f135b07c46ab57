"""Poison values (DESIGN §2.4, §2.6): a row a sink's filter or transform fails on is parked with its
error, its group waits behind it, and everything else flows; transforms see every digit.

Real Postgres, the real stream app (Spark local mode), real HTTP (``tests.support.receiver``). Spark starts
twice for the module, not once per test: the filter tests share one app (its sinks have Spark SQL:
``payload=full``; the first test restarts it with its filter fixed), the transform tests another
(no Spark SQL: ``payload=spool``), each test with its own tables and sinks in the app's config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stream_process import wait_for
from sequin_provider import store
from sequin_provider.buffer import FOLLOWER_ERROR
from sequin_provider.config import load_config
from sequin_provider.spark.pipeline import payload_mode
from tests.support.config import write_config
from tests.support.postgres import execute, sink_messages
from tests.support.receiver import Receiver
from tests.support.stream_app import StreamApp, cli

BIG = "cast(record.amount AS decimal(12,2)) >= 100"

CONFIG = """
databases:
  - name: app
    dsn: {dsn}
    slot: {{name: slot_{db}}}
    publication: {{name: pub_{db}}}
    heartbeat_interval: 1s
sinks:
{sinks}
stream:
  checkpoint_location: {ckpt}
  max_batch_wait: 100ms
"""


def config_of(tmp_path: Path, dsn: str, db: str, sinks: str) -> Path:
    return write_config(tmp_path / "sequin.yaml", CONFIG.format(dsn=dsn, db=db, ckpt=tmp_path / "ckpt", sinks=sinks))


def parked(dsn: str, sink: str) -> list[store.Parked]:
    with psycopg.connect(dsn) as conn:
        return store.list_buffered(conn, "sequin", sink)


def wait_parked(dsn: str, sink: str, count: int, app: Any) -> list[store.Parked]:
    def enough() -> list[store.Parked] | None:
        app.check_alive()
        found = parked(dsn, sink)
        return found if len(found) >= count else None

    return wait_for(enough, 600, what=f"{count} messages of {sink} parked")


def wait_messages(dsn: str, sink: str, count: int, app: Any) -> list[dict[str, Any]]:
    def enough() -> list[dict[str, Any]] | None:
        app.check_alive()
        got = sink_messages(dsn, sink)
        return got if len(got) >= count else None

    return wait_for(enough, 600, what=f"{count} messages in {sink}")


def wait_received(receiver: Receiver, count: int, app: Any) -> list[dict[str, Any]]:
    def enough() -> list[dict[str, Any]] | None:
        app.check_alive()
        got = receiver.messages()
        return got if len(got) >= count else None

    return wait_for(enough, 600, what=f"{count} webhook messages")


def changes(messages: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(id, amount as text) of each message, in the order given."""
    return [(m["record"]["id"], str(m["record"]["amount"])) for m in messages]


def position(m: dict[str, Any]) -> tuple[int, int]:
    return m["metadata"]["commit_lsn"], m["metadata"]["commit_idx"]


@dataclass
class Deployment:
    """A database, the stream app running for ``config``, and the webhook endpoints of its push sinks."""

    dsn: str
    config: Path
    app: StreamApp
    receivers: dict[str, Receiver]


def deploy(
    pg: EmbeddedPostgres,
    tmp: Path,
    db: str,
    schema: list[str],
    sinks: str,
    receivers: dict[str, Receiver],
    payload: str,
) -> Iterator[Deployment]:
    """A database with ``schema`` and the stream app for ``sinks`` (whose batches are ``payload``), until the
    module is done; then the app and ``receivers`` are stopped."""
    try:
        dsn = pg.create_database(db)
        execute(dsn, *schema)
        config = config_of(tmp, dsn, db, sinks)
        assert payload_mode(load_config(config).sinks) == payload
        app = StreamApp(config, tmp / "stream-app.log")
        try:
            app.start().wait_streaming(dsn, timeout=600)
            yield Deployment(dsn, config, app, receivers)
        finally:
            app.stop()
    finally:
        for receiver in receivers.values():
            receiver.stop()


PER_UNIT = "100 / cast(record.qty AS int) > 1"
MATRIX = """CREATE TABLE matrix (id int PRIMARY KEY, big numeric, nan numeric, f float8, tiny float8, i8 int8,
    arr int8[], doc jsonb, t text, ts timestamptz, tsl timestamp, dec numeric(6,3))"""


@pytest.fixture(scope="module")
def filtering(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The filter tests' tables and sinks, in one app: Spark SQL in the sinks makes it ``payload=full``."""
    hooks = {"big_hooks": Receiver(exact=True).start(), "per_unit": Receiver(exact=True).start()}
    sinks = f"""
  - name: big_orders
    tables: [orders]
    filter: "{BIG}"
    destination: {{type: sequin_stream}}
  - name: big_hooks
    tables: [orders]
    filter: "{BIG}"
    destination: {{type: webhook, url: "{hooks["big_hooks"].url}", batch: false, timeout: 5s}}
  - name: all_orders
    tables: [orders]
    destination: {{type: sequin_stream}}
  - name: per_unit
    tables: [items]
    filter: "{PER_UNIT}"
    destination: {{type: webhook, url: "{hooks["per_unit"].url}", batch: false, timeout: 5s}}
"""
    yield from deploy(
        pg,
        tmp_path_factory.mktemp("filtering"),
        "poison_filters",
        [
            "CREATE TABLE orders (id int PRIMARY KEY, amount numeric)",
            "CREATE TABLE items (id int PRIMARY KEY, qty int)",
        ],
        sinks,
        hooks,
        "full",
    )


@pytest.fixture(scope="module")
def transforming(pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The transform tests' tables and sinks, in one app: no Spark SQL, so ``payload=spool``."""
    hooks = {"hooks": Receiver(exact=True).start()}
    sinks = f"""
  - name: hooks
    tables: [orders]
    transform: "tests.support.transforms:refuse_three"
    destination: {{type: webhook, url: "{hooks["hooks"].url}", batch: false, timeout: 5s}}
  - name: stored
    tables: [orders]
    transform: "tests.support.transforms:refuse_three"
    destination: {{type: sequin_stream}}
  - name: raw
    tables: [matrix]
    destination: {{type: sequin_stream}}
  - name: passed
    tables: [matrix]
    transform: "tests.support.transforms:pass_through"
    destination: {{type: sequin_stream}}
"""
    yield from deploy(
        pg,
        tmp_path_factory.mktemp("transforming"),
        "poison_transforms",
        ["CREATE TABLE orders (id int PRIMARY KEY, amount numeric)", MATRIX],
        sinks,
        hooks,
        "spool",
    )


def test_a_filter_that_fails_on_some_rows_parks_only_them_and_retry_reevaluates_the_fixed_filter(
    filtering: Deployment,
) -> None:
    dsn, config, app, receiver = filtering.dsn, filtering.config, filtering.app, filtering.receivers["big_hooks"]
    execute(
        dsn,
        "INSERT INTO orders VALUES (1, 50), (2, 150), (3, 250), (4, 99.99), (5, 200)",
        "UPDATE orders SET amount = 'NaN' WHERE id = 5",  # poison: CAST_INVALID_INPUT
        "INSERT INTO orders VALUES (6, 1e20)",  # poison: out of decimal(12,2)'s range
        "UPDATE orders SET amount = 300 WHERE id = 1",
        "UPDATE orders SET amount = 500 WHERE id = 5",  # behind id 5's poison
        "UPDATE orders SET amount = 120 WHERE id = 6",  # behind id 6's poison
        "INSERT INTO orders VALUES (7, 1000)",
    )
    everything = wait_messages(dsn, "all_orders", 11, app)
    assert changes(everything) == [
        (1, "50"),
        (2, "150"),
        (3, "250"),
        (4, "99.99"),
        (5, "200"),
        (5, "NaN"),
        (6, "100000000000000000000"),
        (1, "300"),
        (5, "500"),
        (6, "120"),
        (7, "1000"),
    ]
    good = [(2, "150"), (3, "250"), (5, "200"), (1, "300"), (7, "1000")]
    for sink in ("big_orders", "big_hooks"):
        held = wait_parked(dsn, sink, 4, app)
        five, six = 'public.orders:["5"]', 'public.orders:["6"]'
        assert [m.group_id for m in held] == [five, six, five, six]  # in position order
        assert [m.state for m in held] == ["parked"] * 4
        nan, huge, follower5, follower6 = held
        prefix = f'sink {sink}: filter "{BIG}" failed: '
        assert nan.last_error.startswith(prefix + "[CAST_INVALID_INPUT]") and "'NaN'" in nan.last_error
        assert huge.last_error.startswith(prefix + "[NUMERIC_VALUE_OUT_OF_RANGE")
        assert "\n" not in nan.last_error and "\n" not in huge.last_error  # the first line only
        assert follower5.last_error == follower6.last_error == FOLLOWER_ERROR
        assert nan.data is None and huge.data is None  # re-evaluated on retry, from the change kept
        assert nan.source is not None and huge.source is not None
        assert json.loads(follower5.data)["record"] == {"id": 5, "amount": 500}
    stored = wait_messages(dsn, "big_orders", len(good), app)
    assert changes(stored) == good
    hooked = wait_received(receiver, len(good), app)  # in order per group, groups sent in parallel
    assert changes(sorted(hooked, key=position)) == good
    app.check_alive()
    listed = cli(config, "buffer", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    errors = [m["error"] for m in json.loads(listed.stdout) if m["sink"] == "big_orders"]
    assert errors[0].startswith(f'sink big_orders: filter "{BIG}" failed: [CAST_INVALID_INPUT]')

    # the stream goes on: a later change of a parked group waits behind it, others flow
    execute(dsn, "UPDATE orders SET amount = 700 WHERE id = 5", "INSERT INTO orders VALUES (8, 800)")
    assert changes(wait_messages(dsn, "big_orders", len(good) + 1, app))[-1] == (8, "800")
    assert [json.loads(m.data)["record"]["amount"] for m in wait_parked(dsn, "big_orders", 5, app)[4:]] == [700]

    # fix the filter: NaN is not big (dropped), 1e20 is (delivered); restart with it, then retry
    assert app.stop() is not None
    config.write_text(
        config.read_text().replace(BIG, "coalesce(try_cast(record.amount AS decimal(30,2)) >= 100, false)")
    )
    app.start().wait_streaming(dsn, timeout=600)
    for sink in ("big_orders", "big_hooks"):
        retried = wait_for(
            lambda s=sink: (lambda r: r if "still parked 0" in r.stdout else None)(
                cli(config, "buffer", "retry", "--sink", s)
            ),
            180,
            what=f"retry of {sink} delivering",
        )
        assert "filtered 1" in retried.stdout, retried.stdout + retried.stderr
    after = [(5, "500"), (6, "100000000000000000000"), (6, "120"), (5, "700")]
    final = wait_messages(dsn, "big_orders", len(good) + 1 + len(after), app)
    hooks = wait_received(receiver, len(good) + 1 + len(after), app)
    for got in (final, hooks):
        by_group: dict[int, list[str]] = {}
        for m in got:
            by_group.setdefault(m["record"]["id"], []).append(str(m["record"]["amount"]))
        assert by_group == {
            1: ["300"],
            2: ["150"],
            3: ["250"],
            5: ["200", "500", "700"],
            6: ["100000000000000000000", "120"],
            7: ["1000"],
            8: ["800"],
        }
        assert len({m["metadata"]["idempotency_key"] for m in got}) == len(got)  # nothing twice
    for group in (5, 6):  # in position order within each group
        ordered = [position(m) for m in final if m["record"]["id"] == group]
        assert ordered == sorted(ordered)
    assert parked(dsn, "big_orders") == parked(dsn, "big_hooks") == []
    app.check_alive()


def test_a_filter_that_divides_by_zero_on_one_row_parks_it_and_retry_keeps_it_until_fixed(
    filtering: Deployment,
) -> None:
    dsn, config, app, receiver = filtering.dsn, filtering.config, filtering.app, filtering.receivers["per_unit"]
    execute(
        dsn,
        "INSERT INTO items VALUES (1, 10), (2, 0), (3, 200), (4, 5)",
        "UPDATE items SET qty = 2 WHERE id = 2",
        "UPDATE items SET qty = 20 WHERE id = 1",
    )
    held = wait_parked(dsn, "per_unit", 2, app)
    assert held[0].last_error.startswith(f'sink per_unit: filter "{PER_UNIT}" failed: [DIVIDE_BY_ZERO]')
    assert held[1].last_error == FOLLOWER_ERROR and json.loads(held[1].data)["record"] == {"id": 2, "qty": 2}
    got = sorted(wait_received(receiver, 3, app), key=position)  # in order per group, groups in parallel
    assert [(m["record"]["id"], m["record"]["qty"]) for m in got] == [(1, 10), (4, 5), (1, 20)]
    app.check_alive()

    # retried with the filter unchanged: still failing, it stays parked with the new error
    again = wait_for(
        lambda: (lambda r: r if "failed again 1" in r.stdout else None)(
            cli(config, "buffer", "retry", "--sink", "per_unit")
        ),
        120,
        what="a retry that evaluates the filter",
    )
    assert again.returncode == 1 and "still parked 2" in again.stdout
    held = parked(dsn, "per_unit")
    assert held[0].attempts == 2 and "[DIVIDE_BY_ZERO]" in held[0].last_error and held[0].data is None

    config.write_text(config.read_text().replace(PER_UNIT, "try_divide(100, cast(record.qty AS int)) > 1"))
    fixed = wait_for(
        lambda: (lambda r: r if "still parked 0" in r.stdout else None)(
            cli(config, "buffer", "retry", "--sink", "per_unit")
        ),
        120,
        what="the retry with the fixed filter",
    )
    assert "filtered 1" in fixed.stdout and "delivered 1" in fixed.stdout, fixed.stdout
    assert [(m["record"]["id"], m["record"]["qty"]) for m in sorted(receiver.messages(), key=position)] == [
        (1, 10),
        (4, 5),
        (2, 2),
        (1, 20),
    ]  # id 2's update, retried, in its place by position


def test_a_transform_that_raises_on_one_row_parks_it_for_both_sink_types_and_the_rest_arrive_exactly(
    transforming: Deployment,
) -> None:
    dsn, app, receiver = transforming.dsn, transforming.app, transforming.receivers["hooks"]
    exact = "12345678901234567890.1234567890"
    execute(
        dsn,
        f"INSERT INTO orders SELECT i, {exact} + i FROM generate_series(1, 5) i",
        "UPDATE orders SET amount = 1 WHERE id = 3",
        "UPDATE orders SET amount = 2 WHERE id = 4",
    )
    expected = [
        (1, "12345678901234567891.1234567890"),
        (2, "12345678901234567892.1234567890"),
        (4, "12345678901234567894.1234567890"),
        (5, "12345678901234567895.1234567890"),
        (4, "2"),
    ]
    for sink in ("hooks", "stored"):
        held = wait_parked(dsn, sink, 2, app)
        assert "ValueError: cannot handle row 3" in held[0].last_error and held[0].data is None
        assert held[1].last_error == FOLLOWER_ERROR
    stored = wait_messages(dsn, "stored", len(expected), app)
    hooks = sorted(wait_received(receiver, len(expected), app), key=position)
    # both parsed with decimals exact: compare their text, digit for digit
    assert [(m["record"]["id"], str(m["record"]["amount"])) for m in stored] == expected
    assert [(m["record"]["id"], str(m["record"]["amount"])) for m in hooks] == expected
    app.check_alive()


def exact(value: Any) -> Any:
    """A parsed message with each decimal as its text (``Decimal('1.0') == Decimal('1.00')`` is not enough)."""
    if isinstance(value, Decimal):
        return ("decimal", str(value))
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [exact(v) for v in value]
    return value


def test_a_pass_through_transform_returns_every_value_to_the_last_digit(transforming: Deployment) -> None:
    dsn, app = transforming.dsn, transforming.app
    execute(
        dsn,
        "INSERT INTO matrix VALUES (1, 12345678901234567890.1234567890, 'NaN', 0.1, 5e-324,"
        " 9223372036854775807, '{9223372036854775807,-9223372036854775808}',"
        ' \'{"big": 123456789012345678901234567890.123456789, "f": 1.10, "n": [1e3, -0.0]}\','
        " 'h\u00e9 \"quoted\" \\ tab\t', '2024-02-29 23:59:59.123456+00', '1999-12-31 23:59:59.999999',"
        " 1.500)",
        "INSERT INTO matrix VALUES (2, -0.00000000000000000001, 'Infinity', 1.7976931348623157e308, -1e-300,"
        " -9223372036854775808, '{}', '[1.000000000000000000001]', '', 'infinity', '-infinity', -999.999)",
    )
    raw = wait_messages(dsn, "raw", 2, app)
    passed = wait_messages(dsn, "passed", 2, app)
    assert str(raw[0]["record"]["big"]) == "12345678901234567890.1234567890"  # the reference is exact
    for m in raw + passed:  # the one field that differs by design: which sink it is
        assert m["metadata"].pop("consumer")["name"] in ("raw", "passed")
    assert [exact(m) for m in passed] == [exact(m) for m in raw]
    app.check_alive()
