"""The buffer on a real store: parking is idempotent, retry keeps group order, backs off, and
discards after max_retry_count without dropping anything.

The sink here is a plain function (it records or refuses what it is given): the HTTP side is
covered by tests/integration/sinks/test_webhook.py; this tests the buffer's own bookkeeping.
"""

from __future__ import annotations

from datetime import datetime, timezone

import psycopg

from sequin_provider import buffer, store
from sequin_provider.buffer import DeliveryError
from sequin_provider.config import parse_config
from sequin_provider.store import Parked, ParkRow


def _config(dsn: str, max_retry_count: int | None) -> tuple[object, object]:
    config = parse_config(
        {
            "databases": [{"name": "app", "dsn": dsn}],
            "sinks": [
                {
                    "name": "hook",
                    "tables": ["kv"],
                    "max_retry_count": max_retry_count,
                    "destination": {"type": "webhook", "url": "http://127.0.0.1:9/x"},
                }
            ],
        }
    )
    return config, config.sinks[0]


def _park(dsn: str, rows: list[tuple[int, str, int]]) -> None:
    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
        parked = [
            ParkRow("hook", lsn, 0, group, f"{lsn}:0", f'{{"n":{lsn}}}', None, attempts, "boom")
            for lsn, group, attempts in rows
        ]
        assert store.park_messages(conn, "sequin", parked) == len(rows)
        assert store.park_messages(conn, "sequin", parked) == 0  # a replayed batch parks nothing twice


def test_retry_delivers_each_group_in_order_and_stops_a_group_at_its_failure(dsn: str) -> None:
    _park(dsn, [(1, "a", 1), (2, "b", 1), (3, "a", 0), (4, "b", 0), (5, "a", 0)])
    config, sink = _config(dsn, None)
    sent: list[int] = []

    def deliver(message: Parked, data: str) -> None:
        if message.commit_lsn == 4:
            raise DeliveryError("HTTP 503: busy")
        sent.append(message.commit_lsn)

    report = buffer.retry_sink(config, sink, deliver, workers=2)  # type: ignore[arg-type]
    assert sorted(sent) == [1, 2, 3, 5] and [n for n in sent if n in (1, 3, 5)] == [1, 3, 5]
    assert (report.delivered, report.failed, report.discarded, report.still_parked) == (4, 1, 0, 1)
    with psycopg.connect(dsn) as conn:
        (left,) = store.list_buffered(conn, "sequin", "hook")
    assert (left.commit_lsn, left.attempts, left.last_error) == (4, 1, "HTTP 503: busy")
    assert left.next_attempt_at > datetime.now(timezone.utc)  # backed off: not due at once
    again = buffer.retry_sink(config, sink, deliver)  # type: ignore[arg-type]
    assert again.delivered == again.failed == 0 and again.still_parked == 1  # not due yet


def test_max_retry_count_discards_with_the_last_error_and_the_group_moves_on(dsn: str) -> None:
    _park(dsn, [(10, "g", 0), (11, "g", 0)])
    config, sink = _config(dsn, 2)
    sent: list[int] = []

    def deliver(message: Parked, data: str) -> None:
        if message.commit_lsn == 10:
            raise DeliveryError(f"HTTP 400: attempt {message.attempts + 1}")
        sent.append(message.commit_lsn)

    first = buffer.retry_sink(config, sink, deliver)  # type: ignore[arg-type]
    assert (first.failed, first.discarded, sent) == (1, 0, [])
    with psycopg.connect(dsn) as conn:  # make it due again now
        conn.execute("UPDATE sequin.buffered_messages SET next_attempt_at = now()")
        conn.commit()
    second = buffer.retry_sink(config, sink, deliver)  # type: ignore[arg-type]
    assert (second.discarded, second.delivered, sent) == (1, 1, [11])
    with psycopg.connect(dsn) as conn:
        kept = store.list_buffered(conn, "sequin", "hook")
        assert [(m.commit_lsn, m.state, m.attempts, m.last_error) for m in kept] == [
            (10, "discarded", 2, "HTTP 400: attempt 2")
        ]
        assert store.buffer_counts(conn, "sequin") == {"hook": {"parked": 0, "discarded": 1}}
        assert store.set_buffered_state(conn, "sequin", "hook", "parked") == 1  # requeue: due now, attempts reset
        (requeued,) = store.list_buffered(conn, "sequin", "hook")
    assert (requeued.state, requeued.attempts) == ("parked", 0)


def test_two_retries_of_one_sink_do_not_run_at_once(dsn: str) -> None:
    _park(dsn, [(20, "x", 0)])
    config, sink = _config(dsn, None)
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext('sequin-retry:' || 'sequin' || ':' || 'hook'))")
        report = buffer.retry_sink(config, sink, lambda m, d: None)  # type: ignore[arg-type]
    assert report.skipped and report.delivered == 0


def test_parked_groups_names_exactly_the_asked_groups_with_parked_messages(dsn: str) -> None:
    """Both ways of answering (the sink's few parked groups read and matched here; more parked
    groups than asked about, matched by the store) give the same answer; discarded messages and
    other sinks' do not block a group."""
    _park(dsn, [(1, "a", 1), (2, "b", 0), (3, "c", 1), (4, "d", 1)])
    with psycopg.connect(dsn) as conn:
        assert store.set_buffered_state(conn, "sequin", "hook", "discarded", group="d") == 1
        store.park_messages(conn, "sequin", [ParkRow("other", 9, 0, "e", "9:0", "{}", None, 1, "boom")])
        conn.commit()
        many_asked = buffer.parked_groups(conn, "sequin", "hook", ["a", "b", "x", "y", "z", "d", "e"])
        few_asked = buffer.parked_groups(conn, "sequin", "hook", ["b", "x"])  # 3 parked groups > 2 asked
        assert (many_asked, few_asked) == ({"a", "b"}, {"b"})
        assert buffer.parked_groups(conn, "sequin", "hook", ["c", "c"]) == {"c"}
        assert buffer.parked_groups(conn, "sequin", "hook", []) == set()
        assert buffer.parked_groups(conn, "sequin", "nobody", ["a"]) == set()
