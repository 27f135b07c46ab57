"""A new destination is one module plus its test: a pushed kind defined here (its "module") is
registered, parsed from ``sequin.yaml`` with typed options and key-path errors, delivered through
the shared push path in group order with failures parked in a real store's buffer, and redelivered
by ``sequin buffer retry``'s entry point, and ``sequin status`` shows its own counts. Its destination
is an in-memory list (this tests the registry's wiring, not a transport; the webhook's transport is
tests/integration/sinks/test_webhook.py's).

The last test checks that no module outside ``sinks/`` names a destination: they ask the kind.
"""

from __future__ import annotations

import ast
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from sequin_provider import buffer, store
from sequin_provider.buffer import DeliveryError
from sequin_provider.cli import main as cli_main
from sequin_provider.config import ConfigError, SequinConfig, SinkConfig, parse_config
from sequin_provider.delivery import Outgoing
from sequin_provider.message_render import RenderedRows
from sequin_provider.sinks import kind, kinds, registry
from sequin_provider.sinks.base import DestinationKind, OptionReader
from sequin_provider.sinks.push import PushSink
from sequin_provider.sinks.retry import retry_sinks
from sequin_provider.sinks.sequin_stream import SequinStreamSink
from sequin_provider.sinks.stored import StreamTableWriter
from tests.support.config import builtin_kind_names

PACKAGE = Path(__file__).resolve().parents[3] / "sequin_provider"

# --- the new destination's module --------------------------------------------------------------

DELIVERED: dict[str, list[list[str]]] = {}
"""What each in-memory destination got: one list per request."""
SENDERS: list[threading.Thread] = []
"""The thread of each request, in the order sent."""
REFUSE: set[str] = set()
"""Messages the destination refuses (a failing request)."""
_LOCK = threading.Lock()


@dataclass(frozen=True)
class MemoryListOptions:
    """Settings of the in-memory destination."""

    list_name: str
    batch_size: int = 2


class MemoryListSink(PushSink):
    """Appends each request to ``DELIVERED[list_name]``; refuses a request holding a ``REFUSE`` message."""

    def __init__(self, sink: SinkConfig) -> None:
        options: MemoryListOptions = sink.destination.options
        self.sink, self.name, self.batch_size, self.lanes = sink.name, options.list_name, options.batch_size, 4

    def send(self, messages: list[str], keys: list[str]) -> None:
        if REFUSE.intersection(messages):
            raise DeliveryError("memory list: refused")
        with _LOCK:
            DELIVERED.setdefault(self.name, []).append(list(messages))
            SENDERS.append(threading.current_thread())


class MemoryListKind(DestinationKind):
    """``type: memory_list``: pushed."""

    name = "memory_list"
    stored = False

    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> MemoryListOptions:
        item = self.option_keys(reader, value, path, {"list_name", "batch_size"}, {"list_name"})
        return MemoryListOptions(
            reader.string(item["list_name"], f"{path}.list_name"),
            reader.integer(item.get("batch_size", 2), f"{path}.batch_size", 1, 100),
        )

    def pusher(self, sink: SinkConfig) -> MemoryListSink:
        return MemoryListSink(sink)

    def counts(self, conn: psycopg.Connection[Any], schema: str, sink: str) -> dict[str, int]:
        """Requests and messages its list got (a test names the list after its sink)."""
        requests = DELIVERED.get(sink, [])
        return {"requests": len(requests), "delivered": sum(len(r) for r in requests)}

    def health(self, sink: SinkConfig) -> str | None:
        """The list's state (a real kind checks that its server answers)."""
        return "refusing" if REFUSE else "ok"


# --- its test ----------------------------------------------------------------------------------


@pytest.fixture()
def memory_kind() -> Iterator[DestinationKind]:
    registered = registry.register(MemoryListKind())
    DELIVERED.clear()
    SENDERS.clear()
    REFUSE.clear()
    yield registered
    registry.unregister(MemoryListKind.name)


def _config(dsn: str, destination: dict[str, Any]) -> SequinConfig:
    return parse_config(
        {
            "databases": [{"name": "app", "dsn": dsn}],
            "sinks": [{"name": "mem", "tables": ["kv"], "destination": destination}],
        },
        "sequin.yaml",
    )


def test_a_registered_kind_is_parsed_into_its_typed_options(memory_kind: DestinationKind) -> None:
    sink = _config("postgresql:///x", {"type": "memory_list", "list_name": "L"}).sinks[0]
    assert sink.destination.options == MemoryListOptions("L", 2)
    assert sink.destination.kind is memory_kind and memory_kind.pushed and not memory_kind.stored
    assert kind("memory_list") is memory_kind
    assert [k.name for k in kinds()] == [*builtin_kind_names(), "memory_list"]
    assert builtin_kind_names()[:2] == ["sequin_stream", "webhook"]


@pytest.mark.parametrize(
    ("destination", "path", "reason"),
    [
        ({"type": "memory_list"}, "sinks[0].destination.list_name", "is required"),
        (
            {"type": "memory_list", "list_name": "L", "colour": "red"},
            "sinks[0].destination.colour",
            "unknown key (allowed: batch_size, list_name, type)",
        ),
        (
            {"type": "memory_list", "list_name": "L", "batch_size": 0},
            "sinks[0].destination.batch_size",
            "must be between 1 and 100, got 0",
        ),
        (
            {"type": "kafka"},
            "sinks[0].destination.type",
            f"unknown destination type 'kafka' ({' | '.join(builtin_kind_names())} | memory_list)",
        ),
        (
            {"list_name": "L"},
            "sinks[0].destination.type",
            f"is required ({' | '.join(builtin_kind_names())} | memory_list)",
        ),
    ],
)
def test_bad_destinations_name_the_key_path(
    memory_kind: DestinationKind, destination: dict[str, Any], path: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _config("postgresql:///x", destination)
    assert (err.value.path, err.value.reason) == (path, reason)


def test_unregistered_the_kind_is_unknown() -> None:
    known = re.escape(" | ".join(builtin_kind_names()))
    with pytest.raises(ConfigError, match=rf"unknown destination type 'memory_list' \({known}\)$"):
        _config("postgresql:///x", {"type": "memory_list", "list_name": "L"})


def test_a_pushed_kind_is_delivered_in_group_order_parks_failures_and_is_retried(
    memory_kind: DestinationKind, dsn: str
) -> None:
    config = _config(dsn, {"type": "memory_list", "list_name": "L", "batch_size": 1})
    sink = config.sinks[0]
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    messages = Outgoing()
    for n, group in enumerate("abababa", start=1):
        messages.extend(Outgoing([n], [0], [group], [f"{n}:0"], [f'{{"n":{n}}}']))
    REFUSE.add('{"n":4}')  # group b's second message: it and b's later ones are parked, a goes on
    pusher = sink.destination.kind.pusher(sink)
    keeper = SequinStreamSink(dsn, "sequin")
    try:
        assert pusher.deliver(messages, keeper, "sequin") == (5, 2)  # 4 refused, 6 parked behind it
    finally:
        keeper.close()
    sent = [m for request in DELIVERED["L"] for m in request]
    assert [m for m in sent if int(m[5:-1]) % 2] == ['{"n":1}', '{"n":3}', '{"n":5}', '{"n":7}']
    assert [m for m in sent if not int(m[5:-1]) % 2] == ['{"n":2}']
    with psycopg.connect(dsn) as conn:
        parked = store.list_buffered(conn, "sequin", "mem")
        assert [(m.commit_lsn, m.attempts, m.last_error) for m in parked] == [
            (4, 1, "memory list: refused"),
            (6, 0, buffer.FOLLOWER_ERROR),
        ]
        store.set_buffered_state(conn, "sequin", "mem", "discarded")  # and back: due now
        store.set_buffered_state(conn, "sequin", "mem", "parked")
        conn.commit()
    REFUSE.clear()
    DELIVERED.clear()
    (report,) = retry_sinks(config, "mem")  # sequin buffer retry: through the kind's retry
    assert (report.delivered, report.still_parked) == (2, 0)
    assert DELIVERED["L"] == [['{"n":4}'], ['{"n":6}']]


def _rendered(ids: list[int], groups: str) -> RenderedRows:
    """Rendered stream messages ``{"record": {"id": n}}`` at positions (n, 0), in ``groups``."""
    return RenderedRows(
        pa.array(ids, pa.int64()),
        pa.array([0] * len(ids), pa.int32()),
        pa.array(list(groups)),
        pa.array([f"{n}:0" for n in ids]),
        pa.array([f'{{"record": {{"id": {n}}}}}' for n in ids]),
    )


def test_a_pushed_kinds_lanes_run_on_threads_kept_from_batch_to_batch(memory_kind: DestinationKind, dsn: str) -> None:
    """The driver delivers every micro-batch: its lanes' threads are started once, not per batch
    (a pool per batch cost 0.9 ms of CPU for 16 lanes), and each batch still goes in group order."""
    config = _config(dsn, {"type": "memory_list", "list_name": "L", "batch_size": 1})
    sink = config.sinks[0]
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()

    def batch(first: int) -> Outgoing:
        out = Outgoing()
        for n in range(first, first + 16):  # groups a-d, four messages each
            out.extend(Outgoing([n], [0], ["abcd"[n % 4]], [f"{n}:0"], [f'{{"n":{n}}}']))
        return out

    pusher = sink.destination.kind.pusher(sink)
    keeper = SequinStreamSink(dsn, "sequin")
    try:
        assert pusher.deliver(batch(0), keeper, "sequin") == (16, 0)
        first = set(SENDERS)
        assert pusher.deliver(batch(16), keeper, "sequin") == (16, 0)
    finally:
        keeper.close()
    assert set(SENDERS[16:]) <= first  # no thread started for the second batch
    sent = [json.loads(m)["n"] for request in DELIVERED["L"] for m in request]
    for group in range(4):  # each group's messages in order, the first batch's before the second's
        assert [n for n in sent if n % 4 == group] == list(range(group, 32, 4))


def test_a_stored_kinds_writer_copies_holds_parked_groups_and_parks_failed_transforms(dsn: str) -> None:
    """The stored kinds' write without Spark (the pipeline feeds it the same rendered rows):
    one COPY for every stored sink; a failed transform is parked with the rest of its group,
    in this write and the next (its group's head is parked), while other groups go on."""
    config = parse_config(
        {
            "databases": [{"name": "app", "dsn": dsn}],
            "sinks": [
                {"name": "plain", "tables": ["t"], "destination": {"type": "sequin_stream"}},
                {
                    "name": "picky",
                    "tables": ["t"],
                    "transform": "tests.support.transforms:refuse_three",
                    "destination": {"type": "sequin_stream"},
                },
            ],
        },
        "sequin.yaml",
    )
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    with pytest.raises(TypeError, match="pushed, not stored"):
        kind("webhook").writer(config.sinks[0], None)  # type: ignore[arg-type]
    table = StreamTableWriter(config.sinks, "sequin", SequinStreamSink(dsn, "sequin"), SequinStreamSink(dsn, "sequin"))
    try:

        def write(ids: list[int], groups: str) -> int:
            payload = (
                chunk for name in ("plain", "picky") for chunk in table.writer(name).tuples(_rendered(ids, groups))
            )
            return table.write(payload, span=lambda: (min(ids), max(ids)))

        assert write([1, 2, 3, 4, 5], "ababa") == 5 + 3  # picky: 3 refused, 5 behind it
        assert write([6, 7], "ab") == 2 + 1  # picky: 6 behind the parked head of group a
    finally:
        table.store.close()
        table.buffer.close()
    with psycopg.connect(dsn) as conn:
        assert [m.commit_lsn for m in store.stream_messages(conn, "sequin", "plain")] == [1, 2, 3, 4, 5, 6, 7]
        assert [(m.commit_lsn, m.data) for m in store.stream_messages(conn, "sequin", "picky")] == [
            (n, f'{{"record":{{"id":{n}}}}}') for n in (1, 2, 4, 7)
        ]
        assert [
            (m.commit_lsn, m.attempts, m.last_error.startswith("transform"))
            for m in store.list_buffered(conn, "sequin", "picky")
        ] == [(3, 1, True), (5, 0, False), (6, 0, False)]


def test_sequin_status_shows_each_kinds_own_counts(
    memory_kind: DestinationKind, dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sequin.yaml"
    config.write_text(
        json.dumps(
            {
                "databases": [{"name": "app", "dsn": dsn}],
                "sinks": [
                    {"name": "changes", "tables": ["kv"], "destination": {"type": "sequin_stream"}},
                    {"name": "mem", "tables": ["kv"], "destination": {"type": "memory_list", "list_name": "mem"}},
                ],
            }
        )
    )
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        store.insert_stream_messages(conn, "sequin", [("changes", lsn, 0, "g", f"{lsn}:0", "{}") for lsn in (1, 2)])
        conn.commit()
    DELIVERED["mem"] = [["a", "b"], ["c"]]
    assert cli_main(["--config", str(config), "status", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["sinks"] == {
        "changes": {"total": 2, "visible": 0, "outstanding": 0},
        "mem": {"requests": 2, "delivered": 3},
    }
    assert entry["messages"] == {"changes": 2}
    assert entry["health"] == {"mem": "ok"}  # the stream kind has no destination to check
    assert cli_main(["--config", str(config), "status"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  sink changes: 2 messages in the stream",
        "  sink mem: 2 requests, 3 delivered",
        "  sink mem destination: ok",
    ]


def _names_a_destination(node: ast.AST, names: set[str]) -> bool:
    """A string literal that is a destination's name, or a comparison of ``<x>.destination.type``."""
    if isinstance(node, ast.Constant) and node.value in names:
        return True
    if isinstance(node, ast.Compare):
        for operand in (node.left, *node.comparators):
            if (
                isinstance(operand, ast.Attribute)
                and operand.attr in ("type", "name")
                and isinstance(operand.value, ast.Attribute)
                and operand.value.attr in ("destination", "kind")
            ):
                return True
    return False


def test_nothing_outside_sinks_names_a_destination() -> None:
    names = {k.name for k in kinds()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "sinks":
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path.relative_to(PACKAGE)}:{n.lineno}" for n in ast.walk(tree) if _names_a_destination(n, names)]
    assert found == []
