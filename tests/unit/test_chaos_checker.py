"""The chaos checker catches each broken guarantee (so a clean chaos run means something)."""

from __future__ import annotations

from typing import Any

from tests.support.chaos.checker import check_sink
from tests.support.chaos.workload import row_key


def msg(
    action: str, id_: int, ver: int, lsn: int, idx: int = 0, key: str | None = None, balance: int = 0
) -> dict[str, Any]:
    return {
        "action": action,
        "record": {"id": id_, "ver": ver, "balance": balance},
        "metadata": {
            "table_name": "accounts",
            "commit_lsn": lsn,
            "commit_idx": idx,
            "idempotency_key": key or f"{lsn}:{idx}",
        },
    }


COMMITTED = [
    ("accounts", "1", "insert", 1),
    ("accounts", "1", "update", 2),
    ("accounts", "2", "insert", 3),
    ("accounts", "2", "delete", 3),
]
GOOD = [
    msg("insert", 1, 1, 10),
    msg("insert", 2, 3, 10, 1),
    msg("update", 1, 2, 20),
    msg("delete", 2, 3, 30),
    msg("read", 7, 0, 40, 0, 'backfill:1:["7"]'),
]
FINAL = {("accounts", "1"): {"id": 1, "ver": 2, "balance": 0}, ("accounts", "7"): {"id": 7, "ver": 0, "balance": 0}}


def check(
    deliveries: list[dict[str, Any]], final: dict[Any, Any] | None = None, acked: dict[str, int] | None = None
) -> Any:
    return check_sink("s", COMMITTED, deliveries, FINAL if final is None else final, row_key, acked)


def test_a_clean_run_passes_and_counts() -> None:
    report = check(GOOD + [GOOD[2]])  # a redelivery of the update: a duplicate, allowed
    assert report.ok and (report.committed, report.delivered, report.reads, report.duplicates) == (4, 4, 1, 1)
    assert report.line() == (
        "sink s: changes committed 4, delivered 4 (+1 reads), lost 0, order violations 0,"
        " duplicates 1 (after ack 0), unexpected 0, state mismatches 0"
    )


def test_a_lost_change_fails() -> None:
    report = check([m for m in GOOD if m["action"] != "update"])
    assert not report.ok and report.lost == 1 and report.state_mismatches == 1
    assert "lost ('accounts', '1', 'update', 2)" in report.examples


def test_a_reordered_group_fails() -> None:
    report = check([GOOD[2], GOOD[0], GOOD[1], GOOD[3], GOOD[4]])
    assert not report.ok and report.order_violations == 1


def test_a_read_after_a_newer_change_fails() -> None:
    stale_read = msg("read", 1, 1, 15, 0, 'backfill:1:["1"]')
    report = check(GOOD[:3] + [stale_read] + GOOD[3:])
    assert not report.ok and report.order_violations == 1


def test_a_row_the_sink_never_saw_fails() -> None:
    report = check(GOOD[:4])  # row 7 exists in the table, no read or change delivered it
    assert not report.ok and report.state_mismatches == 1 and report.lost == 0


def test_an_invented_change_fails() -> None:
    report = check(GOOD + [msg("update", 1, 99, 50)], {**FINAL, ("accounts", "1"): {"id": 1, "ver": 99, "balance": 0}})
    assert not report.ok and report.unexpected == 1 and report.state_mismatches == 0


def test_a_message_delivered_again_after_its_ack_fails() -> None:
    # the update's ack returned when 4 deliveries were recorded: its second delivery, the 4th, came
    # before (at least once); one after it is an acked message come back
    early = check(GOOD[:3] + [GOOD[2]] + GOOD[3:], acked={GOOD[2]["metadata"]["idempotency_key"]: 4})
    assert early.ok and (early.duplicates, early.redelivered_after_ack) == (1, 0)
    late = check(GOOD + [GOOD[2]], acked={GOOD[2]["metadata"]["idempotency_key"]: 3})
    assert not late.ok and (late.duplicates, late.redelivered_after_ack) == (1, 1)
    assert "20:0: delivered again after it was acked" in late.examples
