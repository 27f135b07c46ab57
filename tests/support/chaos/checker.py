"""The chaos checker: what a sink delivered, judged against what committed and the tables' final state.

Pure functions over plain data, so the checker itself is unit-tested with deliveries that break
each guarantee (``tests/unit/test_chaos_checker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

Change = tuple[str, str, str, int]
"""(table, key, action, ver): one committed row change."""


@dataclass
class SinkReport:
    """One sink's verdict: counts and a few examples of each kind of failure."""

    sink: str
    committed: int = 0
    delivered: int = 0
    reads: int = 0
    lost: int = 0
    unexpected: int = 0
    order_violations: int = 0
    duplicates: int = 0
    redelivered_after_ack: int = 0
    state_mismatches: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing invented, no reordering, no acked message delivered again, and the
        replay equals the tables."""
        return not (
            self.lost or self.unexpected or self.order_violations or self.redelivered_after_ack or self.state_mismatches
        )

    def line(self) -> str:
        """The one-line summary printed per run and sink."""
        return (
            f"sink {self.sink}: changes committed {self.committed}, delivered {self.delivered}"
            f" (+{self.reads} reads), lost {self.lost}, order violations {self.order_violations},"
            f" duplicates {self.duplicates} (after ack {self.redelivered_after_ack}), unexpected {self.unexpected},"
            f" state mismatches {self.state_mismatches}"
        )

    def _example(self, text: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(text)


def check_sink(
    sink: str,
    committed: Iterable[Change],
    deliveries: Sequence[dict[str, Any]],
    final: dict[tuple[str, str], dict[str, Any]],
    key_of: Any,
    acked: Mapping[str, int] | None = None,
) -> SinkReport:
    """Judge ``deliveries`` (messages in the order the sink's consumer got them, duplicates included).

    - lost: committed changes never delivered; unexpected: delivered changes that never committed;
    - order violations: per group (table, key), a first delivery whose position is below one already
      delivered (a read after a newer change counts: it would roll the row back);
    - state mismatches: keys whose replay of first deliveries differs from the table's final row
      (a row that exists but was never delivered, by a change or a read, is a mismatch);
    - duplicates: deliveries of an idempotency key already delivered (allowed: at least once);
    - redelivered after ack: duplicates delivered after their consumer group acked the key (a pull
      sink: ``acked`` maps a key to how many deliveries there were when its ack returned; any later
      delivery of the key is one). Not allowed: an acked message never comes back.
    """
    report = SinkReport(sink)
    committed_set = set(committed)
    report.committed = len(committed_set)
    seen: set[str] = set()
    delivered_changes: set[Change] = set()
    last_position: dict[tuple[str, str], tuple[int, int]] = {}
    replay: dict[tuple[str, str], dict[str, Any] | None] = {}
    for n, message in enumerate(deliveries):
        meta = message["metadata"]
        if meta["idempotency_key"] in seen:
            report.duplicates += 1
            if acked is not None and n >= acked.get(meta["idempotency_key"], n + 1):
                report.redelivered_after_ack += 1
                report._example(f"{meta['idempotency_key']}: delivered again after it was acked")
            continue
        seen.add(meta["idempotency_key"])
        table, action, record = meta["table_name"], message["action"], message["record"]
        group = (table, key_of(table, record))
        position = (int(meta["commit_lsn"]), int(meta["commit_idx"]))
        if action == "read":
            report.reads += 1
        else:
            report.delivered += 1
            delivered_changes.add((table, group[1], action, int(record["ver"])))
        previous = last_position.get(group)
        if previous is not None and position <= previous:
            report.order_violations += 1
            report._example(f"{group}: {action} at {position} delivered after {previous}")
        else:
            last_position[group] = position
            replay[group] = None if action == "delete" else record
    for change in sorted(committed_set - delivered_changes)[:5]:
        report._example(f"lost {change}")
    report.lost = len(committed_set - delivered_changes)
    report.unexpected = len(delivered_changes - committed_set)
    for group in sorted(set(replay) | set(final)):
        if replay.get(group) != final.get(group):
            report.state_mismatches += 1
            report._example(f"{group}: replay {replay.get(group)} != table {final.get(group)}")
    return report
